"""attention_decode_fused (metal/attention.metal): the decode step's prepare (q/k norms, RoPE,
KV append) and split-context attention in one dispatch, on the sim under the three lane orders.

prepare and decode are each checked against float64 numpy in test_kernel_attention.py; the fused
kernel goes through the same inline functions in the same order, so it must leave the same
partials and the same caches, bit for bit, as the two dispatches with a barrier between them.
With the combine after it, it is also checked against float64 numpy directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import (
    DECODE_ATOL,
    DECODE_RTOL,
    EPS,
    GROUP_OF_3,
    REAL,
    ROTARY_DIM,
    SCALE,
    SENTINEL,
    THETA,
    TINY,
    _bf16,
    _f64,
    _rope_tolerance,
)

from lily.device import Graph
from lily.engine import reference
from lily.kernels import RowSlots
from lily.kernels.attention import (
    HEAD_DIM,
    decode_splits,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_combine,
    record_attention_decode,
    record_attention_decode_fused,
    record_attention_prepare,
)
from lily.kernels.step import STEP_FIELDS


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


class FusedCase:
    """Projections of one token at `position`, and a cache holding `position` earlier tokens;
    by default the engine's splits for the capacity."""

    def __init__(
        self, heads: tuple[int, int], position: int, capacity: int, splits: int | None = None
    ):
        num_q, num_kv = heads
        splits = decode_splits(capacity) if splits is None else splits
        rng = np.random.default_rng(position + splits)
        self.heads, self.position, self.capacity, self.splits = heads, position, capacity, splits
        self.q_proj = rng.normal(0, 2, (num_q, 2, HEAD_DIM)).astype(np.float32)
        self.k_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
        self.v_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
        self.q_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
        self.k_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
        self.k_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
        self.v_cache = self.k_cache.copy()
        filled = min(position, capacity)
        shape = (num_kv, filled, HEAD_DIM)
        self.k_cache[:, :filled] = _bf16(rng.standard_normal(shape, dtype=np.float32))
        self.v_cache[:, :filled] = _bf16(rng.standard_normal(shape, dtype=np.float32))

    def common(self, device) -> dict:
        num_q, num_kv = self.heads
        return dict(
            q_proj=device.wrap(self.q_proj),
            k_proj=device.wrap(self.k_proj),
            v_proj=device.wrap(self.v_proj),
            q_norm=device.wrap(self.q_norm),
            k_norm=device.wrap(self.k_norm),
            step=device.wrap(np.array([self.position, 0], dtype=np.uint32)),
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            capacity=self.capacity,
        )

    def outputs(self):
        num_q = self.heads[0]
        return (
            np.full(partial_out_bytes(num_q, self.splits) // 4, np.nan, np.float32),
            np.full(partial_stats_bytes(num_q, self.splits) // 4, np.nan, np.float32),
            self.k_cache.copy(),
            self.v_cache.copy(),
        )

    def run_fused(self, device):
        partial_out, partial_stats, k_cache, v_cache = self.outputs()
        graph = Graph()
        record_attention_decode_fused(
            graph,
            device,
            **self.common(device),
            k_cache=device.wrap(k_cache),
            v_cache=device.wrap(v_cache),
            partial_out=device.wrap(partial_out),
            partial_stats=device.wrap(partial_stats),
            rotary_dim=ROTARY_DIM,
            rope_theta=THETA,
            norm_eps=EPS,
            num_splits=self.splits,
        )
        device.run(graph)
        return partial_out, partial_stats, k_cache, v_cache

    def run_two_dispatches(self, device):
        partial_out, partial_stats, k_cache, v_cache = self.outputs()
        queries = np.full((self.heads[0], HEAD_DIM), np.nan, dtype=np.float32)
        common = self.common(device)
        caches = dict(k_cache=device.wrap(k_cache), v_cache=device.wrap(v_cache))
        graph = Graph()
        record_attention_prepare(
            graph,
            device,
            **common,
            **caches,
            queries=device.wrap(queries),
            rotary_dim=ROTARY_DIM,
            rope_theta=THETA,
            norm_eps=EPS,
        )
        graph.barrier()
        for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
            del common[name]
        record_attention_decode(
            graph,
            device,
            **common,
            **caches,
            queries=device.wrap(queries),
            partial_out=device.wrap(partial_out),
            partial_stats=device.wrap(partial_stats),
            num_splits=self.splits,
        )
        device.run(graph)
        return partial_out, partial_stats, k_cache, v_cache


@pytest.mark.parametrize("heads", [REAL, TINY], ids=["real", "tiny"])
@pytest.mark.parametrize(
    ("position", "capacity", "splits"),
    [
        (0, 3, None),  # one position, attended from the staged row
        (1, 4, None),
        (9, 12, None),  # the current position in the second simdgroup's tile
        (31, 34, None),  # the last position of a split (splits of 32)
        (32, 35, None),  # the first of the next, alone in it
        (255, 258, None),  # the last position of the eighth split
        (256, 259, None),  # the first of the ninth
        (300, 303, None),  # a ragged last split
        (5200, 5203, None),  # 28 splits of 192 positions, the current one ragged
        (600, 603, 2),  # past 256 positions per split: two splits of 320
        (40, 43, 1),
        (299, 300, None),  # the cache's last row
    ],
)
def test_fused_equals_prepare_then_decode(device, heads, position, capacity, splits):
    case = FusedCase(heads, position, capacity=capacity, splits=splits)
    fused = case.run_fused(device)
    separate = case.run_two_dispatches(device)
    for name, got, expected in zip(
        ("partial_out", "partial_stats", "k_cache", "v_cache"), fused, separate, strict=True
    ):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    # The append wrote the current row and nothing else.
    changed = np.any(fused[2] != case.k_cache, axis=(0, 2))
    assert np.flatnonzero(changed).tolist() == [position]


@pytest.mark.parametrize(
    ("heads", "position", "capacity"),
    [(REAL, 0, 8), (REAL, 700, 1024), (TINY, 511, 512), (GROUP_OF_3, 260, 300)],
)
def test_fused_then_combine_matches_reference(device, heads, position, capacity):
    """Against float64: queries and the current key normed and rotated by the reference, the
    cached keys and values as the cache holds them (the appended row bf16-rounded, checked
    against the reference's key)."""
    case = FusedCase(heads, position, capacity=capacity)
    partial_out, partial_stats, k_cache, v_cache = case.run_fused(device)
    num_q = heads[0]
    out = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
    graph = Graph()
    record_attention_combine(
        graph,
        device,
        partial_out=device.wrap(partial_out),
        partial_stats=device.wrap(partial_stats),
        q_proj=device.wrap(case.q_proj),
        step=device.wrap(np.array([position, 0], dtype=np.uint32)),
        out=device.wrap(out),
        num_q_heads=num_q,
        num_splits=case.splits,
    )
    device.run(graph)

    def normed_rotated(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        normed = reference.rms_norm(x.astype(np.float64), _f64(gain), EPS)
        return reference.apply_rope(normed[:, None, :], [position], ROTARY_DIM, THETA)

    tol = _rope_tolerance(position)
    expected_k = normed_rotated(case.k_proj, case.k_norm)[:, 0]
    np.testing.assert_allclose(_f64(k_cache[:, position]), expected_k, rtol=2.0**-8, atol=tol)
    np.testing.assert_array_equal(v_cache[:, position], _bf16(case.v_proj))
    k = _f64(k_cache[:, : position + 1])
    v = _f64(v_cache[:, : position + 1])
    q = normed_rotated(case.q_proj[:, 0], case.q_norm)
    attended = reference.attention(q, k, v, SCALE, [position])[:, 0]
    gated = attended * reference.sigmoid(case.q_proj[:, 1].astype(np.float64))
    np.testing.assert_allclose(out, gated, rtol=DECODE_RTOL, atol=DECODE_ATOL)


def test_a_step_past_the_capacity_writes_nothing(device):
    """A step queued at the capacity attends from registers and leaves the cache as it was
    (the checking sim also fails any access past the cache)."""
    case = FusedCase(REAL, position=16, capacity=16)
    partial_out, partial_stats, k_cache, v_cache = case.run_fused(device)
    np.testing.assert_array_equal(k_cache, case.k_cache)
    np.testing.assert_array_equal(v_cache, case.v_cache)
    # Splits of 32 positions: the first of the grid's 32 holds all 17, and is finite.
    num_q = REAL[0]
    written_out = partial_out.reshape(num_q, case.splits, -1)[:, :1]
    written_stats = partial_stats.reshape(num_q, case.splits, 2)[:, :1]
    assert np.all(np.isfinite(written_out)) and np.all(np.isfinite(written_stats))


def _combine(device, case: FusedCase, partial_out, partial_stats) -> np.ndarray:
    out = np.full((case.heads[0], HEAD_DIM), np.nan, dtype=np.float32)
    graph = Graph()
    record_attention_combine(
        graph,
        device,
        partial_out=device.wrap(partial_out),
        partial_stats=device.wrap(partial_stats),
        q_proj=device.wrap(case.q_proj),
        step=device.wrap(np.array([case.position, 0], dtype=np.uint32)),
        out=device.wrap(out),
        num_q_heads=case.heads[0],
        num_splits=case.splits,
    )
    device.run(graph)
    return out


@pytest.mark.parametrize("heads", [REAL, GROUP_OF_3], ids=["real", "group_of_3"])
def test_rows_attend_each_row_over_its_slots_cache(device, heads):
    """A batched pass's attention in two dispatches over all rows: row r on the step and caches
    of slot row_slots[r] (ragged: 3 rows of 4 slots out of order, at different positions; slot
    1 is no row's and keeps its cache). Each row's partials, appended rows and output equal the
    one-sequence kernels' on that slot alone, bit for bit (those are checked against float64
    above)."""
    capacity, positions, row_slots = 70, [33, 5, 0, 64], [3, 0, 2]
    cases = [FusedCase(heads, position, capacity) for position in positions]
    rows = [cases[slot] for slot in row_slots]
    num_q, num_kv = heads
    splits = cases[0].splits
    steps = np.zeros((len(cases), STEP_FIELDS), dtype=np.uint32)
    steps[:, 0] = positions
    k_caches = np.stack([case.k_cache for case in cases])
    v_caches = np.stack([case.v_cache for case in cases])
    partial_out = np.full(partial_out_bytes(num_q, splits, len(rows)) // 4, np.nan, np.float32)
    partial_stats = np.full(partial_stats_bytes(num_q, splits, len(rows)) // 4, np.nan, np.float32)
    out = np.full((len(rows), num_q, HEAD_DIM), np.nan, dtype=np.float32)
    table = RowSlots(device.wrap(np.array(row_slots, dtype=np.uint32)), len(rows))
    q_proj = device.wrap(np.stack([case.q_proj for case in rows]))
    partials = dict(
        partial_out=device.wrap(partial_out),
        partial_stats=device.wrap(partial_stats),
        num_splits=splits,
    )
    graph = Graph()
    record_attention_decode_fused(
        graph,
        device,
        q_proj=q_proj,
        k_proj=device.wrap(np.stack([case.k_proj for case in rows])),
        v_proj=device.wrap(np.stack([case.v_proj for case in rows])),
        q_norm=device.wrap(cases[0].q_norm),
        k_norm=device.wrap(cases[0].k_norm),
        step=device.wrap(steps),
        k_cache=device.wrap(k_caches),
        v_cache=device.wrap(v_caches),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
        row_slots=table,
        **partials,
    )
    graph.barrier()
    record_attention_combine(
        graph,
        device,
        q_proj=q_proj,
        step=device.wrap(steps),
        out=device.wrap(out),
        num_q_heads=num_q,
        row_slots=table,
        **partials,
    )
    device.run(graph)

    row_out = partial_out.reshape(len(rows), -1)
    row_stats = partial_stats.reshape(len(rows), -1)
    for row, (slot, case) in enumerate(zip(row_slots, rows, strict=True)):
        case.q_norm, case.k_norm = cases[0].q_norm, cases[0].k_norm  # the layer's, shared
        alone_out, alone_stats, alone_k, alone_v = case.run_fused(device)
        np.testing.assert_array_equal(k_caches[slot], alone_k)
        np.testing.assert_array_equal(v_caches[slot], alone_v)
        # Splits past the row's context are left as they were (NaN in both).
        np.testing.assert_array_equal(row_out[row], alone_out)
        np.testing.assert_array_equal(row_stats[row], alone_stats)
        combined = _combine(device, case, alone_out, alone_stats)
        assert np.all(np.isfinite(combined))
        np.testing.assert_array_equal(out[row], combined)
    np.testing.assert_array_equal(k_caches[1], cases[1].k_cache)
    np.testing.assert_array_equal(v_caches[1], cases[1].v_cache)


def test_rows_take_no_more_than_the_partials_hold(device):
    case = FusedCase(TINY, 3, 8)
    with pytest.raises(ValueError, match="1 to 9 rows"):
        record_attention_combine(
            Graph(),
            device,
            partial_out=device.wrap(np.zeros(4, np.float32)),
            partial_stats=device.wrap(np.zeros(4, np.float32)),
            q_proj=device.wrap(case.q_proj),
            step=device.wrap(np.zeros(STEP_FIELDS, np.uint32)),
            out=device.wrap(np.zeros(4, np.float32)),
            num_q_heads=TINY[0],
            num_splits=case.splits,
            row_slots=RowSlots(device.wrap(np.zeros(10, np.uint32)), 10),
        )
