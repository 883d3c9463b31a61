"""Batched prefill, measured without a GPU.

Two parts:
- **graph** (any checkpoint; the sim records and checks but does not execute): dispatches and
  barrier levels of a prefill chunk next to the decode step's, the weight bytes one chunk reads
  (the dense projections once per 1,024-token launch band of the GEMMs, the routed experts some
  token of the chunk chose once, by the expected count for uniform routing) and per prompt
  token, the FLOPs per prompt token, and the whole-prompt average of a `--context`-token prompt
  on an M1 Pro, an M4 Max and an M5 Max (with and without its tensor ops), chunk by chunk at
  the chunk lengths each Mac's command-buffer budget gives, each with its costliest parts (the
  central case's seconds, a kernel group's bytes and products apart), beside the anchors'
  published whole-prompt averages, then what issue 40's unbuilt kernels would give
  (`prefill_model.py`: a model from published GPU figures and assumed efficiencies, not a
  measurement; say so when quoting it);
- **time** (small checkpoints, e.g. the demo, on the sim): a prompt prefilled as one chunk
  against the same prompt fed one token per step through the decode graph (final norm, lm_head
  and sampler included: how every prompt went before batched prefill), and, for reference,
  through one-token prefill passes (`max_chunk` 1: no lm_head except for the last token).

Both print `executed/useful matrix FLOPs R`: the multiply-adds the quantized GEMMs execute (token
tiles padded to 8, 16, 32 or 64 rows, weight tiles to 128) over those the chunk needs. The graph
report models it for a chunk of `--context` tokens, 4,096 at most (uniform random routing, the tiles
`grouped_tile_tokens` gives each expert); `--mma` measures it.

- **mma** (`--mma`, small checkpoints on the sim): one prefill chunk run on the sim, with the
  simdgroup-matrix products each kernel executed (the sim's counter, by operand type) per prompt
  token, and executed/useful matrix FLOPs from the counted products of the quantized GEMMs.
  With `--tensor-ops` the sim runs the Metal 4 tensor-op GEMMs and chunk attention, as an M5
  would (their products count under tensor-op).

Usage:
    python benchmarks/bench_prefill.py demo [--tokens 512]          # graph + time
    python benchmarks/bench_prefill.py demo --mma --no-time          # graph + counted products
    python benchmarks/bench_prefill.py demo --mma --no-time --tensor-ops  # ... on tensor ops
    python benchmarks/bench_prefill.py SYNTH_DIR --no-time [--context 4096]  # the real dims

SYNTH_DIR: a full-size random checkpoint (benchmarks/make_synthetic_checkpoint.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import prefill_model

from lily.checkpoint.config import FULL_ATTENTION
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.checkpoint.validate import claims_real_model, expected_layout
from lily.device import MatrixProducts, open_device
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import DEFAULT_MAX_CHUNK, ModelGraph, pass_flops
from lily.kernels.quantized_gemm import (
    BAND_TOKENS,
    WEIGHT_ROWS_PER_TILE,
    dense_tile_tokens,
    grouped_tile_tokens,
)

EMBEDDING = "language_model.model.embed_tokens"
LM_HEAD = "language_model.lm_head"
# Multiply-adds of one 8x8x8 simdgroup-matrix product.
PRODUCT_MACS = 512


def dense_projections(c) -> list[tuple[int, int, int]]:
    """(input dim, output rows, layers) of every dense quantized GEMM projection of a chunk, each
    padded to 128-row weight tiles on its own. The lm_head is not one: a predicting chunk runs it
    for its last token alone, as decode's GEMV."""
    d = c.hidden_size
    attention = len(c.full_attention_layers)
    gdn = c.num_hidden_layers - attention
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    heads = c.linear_num_value_heads
    shared = c.shared_expert_intermediate_size
    layers = c.num_hidden_layers
    return [
        (d, 2 * c.linear_key_dim + c.linear_value_dim, gdn),  # in_proj qkv
        (d, c.linear_value_dim, gdn),  # z
        (d, heads, gdn),  # a
        (d, heads, gdn),  # b
        (c.linear_value_dim, d, gdn),  # out_proj
        (d, 2 * q, attention),  # q and its gate
        (d, kv, attention),
        (d, kv, attention),
        (q, d, attention),  # o_proj
        (d, c.num_experts, layers),  # router
        (d, 1, layers),  # shared-expert gate
        (d, shared, layers),
        (d, shared, layers),
        (shared, d, layers),
    ]


