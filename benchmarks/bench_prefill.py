"""Batched prefill, measured without a GPU.

Two parts:
- **graph** (any checkpoint; the sim records and checks but does not execute): dispatches and
  barrier levels of a prefill chunk next to the decode step's, the weight bytes one chunk reads
  (each weight once per chunk; the routed experts some token of the chunk chose, by the expected
  count for uniform routing) and per prompt token, the FLOPs per prompt token, and a roofline
  estimate of prefill tok/s on Apple GPUs from those two numbers (an estimate, not a measurement:
  the GPU figures below are assumptions, say so when quoting them);
- **time** (small checkpoints, e.g. the demo, on the sim): a prompt prefilled as one chunk
  against the same prompt fed one token per step through the decode graph (final norm, lm_head
  and sampler included: how every prompt went before batched prefill), and, for reference,
  through one-token prefill passes (`max_chunk` 1: no lm_head except for the last token).

Usage:
    python benchmarks/bench_prefill.py demo [--tokens 512]          # graph + time
    python benchmarks/bench_prefill.py SYNTH_DIR --no-time           # graph at the real dims
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lily.checkpoint.config import FULL_ATTENTION
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.checkpoint.validate import expected_layout
from lily.device import open_device
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import ModelGraph, pass_flops

EMBEDDING = "language_model.model.embed_tokens"
LM_HEAD = "language_model.lm_head"
# Assumed GPU figures for the roofline estimate: memory bandwidth (bytes/s) and the fp32
# simdgroup-matrix rate our GEMMs use (FLOP/s), both peak; a real kernel reaches a fraction.
GPUS = {
    "M1 Pro (16-core GPU)": (200e9, 5.2e12),
    "M5 Max (40-core GPU)": (614e9, 18.4e12),
}
ASSUMED_EFFICIENCY = 0.5


def weight_bytes_per_chunk(checkpoint, tokens: int) -> dict[str, float]:
    """Bytes of weights one chunk of `tokens` reads from memory if each is read once: every
    projection, the embedding rows, and the routed experts at least one token chose (expected
    E * (1 - (1 - k/E)^T) per layer for uniform routing). The lm_head is read for the one
    predicting token."""
    c = checkpoint.config
    layout = expected_layout(c)
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
            totals["projections"] += per_row * lin.out_features
    return totals


def graph_report(checkpoint, tokens: int) -> None:
    c = checkpoint.config
    device = open_device("sim", execute=False)
    start = time.perf_counter()
    model = ModelGraph(checkpoint, device, tokens + 64, c.vocab_size, max_chunk=tokens)
    chunk = model.graph(tokens, predicts=True)
    recorded = time.perf_counter() - start
    print(f"checkpoint            {checkpoint.path} ({checkpoint.level})")
    print(f"graphs recorded in    {recorded * 1e3:.0f} ms (decode step + chunk of {tokens})")
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
    for context in (tokens, 4096):
        flops = pass_flops(c, context - tokens, tokens) / tokens
        print(f"FLOPs / prompt token  {flops / 1e9:.2f} G (chunk ending at {context})")
    print(f"estimate at {ASSUMED_EFFICIENCY:.0%} of peak (assumed GPU figures, not measured):")
    flops = pass_flops(c, 4096 - tokens, tokens)
    for gpu, (bandwidth, rate) in GPUS.items():
        seconds = max(total / bandwidth, flops / rate) / ASSUMED_EFFICIENCY
        bound = "compute" if flops / rate > total / bandwidth else "memory"
        print(f"  {gpu:<22} {tokens / seconds:7.0f} tok/s ({bound}-bound, chunk ending at 4096)")


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
    parser.add_argument("--no-time", action="store_true", help="only the graph report")
    args = parser.parse_args()
    checkpoint = load_checkpoint(resolve_model(args.model))
    graph_report(checkpoint, args.tokens)
    if not args.no_time:
        time_report(checkpoint, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
