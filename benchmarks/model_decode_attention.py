"""A MODEL, not a measurement, of the decode step's attention at long context on Apple GPUs:
the bandwidth at which the split-context decode kernel reads the KV cache, for the kernel of
issue 29 (the group's 8 query heads as fragment rows, tiles of 8 positions) next to the one it
replaced (one position per SIMD-group iteration, every score on all 32 lanes). Nothing here has
run on a Mac; every GPU figure below is an assumption, say so when quoting the output.

The model, per kernel, chip and context (the real model's 10 attention layers, 16 query and
2 kv heads of 256 dims, a bf16 cache: 1 KB of K and V per position and kv head):

- bytes: the context's K and V once, plus the partials each reached split writes and the
  combine reads back (16 heads x 1 KB per split);
- a SIMD-group loops over iterations: it issues its loads (1 position for the old kernel, a
  tile of 8 for the new one), waits LATENCY_SECONDS for them, then issues its ALU work
  (ISSUE_* lane-instructions per iteration, counted below from the kernels' code);
- a core keeps `resident` SIMD-groups (register-bound: both kernels hold ~200 fp32 registers
  per lane; 4 and 8 are shown) and issues SCHEDULERS SIMD-group instructions per cycle;
- a core then streams min(resident x bytes per iteration / (latency + issue / clock),
  min(resident, SCHEDULERS) x clock / issue x bytes per iteration), the first the latency bound
  and the second the ALU bound; the GPU streams the sum over cores, capped at
  BANDWIDTH_EFFICIENCY of the peak (as bench_decode_graph.py's model); a dispatch with fewer
  SIMD-groups than the cores could hold uses only those;
- each layer adds two levels (decode and combine) of LEVEL_SECONDS.

It leaves out: the prologue (norms and RoPE of the queries, the current key), the threadgroup
merge, tail effects of the last wave, and L2 hits.

Usage:
    python benchmarks/model_decode_attention.py [--capacity 262144]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from lily.kernels.attention import decode_splits, split_length

# Assumed, not measured: peak memory bandwidth (B/s), GPU cores, GPU clock (Hz). The clocks are
# the fp32 rates bench_prefill.py assumes (5.2 and 18.4 TFLOP/s) over 128 lanes x 2 per core.
GPUS = {"M1 Pro": (200e9, 16, 1.27e9), "M4 Max": (546e9, 40, 1.8e9), "M5 Max": (614e9, 40, 1.8e9)}
BANDWIDTH_EFFICIENCY = 0.8
LEVEL_SECONDS = 2.5e-6
LATENCY_SECONDS = 600e-9
SCHEDULERS = 4
RESIDENT = (4, 8)
# The rest of the step (weights, GDN state, every other level), from docs/benchmarks.md's
# estimate at 256 positions of context (bench_decode_graph.py SYNTH_DIR --traffic) less its
# 20 attention levels and their 10.5 MB.
STEP_AT_256 = {"M1 Pro": 11.82e-3, "M4 Max": 4.73e-3, "M5 Max": 4.28e-3}
ATTENTION_AT_256_BYTES = 10.5e6

LAYERS, Q_HEADS, KV_HEADS = 10, 16, 2
ROW_BYTES = 2 * 256 * 2  # K and V of one position and kv head, bf16
PARTIAL_BYTES = 256 * 4 + 8  # one query head's partial of one split

# Lane-instructions one SIMD-group issues per iteration. Old kernel, per position: 2 loads and
# 16 widening ops, then per query head (8): an 8-term dot product (8), simd_sum (5 shuffles, 5
# adds), max, 2 subtractions, 2 exps (2 each), the running sum (1), acc = acc * rescale +
# weight * v (16). New kernel, per tile of 8 positions: 64 fragment products (512 fp32 FMAs over
# 32 lanes: 16 each, assuming the products issue at the full fp32 rate), 96 ops widening K and
# 64 widening V, 64 rescaling the accumulators, 16 loads, ~26 for the softmax and the partial
# scores.
ISSUE_OLD = 2 + 16 + 8 * (8 + 10 + 1 + 2 + 4 + 1 + 16)
ISSUE_NEW = 64 * 16 + 96 + 64 + 64 + 16 + 26


def old_splits(context: int, capacity: int) -> int:
    """The replaced kernel's split rule: at least 20 splits of 16 to 256 positions."""
    grid = min(128, max(20, -(-capacity // 256)))
    spread = min(256, max(16, -(-context // 20)))
    return -(-context // max(spread, -(-context // grid)))


def new_splits(context: int, capacity: int) -> int:
    return -(-context // split_length(context, decode_splits(capacity)))


@dataclass(frozen=True)
class Kernel:
    name: str
    simdgroups_per_threadgroup: int
    positions_per_iteration: int
    issue_per_iteration: int
    splits: Callable[[int, int], int]  # (context, capacity) -> splits the context reaches


KERNELS = (
    Kernel("old (1 position per iteration)", 8, 1, ISSUE_OLD, old_splits),
    Kernel("new (8-position tiles, 8 heads as rows)", 4, 8, ISSUE_NEW, new_splits),
)


def layer_seconds(
    kernel: Kernel, chip: tuple[float, int, float], context: int, capacity: int, resident: int
) -> tuple[float, float, int]:
    """(seconds per layer, KV streaming rate in B/s, SIMD-groups of the dispatch)."""
    peak, cores, clock = chip
    splits = kernel.splits(context, capacity)
    simdgroups = splits * KV_HEADS * kernel.simdgroups_per_threadgroup
    per_core = min(resident, simdgroups / cores)
    iteration_bytes = kernel.positions_per_iteration * ROW_BYTES
    issue = kernel.issue_per_iteration
    latency_bound = per_core * iteration_bytes / (LATENCY_SECONDS + issue / clock)
    alu_bound = min(per_core, SCHEDULERS) * clock / issue * iteration_bytes
    rate = min(BANDWIDTH_EFFICIENCY * peak, cores * min(latency_bound, alu_bound))
    kv_bytes = context * KV_HEADS * ROW_BYTES
    partial_bytes = 2 * splits * Q_HEADS * PARTIAL_BYTES
    seconds = 2 * LEVEL_SECONDS + kv_bytes / rate + partial_bytes / (BANDWIDTH_EFFICIENCY * peak)
    return seconds, rate, simdgroups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=262144, help="the graph's cache capacity")
    args = parser.parse_args()
    print(
        f"MODEL, not a measurement: latency {LATENCY_SECONDS * 1e9:.0f} ns, "
        f"{SCHEDULERS} schedulers per core, cap {BANDWIDTH_EFFICIENCY:.0%} of peak, "
        f"{LEVEL_SECONDS * 1e6:.1f} us per level; issue per iteration: old {ISSUE_OLD} "
        f"(1 position), new {ISSUE_NEW} (8 positions)"
    )
    for gpu, chip in GPUS.items():
        peak = chip[0]
        rest = STEP_AT_256[gpu] - 20 * LEVEL_SECONDS
        rest -= ATTENTION_AT_256_BYTES / (BANDWIDTH_EFFICIENCY * peak)
        print(f"{gpu} ({peak / 1e9:.0f} GB/s, {chip[1]} cores, {chip[2] / 1e9:.2f} GHz):")
        for context in (4096, 32768, 131072):
            for kernel in KERNELS:
                cells = []
                for resident in RESIDENT:
                    seconds, rate, simdgroups = layer_seconds(
                        kernel, chip, context, args.capacity, resident
                    )
                    step = rest + LAYERS * seconds
                    cells.append(
                        f"{resident} resident: KV at {rate / 1e9:4.0f} GB/s "
                        f"({rate / peak:4.0%} of peak), {LAYERS * seconds * 1e3:5.2f} ms/token, "
                        f"{1 / step:4.0f} tok/s"
                    )
                print(
                    f"  {context:>6} ctx {kernel.name:<40} {simdgroups:>5} SIMD-groups | "
                    + " | ".join(cells)
                )


if __name__ == "__main__":
    main()
