"""Multimodal rotary positions in the attention kernels (metal/attention.metal) and the copy of
image rows over a chunk's embeddings (metal/copy.metal), on the sim against numpy.

With a rope-position table, attention_prepare rotates each token by the table's three positions
(temporal, height, width) of its cache slot, the interleaved sections picking one per frequency;
the fused decode kernel rotates its key exactly as prepare does, and in a batched pass each row
by the table of its own sequence slot; a table of identity rows gives the bits of no table (text
prompts on a model that takes images)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import DECODE_ATOL, DECODE_RTOL, SCALE

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.engine import reference
from lily.kernels import RowSlots
from lily.kernels.attention import (
    HEAD_DIM,
    decode_splits,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_combine,
    record_attention_decode_fused,
    record_attention_prepare,
)
from lily.kernels.copy import record_copy_flagged_rows
from lily.kernels.step import STEP_FIELDS

EPS = 1e-6
THETA = 1e7
ROTARY_DIM = 64
HEADS = (4, 2)
CAPACITY = 64
# mrope_section [11, 11, 10] of the real model: height below frequency 33, width below 30.
BOUNDS = (33, 30)
STREAMS = [1 if i % 3 == 1 and i < 33 else 2 if i % 3 == 2 and i < 30 else 0 for i in range(32)]


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def _inputs(tokens: int, seed: int) -> dict[str, np.ndarray]:
    num_q, num_kv = HEADS
    rng = np.random.default_rng(seed)
    return {
        "q_proj": rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(np.float32),
        "k_proj": rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32),
        "v_proj": rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32),
        "q_norm": float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(np.float32)),
        "k_norm": float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(np.float32)),
    }


def _table(seed: int) -> np.ndarray:
    """Three different positions per slot, as an image's tokens have."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 5000, (CAPACITY, 3)).astype(np.uint32)


def _prepare(device, inputs, position: int, tokens: int, table: np.ndarray | None):
    num_q, num_kv = HEADS
    queries = np.full((tokens, num_q, HEAD_DIM), np.nan, np.float32)
    k_cache = np.zeros((num_kv, CAPACITY, HEAD_DIM), np.uint16)
    v_cache = np.zeros_like(k_cache)
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        **{name: device.wrap(value) for name, value in inputs.items()},
        step=device.wrap(np.array([position, 0], np.uint32)),
        queries=device.wrap(queries),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=CAPACITY,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
        tokens=tokens,
        rope_table=None if table is None else device.wrap(table),
        mrope_bounds=BOUNDS,
    )
    device.run(graph)
    return queries, k_cache


def test_prepare_rotates_by_the_tables_three_positions(device) -> None:
    position, tokens = 5, 6
    inputs, table = _inputs(tokens, seed=1), _table(seed=2)
    queries, k_cache = _prepare(device, inputs, position, tokens, table)
    positions = table[position : position + tokens].T.astype(np.int64)  # [3, T]

    def expected(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        # x [T, H, D] -> [H, T, D], rotated per token by its three positions.
        normed = reference.rms_norm(x.astype(np.float64), bf16_to_float32(gain), EPS)
        rotated = reference.apply_rope(
            normed.transpose(1, 0, 2), positions, ROTARY_DIM, THETA, STREAMS
        )
        return rotated.transpose(1, 0, 2)

    # fp32 angles of positions up to 5000 lose up to ~5000 * 2^-24 radians.
    tol = 1e-5 + 2 * 5000 * 2.0**-24
    expected_q = expected(inputs["q_proj"][:, :, 0], inputs["q_norm"])
    np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=tol)
    keys = bf16_to_float32(k_cache[:, position : position + tokens]).transpose(1, 0, 2)
    expected_k = expected(inputs["k_proj"], inputs["k_norm"])
    np.testing.assert_allclose(keys, expected_k, rtol=2.0**-8, atol=tol)
    # Plain RoPE at the slot would rotate otherwise: the table is what moved the result.
    plain, _ = _prepare(device, inputs, position, tokens, None)
    assert np.abs(plain - queries).max() > 1e-2