def padded(rows: int) -> int:
    return -(-rows // WEIGHT_ROWS_PER_TILE) * WEIGHT_ROWS_PER_TILE


def matrix_flops_model(c, tokens: int, seed: int = 0) -> tuple[float, float]:
    """(executed, useful) multiply-adds of a chunk's quantized GEMMs: dense projections in token
    tiles of dense_tile_tokens(tokens), and the routed experts of every layer under uniformly
    random top-k routing, each expert in the tiles grouped_tile_tokens gives its count. Weight
    rows are padded to 128-row tiles (64 gate and 64 up rows with SwiGLU, the same padding)."""
    executed = useful = 0.0
    tile = dense_tile_tokens(tokens)
    rows_executed = -(-tokens // tile) * tile
    for in_dim, rows, layers in dense_projections(c):
        useful += layers * tokens * rows * in_dim
        executed += layers * rows_executed * padded(rows) * in_dim
    d, e, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    expert_macs = 3 * d * c.moe_intermediate_size  # gate, up and down of one assignment
    rng = np.random.default_rng(seed)
    for _ in range(c.num_hidden_layers):
        choices = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]
        counts = np.bincount(choices.ravel(), minlength=e)
        rows_run = sum(sum(grouped_tile_tokens(int(n))) for n in counts)
        useful += tokens * k * expert_macs
        executed += rows_run * expert_macs
    return executed, useful


def weight_bytes_per_chunk(checkpoint, tokens: int) -> dict[str, float]:
    """Bytes of weights one chunk of `tokens` reads from memory: every dense projection once per
    launch band of BAND_TOKENS (the dense GEMMs' order), the embedding rows, and the routed
    experts at least one token chose, once (expected E * (1 - (1 - k/E)^T) per layer for uniform
    routing). The lm_head is read for the one predicting token."""
    c = checkpoint.config
    layout = expected_layout(c)
    bands = -(-tokens // BAND_TOKENS)
    chosen = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens)
    totals = {"projections": 0.0, "routed experts": 0.0, "embedding rows": 0.0, "lm_head": 0.0}
    for lin in layout.linears.values():
        q = lin.quant
        per_row = lin.in_features * q.bits // 8 + 2 * 2 * (lin.in_features // q.group_size)
        if lin.path == EMBEDDING:
            totals["embedding rows"] += per_row * tokens
            if c.tie_word_embeddings:
                totals["lm_head"] += per_row * lin.out_features
        elif lin.path == LM_HEAD:
            totals["lm_head"] += per_row * lin.out_features
        elif lin.experts is not None:
            totals["routed experts"] += per_row * lin.out_features * chosen
        else:
            totals["projections"] += per_row * lin.out_features * bands
    return totals


def useful_macs(c, tokens: int) -> float:
    """Multiply-adds a chunk's quantized GEMMs need (matrix_flops_model's useful figure)."""
    dense = sum(layers * tokens * rows * in_dim for in_dim, rows, layers in dense_projections(c))
    experts = c.num_hidden_layers * tokens * c.num_experts_per_tok * 3 * c.hidden_size
    return dense + experts * c.moe_intermediate_size


def mma_report(checkpoint, tokens: int, tensor_ops: bool = False) -> None:
    """One chunk of `tokens` on the sim: the simdgroup-matrix products per prompt token by operand
    type (chunk attention on its own line), and the quantized GEMMs' executed/useful work;
    `tensor_ops`: with the GEMMs and chunk attention on the Metal 4 tensor-op kernels."""
    c = checkpoint.config
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, tokens).tolist()
    device = open_device("sim", tensor_ops=tensor_ops)
    engine = DeviceEngine(checkpoint, device, tokens + 8, c.vocab_size, tokens)
    engine.prompt_logits(prompt[:8])  # records the graphs
    device.matrix_products()
    engine.prompt_logits(prompt)
    counted = device.matrix_products()
    total = sum(counted.values(), MatrixProducts())
    print(f"sim chunk of {tokens}: simdgroup-matrix products per kernel (per prompt token)")
    for kernel, p in sorted(counted.items(), key=lambda item: -item[1].total):
        print(
            f"  {kernel:<30} fp32 {p.fp32 / tokens:9.1f}  half {p.half / tokens:7.1f}"
            f"  bfloat {p.bfloat / tokens:9.1f}  tensor-op {p.tensor_op / tokens:7.1f}"
        )
    attention = sum(
        (p for kernel, p in counted.items() if kernel.startswith("attention")), MatrixProducts()
    )
    print(
        f"mma per prompt token: fp32 {total.fp32 / tokens:.0f}, half {total.half / tokens:.0f}, "
        f"bfloat {total.bfloat / tokens:.0f}, tensor-op {total.tensor_op / tokens:.0f}"
    )
    print(
        f"  of which chunk attention: fp32 {attention.fp32 / tokens:.0f}, half "
        f"{attention.half / tokens:.0f}, bfloat {attention.bfloat / tokens:.0f}, tensor-op "
        f"{attention.tensor_op / tokens:.0f}"
    )
    gemm = sum(p.total for kernel, p in counted.items() if kernel.startswith("qgemm"))
    ratio = gemm * PRODUCT_MACS / useful_macs(c, tokens)
    print(f"executed/useful matrix FLOPs {ratio:.3f} (quantized GEMMs, counted on the sim)")


