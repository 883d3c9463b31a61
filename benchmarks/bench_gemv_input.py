"""Does the decode GEMVs' fp32 input cost time? A question only a Mac can answer.

Every SIMD-group of a decode GEMV reads all of x in fp32 (8 KB for 2048 inputs, more than its 4
rows of 4-bit weights), from cache. Issue 12 suggests a compact bf16 or fp16 x; that changes the
engine's rounding, so it is worth doing only if the fp32 reads are measurably slower. This script
times the same GEMV three ways at the decode step's real shapes:

- `normed fp32`: what the decode step runs (`qgemv_normed_4_float`: the residual, norm folded);
- `fp32`: the plain GEMV on an fp32 x (`qgemv_4_float`);
- `bf16`: the plain GEMV on a bf16 x (`qgemv_4_bfloat`), the compact input.

Each case runs `--copies` distinct copies of the weights, one per level as in the decode step
(so they come from DRAM, not from the system cache), and reports microseconds per GEMV and the
weight bytes per second. If `bf16` is clearly faster than `fp32` on a Mac, a compact x pays; if
not, the fp32 input is free. On the sim the numbers say nothing about a GPU (the shapes are
shrunk so that it finishes): that mode only shows the script works.

Usage: python benchmarks/bench_gemv_input.py [--device metal|sim] [--copies N] [--repeat N]
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_sim import random_quantized, time_graph

from lily.checkpoint.quant import float32_to_bf16
from lily.device import available, open_device
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import QuantWeight, wrap_quant_weight
from lily.kernels.quantized import record_qgemv

HIDDEN = 2048
# One decode dispatch's projections of the hidden state, with their output rows (the real model).
SHAPES = {
    "GDN in_proj qkv|z|a|b": (8192, 4096, 32, 32),
    "attention q|k|v": (8192, 512, 512),
    "MoE shared gate|up": (512, 512),
}
# The sim runs the same kernels at rows / SIM_SHRINK, so that a run takes seconds.
SIM_SHRINK = 16


def weight_bytes(weight: QuantWeight) -> int:
    return weight.rows * (HIDDEN // 2 + 4 * HIDDEN // 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "metal" if "metal" in available() else "sim"
    parser.add_argument("--device", choices=("metal", "sim"), default=default_device)
    parser.add_argument("--copies", type=int, help="weight copies per graph (default 30; sim 2)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    on_sim = args.device == "sim"
    copies = args.copies or (2 if on_sim else 30)
    repeat = min(args.repeat, 3) if on_sim else args.repeat
    device = open_device(args.device)
    rng = np.random.default_rng(0)

    residual = rng.normal(0, 1, HIDDEN).astype(np.float32)
    x_fp32 = device.wrap(residual)
    x_bf16 = device.wrap(float32_to_bf16(residual))
    norm = FoldedNorm(device.wrap(float32_to_bf16(np.ones(HIDDEN, np.float32))), 1e-6)
    print(f"device {device.name}, {copies} weight copies per graph, median of {repeat} runs")
    if on_sim:
        print(f"(sim: rows / {SIM_SHRINK}; these times say nothing about a GPU)")
    print(f"{'projections':<24} {'x':<12} {'us per GEMV':>12} {'weight GB/s':>12}")
    for name, rows in SHAPES.items():
        rows = tuple(max(32, r // SIM_SHRINK) if on_sim else r for r in rows)
        layers = []
        for _ in range(copies):
            weights = [
                wrap_quant_weight(device, *random_quantized(rng, r, HIDDEN, 4)) for r in rows
            ]
            layers.append([(w, device.alloc(4 * w.rows)) for w in weights])
        per_gemv = sum(weight_bytes(w) for w, _ in layers[0])
        cases = {
            "normed fp32": dict(x=x_fp32, norm=norm),
            "fp32": dict(x=x_fp32),
            "bf16": dict(x=x_bf16, x_dtype="bfloat16"),
        }
        for label, inputs in cases.items():

            def record(graph, inputs=inputs, layers=layers):
                for projections in layers:
                    record_qgemv(graph, device, projections=projections, **inputs)
                    graph.barrier()

            seconds = time_graph(device, record, repeat) / copies
            rate = per_gemv / seconds / 1e9
            print(f"{name:<24} {label:<12} {seconds * 1e6:>12.1f} {rate:>12.1f}")


if __name__ == "__main__":
    main()
