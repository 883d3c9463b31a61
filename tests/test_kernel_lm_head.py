"""lm_head GEMV + argmax (`metal/lm_head.metal`): the next token id written on the device.

Ties must go to the lowest index (numpy's argmax). The logits of the full-size run are checked
with the GEMV's error bound (see test_kernel_quantized.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)
from test_kernel_quantized import ulps_for

from lily.kernels.lm_head import record_argmax, record_lm_head
from lily.kernels.quantized import wrap_quant_weight


def device_argmax(device, values: np.ndarray) -> int:
    index = device.alloc(4)
    index.numpy()[:] = 0xFF  # not a plausible answer
    run(device, lambda g: record_argmax(g, device, device.wrap(values), len(values), index))
    return int(index.numpy().view(np.uint32)[0])


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("count", [1, 33, 1025, 4096, 248320])
def test_argmax_random(lane_order, count):
    values = np.random.default_rng(count).normal(0, 1, count).astype(np.float32)
    assert device_argmax(sim_device(lane_order), values) == int(np.argmax(values))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_argmax_ties_go_to_the_lowest_index(lane_order):
    device = sim_device(lane_order)
    values = np.random.default_rng(0).normal(0, 1, 248320).astype(np.float32)
    # Equal maxima held by different threads and SIMD-groups, and by the same thread.
    for positions in ([248000, 70001, 5000], [2047, 1023], [4096, 3072, 1024]):
        tied = values.copy()
        tied[positions] = 10.0
        assert device_argmax(device, tied) == min(positions)
    assert device_argmax(device, np.full(300, -np.inf, dtype=np.float32)) == 0
    assert device_argmax(device, np.zeros(5000, dtype=np.float32)) == 0


def check_lm_head(lane_order: str, vocab: int, hidden: int):
    rng = np.random.default_rng(vocab)
    device = sim_device(lane_order)
    triple = random_quantized(rng, vocab, hidden, 4)
    x = rng.normal(0, 1, hidden).astype(np.float32)
    logits = float_buffer(device, vocab)
    token = device.alloc(4)
    weights = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_lm_head(g, device, device.wrap(x), weights, logits, token))

    actual = as_float32(logits, vocab)
    expected, magnitude = reference_qgemv(*triple, 4, x.astype(np.float64))
    assert_within_ulps(actual, expected, magnitude, ulps_for(hidden, 4))
    chosen = int(token.numpy().view(np.uint32)[0])
    assert chosen == int(np.argmax(actual))
    top2 = np.sort(expected)[-2:]
    if top2[1] - top2[0] > 2 * ulps_for(hidden, 4) * np.finfo(np.float32).eps * magnitude.max():
        assert chosen == int(np.argmax(expected))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_lm_head_tiny(lane_order):
    check_lm_head(lane_order, 4096, 128)


def test_lm_head_real_size():
    # The largest GEMV of the model (248320 x 2048, 4-bit), run once.
    check_lm_head("forward", 248320, 2048)
