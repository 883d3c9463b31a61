"""The DFlash drafter's attention kernels (metal/dflash_attention.metal) on the sim against the
numpy reference (lily.engine.dflash_reference), under the three lane orders, at ragged sizes:
the prepare's norms, full-width YaRN RoPE and cache writes (with and without queries), and the
block's attention over context and block keys (not causal, causal, windowed)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import FLOAT32_EPS, LANE_ORDERS, assert_within, random_bf16, sim_device

from lily.checkpoint.dflash import YarnRope
from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.engine.dflash_reference import (
    apply_yarn_rope,
    block_attention,
    yarn_attention_factor,
    yarn_ramp,
)
from lily.engine.reference import rms_norm
from lily.kernels.dflash_attention import (
    HEAD_DIM,
    DraftRope,
    record_dflash_attention,
    record_dflash_prepare,
)

EPS = 1e-6
CAPACITY = 48
ROPE = YarnRope(
    theta=1e7, factor=64, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1
)


def draft_rope(rope: YarnRope) -> DraftRope:
    low, high = yarn_ramp(HEAD_DIM, rope)
    return DraftRope(rope.theta, rope.factor, low, high, yarn_attention_factor(rope.factor))


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def prepare(device, rows: int, first: int, heads: tuple[int, int], queries: bool, seed: int):
    num_q, num_kv = heads
    rng = np.random.default_rng(seed)
    inputs = {
        "q_proj": rng.normal(0, 2, (rows, num_q, HEAD_DIM)).astype(np.float32),
        "k_proj": rng.normal(0, 2, (rows, num_kv, HEAD_DIM)).astype(np.float32),
        "v_proj": rng.normal(0, 2, (rows, num_kv, HEAD_DIM)).astype(np.float32),
        "q_norm": random_bf16(rng, HEAD_DIM, 0.1, 1.0),
        "k_norm": random_bf16(rng, HEAD_DIM, 0.1, 1.0),
    }
    out = np.full((rows, num_q, HEAD_DIM), np.nan, np.float32)
    # Rows the pass does not write keep a marker.
    k_cache = np.full((num_kv, CAPACITY, HEAD_DIM), 0x3F80, np.uint16)  # bf16 1.0
    v_cache = k_cache.copy()
    graph = Graph()
    record_dflash_prepare(
        graph,
        device,
        q_proj=device.wrap(inputs["q_proj"]) if queries else None,
        k_proj=device.wrap(inputs["k_proj"]),
        v_proj=device.wrap(inputs["v_proj"]),
        q_norm=device.wrap(inputs["q_norm"]),
        k_norm=device.wrap(inputs["k_norm"]),
        first=device.wrap(np.array([first], np.uint32)),
        queries=device.wrap(out) if queries else None,
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        num_q_heads=num_q if queries else 0,
        num_kv_heads=num_kv,
        capacity=CAPACITY,
        rows=rows,
        rope=draft_rope(ROPE),
        norm_eps=EPS,
    )
    device.run(graph)
    return inputs, out, k_cache, v_cache


def expected_heads(x: np.ndarray, gain: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [rows, H, D] normed and rotated as the reference does, in float64 -> [rows, H, D]."""
    normed = rms_norm(x.astype(np.float64), bf16_to_float32(gain).astype(np.float64), EPS)
    return apply_yarn_rope(normed.transpose(1, 0, 2), positions, ROPE).transpose(1, 0, 2)


def rotation_bound(expected: np.ndarray, last_position: int) -> np.ndarray:
    # fp32 norm and rotation: a few ulps of the row; an fp32 angle at position p is off by up to
    # p ulps of a radian (frequencies are at most 1), which moves a value by that much of the
    # row's magnitude.
    magnitude = np.abs(expected).max(axis=-1, keepdims=True)
    return (16 + 2 * last_position) * FLOAT32_EPS * magnitude