def graph_report(checkpoint, tokens: int, context: int) -> None:
    c = checkpoint.config
    device = open_device("sim", execute=False)
    start = time.perf_counter()
    model = ModelGraph(checkpoint, device, tokens + 64, c.vocab_size, max_chunk=tokens)
    chunk = model.graph(tokens, predicts=True)
    recorded = time.perf_counter() - start
    print(f"checkpoint            {checkpoint.path} ({checkpoint.level})")
    print(f"graphs recorded in    {recorded * 1e3:.0f} ms (decode step + chunk of {tokens})")
    chunk_graph = chunk
    for name, graph in (("decode step", model.decode), (f"chunk of {tokens}", chunk)):
        levels = graph.barrier_count + 1
        print(f"{name:<21} {graph.dispatch_count} dispatches, {levels} barrier levels")
    totals = weight_bytes_per_chunk(checkpoint, tokens)
    total = sum(totals.values())
    for kind, nbytes in totals.items():
        print(f"  {kind:<19} {nbytes / 1e9:8.3f} GB per chunk")
    print(f"weights per chunk     {total / 1e9:.3f} GB, {total / tokens / 1e6:.2f} MB per token")
    gdn_layers = sum(1 for t in c.layer_types if t != FULL_ATTENTION)
    print(f"GDN layers            {gdn_layers} (state read and written once per chunk)")
    for end in (tokens, 4096):
        flops = pass_flops(c, end - tokens, tokens) / tokens
        print(f"FLOPs / prompt token  {flops / 1e9:.2f} G (chunk ending at {end})")
    chunk = min(DEFAULT_MAX_CHUNK, context)
    executed, useful = matrix_flops_model(c, chunk)
    print(
        f"executed/useful matrix FLOPs {executed / useful:.3f} (a chunk of {chunk} tokens: "
        f"quantized GEMMs, expert tiles included; modelled, uniform routing)"
    )
    whole_prompt_report(checkpoint, context, chunk_graph.barrier_count + 1)


# The anchors' whole-prompt averages for the real model on an M5 Max at 4k and 32k, as their
# authors publish them (docs/benchmarks.md, "Prefill").
ANCHORS = {
    4096: "reference engine 5,724, mlx-lm 5,166",
    32768: "reference engine 3,928, mlx-lm 3,964",
}


def time_shares(terms: dict[str, tuple[float, float]], shown: int = 4) -> str:
    """The `shown` costliest parts of a whole prompt's central time, each with its share and, for
    a kernel group, its memory and compute seconds (it takes the longer)."""
    spent = {name: max(pair) for name, pair in terms.items()}
    total = sum(spent.values())
    parts = []
    for name in sorted(spent, key=spent.get, reverse=True)[:shown]:
        memory, compute = terms[name]
        split = f": bytes {memory:.2f} s, products {compute:.2f} s" if memory else ""
        parts.append(f"{name} {spent[name] / total:.0%} ({spent[name]:.2f} s{split})")
    return f"central time {total:.2f} s: " + "; ".join(parts)


