"""Multi-query decode attention (attention_decode_tokens + attention_combine with tokens=T,
metal/attention.metal) on the sim under the three lane orders, against float64 numpy.

A verify pass's T tokens sit at positions p0 .. p0 + T - 1, their rows already in the cache;
token t attends causally to positions [0, p0 + t]. The reference is float64 attention per token
over the values the cache stands for (bf16, or int8 codes times fp16 scales), gated. The cache
rows past the pass's context p0 + T hold NaN (bf16) or NaN scales (int8), so reading one poisons
the output; the rows of the pass's own later tokens hold keys scaled up so that they would
dominate a token that saw them. Per-split partials are checked against the split layout
(test_kernel_attention_splits restates it), including the splits a token does not reach (sum 0).
Contexts end mid-tile (tiles of 8 positions, stages of 16), straddle split boundaries, and fill
the grid exactly; heads are the real model's (16 query heads on 2 kv heads, 256 dims) and tiny;
T = 2, 5 and 9 (a verify pass's), and 1 (the MTP head's passes).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import (
    BF16_NAN,
    DECODE_ATOL,
    DECODE_RTOL,
    GROUP_OF_3,
    REAL,
    SCALE,
    TINY,
    _bf16,
    _f64,
    _step_buffer,
)
from test_kernel_attention_int8 import decode_rows, encode_rows, poisoned_cache
from test_kernel_attention_splits import expected_split_length

from lily.device import Graph
from lily.engine import reference
from lily.kernels.attention import (
    HEAD_DIM,
    MAX_DECODE_TOKENS,
    decode_splits,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_combine,
    record_attention_decode_tokens,
)


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


# The pass's own later rows: keys this much larger than the others give scores of spread ~16,
# so a token that sees a later token's row puts nearly all its weight there.
LATER_ROW_SCALE = 8.0


class TokensCase:
    """T queries at positions position .. position + T - 1 over a random cache of `kv_cache`
    format holding position + T rows (NaN past them), with q_proj's query halves NaN (the
    combine reads only the gates)."""

    def __init__(
        self,
        heads: tuple[int, int],
        tokens: int,
        position: int,
        kv_cache: str,
        seed: int,
        capacity: int | None = None,
    ) -> None:
        num_q, num_kv = heads
        context = position + tokens
        self.heads, self.tokens, self.position, self.kv_cache = heads, tokens, position, kv_cache
        self.context = context
        self.capacity = context + 5 if capacity is None else capacity
        self.num_splits = decode_splits(self.capacity)
        rng = np.random.default_rng(seed)
        keys = rng.standard_normal((num_kv, context, HEAD_DIM), dtype=np.float32)
        keys[:, position + 1 :] *= LATER_ROW_SCALE
        values = rng.standard_normal((num_kv, context, HEAD_DIM), dtype=np.float32)
        if kv_cache == "int8":
            self.k_cache = poisoned_cache(num_kv, self.capacity)
            self.v_cache = poisoned_cache(num_kv, self.capacity)
            self.k_cache[:, :context] = encode_rows(keys)
            self.v_cache[:, :context] = encode_rows(values)
            self.k_values = decode_rows(self.k_cache[:, :context])
            self.v_values = decode_rows(self.v_cache[:, :context])
        else:
            shape = (num_kv, self.capacity, HEAD_DIM)
            self.k_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
            self.v_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
            self.k_cache[:, :context] = _bf16(keys)
            self.v_cache[:, :context] = _bf16(values)
            self.k_values = _f64(self.k_cache[:, :context])
            self.v_values = _f64(self.v_cache[:, :context])
        self.queries = rng.normal(0, 2, (tokens, num_q, HEAD_DIM)).astype(np.float32)
        self.q_proj = np.full((tokens, num_q, 2, HEAD_DIM), np.nan, dtype=np.float32)
        self.q_proj[:, :, 1] = rng.normal(0, 2, (tokens, num_q, HEAD_DIM))
        self.out = np.full((tokens, num_q, HEAD_DIM), np.nan, dtype=np.float32)
        self.partial_out = np.full(
            partial_out_bytes(num_q, self.num_splits, tokens) // 4, np.nan, np.float32
        )
        self.partial_stats = np.full(
            partial_stats_bytes(num_q, self.num_splits, tokens) // 4, np.nan, np.float32
        )

    def run(self, device) -> None:
        num_q, num_kv = self.heads
        step = device.wrap(_step_buffer(self.position))
        partial_out, partial_stats = device.wrap(self.partial_out), device.wrap(self.partial_stats)
        graph = Graph()
        record_attention_decode_tokens(
            graph,
            device,
            queries=device.wrap(self.queries),
            k_cache=device.wrap(self.k_cache),
            v_cache=device.wrap(self.v_cache),
            step=step,
            partial_out=partial_out,
            partial_stats=partial_stats,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            capacity=self.capacity,
            num_splits=self.num_splits,
            tokens=self.tokens,
            kv_cache=self.kv_cache,
        )
        graph.barrier()
        record_attention_combine(
            graph,
            device,
            partial_out=partial_out,
            partial_stats=partial_stats,
            q_proj=device.wrap(self.q_proj),
            step=step,
            out=device.wrap(self.out),
            num_q_heads=num_q,
            num_splits=self.num_splits,
            tokens=self.tokens,
        )
        device.run(graph)

    def scores(self) -> np.ndarray:
        """Scaled scores [T, Hq, context], float64, unmasked."""
        num_q, num_kv = self.heads
        k = np.repeat(self.k_values, num_q // num_kv, axis=0)
        return np.einsum("thd,hpd->thp", self.queries.astype(np.float64), k) * SCALE

    def expected(self) -> np.ndarray:
        """Gated attention [T, Hq, 256], token t over positions [0, position + t]."""
        q = self.queries.astype(np.float64).transpose(1, 0, 2)
        positions = self.position + np.arange(self.tokens)
        attended = reference.attention(q, self.k_values, self.v_values, SCALE, positions)
        gates = reference.sigmoid(self.q_proj[:, :, 1].astype(np.float64))
        return attended.transpose(1, 0, 2) * gates


CASES = [
    # (heads, tokens, position): contexts position + T ending mid-tile, mid-stage, at a tile's end
    (REAL, 2, 0),
    (REAL, 5, 8),
    (REAL, 9, 4),
    (REAL, 9, 23),
    (TINY, 2, 13),
    (TINY, 5, 42),
    (GROUP_OF_3, 9, 100),
    # straddling the split boundary at 256 (32 splits of 32 positions)
    (REAL, 5, 254),
    (REAL, 9, 250),
    # longer splits: 4097 positions in splits of 160, the pass across the boundary at 4000
    (REAL, 9, 3996),
    (TINY, 2, 4095),
    # one token: the MTP head's passes
    (REAL, 1, 300),
]


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
@pytest.mark.parametrize(("heads", "tokens", "position"), CASES)
def test_tokens_attention_matches_reference(
    device, kv_cache: str, heads: tuple[int, int], tokens: int, position: int
) -> None:
    case = TokensCase(heads, tokens, position, kv_cache, seed=position + 31 * tokens)
    case.run(device)
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


def test_each_token_sees_exactly_its_own_prefix(device) -> None:
    """The causal mask per token: against references shifted by one position either way, the
    output is far off (the scaled-up later rows dominate whoever sees them)."""
    case = TokensCase(REAL, 5, 40, "bf16", seed=3)
    case.run(device)
    q = case.queries.astype(np.float64).transpose(1, 0, 2)
    gates = reference.sigmoid(case.q_proj[:, :, 1].astype(np.float64)).transpose(1, 0, 2)
    for shift in (-1, 1):
        positions = case.position + np.arange(case.tokens) + shift
        # A shift of +1 past the pass's last row has no row to see: compare the first T - 1.
        seen = slice(None, case.tokens - 1) if shift > 0 else slice(1, None)
        wrong = reference.attention(q, case.k_values, case.v_values, SCALE, positions) * gates
        error = np.abs(case.out[seen] - wrong.transpose(1, 0, 2)[seen])
        assert np.all(error.max(axis=(1, 2)) > 0.05)
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


@pytest.mark.parametrize(
    ("heads", "tokens", "position", "capacity"),
    [
        (REAL, 9, 250, None),
        (REAL, 2, 287, None),
        # 8192 positions fill the grid of 32 splits of 256 exactly; the pass spans the last two
        (REAL, 9, 8183, 8192),
        (GROUP_OF_3, 5, 1020, None),
    ],
)
@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_split_partials_per_token(
    device, kv_cache: str, heads: tuple[int, int], tokens: int, position: int, capacity
) -> None:
    """Each token's partials per split: max, sum and weighted values over the part of the split
    the token sees; a split past the token's position has sum 0 (the combine skips it), and the
    splits past the pass's context are not written."""
    case = TokensCase(heads, tokens, position, kv_cache, seed=position, capacity=capacity)
    case.run(device)
    num_q, _ = heads
    length = expected_split_length(case.context, case.num_splits)
    splits = -(-case.context // length)
    stats = case.partial_stats.reshape(tokens, num_q, case.num_splits, 2)
    partials = case.partial_out.reshape(tokens, num_q, case.num_splits, HEAD_DIM)
    scores = case.scores()
    v = np.repeat(case.v_values, num_q // heads[1], axis=0)
    for t in range(tokens):
        token_end = position + t + 1
        for s in range(splits):
            begin, end = s * length, min((s + 1) * length, token_end)
            if begin >= token_end:
                assert np.all(stats[t, :, s, 1] == 0)
                continue
            m = scores[t, :, begin:end].max(axis=1)
            w = np.exp(scores[t, :, begin:end] - m[:, None])
            np.testing.assert_allclose(stats[t, :, s, 0], m, rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(stats[t, :, s, 1], w.sum(axis=1), rtol=1e-5)
            weighted = np.einsum("hp,hpd->hd", w, v[:, begin:end]) / w.sum(axis=1)[:, None]
            np.testing.assert_allclose(
                partials[t, :, s] / stats[t, :, s, 1:], weighted, rtol=DECODE_RTOL, atol=1e-5
            )
    assert np.all(np.isnan(stats[:, :, splits:])) and np.all(np.isnan(partials[:, :, splits:]))
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


def test_more_tokens_than_the_kernel_takes_are_refused() -> None:
    device = sim_device("forward")
    with pytest.raises(ValueError, match="1 to 9 tokens"):
        record_attention_decode_tokens(
            Graph(),
            device,
            queries=device.alloc(4),
            k_cache=device.alloc(4),
            v_cache=device.alloc(4),
            step=device.alloc(8),
            partial_out=device.alloc(4),
            partial_stats=device.alloc(4),
            num_q_heads=16,
            num_kv_heads=2,
            capacity=64,
            num_splits=32,
            tokens=MAX_DECODE_TOKENS + 1,
        )