@pytest.mark.parametrize(("rows", "first", "heads"), [(5, 7, (4, 2)), (3, 40, (8, 1))])
def test_prepare_writes_normed_rotated_queries_and_cache_rows(device, rows, first, heads):
    inputs, queries, k_cache, v_cache = prepare(device, rows, first, heads, True, seed=rows)
    positions = first + np.arange(rows)
    expected_q = expected_heads(inputs["q_proj"], inputs["q_norm"], positions)
    assert_within(queries, expected_q, rotation_bound(expected_q, positions[-1]))
    expected_k = expected_heads(inputs["k_proj"], inputs["k_norm"], positions)
    keys = bf16_to_float32(k_cache[:, first : first + rows]).transpose(1, 0, 2)
    # bf16 rows: rounding to nearest, which an fp32 difference may tip at a midpoint.
    bf16_bound = 2.0**-8 * np.abs(expected_k) + rotation_bound(expected_k, positions[-1])
    assert_within(keys, expected_k, bf16_bound)
    values = v_cache[:, first : first + rows].transpose(1, 0, 2)
    np.testing.assert_array_equal(values, float32_to_bf16(inputs["v_proj"]))
    untouched = np.ones(CAPACITY, bool)
    untouched[first : first + rows] = False
    assert np.all(k_cache[:, untouched] == 0x3F80) and np.all(v_cache[:, untouched] == 0x3F80)


def test_prepare_without_queries_writes_the_same_cache_rows(device):
    _, _, with_queries, _ = prepare(device, 4, 11, (4, 2), True, seed=9)
    _, _, keys_only, _ = prepare(device, 4, 11, (4, 2), False, seed=9)
    np.testing.assert_array_equal(keys_only, with_queries)


def test_prepare_writes_nothing_past_the_capacity(device):
    # Rows 2 and 3 fall past the cache: a write there is outside the buffer, which the checking
    # sim (the random lane order) refuses; the rows inside are written, the others untouched.
    inputs, _, k_cache, v_cache = prepare(device, 4, CAPACITY - 2, (4, 2), True, seed=3)
    assert np.all(k_cache[:, : CAPACITY - 2] == 0x3F80)
    assert np.all(v_cache[:, : CAPACITY - 2] == 0x3F80)
    written = v_cache[:, CAPACITY - 2 :].transpose(1, 0, 2)
    np.testing.assert_array_equal(written, float32_to_bf16(inputs["v_proj"][:2]))


@pytest.mark.parametrize(
    ("context", "block", "heads", "causal", "window"),
    [
        (13, 5, (4, 2), False, None),  # a full-attention layer
        (13, 5, (4, 2), True, 7),  # a sliding one: causal block, window over the context
        (30, 9, (8, 1), False, 4),
        (0, 3, (2, 2), False, None),  # no context yet
        (6, 1, (4, 4), True, None),
    ],
)
def test_block_attention_matches_the_reference(device, context, block, heads, causal, window):
    num_q, num_kv = heads
    rng = np.random.default_rng(context + block)
    queries = rng.normal(0, 1, (block, num_q, HEAD_DIM)).astype(np.float32)
    # Rows past the block hold garbage that must not be read (NaN is never seen in the output).
    k_cache = np.full((num_kv, CAPACITY, HEAD_DIM), 0x7FC0, np.uint16)
    v_cache = k_cache.copy()
    k_cache[:, : context + block] = random_bf16(rng, (num_kv, context + block, HEAD_DIM), 0.5)
    v_cache[:, : context + block] = random_bf16(rng, (num_kv, context + block, HEAD_DIM))
    out = np.full((block, num_q, HEAD_DIM), np.nan, np.float32)
    graph = Graph()
    record_dflash_attention(
        graph,
        device,
        queries=device.wrap(queries),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        first=device.wrap(np.array([context], np.uint32)),
        out=device.wrap(out),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=CAPACITY,
        block_rows=block,
        causal=causal,
        window=window,
        scale=HEAD_DIM**-0.5,
    )
    device.run(graph)
    keys = bf16_to_float32(k_cache[:, : context + block]).astype(np.float64)
    values = bf16_to_float32(v_cache[:, : context + block]).astype(np.float64)
    expected = block_attention(
        queries.astype(np.float64).transpose(1, 0, 2),
        keys,
        values,
        HEAD_DIM**-0.5,
        context,
        causal,
        window,
    ).transpose(1, 0, 2)
    # fp32 scores (a 128-term dot product) and an online softmax: a few hundred ulps of the
    # largest value at most.
    assert_within(out, expected, 256 * FLOAT32_EPS * np.abs(values).max())
