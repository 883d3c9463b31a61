"""A verify pass of speculative decoding at the real model's dims: the weight bytes it reads and
the matrix FLOPs it executes, with the GEMMs' tiles a prefill chunk uses (dense token tiles of
8 or 16 rows at these sizes, an 8-row tile per chosen expert; how verify passes would run without
`qgemv_tokens` and the MoE's few-token path) and with the GEMV-shaped kernels they run, and a
time estimate on Apple GPUs from the figures and efficiencies `prefill_model.py`
assumes (a model, not a measurement; the norms are left out).

Attention is modelled apart (second table) with the latency and issue model of
`model_decode_attention.py` and its assumed clocks, latency and occupancy, at contexts of 512,
4k and 32k on a cache of 262,144 positions:

- before, `attention_chunk` as it was then (32-row threadgroups of 4 SIMD-groups; it has 64 rows
  of 8 now): ceil(8 T / 32) threadgroups per kv head (4 in all at T = 5), each
  of 4 SIMD-groups streaming the whole context alone on a core, 16 keys per iteration: one
  memory round trip (it stages a tile, then computes on it) plus CHUNK_ISSUE lane-instructions
  per SIMD-group, counted from the kernel's code; 2 levels per layer (prepare, chunk);
- after, `attention_decode_tokens`: the decode grid (splits by context, 2 kv heads), T
  SIMD-groups per threadgroup, each computing every tile of its split for its token (the decode
  kernel's ISSUE_NEW per 8 positions) from 16-position stages read once per threadgroup; bytes
  are the context's K and V once plus the T tokens' partials written and read back; 3 levels
  per layer (prepare, decode, combine).

The decode step's attention (the same model's `attention_decode_fused`, T = 1) is printed beside
them, so that a verify pass's cost in decode steps includes attention.

The experts: each of the k + 1 tokens chooses 8 of 256 per layer; at uniform routing the
expected number of distinct experts is 256 (1 - (1 - 8/256)^(k+1)). The grouped GEMM reads each
distinct expert once but runs an 8-row tile per expert for its one or two tokens. The bytes and
the GEMVs' ALU work of the first table are `model_graph.pass_traffic`'s (each distinct expert
read once, at uniform routing); "break-even" is `verify_cost_ratio`, the tokens per pass at
which a verify pass pays (what speculative="auto" compares a draft source's tokens per pass
with), on a roofline at the M5 Max's ridge, with what the pass's recurrent state moves beyond a
decode step's one read and write of it (`verify_state_traffic`).

The third table counts the experts as the kernels read them, for an overlap given as a
parameter: the chance that an expert a token of the pass chooses is one an earlier token of
the pass chose, beyond chance (`distinct_experts`: each token takes that share of its choices
from the pass's earlier experts and draws the rest uniformly). A verify pass's tokens are
consecutive tokens of one text, and routing is correlated in time: Cohere's "Why MoE models get
more from speculative decoding" (April 2026; its figures as headsupai.io's summary of it
reports them: adjacent tokens share 38% of their experts, and 4 tokens load about 2.5 tokens'
worth of unique experts instead of 4, up to 31% fewer than uniform routing) measured it on its
Command models; MoE-Spec (arXiv 2602.16052) finds the routing within a draft heavy-tailed, a
few experts taking most of the draft's choices. Nothing here measures Qwen3.6's routing. The
cases: 0 (uniform routing, the floor), 0.38 (the adjacent-token figure) and the overlap at which
4 tokens read 2.5 tokens' experts on this model's 256 / top-8. The kernels: "per pair" (each
(token, expert) pair reads its expert's gate, up and down, as before), "union gate/up" (what a
verify pass runs: `moe_gate_up_union` reads each distinct expert's gate and up once, the down
stays per pair) and "union all" (the down too; not built). Every read is counted from memory:
a GPU's system cache may serve an expert a second token reads in the same dispatch, which
would give the per-pair kernels part of the union's saving; nothing here measures that.

    python benchmarks/verify_pass_model.py
"""

from __future__ import annotations

