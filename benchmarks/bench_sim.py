"""Throughput of the sim device, to budget test time (nothing here says anything about a GPU).

Prints, for a few kernels, the simulated threads per second and the wall time per dispatch, among
them the 2048x2048 4-bit GEMV. Usage: python benchmarks/bench_sim.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from lily.checkpoint.quant import float32_to_bf16
from lily.device import Graph, open_device
from lily.kernels.embedding import record_embedding
from lily.kernels.norm import record_rms_norm, threads_for
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import record_qgemv


def random_quantized(rng: np.random.Generator, rows: int, in_dim: int, bits: int):
    words = rng.integers(0, 2**32, (rows, in_dim * bits // 32), dtype=np.uint32)
    scales = float32_to_bf16(rng.uniform(0.002, 0.02, (rows, in_dim // 64)).astype(np.float32))
    biases = float32_to_bf16(rng.normal(0, 0.05, (rows, in_dim // 64)).astype(np.float32))
    return words, scales, biases


def time_graph(device, record: Callable[[Graph], None], repeat: int) -> float:
    """Median wall time of running the recorded graph, after one warm-up run."""
    graph = Graph()
    record(graph)
    device.run(graph)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        device.run(graph)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    device = open_device("sim", lane_order="forward", seed=0)
    rng = np.random.default_rng(0)
    print(f"sim device on {os.cpu_count()} CPUs, median of {args.repeat} runs")
    print(f"{'case':<40} {'threads':>10} {'ms':>10} {'Mthreads/s':>11}")

    def report(name: str, threads: int, seconds: float) -> None:
        print(f"{name:<40} {threads:>10} {seconds * 1e3:>10.2f} {threads / seconds / 1e6:>11.2f}")

    # Trivial threads: one 4-bit word dequantized per thread.
    table = wrap_quant_weight(device, *random_quantized(rng, 4096, 2048, 4))
    tokens = device.wrap(rng.integers(0, 4096, 64, dtype=np.uint32))
    rows_out = device.alloc(4 * 64 * 2048)
    first = device.alloc(4)
    seconds = time_graph(
        device,
        lambda g: record_embedding(g, device, tokens, first, table, rows_out, 64),
        args.repeat,
    )
    report("embedding gather, 64 tokens x 2048", 64 * 256, seconds)

    x = device.wrap(rng.normal(0, 1, 64 * 2048).astype(np.float32))
    gain = device.wrap(float32_to_bf16(np.ones(2048, np.float32)))
    seconds = time_graph(
        device,
        lambda g: record_rms_norm(g, device, x, gain, rows_out, 64, 2048, 1e-6),
        args.repeat,
    )
    report("rms_norm, 64 rows x 2048", 64 * threads_for(2048), seconds)

    x1 = device.wrap(rng.normal(0, 1, 2048).astype(np.float32))
    for rows, in_dim in ((2048, 2048), (8192, 2048)):
        weight = wrap_quant_weight(device, *random_quantized(rng, rows, in_dim, 4))
        out = device.alloc(4 * rows)
        seconds = time_graph(
            device,
            lambda g, weight=weight, out=out: record_qgemv(g, device, x1, [(weight, out)]),
            args.repeat,
        )
        report(f"qgemv 4-bit {rows}x{in_dim}", rows // 8 * 64, seconds)


if __name__ == "__main__":
    main()
