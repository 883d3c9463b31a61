"""attention_decode_fused (metal/attention.metal): the decode step's prepare (q/k norms, RoPE,
KV append) and split-context attention in one dispatch, on the sim under the three lane orders.

prepare and decode are each checked against float64 numpy in test_kernel_attention.py; the fused
kernel goes through the same inline functions in the same order, so it must leave the same
partials and the same caches, bit for bit, as the two dispatches with a barrier between them.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import EPS, REAL, ROTARY_DIM, SENTINEL, THETA, TINY, _bf16

from lily.device import Graph
from lily.kernels.attention import (
    HEAD_DIM,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_decode,
    record_attention_decode_fused,
    record_attention_prepare,
)


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


class FusedCase:
    """Projections of one token at `position`, and a cache holding `position` earlier tokens."""

    def __init__(self, heads: tuple[int, int], position: int, capacity: int, splits: int):
        num_q, num_kv = heads
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
    ("position", "splits"), [(0, 32), (1, 32), (254, 32), (255, 32), (300, 7), (40, 1)]
)
def test_fused_equals_prepare_then_decode(device, heads, position, splits):
    case = FusedCase(heads, position, capacity=position + 3, splits=splits)
    fused = case.run_fused(device)
    separate = case.run_two_dispatches(device)
    for name, got, expected in zip(
        ("partial_out", "partial_stats", "k_cache", "v_cache"), fused, separate, strict=True
    ):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    # The append wrote the current row and nothing else.
    changed = np.any(fused[2] != case.k_cache, axis=(0, 2))
    assert np.flatnonzero(changed).tolist() == [position]


def test_a_step_past_the_capacity_writes_nothing(device):
    """A step queued at the capacity attends from registers and leaves the cache as it was
    (the checking sim also fails any access past the cache)."""
    case = FusedCase(REAL, position=16, capacity=16, splits=32)
    partial_out, partial_stats, k_cache, v_cache = case.run_fused(device)
    np.testing.assert_array_equal(k_cache, case.k_cache)
    np.testing.assert_array_equal(v_cache, case.v_cache)
    assert np.all(np.isfinite(partial_out)) and np.all(np.isfinite(partial_stats))
