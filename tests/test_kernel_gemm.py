"""The simdgroup_matrix GEMM tile (`metal/gemm.metal`), C = A B^T, against float64 numpy.

Error bound: every element of C is a length-k sum accumulated in fp32 (8 products per fragment
multiply-accumulate, fragments in sequence), so it is within (k + 8) float32 ulps of sum |a b|.
bf16 operands are widened exactly, so the reference uses the same rounded values.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.kernels.gemm import record_gemm_nt


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (32, 32, 16),  # exactly one tile and one stage
        (1, 1, 1),
        (37, 45, 19),  # ragged in every dimension
        (8, 512, 2048),  # a prefill chunk of 8 tokens through a 512x2048 projection
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemm_nt(lane_order, m, n, k, dtype):
    rng = np.random.default_rng(m * n + k)
    device = sim_device(lane_order)
    a32 = rng.normal(0, 1, (m, k)).astype(np.float32)
    b32 = rng.normal(0, 1, (n, k)).astype(np.float32)
    if dtype == "bfloat16":
        a, b = float32_to_bf16(a32), float32_to_bf16(b32)
        a64, b64 = bf16_to_float32(a).astype(np.float64), bf16_to_float32(b).astype(np.float64)
    else:
        a, b = a32, b32
        a64, b64 = a32.astype(np.float64), b32.astype(np.float64)
    c = float_buffer(device, m * n)
    run(
        device,
        lambda g: record_gemm_nt(g, device, device.wrap(a), device.wrap(b), c, m, n, k, dtype),
    )
    expected = a64 @ b64.T
    assert_within_ulps(
        as_float32(c, m * n).reshape(m, n), expected, np.abs(a64) @ np.abs(b64).T, k + 8
    )