import model_decode_attention as decode_model
from make_synthetic_checkpoint import real_config
from prefill_model import CENTRAL, GPUS, MEMORY_EFFICIENCY

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig, parse_config
from lily.engine.model_graph import pass_traffic, token_macs, verify_cost_ratio
from lily.kernels.attention import MAX_GROUP, decode_splits, split_length
from lily.kernels.quantized_gemm import dense_tile_tokens, grouped_tile_tokens

BYTES_PER_WEIGHT = 4.5 / 8  # 4-bit codes, a bf16 scale and bias per 64
ROUTER_BYTES_PER_WEIGHT = 8.5 / 8  # the 8-bit router and shared-expert gate
# The prefill GEMM's tiles as this model runs them: fp32 simdgroup tiles at 30% of the fp32 peak
# (what prefill_model.py assumed for them before the GEMMs took 2-byte operands).
FP32_TILE_EFFICIENCY = 0.3

CAPACITY = 262144
CONTEXTS = (512, 4096, 32768)
# attention_chunk as it was (32 rows per threadgroup) per SIMD-group and 16-key iteration: 64
# fragment products for S and 64 for P V (16 lane-FMAs each), 512 filling their K and V
# fragments from threadgroup memory (a load and a widening per element), 384 staging the tile
# (64 2-byte loads and stores per lane and their indexing), ~40 for the softmax and 64 rescaling
# the accumulators.
CHUNK_KEYS = 16
CHUNK_ROWS = 32
CHUNK_ISSUE = 128 * 16 + 512 + 384 + 40 + 64
# attention_decode_tokens per SIMD-group and 16-position stage (16 KB of K and V of one kv
# head): two decode tiles (ISSUE_NEW each, their 16 loads now from threadgroup memory) and a
# share of staging the stage (a load, a store and ~4 indexing operations per 16 bytes, spread
# over the threadgroup's T x 32 lanes).
STAGE_POSITIONS = 16
STAGE_BYTES = STAGE_POSITIONS * decode_model.ROW_BYTES


# The expert overlap cases of the third table (see the docstring).
ADJACENT_OVERLAP = 0.38
FOUR_TOKEN_EXPERTS = 2.5  # 4 tokens read this many tokens' experts
# Expert matrices read over the union, per kernel design: gate and up (built), all three (not).
UNION_DESIGNS = {"per pair": 0, "union gate/up": 2, "union all": 3}


def distinct_experts(experts: int, top_k: int, tokens: int, overlap: float) -> float:
    """The expected distinct experts of `tokens` tokens choosing `top_k` of `experts` each, when
    each token takes a share `overlap` of its choices from the earlier tokens' experts and draws
    the rest uniformly (which may land on an earlier token's expert too); overlap 0 is uniform
    routing, experts (1 - (1 - top_k / experts)^tokens)."""
    distinct = float(top_k)
    for _ in range(1, tokens):
        distinct += top_k * (1 - overlap) * (1 - distinct / experts)
    return distinct


def overlap_for(experts: int, top_k: int, tokens: int, top_k_multiple: float) -> float:
    """The overlap at which `tokens` tokens choose `top_k_multiple` x top_k distinct experts."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if distinct_experts(experts, top_k, tokens, middle) > top_k_multiple * top_k:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def overlap_cases(c: ModelConfig) -> dict[str, float]:
    fit = overlap_for(c.num_experts, c.num_experts_per_tok, 4, FOUR_TOKEN_EXPERTS)
    return {
        "uniform": 0.0,
        f"adjacent {ADJACENT_OVERLAP:.2f}": ADJACENT_OVERLAP,
        f"4 tokens {FOUR_TOKEN_EXPERTS}x ({fit:.2f})": fit,
    }


def expert_matrix_bytes(c: ModelConfig) -> float:
    """One expert's gate, up or down projection, 4-bit."""
    return c.hidden_size * c.moe_intermediate_size * BYTES_PER_WEIGHT


