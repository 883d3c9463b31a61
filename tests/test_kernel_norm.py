"""RMSNorm and the fused residual add + RMSNorm (`metal/rms_norm.metal`) against float64 numpy.

Error bound: a thread sums the squares of its ceil(dim / threads) elements, the SIMD-group sum
adds up to 31 roundings and the threadgroup adds up to 32 partials, so the mean square is within
(per_thread + 64) ulps; rsqrt, the two multiplies and the division by dim add a few more, and the
square root halves the relative error of the sum. The output is checked to within
(per_thread + 64) / 2 + 8 float32 ulps of its own magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    random_bf16,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32
from lily.engine import reference
from lily.kernels.norm import record_add_rms_norm, record_rms_norm, threads_for

EPS = 1e-6


def ulps_for(dim: int) -> float:
    per_thread = -(-dim // threads_for(dim))
    return (per_thread + 64) / 2 + 8


def stored_gain(rng: np.random.Generator, dim: int) -> np.ndarray:
    """A zero-centred norm's stored 1 + w (MLX layout), deliberately far from identity."""
    return random_bf16(rng, dim, scale=0.1, loc=1.0)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "dim", "dtype"),
    [
        (1, 2048, "float32"),  # input / post-attention / final norm
        (16, 256, "float32"),  # q_norm over 16 heads
        (2, 256, "bfloat16"),  # k_norm
        (3, 128, "float32"),  # tiny hidden size
        (5, 100, "float32"),  # ragged
        (2, 1, "bfloat16"),
        (1, 9000, "float32"),  # more elements than one threadgroup has threads
    ],
)
def test_rms_norm(lane_order, rows, dim, dtype):
    rng = np.random.default_rng(dim + rows)
    device = sim_device(lane_order)
    if dtype == "bfloat16":
        x = random_bf16(rng, (rows, dim), scale=3.0)
        x64 = bf16_to_float32(x).astype(np.float64)
    else:
        x = rng.normal(0, 3.0, (rows, dim)).astype(np.float32)
        x64 = x.astype(np.float64)
    gain = stored_gain(rng, dim)
    out = float_buffer(device, rows * dim)
    run(
        device,
        lambda g: record_rms_norm(
            g, device, device.wrap(x), device.wrap(gain), out, rows, dim, EPS, x_dtype=dtype
        ),
    )
    expected = reference.rms_norm(x64, bf16_to_float32(gain).astype(np.float64), EPS)
    actual = as_float32(out, rows * dim).reshape(rows, dim)
    assert_within_ulps(actual, expected, np.abs(expected), ulps_for(dim))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "dim"), [(1, 2048), (1, 128), (3, 200)])
@pytest.mark.parametrize("in_place", [False, True])
def test_add_rms_norm(lane_order, rows, dim, in_place):
    rng = np.random.default_rng(dim)
    device = sim_device(lane_order)
    residual = rng.normal(0, 2.0, (rows, dim)).astype(np.float32)
    delta = rng.normal(0, 0.5, (rows, dim)).astype(np.float32)
    gain = stored_gain(rng, dim)
    # The add is one fp32 rounding in the kernel and in numpy: h must match exactly.
    expected_h = residual + delta
    residual_buffer = device.wrap(residual.copy())
    h = residual_buffer if in_place else float_buffer(device, rows * dim)
    out = float_buffer(device, rows * dim)
    run(
        device,
        lambda g: record_add_rms_norm(
            g,
            device,
            residual_buffer,
            device.wrap(delta),
            device.wrap(gain),
            h,
            out,
            rows,
            dim,
            EPS,
        ),
    )
    np.testing.assert_array_equal(as_float32(h, rows * dim).reshape(rows, dim), expected_h)
    expected = reference.rms_norm(
        expected_h.astype(np.float64), bf16_to_float32(gain).astype(np.float64), EPS
    )
    actual = as_float32(out, rows * dim).reshape(rows, dim)
    assert_within_ulps(actual, expected, np.abs(expected), ulps_for(dim))