def whole_prompt_report(checkpoint, context: int, levels: int) -> None:
    """prefill_model's whole-prompt average over a prompt of `context` tokens on each Mac, along
    today's kernels (with and without the M5's tensor ops, and on an M5 with an int8 cache,
    whose chunk attention keeps simdgroup matrices), then along issue 40's unbuilt ones."""
    c = checkpoint.config
    ratios: dict[int, float] = {}

    def chunk_weights(tokens: int) -> tuple[dict[str, float], float]:
        # The tile padding changes slowly with the chunk: one sample per 64 tokens.
        key = max(64, round(tokens / 64) * 64)
        if key not in ratios:
            executed, useful = matrix_flops_model(c, key)
            ratios[key] = executed / useful
        return weight_bytes_per_chunk(checkpoint, tokens), ratios[key]

    print(
        f"whole-prompt estimates at {context} tokens: prompt tokens over the sum of the chunks' "
        "times, chunks cut by each Mac's command-buffer budget (a MODEL from published GPU "
        "figures and assumed efficiencies, not a measurement: benchmarks/prefill_model.py; "
        "range: its slow and fast efficiencies)"
    )
    built = [
        (gpu, path)
        for gpu in prefill_model.GPUS
        for path in (prefill_model.SIMDGROUP, prefill_model.TENSOR_OPS, prefill_model.TENSOR_GEMMS)
        if gpu.tensor_units or not path.tensor_ops
    ]
    # Half activations (issue 40, item 2) as the model sees them: an estimate of kernels not
    # built yet.
    unbuilt = [(gpu, prefill_model.LEAN) for gpu in prefill_model.GPUS if gpu.tensor_units]
    for gpu, path in built + unbuilt:
        estimate = prefill_model.whole_prompt(c, gpu, path, context, chunk_weights, levels)
        slow, central, fast = estimate.tokens_per_second
        chunks = estimate.chunks
        line = f"{gpu.name} {central:.0f} tok/s ({path.name})"
        detail = (
            f"  [range {slow:.0f}-{fast:.0f}; chunks of {max(chunks)}..{min(chunks)} tokens "
            f"({len(chunks)}); {gpu.command_buffer_flops:.2g} FLOPs per command buffer]"
        )
        if path.built:
            print(f"whole-prompt estimate at {context} tokens: {line}{detail}")
            print(f"  {time_shares(estimate.central_terms)}")
        else:
            print(f"  not built (issue 40), estimate: {line}{detail}")
    if context in ANCHORS and claims_real_model(c):
        print(
            f"anchors' published whole-prompt averages at {context} tokens, M5 Max: "
            f"{ANCHORS[context]} tok/s"
        )


def time_report(checkpoint, tokens: int, repeat: int) -> None:
    """Wall time decides; CPU time (all threads of the process) is printed too, as it moves less
    when other work shares the machine."""
    c = checkpoint.config
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, tokens).tolist()

    def engine(max_chunk: int) -> DeviceEngine:
        return DeviceEngine(checkpoint, open_device("sim"), tokens + 8, c.vocab_size, max_chunk)

    per_step, per_pass, chunked = engine(1), engine(1), engine(tokens)
    arms = {
        "decode step per token": (per_step.teacher_forced_logits, prompt[:8]),
        "prefill pass per token": (per_pass.prompt_logits, prompt[:8]),
        f"one chunk of {tokens}": (chunked.prompt_logits, prompt),
    }
    results = {}
    for name, (run, warm_up) in arms.items():
        run(warm_up)  # records the graphs and warms the caches
        best_wall = best_cpu = float("inf")
        for _ in range(repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            run(prompt)
            best_wall = min(best_wall, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
        results[name] = best_wall, best_cpu
        print(
            f"sim prefill, {name:<24} {best_wall:7.3f} s  {tokens / best_wall:7.1f} tok/s"
            f"  (CPU {best_cpu:.3f} s)"
        )
    (step, step_cpu), (single, single_cpu), (chunk, chunk_cpu) = results.values()
    print(
        f"speed-up over decode steps      {step / chunk:.1f}x"
        f"  (CPU time {step_cpu / chunk_cpu:.1f}x)"
    )
    print(
        f"speed-up over one-token passes  {single / chunk:.1f}x"
        f"  (CPU time {single_cpu / chunk_cpu:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory, repo id or 'demo'")
    parser.add_argument("--tokens", type=int, default=512, help="prompt and chunk length")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per arm (best kept)")
    parser.add_argument("--no-time", action="store_true", help="no timed runs")
    parser.add_argument(
        "--context", type=int, default=4096, help="model a whole prompt of this many tokens"
    )
    parser.add_argument(
        "--mma", action="store_true", help="count a chunk's simdgroup-matrix products on the sim"
    )
    parser.add_argument(
        "--tensor-ops",
        action="store_true",
        help="with --mma: the GEMMs and chunk attention on the Metal 4 tensor-op kernels (the "
        "sim's emulation)",
    )
    args = parser.parse_args()
    checkpoint = load_checkpoint(resolve_model(args.model))
    graph_report(checkpoint, args.tokens, args.context)
    if args.mma:
        mma_report(checkpoint, args.tokens, args.tensor_ops)
    if not args.no_time:
        time_report(checkpoint, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