def test_an_identity_table_rotates_as_no_table(device) -> None:
    position, tokens = 9, 4
    inputs = _inputs(tokens, seed=3)
    identity = np.repeat(np.arange(CAPACITY, dtype=np.uint32)[:, None], 3, axis=1)
    with_table = _prepare(device, inputs, position, tokens, identity)
    without = _prepare(device, inputs, position, tokens, None)
    for a, b in zip(with_table, without, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_fused_decode_kernel_rotates_its_key_as_prepare(device) -> None:
    num_q, num_kv = HEADS
    position = 17
    inputs = {k: v[:1] if k.endswith("proj") else v for k, v in _inputs(1, seed=4).items()}
    table = _table(seed=5)
    _, expected_cache = _prepare(device, inputs, position, 1, table)
    k_cache = np.zeros((num_kv, CAPACITY, HEAD_DIM), np.uint16)
    v_cache = np.zeros_like(k_cache)
    splits = decode_splits(CAPACITY)
    graph = Graph()
    record_attention_decode_fused(
        graph,
        device,
        **{name: device.wrap(np.ascontiguousarray(value)) for name, value in inputs.items()},
        step=device.wrap(np.array([position, 0], np.uint32)),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        partial_out=device.wrap(np.zeros(partial_out_bytes(num_q, splits) // 4, np.float32)),
        partial_stats=device.wrap(np.zeros(partial_stats_bytes(num_q, splits) // 4, np.float32)),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=CAPACITY,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
        num_splits=splits,
        rope_table=device.wrap(table),
        mrope_bounds=BOUNDS,
    )
    device.run(graph)
    np.testing.assert_array_equal(k_cache[:, position], expected_cache[:, position])


def _normed_rotated(x: np.ndarray, gain: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Heads x [H, D] of one token normed and rotated by its multimodal `positions` [3, 1], in
    float64: [H, 1, D]."""
    normed = reference.rms_norm(x.astype(np.float64), bf16_to_float32(gain), EPS)
    return reference.apply_rope(normed[:, None, :], positions, ROTARY_DIM, THETA, STREAMS)


def test_batched_rows_rotate_by_their_own_slots_tables(device) -> None:
    """A batched pass over two sequence slots, rows out of slot order: slot 0 holds a text
    sequence (identity table), slot 1 an image's (three positions per slot). Each row's appended
    key and attention output are float64 numpy's with its own slot's positions."""
    num_q, num_kv = HEADS
    positions, row_slots = [20, 11], [1, 0]
    identity = np.repeat(np.arange(CAPACITY, dtype=np.uint32)[:, None], 3, axis=1)
    tables = np.stack([identity, _table(seed=7)])
    rows = len(row_slots)
    rng = np.random.default_rng(8)
    inputs = _inputs(rows, seed=9)
    k_caches = float32_to_bf16(rng.standard_normal((2, num_kv, CAPACITY, HEAD_DIM), np.float32))
    v_caches = float32_to_bf16(rng.standard_normal((2, num_kv, CAPACITY, HEAD_DIM), np.float32))
    before = k_caches.copy()
    steps = np.zeros((2, STEP_FIELDS), np.uint32)
    steps[:, 0] = positions
    splits = decode_splits(CAPACITY)
    partials = dict(
        partial_out=device.wrap(np.zeros(partial_out_bytes(num_q, splits, rows) // 4, np.float32)),
        partial_stats=device.wrap(
            np.zeros(partial_stats_bytes(num_q, splits, rows) // 4, np.float32)
        ),
        num_splits=splits,
    )
    out = np.full((rows, num_q, HEAD_DIM), np.nan, np.float32)
    slots = RowSlots(device.wrap(np.array(row_slots, np.uint32)), rows)
    q_proj = device.wrap(inputs["q_proj"])
    graph = Graph()
    record_attention_decode_fused(
        graph,
        device,
        **{name: device.wrap(value) for name, value in inputs.items() if name != "q_proj"},
        q_proj=q_proj,
        step=device.wrap(steps),
        k_cache=device.wrap(k_caches),
        v_cache=device.wrap(v_caches),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=CAPACITY,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
        rope_table=device.wrap(tables),
        mrope_bounds=BOUNDS,
        row_slots=slots,
        **partials,
    )
    graph.barrier()
    record_attention_combine(
        graph,
        device,
        **partials,
        q_proj=q_proj,
        step=device.wrap(steps),
        out=device.wrap(out),
        num_q_heads=num_q,
        row_slots=slots,
    )
    device.run(graph)

    tol = 1e-5 + 2 * 5000 * 2.0**-24  # fp32 angles of positions up to 5000 (as above)
    for row, slot in enumerate(row_slots):
        position = positions[slot]
        rotary = tables[slot][position].astype(np.int64)[:, None]  # [3, 1]: its slot's
        key = _normed_rotated(inputs["k_proj"][row], inputs["k_norm"], rotary)[:, 0]
        cached = bf16_to_float32(k_caches[slot][:, position]).astype(np.float64)
        np.testing.assert_allclose(cached, key, rtol=2.0**-8, atol=tol)
        k = bf16_to_float32(k_caches[slot][:, : position + 1]).astype(np.float64)
        v = bf16_to_float32(v_caches[slot][:, : position + 1]).astype(np.float64)
        q = _normed_rotated(inputs["q_proj"][row, :, 0], inputs["q_norm"], rotary)
        attended = reference.attention(q, k, v, SCALE, [position])[:, 0]
        gate = reference.sigmoid(inputs["q_proj"][row, :, 1].astype(np.float64))
        np.testing.assert_allclose(out[row], attended * gate, rtol=DECODE_RTOL, atol=DECODE_ATOL)
        # Only the row's own position was appended to its slot's cache.
        untouched = np.arange(CAPACITY) != position
        np.testing.assert_array_equal(k_caches[slot][:, untouched], before[slot][:, untouched])
    # The image slot's table moved its row: its positions are not its index.
    assert not np.array_equal(tables[1][positions[1]], identity[positions[1]])


def test_flagged_rows_replace_only_their_rows(device) -> None:
    rng = np.random.default_rng(6)
    rows = rng.normal(size=(7, 40)).astype(np.float32)
    staged = rng.normal(size=(7, 40)).astype(np.float32)
    flags = np.array([0, 1, 1, 0, 0, 1, 0], np.uint32)
    expected = np.where(flags[:, None] != 0, staged, rows)
    out = rows.copy()
    graph = Graph()
    record_copy_flagged_rows(
        graph,
        device,
        flags=device.wrap(flags),
        staged=device.wrap(staged),
        rows=device.wrap(out),
        count=6,  # the last row is past the pass: untouched whatever its flag
        row_bytes=4 * 40,
    )
    device.run(graph)
    np.testing.assert_array_equal(out[:6], expected[:6])
    np.testing.assert_array_equal(out[6], rows[6])
