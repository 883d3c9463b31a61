"""Shared helpers of the kernel tests: sim devices per lane order, running one recorded dispatch,
random MLX-quantized weights and the quantized GEMV reference (shared with `lily doctor`, in
lily.diagnostics.kernel_checks), float64 references, and tolerances stated in ulps.

Every kernel test runs under the three lane orders of the sim (forward, reverse, seeded random),
which also interleave SIMD-groups differently: a missing barrier or a read of another lane's
unwritten value shows up as a difference between them, or as the NaN poison the sim puts in
threadgroup memory. The random order runs on the checking sim, so every kernel test also runs
once with every memory access checked (out of bounds, threadgroup races, reads of unwritten
memory; docs/sim.md). ``LILY_SIM_CHECK=1`` checks all three orders, ``LILY_SIM_CHECK=0`` none.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np

from lily.checkpoint.quant import float32_to_bf16
from lily.device import CHECK_ENV, Graph, open_device
from lily.diagnostics.kernel_checks import random_quantized, reference_qgemv  # noqa: F401 - shared with doctor

LANE_ORDERS = ("forward", "reverse", "random")
FLOAT32_EPS = float(np.finfo(np.float32).eps)


@functools.cache
def sim_device(lane_order: str, tensor_ops: bool = False):
    """`tensor_ops`: the prefill GEMMs run their Metal 4 tensor-op kernels."""
    setting = os.environ.get(CHECK_ENV)
    check = lane_order == "random" if setting is None else setting not in ("", "0")
    return open_device("sim", lane_order=lane_order, seed=0, check=check, tensor_ops=tensor_ops)


def run(device, record: Callable[[Graph], None]) -> None:
    """Records one or more dispatches into a fresh graph and runs it to completion."""
    graph = Graph()
    record(graph)
    device.run(graph)


def float_buffer(device, count: int):
    """A device buffer of `count` float32 values for a kernel to write: scratch memory, zeroed
    except on the checking sim, where it starts as NaN and a kernel reading a value before
    anything wrote it is an error. Outputs a kernel accumulates into need ``device.alloc``."""
    return device.scratch(4 * count)


def as_float32(buffer, count: int, offset: int = 0) -> np.ndarray:
    return buffer.numpy()[offset : offset + 4 * count].view(np.float32)


def random_bf16(
    rng: np.random.Generator, shape, scale: float = 1.0, loc: float = 0.0
) -> np.ndarray:
    """Raw bf16 bits of normally distributed values."""
    return float32_to_bf16(rng.normal(loc, scale, shape).astype(np.float32))


def assert_within_ulps(actual: np.ndarray, expected: np.ndarray, magnitude, ulps: float) -> None:
    """|actual - expected| <= ulps * eps(float32) * magnitude, elementwise: an error bound in
    float32 ulps of the magnitude the rounding errors scale with."""
    assert_within(actual, expected, ulps * FLOAT32_EPS * np.asarray(magnitude, dtype=np.float64))


def assert_within(actual: np.ndarray, expected: np.ndarray, bound) -> None:
    """|actual - expected| <= bound, elementwise, with a message naming the worst element."""
    actual = np.asarray(actual, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), np.shape(expected))
    assert np.all(np.isfinite(actual)), "non-finite output"
    error = np.abs(actual - expected)
    if not np.all(error <= bound):
        worst = int(np.argmax(error - bound))
        raise AssertionError(
            f"{int(np.sum(error > bound))} of {error.size} values outside the bound; worst at "
            f"{worst}: got {actual.flat[worst]!r}, expected {expected.flat[worst]!r}, "
            f"bound {bound.flat[worst]!r}"
        )
