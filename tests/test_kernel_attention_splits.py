"""The decode attention's per-split partials (attention_decode, metal/attention.metal) against a
float64 numpy reference of the split layout, on the sim under the three lane orders.

test_kernel_attention.py checks the merged, gated output against float64 attention; this checks
what each threadgroup leaves for the combine: for every split the context reaches, the max of its
scores, the sum of exp(score - max) and the sum of exp(score - max) * v per query head, with the
split boundaries the kernels document (attention.metal's split_length: the context spread over
32 splits of 32 to 256 positions, then 256 per split until the grid runs out, then evenly more;
always multiples of 32), restated here. Contexts end mid-tile (tiles of 8 positions), exactly
at and one past a split boundary, and at and one past the grid's last split; the groups of 8
query heads (the real model's: every row of the kernel's fragments), 2 and 3 (rows unused).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import (
    DECODE_ATOL,
    DECODE_RTOL,
    GROUP_OF_3,
    REAL,
    SCALE,
    TINY,
    DecodeCase,
    _f64,
)

from lily.kernels.attention import HEAD_DIM, decode_splits


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def expected_split_length(context: int, num_splits: int) -> int:
    def ceil_div(a: int, b: int) -> int:
        return -(-a // b)

    spread = min(256, max(32, ceil_div(context, 32)))
    return ceil_div(max(spread, ceil_div(context, num_splits)), 32) * 32


def reference_split_partials(case: DecodeCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(max, sum, weighted values) per query head and reached split, float64: [Hq, S], [Hq, S],
    [Hq, S, 256]."""
    num_q, num_kv = case.heads
    group = num_q // num_kv
    length = expected_split_length(case.context, case.num_splits)
    splits = -(-case.context // length)
    k = _f64(case.k_cache[:, : case.context])
    v = _f64(case.v_cache[:, : case.context])
    scores = np.einsum("hd,hpd->hp", case.queries.astype(np.float64), np.repeat(k, group, 0))
    scores *= SCALE
    maxima = np.empty((num_q, splits))
    sums = np.empty((num_q, splits))
    weighted = np.empty((num_q, splits, HEAD_DIM))
    for s in range(splits):
        part = slice(s * length, min((s + 1) * length, case.context))
        m = scores[:, part].max(axis=1)
        w = np.exp(scores[:, part] - m[:, None])
        maxima[:, s], sums[:, s] = m, w.sum(axis=1)
        weighted[:, s] = np.einsum("hp,hpd->hd", w, np.repeat(v[:, part], group, 0))
    return maxima, sums, weighted


@pytest.mark.parametrize(
    ("heads", "context", "capacity"),
    [(REAL, n, n + 3) for n in (1, 7, 31, 32, 33, 255, 256, 257, 4097)]
    + [(REAL, 8192, 8192), (REAL, 8193, 8196)]
    + [(TINY, 33, 36), (TINY, 1025, 1028), (GROUP_OF_3, 257, 300)],
)
def test_split_partials_match_reference(
    device, heads: tuple[int, int], context: int, capacity: int
) -> None:
    """8192 fills the grid of 32 splits of 256 exactly; 8193 over a grid of 33 leaves one
    position to the last split."""
    case = DecodeCase(heads, context, seed=context + 7, capacity=capacity)
    assert case.num_splits == decode_splits(capacity)
    case.run(device)
    maxima, sums, weighted = reference_split_partials(case)
    num_q, splits = maxima.shape
    stats = case.partial_stats.reshape(num_q, case.num_splits, 2)
    partials = case.partial_out.reshape(num_q, case.num_splits, HEAD_DIM)
    # Scores of order 1-10 from fp32 dot products of 256 terms.
    np.testing.assert_allclose(stats[:, :splits, 0], maxima, rtol=0, atol=1e-5)
    np.testing.assert_allclose(stats[:, :splits, 1], sums, rtol=1e-5)
    np.testing.assert_allclose(
        partials[:, :splits] / stats[:, :splits, 1:],
        weighted / sums[..., None],
        rtol=DECODE_RTOL,
        atol=DECODE_ATOL,
    )
    # Nothing past the reached splits was written (DecodeCase fills the partials with NaN).
    assert np.all(np.isnan(stats[:, splits:])) and np.all(np.isnan(partials[:, splits:]))
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)
