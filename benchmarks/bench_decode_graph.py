"""The decode graph of a checkpoint, measured without a GPU: dispatches and barriers per decoded
token, the weight bytes one token reads (against spec/model.md's 1.80 GB minimum for the real
model), and the host's time to submit and retire one step, with the sim recording and submitting
but not executing kernels (so the number is the host overhead alone).

With --traffic it also runs one step on the counting sim (every load and store of the kernels
counted, distinct bytes per dispatch and binding) and reports the measured bytes per token, by
what they are, next to the analytic figure: a kernel that reads a weight twice or reads padding
shows up as a difference. It then prints a per-kernel table (dispatches, threadgroups, levels,
bytes moved) and an ESTIMATE of the time per token on Apple GPUs from a stated model (see
`estimate_seconds`): not a measurement.

Usage:
    python benchmarks/make_synthetic_checkpoint.py SYNTH_DIR   # once, ~19.5 GB
    python benchmarks/bench_decode_graph.py SYNTH_DIR [--steps 200] [--context 256] [--traffic]
        [--kv-cache bf16|int8]
    python benchmarks/bench_decode_graph.py demo
    python benchmarks/bench_decode_graph.py --real-config [--kv-cache int8]

It also prints the KV cache's bytes per context token in the chosen format (`--kv-cache`), and
the bytes one decoded token reads at contexts of 4k, 32k and 128k: the weights and GDN state
above plus the KV rows of the whole context. `--real-config` prints only those, for the real
model's config.json (make_synthetic_checkpoint.py's) and its expected tensors, without a
checkpoint.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from lily.checkpoint.config import FULL_ATTENTION
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.checkpoint.validate import expected_layout
from lily.device import open_device
from lily.engine.model_graph import ModelGraph, kv_cache_bytes_per_token
from lily.kernels.attention import KV_CACHE_TYPES
from lily.kernels.gdn import state_bytes

EMBEDDING = "language_model.model.embed_tokens"
SPEC_MINIMUM_GB = 1.80


def weight_bytes_per_token(checkpoint) -> dict[str, int]:
    """Bytes of weights and recurrent state one decoded token reads, by kind: every projection
    is read whole once, except the embedding (one row) and the routed experts (top-k of E)."""
    c = checkpoint.config
    layout = expected_layout(c)
    totals = {"projections": 0, "routed experts": 0, "embedding row": 0, "small tensors": 0}
    for lin in layout.linears.values():
        q = lin.quant
        per_row = lin.in_features * q.bits // 8 + 2 * 2 * (lin.in_features // q.group_size)
        if lin.path == EMBEDDING:
            totals["embedding row"] += per_row
        elif lin.experts is not None:
            totals["routed experts"] += per_row * lin.out_features * c.num_experts_per_tok
        else:
            totals["projections"] += per_row * lin.out_features
    for name in layout.plain:
        totals["small tensors"] += checkpoint.locations[name].nbytes
    gdn_layers = sum(1 for t in c.layer_types if t != FULL_ATTENTION)
    totals["GDN state (read + write)"] = 2 * gdn_layers * state_bytes(c.linear_num_value_heads)
    return totals


# The contexts the KV report prints the bytes per decoded token at.
KV_REPORT_CONTEXTS = (4096, 32768, 131072)


# Assumed, not measured: peak memory bandwidth (GB/s) and GPU cores of each chip, the fraction
# of the peak a well-filled streaming kernel reaches, and the cost of one dependent level
# (launch, drain and the barrier) on Apple GPUs.
GPUS = {"M1 Pro": (200.0, 16), "M4 Max": (546.0, 40), "M5 Max": (614.0, 40)}
BANDWIDTH_EFFICIENCY = 0.8
LEVEL_SECONDS = 2.5e-6


def estimate_seconds(levels: list[list[tuple[int, int]]], bandwidth_gbs: float, cores: int):
    """The estimated time of one decode step: each level (its dispatches' (bytes moved,
    threadgroups)) takes LEVEL_SECONDS plus its slowest dispatch's bytes at
    BANDWIDTH_EFFICIENCY of the peak, scaled down when it has fewer threadgroups than the GPU
    has cores (a core's share of the bandwidth then idles)."""
    total = 0.0
    for level in levels:
        slowest = 0.0
        for nbytes, threadgroups in level:
            fill = min(1.0, threadgroups / cores)
            slowest = max(slowest, nbytes / (bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY * fill))
        total += LEVEL_SECONDS + slowest
    return total


def print_kernel_table(graph, traffic) -> None:
    """Per kernel: dispatches per token, threadgroups per dispatch, the levels it runs in, and
    the bytes its dispatches moved (read + written, distinct per binding); then the estimate."""
    rows: dict[str, dict] = {}
    levels: dict[int, list[tuple[int, int]]] = {}
    for record, moved in zip(graph.dispatches, traffic, strict=True):
        assert record.kernel == moved.kernel, (record.kernel, moved.kernel)
        nbytes = moved.read + moved.written
        threadgroups = record.threadgroups[0] * record.threadgroups[1] * record.threadgroups[2]
        row = rows.setdefault(record.kernel, {"n": 0, "tg": set(), "bytes": 0, "read": 0})
        row["n"] += 1
        row["tg"].add(threadgroups)
        row["bytes"] += nbytes
        row["read"] += moved.read
        levels.setdefault(record.level, []).append((nbytes, threadgroups))
    print(f"per kernel, one step ({len(levels)} levels):")
    print(
        f"  {'kernel':<36} {'dispatches':>10} {'threadgroups':>14} {'MB read':>9} {'MB moved':>9}"
    )
    for name, row in sorted(rows.items(), key=lambda item: -item[1]["bytes"]):
        tg = sorted(row["tg"])
        groups = str(tg[0]) if len(tg) == 1 else f"{tg[0]}-{tg[-1]}"
        print(
            f"  {name:<36} {row['n']:>10} {groups:>14} {row['read'] / 1e6:>9.2f} "
            f"{row['bytes'] / 1e6:>9.2f}"
        )
    print(
        f"ESTIMATED time per token (model: {LEVEL_SECONDS * 1e6:.1f} us per level + bytes at "
        f"{BANDWIDTH_EFFICIENCY:.0%} of peak bandwidth, scaled by min(1, threadgroups / cores)):"
    )
    for gpu, (bandwidth, cores) in GPUS.items():
        seconds = estimate_seconds(list(levels.values()), bandwidth, cores)
        floor = LEVEL_SECONDS * len(levels)
        print(
            f"  {gpu:<8} {bandwidth:.0f} GB/s, {cores} cores: {seconds * 1e3:.2f} ms "
            f"({1 / seconds:.0f} tok/s; of it {floor * 1e3:.2f} ms of levels)"
        )


def print_kv_report(config, kv_cache: str, weights: int) -> None:
    """The KV cache's bytes per context token, and per decoded token at KV_REPORT_CONTEXTS
    (`weights`: the weights and state a token reads besides)."""
    kv_per_token = kv_cache_bytes_per_token(config, kv_cache)
    print(f"KV cache ({kv_cache})     {kv_per_token:,} B per context token")
    for context in KV_REPORT_CONTEXTS:
        at = kv_per_token * context
        print(
            f"  at {context // 1024:>3}k context     {(weights + at) / 1e9:.4f} GB per token "
            f"({at / 1e9:.4f} GB of it KV)"
        )


def real_config_report(kv_cache: str) -> None:
    """print_kv_report for the real model, its weights per token counted from the expected
    tensors (the small ones at their full size) instead of a checkpoint's files."""
    from make_synthetic_checkpoint import nbytes, real_config

    from lily.checkpoint.config import parse_config
    from lily.checkpoint.validate import expected_tensors

    config = parse_config(real_config())
    sizes = {
        name: SimpleNamespace(nbytes=nbytes(t)) for name, t in expected_tensors(config).items()
    }
    weights = sum(weight_bytes_per_token(SimpleNamespace(config=config, locations=sizes)).values())
    print(f"real model's config: {weights / 1e9:.4f} GB of weights and GDN state per token")
    print_kv_report(config, kv_cache, weights)


def measured_bytes_per_token(
    checkpoint, max_seq: int, kv_cache: str
) -> tuple[dict[str, int], float]:
    """Runs the first decode step (position 0) on the counting sim: the distinct bytes every
    dispatch read plus those it wrote, summed over the step by what the buffer holds, and the
    seconds the step took; then prints the per-kernel table and the estimate."""
    device = open_device("sim", count_traffic=True)
    decode = ModelGraph(
        checkpoint, device, max_seq, checkpoint.config.vocab_size, max_chunk=1, kv_cache=kv_cache
    )
    state = decode.state
    kinds = {}
    for buffer in state.recurrent.values():
        kinds[id(buffer)] = "GDN state (read + write)"
    for buffer in state.conv_windows.values():
        kinds[id(buffer)] = "conv windows"
    for buffer in [*state.k_cache.values(), *state.v_cache.values()]:
        kinds[id(buffer)] = "KV cache"
    for buffer in (state.logits, state.logprob_ring):
        kinds[id(buffer)] = "logits"
    start = time.perf_counter()
    device.run(decode.decode)
    seconds = time.perf_counter() - start
    totals: dict[str, int] = {}
    traffic = device.traffic()
    print_kernel_table(decode.decode, traffic)
    for dispatch in traffic:
        for binding in dispatch.buffers.values():
            # The checkpoint's shards are the only read-only buffers.
            kind = "weights" if not binding.buffer.writable else "activations and step"
            kind = kinds.get(id(binding.buffer), kind)
            totals[kind] = totals.get(kind, 0) + binding.read + binding.written
    return totals, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory, repo id or 'demo'")
    parser.add_argument("--steps", type=int, default=200, help="steps timed in no-execute mode")
    parser.add_argument("--context", type=int, default=256, help="context for the KV bytes")
    parser.add_argument("--max-seq", type=int, default=4096)
    parser.add_argument(
        "--traffic", action="store_true", help="run one step counting the bytes it moves"
    )
    parser.add_argument("--kv-cache", choices=KV_CACHE_TYPES, default="bf16")
    parser.add_argument(
        "--real-config",
        action="store_true",
        help="the KV arithmetic of the real model's config alone, without a checkpoint",
    )
    args = parser.parse_args()
    if args.real_config:
        real_config_report(args.kv_cache)
        return
    if args.model is None:
        parser.error("a checkpoint (or --real-config) is needed")

    checkpoint = load_checkpoint(resolve_model(args.model))
    config = checkpoint.config
    device = open_device("sim", execute=False)
    start = time.perf_counter()
    decode = ModelGraph(
        checkpoint, device, args.max_seq, config.vocab_size, max_chunk=1, kv_cache=args.kv_cache
    )
    recorded = time.perf_counter() - start
    graph = decode.decode

    totals = weight_bytes_per_token(checkpoint)
    weights = sum(totals.values())
    kv_per_token = kv_cache_bytes_per_token(config, args.kv_cache)
    kv = kv_per_token * args.context
    print(f"checkpoint          {checkpoint.path} ({checkpoint.level})")
    print(f"graph recorded in   {recorded * 1e3:.1f} ms")
    print(f"dispatches / token  {graph.dispatch_count}")
    print(f"barriers / token    {graph.barrier_count}")
    for kind, nbytes in totals.items():
        print(f"  {kind:<24} {nbytes / 1e9:8.4f} GB")
    print(f"bytes / token       {weights / 1e9:.4f} GB + KV {kv / 1e6:.2f} MB at {args.context}")
    if checkpoint.level == "strict":
        print(f"spec minimum        {SPEC_MINIMUM_GB:.2f} GB (spec/model.md section 4)")
    print_kv_report(config, args.kv_cache, weights)

    in_flight = []
    start = time.perf_counter()
    for _ in range(args.steps):
        in_flight.append(device.submit(graph))
        if len(in_flight) == 2:
            device.wait(in_flight.pop(0))
    for ticket in in_flight:
        device.wait(ticket)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"host time / step    {per_step * 1e6:.1f} us (submit + wait, kernels not executed)")

    if args.traffic:
        measured, seconds = measured_bytes_per_token(checkpoint, args.max_seq, args.kv_cache)
        print(f"measured, one step at position 0 on the counting sim ({seconds:.0f} s):")
        for kind, nbytes in sorted(measured.items(), key=lambda item: -item[1]):
            print(f"  {kind:<24} {nbytes / 1e9:8.4f} GB")
        state = "GDN state (read + write)"
        analytic_weights = weights - totals[state]
        for kind, analytic in (("weights", analytic_weights), (state, totals[state])):
            difference = measured.get(kind, 0) - analytic
            print(f"  {kind} vs analytic: {difference:+d} bytes ({difference / analytic:+.4%})")
        total = sum(measured.values())
        rest = total - measured.get("weights", 0) - measured.get(state, 0)
        print(
            f"measured bytes / token {total / 1e9:.4f} GB vs analytic {weights / 1e9:.4f} GB "
            f"({total / weights - 1:+.3%}; {rest / 1e6:.1f} MB of activations, conv windows, "
            "logits and KV, which the analytic figure leaves out)"
        )


if __name__ == "__main__":
    main()