def expert_bytes_beyond_traffic(
    c: ModelConfig, tokens: int, overlap: float, union_matrices: int
) -> float:
    """The expert bytes a pass of `tokens` tokens reads beyond `pass_traffic`'s count (each
    distinct expert once, at uniform routing), when `union_matrices` of each expert's three
    matrices are read once per distinct expert and the others once per (token, expert) pair."""
    top_k, layers = c.num_experts_per_tok, c.num_hidden_layers
    distinct = distinct_experts(c.num_experts, top_k, tokens, overlap)
    reads = union_matrices * distinct + (3 - union_matrices) * tokens * top_k
    counted = 3 * distinct_experts(c.num_experts, top_k, tokens, 0.0)
    return layers * (reads - counted) * expert_matrix_bytes(c)


def stage_issue(tokens: int) -> float:
    return 2 * decode_model.ISSUE_NEW + 6 * STAGE_BYTES / 16 / (32 * tokens)


def chunk_attention_seconds(chip: tuple[float, int, float], tokens: int, context: int) -> float:
    """One layer of attention_chunk (and its prepare's level) for `tokens` queries."""
    _, cores, clock = chip
    threadgroups = -(-tokens * MAX_GROUP // CHUNK_ROWS) * decode_model.KV_HEADS
    assert threadgroups <= cores, "the model puts each threadgroup alone on a core"
    iteration = decode_model.LATENCY_SECONDS + CHUNK_ISSUE / clock
    return 2 * decode_model.LEVEL_SECONDS + -(-context // CHUNK_KEYS) * iteration


def tokens_attention_seconds(
    chip: tuple[float, int, float], tokens: int, context: int, resident: int
) -> float:
    """One layer of attention_decode_tokens and its combine (and the prepare's level): the
    decode model's per-core latency and ALU bounds with a SIMD-group's share of a stage as its
    bytes per iteration, plus the T tokens' partials."""
    peak, cores, clock = chip
    splits = -(-context // split_length(context, decode_splits(CAPACITY)))
    simdgroups = splits * decode_model.KV_HEADS * tokens
    per_core = min(resident, simdgroups / cores)
    iteration_bytes = STAGE_BYTES / tokens
    issue = stage_issue(tokens)
    latency_bound = per_core * iteration_bytes / (decode_model.LATENCY_SECONDS + issue / clock)
    alu_bound = min(per_core, decode_model.SCHEDULERS) * clock / issue * iteration_bytes
    cap = decode_model.BANDWIDTH_EFFICIENCY * peak
    rate = min(cap, cores * min(latency_bound, alu_bound))
    kv_bytes = context * decode_model.KV_HEADS * decode_model.ROW_BYTES
    partial_bytes = 2 * tokens * splits * decode_model.Q_HEADS * decode_model.PARTIAL_BYTES
    return 3 * decode_model.LEVEL_SECONDS + kv_bytes / rate + partial_bytes / cap


def main() -> None:
    c = parse_config(real_config())
    d, layers = c.hidden_size, c.num_hidden_layers
    attention_layers = sum(1 for kind in c.layer_types if kind == FULL_ATTENTION)
    macs = token_macs(c)
    dense = (layers - attention_layers) * macs.gdn + attention_layers * macs.attention
    # The router and shared-expert gate are 8-bit: counted apart from the 4-bit shared expert.
    router = layers * d * (c.num_experts + 1)
    dense += layers * macs.shared - router
    head = d * c.vocab_size
    expert = macs.experts // c.num_experts_per_tok
    weights_seconds: dict[tuple[str, int], float] = {}
    print("verify pass at the real dims: weights read and matrix work executed (a model)")
    print(f"{'drafts':>6} {'tokens':>6} {'GB read':>8} {'GEMM tiles GFLOP':>17} "
          f"{'GEMV GFLOP':>11} {'break-even':>10}   estimated ms, GEMM tiles -> GEMVs")  # fmt: skip
    for drafts in (0, 1, 2, 4, 8):
        tokens = drafts + 1
        distinct = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens)
        traffic = pass_traffic(c, tokens)
        gb = traffic.weight_bytes
        # A decode step (one token) runs GEMVs either way.
        dense_rows = dense_tile_tokens(tokens) if tokens > 1 else 1
        expert_rows = sum(grouped_tile_tokens(1)) if tokens > 1 else 1
        tiles = 2.0 * dense_rows * (dense + router + head)
        tiles += 2.0 * expert_rows * layers * distinct * expert
        useful = 2.0 * tokens * (dense + router + head + layers * c.num_experts_per_tok * expert)
        gemv_ops = traffic.gemv_ops
        times = []
        for gpu in GPUS:
            bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY[CENTRAL]
            rate = gpu.fp32_rate * FP32_TILE_EFFICIENCY
            before = max(gb / bandwidth, tiles / rate)
            # gemv_ops are instructions (model_graph.pass_traffic): an FMA is two of the
            # published FLOPs, so the GPU issues fp32_rate / 2 of them a second.
            after = max(gb / bandwidth, gemv_ops / (gpu.fp32_rate / 2))
            times.append(f"{gpu.name.split(' (')[0]} {before * 1e3:6.1f} -> {after * 1e3:5.1f}")
            weights_seconds[gpu.name.split(" (")[0], tokens] = after
        print(
            f"{drafts:>6} {tokens:>6} {gb / 1e9:8.2f} {tiles / 1e9:17.0f} {useful / 1e9:11.1f} "
            f"{verify_cost_ratio(c, drafts):10.2f}   " + ", ".join(times)
        )
    print_attention(weights_seconds, attention_layers)
    print_expert_overlap(c)


def print_expert_overlap(c: ModelConfig) -> None:
    print()
    print(
        "experts of a verify pass as the kernels read them, per expert overlap (a MODEL: every "
        "read from memory): distinct experts per layer, then GB a pass reads, per kernel design"
    )
    designs = " | ".join(f"{name:>13}" for name in UNION_DESIGNS)
    print(f"{'overlap':>24} {'drafts':>6} {'distinct':>8}   GB: {designs}")
    for name, overlap in overlap_cases(c).items():
        for drafts in (1, 2, 3, 4, 8):
            tokens = drafts + 1
            distinct = distinct_experts(c.num_experts, c.num_experts_per_tok, tokens, overlap)
            counted = pass_traffic(c, tokens).weight_bytes
            gb = [
                (counted + expert_bytes_beyond_traffic(c, tokens, overlap, matrices)) / 1e9
                for matrices in UNION_DESIGNS.values()
            ]
            shown = " | ".join(f"{value:13.2f}" for value in gb)
            print(f"{name:>24} {drafts:>6} {distinct:8.1f}       {shown}")


def print_attention(weights_seconds: dict[tuple[str, int], float], layers: int) -> None:
    print()
    print(
        f"attention per pass ({layers} layers; a MODEL: {decode_model.LATENCY_SECONDS * 1e9:.0f}"
        f" ns latency, {decode_model.SCHEDULERS} schedulers per core, 4 / 8 SIMD-groups resident,"
        f" cap {decode_model.BANDWIDTH_EFFICIENCY:.0%} of peak) and the whole pass with the GEMVs"
    )
    print(
        f"{'GPU':>7} {'context':>7} {'drafts':>6}   attention ms: decode step | chunk -> tokens"
        "   pass ms: chunk -> tokens (decode step)"
    )
    for gpu, chip in decode_model.GPUS.items():
        for context in CONTEXTS:
            decode_seconds = [
                layers
                * decode_model.layer_seconds(
                    decode_model.KERNELS[1], chip, context, CAPACITY, resident
                )[0]
                for resident in decode_model.RESIDENT
            ]
            step = weights_seconds[gpu, 1] + decode_seconds[0]
            for drafts in (1, 4, 8):
                tokens = drafts + 1
                chunk = layers * chunk_attention_seconds(chip, tokens, context)
                after = [
                    layers * tokens_attention_seconds(chip, tokens, context, resident)
                    for resident in decode_model.RESIDENT
                ]
                weights = weights_seconds[gpu, tokens]
                print(
                    f"{gpu:>7} {context:>7} {drafts:>6}   "
                    f"{decode_seconds[0] * 1e3:5.2f} / {decode_seconds[1] * 1e3:5.2f} | "
                    f"{chunk * 1e3:6.2f} -> {after[0] * 1e3:5.2f} / {after[1] * 1e3:5.2f}   "
                    f"{(weights + chunk) * 1e3:6.1f} -> {(weights + after[0]) * 1e3:5.1f} "
                    f"({step * 1e3:4.1f})"
                )


if __name__ == "__main__":
    main()
