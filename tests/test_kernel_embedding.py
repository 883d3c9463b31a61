"""The quantized embedding gather (`metal/embedding.metal`), of a run of tokens and of a batched
pass's rows, against float64 numpy.

Each output is scale * code + bias evaluated in fp32: at most two roundings, so within 2 float32
ulps of |scale * code| + |bias|.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    random_quantized,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32, unpack_codes
from lily.kernels import RowSlots
from lily.kernels.embedding import record_embedding, record_embedding_rows
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.step import STEP_FIELDS, TOKEN


@functools.cache
def table(vocab: int, dim: int, bits: int):
    return random_quantized(np.random.default_rng(vocab + bits), vocab, dim, bits)


def expected_rows(triple, bits: int, tokens: np.ndarray):
    weight, scales, biases = (a[tokens] for a in triple)
    codes = unpack_codes(weight, bits).astype(np.float64).reshape(len(tokens), -1, 64)
    s = bf16_to_float32(scales).astype(np.float64)[..., None]
    b = bf16_to_float32(biases).astype(np.float64)[..., None]
    value = (s * codes + b).reshape(len(tokens), -1)
    magnitude = (np.abs(s * codes) + np.abs(b)).reshape(len(tokens), -1)
    return value, magnitude


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("vocab", "dim", "bits", "tokens"),
    [
        (248320, 2048, 4, [248046]),  # the real table, one decode token (<|im_end|>)
        (248320, 2048, 4, [0, 248319, 12345, 12345]),  # first, last, repeated rows
        (4096, 128, 4, [7, 4095, 0]),  # the tiny config
        (100, 192, 8, [99, 3]),  # 8-bit, ragged row length
    ],
)
@pytest.mark.parametrize("first", [0, 3])
def test_embedding(lane_order, vocab, dim, bits, tokens, first):
    """The ids start `first` entries into the token buffer, as a chunk's do in the history."""
    device = sim_device(lane_order)
    triple = table(vocab, dim, bits)
    ids = np.array(tokens, dtype=np.uint32)
    pad = np.full(first, vocab - 1, np.uint32)
    history = np.concatenate([pad, ids, np.array([vocab - 1], np.uint32)])
    start = device.wrap(np.array([first], np.uint32))
    out = float_buffer(device, len(ids) * dim)
    weights = wrap_quant_weight(device, *triple)
    run(
        device,
        lambda g: record_embedding(
            g, device, device.wrap(history), start, weights, out, token_count=len(ids)
        ),
    )
    expected, magnitude = expected_rows(triple, bits, ids)
    actual = as_float32(out, len(ids) * dim).reshape(len(ids), dim)
    assert_within_ulps(actual, expected, magnitude, 2)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("vocab", "dim", "bits", "slot_tokens", "row_slots"),
    [
        (248320, 2048, 4, [248046, 5, 248319, 0], [2, 0, 3]),  # the real table, rows out of order
        (4096, 128, 4, [7, 4095, 7], [1]),  # the tiny config, one row
        (100, 192, 8, [99, 3, 50, 0, 1], [4, 3, 2, 1, 0]),  # 8-bit, ragged row length
    ],
)
def test_embedding_rows(lane_order, vocab, dim, bits, slot_tokens, row_slots):
    """Row r embeds the token field of slot row_slots[r]'s step buffer (the slots' steps one
    after another), whatever the other fields and slots hold."""
    device = sim_device(lane_order)
    triple = table(vocab, dim, bits)
    rng = np.random.default_rng(len(slot_tokens))
    steps = rng.integers(0, vocab, (len(slot_tokens), STEP_FIELDS)).astype(np.uint32)
    steps[:, TOKEN] = slot_tokens
    out = float_buffer(device, len(row_slots) * dim)
    slots = RowSlots(device.wrap(np.array(row_slots, np.uint32)), len(row_slots))
    weights = wrap_quant_weight(device, *triple)
    run(
        device,
        lambda g: record_embedding_rows(g, device, device.wrap(steps), weights, out, slots),
    )
    expected, magnitude = expected_rows(triple, bits, steps[row_slots, TOKEN])
    actual = as_float32(out, len(row_slots) * dim).reshape(len(row_slots), dim)
    assert_within_ulps(actual, expected, magnitude, 2)
