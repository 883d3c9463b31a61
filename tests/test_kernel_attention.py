"""The attention kernels (metal/attention.metal) on the sim against float64 numpy references.

prepare (norms, RoPE, cache append), decode (split context) and combine (merge, output gate) are
checked one by one, then chained in a recorded graph replayed over several positions as the
engine does. Context lengths cover one token, partly and exactly filled splits, and long caches.
For a chunk of prompt tokens, prepare over T tokens and the causal chunk kernel are checked on
their own at ragged T and start positions, then against T decode steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph, MatrixProducts
from lily.diagnostics.kernel_checks import ATTENTION_CHUNK_TOLERANCE
from lily.engine import reference
from lily.kernels.attention import (
    CHUNK_TILE_KEYS,
    HEAD_DIM,
    cache_bytes,
    chunk_attention_on_tensor_ops,
    decode_splits,
    packed_queries_bytes,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_chunk,
    record_attention_combine,
    record_attention_decode,
    record_attention_prepare,
    row_bytes,
)

EPS = 1e-6
THETA = 1e7
ROTARY_DIM = 64
SCALE = HEAD_DIM**-0.5
# A bf16 value no kernel output takes here, to see which cache rows were written.
SENTINEL = np.uint16(0xC0E0)  # -7.0
BF16_NAN = np.uint16(0x7FC0)

# (q heads, kv heads): the real model, the tiny config, and a group of three query heads (the
# chunk kernel's 64-row tiles and 8-row SIMD-groups then start in the middle of a token's group).
REAL, TINY, GROUP_OF_3 = (16, 2), (4, 2), (6, 2)


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def _bf16(x: np.ndarray) -> np.ndarray:
    return float32_to_bf16(np.asarray(x, dtype=np.float32))


def _f64(bits: np.ndarray) -> np.ndarray:
    return bf16_to_float32(bits).astype(np.float64)


def _step_buffer(position: int) -> np.ndarray:
    return np.array([position, 0], dtype=np.uint32)


def _rope_tolerance(position: int) -> float:
    """fp32 RoPE angles lose up to ~position * 2^-24 radians (mlx computes them the same way);
    on values of order 1 that is the error of the rotated dims."""
    return 1e-5 + 2 * position * 2.0**-24


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------


def _run_prepare(
    device,
    heads: tuple[int, int],
    position: int,
    capacity: int,
    seed: int,
    rotary_dim: int = ROTARY_DIM,
):
    num_q, num_kv = heads
    rng = np.random.default_rng(seed)
    q_proj = rng.normal(0, 2, (num_q, 2, HEAD_DIM)).astype(np.float32)
    k_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
    v_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
    q_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    k_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    queries = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
    k_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    v_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    assert k_cache.nbytes == cache_bytes(num_kv, capacity)
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        q_proj=device.wrap(q_proj),
        k_proj=device.wrap(k_proj),
        v_proj=device.wrap(v_proj),
        q_norm=device.wrap(q_norm),
        k_norm=device.wrap(k_norm),
        step=device.wrap(_step_buffer(position)),
        queries=device.wrap(queries),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        rotary_dim=rotary_dim,
        rope_theta=THETA,
        norm_eps=EPS,
    )
    device.run(graph)

    def normed_rotated(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        normed = reference.rms_norm(x.astype(np.float64), _f64(gain), EPS)
        return reference.apply_rope(normed[:, None, :], [position], rotary_dim, THETA)[:, 0]

    expected_q = normed_rotated(q_proj[:, 0], q_norm)
    expected_k = normed_rotated(k_proj, k_norm)
    return queries, k_cache, v_cache, expected_q, expected_k, v_proj


@pytest.mark.parametrize("heads", [REAL, TINY])
@pytest.mark.parametrize("position", [0, 1, 255, 4095])
def test_prepare_matches_reference(device, heads: tuple[int, int], position: int) -> None:
    capacity = 4096
    queries, k_cache, v_cache, expected_q, expected_k, v_proj = _run_prepare(
        device, heads, position, capacity, seed=position
    )
    tol = _rope_tolerance(position)
    # Queries stay fp32; the gate halves of q_proj must not leak in.
    np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=tol)
    # The cache holds bf16: one rounding (2^-9 relative) on top of the fp32 error.
    k_row = _f64(k_cache[:, position])
    np.testing.assert_allclose(k_row, expected_k, rtol=2.0**-8, atol=tol)
    np.testing.assert_array_equal(v_cache[:, position], _bf16(v_proj))
    # Nothing else in the cache was written.
    untouched = np.ones(capacity, dtype=bool)
    untouched[position] = False
    assert np.all(k_cache[:, untouched] == SENTINEL)
    assert np.all(v_cache[:, untouched] == SENTINEL)


@pytest.mark.parametrize("rotary_dim", [128, 192, 256])
def test_prepare_rotates_wider_rotary_dims(device, rotary_dim: int) -> None:
    """Rotate-half partners sit rotary_dim / 16 lanes apart: 8, 12 and 16 lanes here (4 for the
    model's 64)."""
    position = 1000
    queries, k_cache, _, expected_q, expected_k, _ = _run_prepare(
        device, TINY, position, position + 1, seed=rotary_dim, rotary_dim=rotary_dim
    )
    tol = _rope_tolerance(position)
    np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(_f64(k_cache[:, position]), expected_k, rtol=2.0**-8, atol=tol)


def test_prepare_at_a_far_position(device) -> None:
    """RoPE at position 65535, one kv head to keep the cache small."""
    position = 65535
    queries, k_cache, _, expected_q, expected_k, _ = _run_prepare(
        device, (2, 1), position, position + 1, seed=3
    )
    tol = _rope_tolerance(position)
    np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(_f64(k_cache[:, position]), expected_k, rtol=2.0**-8, atol=tol)
    # The dims past the rotary ones are only normalised: tight.
    np.testing.assert_allclose(
        queries[:, ROTARY_DIM:], expected_q[:, ROTARY_DIM:], rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------------------------
# decode + combine
# --------------------------------------------------------------------------------------------


class DecodeCase:
    """Random queries, a random bf16 cache of `context` tokens and a q_proj whose query halves
    are NaN (combine must read only the gate halves). By default spare capacity past the context,
    and the engine's splits for it; the rows past the context are NaN, so that reading one (a
    wrong head stride, a masked position of the last tile) poisons the output even with zero
    weight."""

    def __init__(
        self,
        heads: tuple[int, int],
        context: int,
        seed: int,
        num_splits: int | None = None,
        capacity: int | None = None,
    ) -> None:
        num_q, num_kv = heads
        self.capacity = context + 3 if capacity is None else capacity
        if num_splits is None:
            num_splits = decode_splits(self.capacity)
        self.heads, self.context, self.num_splits = heads, context, num_splits
        rng = np.random.default_rng(seed)
        shape = (num_kv, self.capacity, HEAD_DIM)
        self.k_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
        self.v_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
        filled = (num_kv, context, HEAD_DIM)
        self.k_cache[:, :context] = _bf16(rng.standard_normal(filled, dtype=np.float32))
        self.v_cache[:, :context] = _bf16(rng.standard_normal(filled, dtype=np.float32))
        # Queries of norm ~32 give scores of spread ~2: peaked enough to exercise the rescaling.
        self.queries = rng.normal(0, 2, (num_q, HEAD_DIM)).astype(np.float32)
        self.q_proj = np.full((num_q, 2, HEAD_DIM), np.nan, dtype=np.float32)
        self.q_proj[:, 1] = rng.normal(0, 2, (num_q, HEAD_DIM))
        self.out = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
        self.partial_out = np.full(partial_out_bytes(num_q, num_splits) // 4, np.nan, np.float32)
        self.partial_stats = np.full(
            partial_stats_bytes(num_q, num_splits) // 4, np.nan, np.float32
        )
        self.step = _step_buffer(context - 1)

    def run(self, device) -> None:
        num_q, num_kv = self.heads
        partial_out, partial_stats = device.wrap(self.partial_out), device.wrap(self.partial_stats)
        q_proj = device.wrap(self.q_proj)
        graph = Graph()
        record_attention_decode(
            graph,
            device,
            queries=device.wrap(self.queries),
            k_cache=device.wrap(self.k_cache),
            v_cache=device.wrap(self.v_cache),
            step=device.wrap(self.step),
            partial_out=partial_out,
            partial_stats=partial_stats,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            capacity=self.capacity,
            num_splits=self.num_splits,
        )
        graph.barrier()
        record_attention_combine(
            graph,
            device,
            partial_out=partial_out,
            partial_stats=partial_stats,
            q_proj=q_proj,
            step=device.wrap(self.step),
            out=device.wrap(self.out),
            num_q_heads=num_q,
            num_splits=self.num_splits,
        )
        device.run(graph)

    def expected(self) -> np.ndarray:
        k = _f64(self.k_cache[:, : self.context])
        v = _f64(self.v_cache[:, : self.context])
        q = self.queries.astype(np.float64)[:, None, :]
        attended = reference.attention(q, k, v, SCALE, [self.context - 1])[:, 0]
        return attended * reference.sigmoid(self.q_proj[:, 1].astype(np.float64))


# fp32 online softmax against float64: outputs are of order 0.1 for short contexts and shrink
# like 1/sqrt(context) for long random ones; absolute errors stay near 1e-6 and below, a formula
# error (a missed key, a wrong rescale, a wrong head) is orders of magnitude larger. The order of
# the sums follows the split layout (splits of 32 to 256 positions, 4 simdgroups taking tiles of
# 8 positions in turn, merged per split and then across splits), which the bound does not depend
# on.
DECODE_RTOL, DECODE_ATOL = 1e-4, 1e-5

# The chunk kernel's 2-byte operands' bound (kernel_checks explains it).
CHUNK_RTOL, CHUNK_ATOL = ATTENTION_CHUNK_TOLERANCE


@pytest.mark.parametrize(
    ("heads", "context"),
    [(heads, n) for heads in (REAL, TINY) for n in (1, 7, 31, 32, 33, 255, 256, 257, 4097)]
    + [(GROUP_OF_3, 300)],
)
def test_decode_matches_reference(device, heads: tuple[int, int], context: int) -> None:
    """Over the grid of 32 splits: one position (three simdgroups with nothing to do), a tile
    ending mid-way, one split of 32 just short, exactly and one past (a second split of one
    position), eight splits of 32 just short, exactly and one past, and 26 splits of 160, the
    last ragged."""
    case = DecodeCase(heads, context, seed=context)
    case.run(device)
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


@pytest.mark.parametrize("context", [5120, 5117])
def test_decode_at_the_capacity(device, context: int) -> None:
    """The cache full to its last row: every split of the grid in use (32 of 160 positions),
    the last one full or ragged."""
    case = DecodeCase(REAL, context, seed=context + 1, capacity=5120)
    assert case.num_splits == 32
    case.run(device)
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


@pytest.fixture(scope="module")
def long_case() -> tuple[DecodeCase, np.ndarray]:
    """The 65536-token cache and its expected output, built once per module (one kv head, a
    group of two: the context length is what this case is about). Its grid has the most splits
    there are, each 512 positions long."""
    case = DecodeCase((2, 1), 65536, seed=65536)
    assert case.num_splits == 128
    return case, case.expected()


def test_decode_at_65536_tokens(device, long_case: tuple[DecodeCase, np.ndarray]) -> None:
    case, expected = long_case
    case.out[:] = np.nan
    case.run(device)
    np.testing.assert_allclose(case.out, expected, rtol=DECODE_RTOL, atol=DECODE_ATOL)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_count_does_not_change_the_result(device, num_splits: int) -> None:
    """A context longer than 256 positions per split, over grids smaller than the engine's:
    1000 positions in one split, in three of 352, in seven of 160 (whole rounds of 32)."""
    case = DecodeCase(TINY, 1000, num_splits=num_splits, seed=5)
    case.run(device)
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


@pytest.mark.parametrize(
    ("context", "capacity", "active"),
    [(1, 4096, 1), (33, 4096, 2), (300, 4096, 10), (1025, 4096, 17), (6000, 16384, 32)],
)
def test_splits_past_the_context_are_neither_written_nor_read(
    device, context: int, capacity: int, active: int
) -> None:
    """Over a grid of 32 splits (capacity 4096) a context of n positions is spread in splits of
    clamp(ceil(n / 32), 32, 256) positions rounded up to a multiple of 32, over 64 (capacity
    16384) alike: 6000 positions in 32 splits of 192. The splits past the context keep what they
    held, here a finite partial that would dominate the result if the combine merged it (max
    100, sum 1, values 1e6)."""
    case = DecodeCase(TINY, context, seed=context, capacity=capacity)
    num_q = TINY[0]
    stats = case.partial_stats.reshape(num_q, case.num_splits, 2)
    stats[:, :, 0], stats[:, :, 1] = 100.0, 1.0
    case.partial_out[:] = 1e6
    case.run(device)
    stats = case.partial_stats.reshape(num_q, case.num_splits, 2)
    partials = case.partial_out.reshape(num_q, case.num_splits, HEAD_DIM)
    assert np.all(stats[:, active:] == [100.0, 1.0])
    assert np.all(partials[:, active:] == 1e6)
    assert np.all(stats[:, :active, 1] >= 1.0)  # the max's own position weighs 1
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


def test_decode_splits_follow_the_capacity() -> None:
    """One split per 256 positions of the cache, at least 32 (a short context still spreads
    over 64 threadgroups of the real model's 2 kv heads), at most 128 (the kernels lengthen
    them past that)."""
    capacities = (1, 256, 4096, 8192, 8193, 32768, 32769, 262144)
    assert [decode_splits(n) for n in capacities] == [32, 32, 32, 32, 33, 128, 128, 128]


# --------------------------------------------------------------------------------------------
# the three kernels chained, replayed over positions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [REAL, TINY])
def test_replayed_graph_over_a_sequence(device, heads: tuple[int, int]) -> None:
    """One graph recorded once; each replay appends the token at the position in the step
    buffer and attends over everything appended so far."""
    num_q, num_kv = heads
    steps, capacity = 6, 8
    num_splits = decode_splits(capacity)
    rng = np.random.default_rng(21)
    arrays = {
        "q_proj": np.zeros((num_q, 2, HEAD_DIM), dtype=np.float32),
        "k_proj": np.zeros((num_kv, HEAD_DIM), dtype=np.float32),
        "v_proj": np.zeros((num_kv, HEAD_DIM), dtype=np.float32),
        "q_norm": _bf16(1 + rng.normal(0, 0.1, HEAD_DIM)),
        "k_norm": _bf16(1 + rng.normal(0, 0.1, HEAD_DIM)),
        "step": _step_buffer(0),
        "queries": np.zeros((num_q, HEAD_DIM), dtype=np.float32),
        "k_cache": np.zeros((num_kv, capacity, HEAD_DIM), dtype=np.uint16),
        "v_cache": np.zeros((num_kv, capacity, HEAD_DIM), dtype=np.uint16),
        "partial_out": np.zeros(partial_out_bytes(num_q, num_splits), dtype=np.uint8),
        "partial_stats": np.zeros(partial_stats_bytes(num_q, num_splits), dtype=np.uint8),
        "out": np.zeros((num_q, HEAD_DIM), dtype=np.float32),
    }
    b = {name: device.wrap(array) for name, array in arrays.items()}
    heads_kw = {"num_q_heads": num_q, "num_kv_heads": num_kv, "capacity": capacity}
    cache_kw = {name: b[name] for name in ("step", "queries", "k_cache", "v_cache")}
    partials_kw = {name: b[name] for name in ("partial_out", "partial_stats")}
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        **{name: b[name] for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")},
        **cache_kw,
        **heads_kw,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
    )
    graph.barrier()
    record_attention_decode(
        graph, device, **cache_kw, **partials_kw, **heads_kw, num_splits=num_splits
    )
    graph.barrier()
    record_attention_combine(
        graph,
        device,
        **partials_kw,
        q_proj=b["q_proj"],
        step=b["step"],
        out=b["out"],
        num_q_heads=num_q,
        num_splits=num_splits,
    )

    for position in range(steps):
        for name in ("q_proj", "k_proj", "v_proj"):
            arrays[name][:] = rng.normal(0, 2, arrays[name].shape)
        arrays["step"][0] = position
        device.run(graph)

        def normed_rotated(x: np.ndarray, gain: np.ndarray, position: int = position):
            normed = reference.rms_norm(x.astype(np.float64), _f64(gain), EPS)
            return reference.apply_rope(normed[:, None, :], [position], ROTARY_DIM, THETA)[:, 0]

        tol = _rope_tolerance(position)
        queries = arrays["queries"]
        expected_q = normed_rotated(arrays["q_proj"][:, 0], arrays["q_norm"])
        np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=tol)
        k_row = _f64(arrays["k_cache"][:, position])
        expected_k = normed_rotated(arrays["k_proj"], arrays["k_norm"])
        np.testing.assert_allclose(k_row, expected_k, rtol=2.0**-8, atol=tol)
        np.testing.assert_array_equal(arrays["v_cache"][:, position], _bf16(arrays["v_proj"]))
        # Attention over what the cache holds now (bf16, checked above), from the queries.
        k = _f64(arrays["k_cache"][:, : position + 1])
        v = _f64(arrays["v_cache"][:, : position + 1])
        attended = reference.attention(
            queries[:, None, :].astype(np.float64), k, v, SCALE, [position]
        )
        gate = reference.sigmoid(arrays["q_proj"][:, 1].astype(np.float64))
        np.testing.assert_allclose(
            arrays["out"], attended[:, 0] * gate, rtol=DECODE_RTOL, atol=DECODE_ATOL
        )


# --------------------------------------------------------------------------------------------
# a chunk of prompt tokens: prepare over T tokens, then the causal chunk kernel
# --------------------------------------------------------------------------------------------


def _normed_rotated(x: np.ndarray, gain: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [T, H, D] normed and rotated at positions [T], in float64."""
    normed = reference.rms_norm(x.astype(np.float64), _f64(gain), EPS)
    return reference.apply_rope(normed.transpose(1, 0, 2), positions, ROTARY_DIM, THETA).transpose(
        1, 0, 2
    )


@pytest.mark.parametrize(
    ("heads", "tokens", "position"),
    [
        (TINY, 1, 0),
        (TINY, 7, 0),
        (TINY, 7, 250),
        (REAL, 64, 0),
        (REAL, 64, 1000),
        (GROUP_OF_3, 300, 0),
        (TINY, 300, 4000),
    ],
)
def test_prepare_chunk_matches_reference(
    device, heads: tuple[int, int], tokens: int, position: int
) -> None:
    num_q, num_kv = heads
    capacity = position + tokens + 5
    rng = np.random.default_rng(tokens + position)
    q_proj = rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(np.float32)
    k_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    v_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    q_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    k_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    # One row more than the chunk, to see that nothing is written past it.
    queries = np.full((tokens + 1, num_q, HEAD_DIM), np.nan, dtype=np.float32)
    k_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    v_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        q_proj=device.wrap(q_proj),
        k_proj=device.wrap(k_proj),
        v_proj=device.wrap(v_proj),
        q_norm=device.wrap(q_norm),
        k_norm=device.wrap(k_norm),
        step=device.wrap(_step_buffer(position)),
        queries=device.wrap(queries),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        norm_eps=EPS,
        tokens=tokens,
    )
    device.run(graph)

    positions = position + np.arange(tokens)
    tol = _rope_tolerance(position + tokens - 1)
    expected_q = _normed_rotated(q_proj[:, :, 0], q_norm, positions)
    np.testing.assert_allclose(queries[:tokens], expected_q, rtol=1e-5, atol=tol)
    assert np.all(np.isnan(queries[tokens]))
    chunk = slice(position, position + tokens)
    expected_k = _normed_rotated(k_proj, k_norm, positions).transpose(1, 0, 2)
    np.testing.assert_allclose(_f64(k_cache[:, chunk]), expected_k, rtol=2.0**-8, atol=tol)
    np.testing.assert_array_equal(v_cache[:, chunk], _bf16(v_proj).transpose(1, 0, 2))
    untouched = np.ones(capacity, dtype=bool)
    untouched[chunk] = False
    assert np.all(k_cache[:, untouched] == SENTINEL)
    assert np.all(v_cache[:, untouched] == SENTINEL)


def test_prepare_chunk_stops_at_the_capacity(device) -> None:
    """A chunk running past the cache writes the positions that fit and nothing else: head 0's
    positions past the capacity would land on head 1's first rows."""
    num_q, num_kv, tokens, position, capacity = 2, 2, 6, 5, 8
    rng = np.random.default_rng(8)
    k_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    v_cache = np.full((num_kv, capacity, HEAD_DIM), SENTINEL, dtype=np.uint16)
    v_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        q_proj=device.wrap(rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(np.float32)),
        k_proj=device.wrap(rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)),
        v_proj=device.wrap(v_proj),
        q_norm=device.wrap(_bf16(np.ones(HEAD_DIM))),
        k_norm=device.wrap(_bf16(np.ones(HEAD_DIM))),
        step=device.wrap(_step_buffer(position)),
        queries=device.wrap(np.zeros((tokens, num_q, HEAD_DIM), dtype=np.float32)),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        rotary_dim=ROTARY_DIM,
        rope_theta=THETA,
        tokens=tokens,
    )
    device.run(graph)
    fits = capacity - position
    np.testing.assert_array_equal(v_cache[:, position:], _bf16(v_proj[:fits]).transpose(1, 0, 2))
    assert np.all(k_cache[:, :position] == SENTINEL)
    assert np.all(v_cache[:, :position] == SENTINEL)


class ChunkCase:
    """Random queries of a chunk of `tokens` tokens at `position`, a random bf16 cache holding
    positions [0, position + tokens) (earlier chunks' and this one's keys), NaN rows past them
    (a key read past the context poisons the output even with zero weight), and a q_proj whose
    query halves are NaN (only the gate halves may be read)."""

    def __init__(self, heads: tuple[int, int], tokens: int, position: int, seed: int) -> None:
        num_q, num_kv = heads
        self.heads, self.tokens, self.position = heads, tokens, position
        rng = np.random.default_rng(seed)
        context = position + tokens
        self.capacity = context + 3
        shape = (num_kv, self.capacity, HEAD_DIM)
        self.k_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
        self.v_cache = np.full(shape, BF16_NAN, dtype=np.uint16)
        filled = (num_kv, context, HEAD_DIM)
        self.k_cache[:, :context] = _bf16(rng.standard_normal(filled, dtype=np.float32))
        self.v_cache[:, :context] = _bf16(rng.standard_normal(filled, dtype=np.float32))
        self.queries = rng.normal(0, 2, (tokens, num_q, HEAD_DIM)).astype(np.float32)
        self.q_proj = np.full((tokens, num_q, 2, HEAD_DIM), np.nan, dtype=np.float32)
        self.q_proj[:, :, 1] = rng.normal(0, 2, (tokens, num_q, HEAD_DIM))
        # One row more than the chunk, to see that nothing is written past it.
        self.out = np.full((tokens + 1, num_q * HEAD_DIM), np.nan, dtype=np.float32)

    def run(self, device) -> None:
        """On a device with tensor ops, the tensor-op kernels (their packed queries in scratch
        memory, which the checking sim poisons: every padding row must be written)."""
        num_q, num_kv = self.heads
        packed = (
            device.scratch(packed_queries_bytes(num_q, num_kv, self.tokens))
            if chunk_attention_on_tensor_ops(device)
            else None
        )
        graph = Graph()
        record_attention_chunk(
            graph,
            device,
            queries=device.wrap(self.queries),
            q_proj=device.wrap(self.q_proj),
            k_cache=device.wrap(self.k_cache),
            v_cache=device.wrap(self.v_cache),
            step=device.wrap(_step_buffer(self.position)),
            out=device.wrap(self.out),
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            capacity=self.capacity,
            tokens=self.tokens,
            packed_queries=packed,
        )
        device.run(graph)

    def expected(self, in_tiles: bool = False, tile_keys: int = CHUNK_TILE_KEYS) -> np.ndarray:
        """In float64: exact, or (`in_tiles`) with the kernel's rounding modelled in tiles of
        `tile_keys` keys."""
        context = self.position + self.tokens
        k = _f64(self.k_cache[:, :context])
        v = _f64(self.v_cache[:, :context])
        q = self.queries.astype(np.float64).transpose(1, 0, 2)
        positions = self.position + np.arange(self.tokens)
        if in_tiles:
            attended = reference.attention_in_tiles(q, k, v, SCALE, positions, tile_keys)
        else:
            attended = reference.attention(q, k, v, SCALE, positions)
        attended = attended.transpose(1, 0, 2)
        gated = attended * reference.sigmoid(self.q_proj[:, :, 1].astype(np.float64))
        return gated.reshape(self.tokens, -1)


@pytest.mark.parametrize(
    ("heads", "tokens", "position"),
    [
        (TINY, 1, 0),
        (TINY, 1, 50),
        (TINY, 7, 0),
        (TINY, 7, 13),
        (GROUP_OF_3, 64, 0),
        # The last threadgroup's rows end inside a SIMD-group (69 rows: 64 + 5).
        (GROUP_OF_3, 23, 41),
        (REAL, 13, 5),
        (REAL, 64, 100),
        (REAL, 300, 37),
        ((2, 1), 513, 300),
        # A long context ending one key into a tile (4,097 positions).
        pytest.param((2, 1), 1000, 3097, marks=pytest.mark.slow),
    ],
)
def test_chunk_matches_reference(device, heads: tuple[int, int], tokens: int, position: int):
    case = ChunkCase(heads, tokens, position, seed=tokens + position)
    case.run(device)
    np.testing.assert_allclose(case.out[:tokens], case.expected(), rtol=CHUNK_RTOL, atol=CHUNK_ATOL)
    assert np.all(np.isnan(case.out[tokens]))


@pytest.mark.parametrize(
    ("heads", "tokens", "position"), [(TINY, 7, 13), (REAL, 64, 100), ((2, 1), 513, 300)]
)
def test_chunk_rounds_where_the_modelling_reference_does(
    device, heads: tuple[int, int], tokens: int, position: int
) -> None:
    """reference.attention_in_tiles rounds where attention_chunk does (Q and K half, each tile's
    weights bfloat under the running maximum): the kernel's outputs sit a median ~1e-3 as far
    from it as from exact attention (measured 2e-8 against 5e-5), 99% of them within 2e-5
    (5e-6). The rest are rows where a weight lying within fp32's error of a bfloat tie rounds
    the other way, which moves them by up to 2^-8 of that weight (3.6e-4 measured)."""
    case = ChunkCase(heads, tokens, position, seed=tokens + position)
    case.run(device)
    modelled = np.abs(case.out[:tokens] - case.expected(in_tiles=True))
    exact = np.abs(case.out[:tokens] - case.expected())
    assert np.median(modelled) < 1e-2 * np.median(exact)
    assert np.quantile(modelled, 0.99) < 2e-5


def test_chunk_holds_values_past_half_range(device) -> None:
    """Values of ~1e6 (past half's 65504; bf16 holds them): P V's bfloat operands take them
    exactly, and the output scales with them within the chunk's bound."""
    magnitude = 2.0**20
    case = ChunkCase(TINY, 7, 13, seed=3)
    case.v_cache = _bf16(_f64(case.v_cache) * magnitude)
    case.run(device)
    np.testing.assert_allclose(
        case.out[:7] / magnitude, case.expected() / magnitude, rtol=CHUNK_RTOL, atol=CHUNK_ATOL
    )


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
@pytest.mark.parametrize(("heads", "tokens", "position"), [(TINY, 7, 13), (REAL, 16, 10)])
def test_chunk_products_take_2_byte_operands(
    kv_cache: str, heads: tuple[int, int], tokens: int, position: int
) -> None:
    """S = Q K^T takes half operands, P V bfloat ones (half for an int8 cache): per SIMD-group
    and tile of 16 keys, 2 x 32 fragment products for each, and no products for the tiles past
    a SIMD-group's last token. TINY: 7 tokens of 2 query heads per kv head are 14 rows, two
    SIMD-groups of one threadgroup per kv head, both seeing 2 tiles from position 13 (the other
    six have no rows). REAL: 16 tokens of 8 heads from position 10, two threadgroups per kv
    head; the SIMD-groups of tokens 0-5 see one tile, the other ten two."""
    device = sim_device("forward")
    num_q, num_kv = heads
    capacity = position + tokens
    cache = np.zeros((num_kv, capacity, row_bytes(kv_cache)), dtype=np.uint8)
    graph = Graph()
    record_attention_chunk(
        graph,
        device,
        queries=device.wrap(np.ones((tokens, num_q, HEAD_DIM), dtype=np.float32)),
        q_proj=device.wrap(np.ones((tokens, num_q, 2, HEAD_DIM), dtype=np.float32)),
        k_cache=device.wrap(cache),
        v_cache=device.wrap(cache.copy()),
        step=device.wrap(_step_buffer(position)),
        out=device.wrap(np.zeros((tokens, num_q * HEAD_DIM), dtype=np.float32)),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        tokens=tokens,
        kv_cache=kv_cache,
    )
    device.matrix_products()  # what earlier runs left
    device.run(graph)
    # SIMD-group tiles per kv head, as the docstring counts them.
    tiles = {(TINY, 7, 13): 2 * 2, (REAL, 16, 10): 6 * 1 + 10 * 2}[(heads, tokens, position)]
    per_kernel = num_kv * tiles * 2 * 32
    expected = {
        "bf16": {"attention_chunk": MatrixProducts(half=per_kernel, bfloat=per_kernel)},
        "int8": {"attention_chunk_int8": MatrixProducts(half=2 * per_kernel)},
    }
    assert device.matrix_products() == expected[kv_cache]


@pytest.mark.parametrize(("heads", "tokens", "position"), [(REAL, 7, 20), (TINY, 40, 9)])
def test_chunk_equals_decode_steps(
    device, heads: tuple[int, int], tokens: int, position: int
) -> None:
    """prepare + chunk over T tokens leaves the same cache as T replays of the decode graph
    (prepare, decode, combine per token) and the same outputs within the chunk's bound."""
    num_q, num_kv = heads
    capacity = position + tokens + 2
    num_splits = decode_splits(capacity)
    rng = np.random.default_rng(tokens)
    q_proj = rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(np.float32)
    k_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    v_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    norms = {
        "q_norm": device.wrap(_bf16(1 + rng.normal(0, 0.1, HEAD_DIM))),
        "k_norm": device.wrap(_bf16(1 + rng.normal(0, 0.1, HEAD_DIM))),
    }
    earlier = np.zeros((num_kv, capacity, HEAD_DIM), dtype=np.uint16)
    earlier[:, :position] = _bf16(rng.standard_normal((num_kv, position, HEAD_DIM)))
    heads_kw = {"num_q_heads": num_q, "num_kv_heads": num_kv, "capacity": capacity}
    rope_kw = {"rotary_dim": ROTARY_DIM, "rope_theta": THETA, "norm_eps": EPS}

    chunk = {
        "q_proj": q_proj,
        "k_proj": k_proj,
        "v_proj": v_proj,
        "step": _step_buffer(position),
        "queries": np.zeros((tokens, num_q, HEAD_DIM), dtype=np.float32),
        "k_cache": earlier.copy(),
        "v_cache": earlier.copy(),
        "out": np.zeros((tokens, num_q * HEAD_DIM), dtype=np.float32),
    }
    c = {name: device.wrap(array) for name, array in chunk.items()}
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        **{name: c[name] for name in ("q_proj", "k_proj", "v_proj", "step", "queries")},
        **{name: c[name] for name in ("k_cache", "v_cache")},
        **norms,
        **heads_kw,
        **rope_kw,
        tokens=tokens,
    )
    graph.barrier()
    record_attention_chunk(
        graph,
        device,
        **{name: c[name] for name in ("queries", "q_proj", "k_cache", "v_cache", "step", "out")},
        **heads_kw,
        tokens=tokens,
    )
    device.run(graph)

    one = {
        "q_proj": np.zeros((num_q, 2, HEAD_DIM), dtype=np.float32),
        "k_proj": np.zeros((num_kv, HEAD_DIM), dtype=np.float32),
        "v_proj": np.zeros((num_kv, HEAD_DIM), dtype=np.float32),
        "step": _step_buffer(0),
        "queries": np.zeros((num_q, HEAD_DIM), dtype=np.float32),
        "k_cache": earlier.copy(),
        "v_cache": earlier.copy(),
        "partial_out": np.zeros(partial_out_bytes(num_q, num_splits), dtype=np.uint8),
        "partial_stats": np.zeros(partial_stats_bytes(num_q, num_splits), dtype=np.uint8),
        "out": np.zeros((num_q, HEAD_DIM), dtype=np.float32),
    }
    d = {name: device.wrap(array) for name, array in one.items()}
    cache_kw = {name: d[name] for name in ("step", "queries", "k_cache", "v_cache")}
    partials_kw = {name: d[name] for name in ("partial_out", "partial_stats")}
    decode = Graph()
    record_attention_prepare(
        decode,
        device,
        **{name: d[name] for name in ("q_proj", "k_proj", "v_proj")},
        **cache_kw,
        **norms,
        **heads_kw,
        **rope_kw,
    )
    decode.barrier()
    record_attention_decode(
        decode, device, **cache_kw, **partials_kw, **heads_kw, num_splits=num_splits
    )
    decode.barrier()
    record_attention_combine(
        decode,
        device,
        **partials_kw,
        q_proj=d["q_proj"],
        step=d["step"],
        out=d["out"],
        num_q_heads=num_q,
        num_splits=num_splits,
    )
    for t in range(tokens):
        one["q_proj"][:], one["k_proj"][:], one["v_proj"][:] = q_proj[t], k_proj[t], v_proj[t]
        one["step"][0] = position + t
        device.run(decode)
        # Same prepare code per token: the same bits.
        np.testing.assert_array_equal(chunk["queries"][t], one["queries"])
        np.testing.assert_allclose(
            chunk["out"][t], one["out"].reshape(-1), rtol=CHUNK_RTOL, atol=CHUNK_ATOL
        )
    np.testing.assert_array_equal(chunk["k_cache"], one["k_cache"])
    np.testing.assert_array_equal(chunk["v_cache"], one["v_cache"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 128}, "256-dim"),
        ({"rotary_dim": 48}, "rotary_dim"),
        ({"num_q_heads": 5}, "share"),
        ({"tokens": 0}, "at least one token"),
    ],
)
def test_rejects_dims_it_was_not_built_for(device, change: dict, message: str) -> None:
    buffer = device.alloc(16)
    names = (
        "q_proj",
        "k_proj",
        "v_proj",
        "q_norm",
        "k_norm",
        "step",
        "queries",
        "k_cache",
        "v_cache",
    )
    dims = {
        "num_q_heads": 4,
        "num_kv_heads": 2,
        "capacity": 8,
        "rotary_dim": 64,
        "rope_theta": THETA,
    }
    with pytest.raises(ValueError, match=message):
        record_attention_prepare(Graph(), device, **dict.fromkeys(names, buffer), **(dims | change))


def test_decode_rejects_groups_of_more_than_8_heads(device) -> None:
    """The decode kernels keep at most 8 query heads' states per kv head."""
    buffer = device.alloc(16)
    names = ("queries", "k_cache", "v_cache", "step", "partial_out", "partial_stats")
    with pytest.raises(ValueError, match="at most 8"):
        record_attention_decode(
            Graph(),
            device,
            **dict.fromkeys(names, buffer),
            num_q_heads=18,
            num_kv_heads=2,
            capacity=8,
            num_splits=1,
        )


def test_chunk_rejects_dims_it_was_not_built_for(device) -> None:
    buffer = device.alloc(16)
    names = ("queries", "q_proj", "k_cache", "v_cache", "step", "out")
    dims = {"num_q_heads": 4, "num_kv_heads": 2, "capacity": 8, "tokens": 3}
    for change, message in (({"tokens": 0}, "at least one token"), ({"head_dim": 64}, "256-dim")):
        with pytest.raises(ValueError, match=message):
            record_attention_chunk(
                Graph(), device, **dict.fromkeys(names, buffer), **(dims | change)
            )
