"""The attention kernels over an int8 KV cache (the `_int8` kernels of metal/attention.metal) on
the sim under the three lane orders, against float64 numpy.

The row format (docs/architecture.md): 256 int8 codes, then 8 fp16 scales, one per group of 32
dims; scale = the group's max |x| / 127 rounded to fp16, code = x / scale rounded to nearest.
`encode_rows` restates it in numpy (float32 arithmetic, as the kernels do) to build caches, and
`decode_rows` gives the float64 values a cache stands for. The appends are checked against the
format's definition (bit for bit where the input is exact); the readers (decode, fused decode,
chunk) against float64 attention over the values the cache stands for, at contexts that end
mid-tile, at and one past split boundaries, and with the rows past the context holding NaN
scales, so that reading one poisons the output.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import (
    CHUNK_ATOL,
    CHUNK_RTOL,
    DECODE_ATOL,
    DECODE_RTOL,
    EPS,
    GROUP_OF_3,
    REAL,
    ROTARY_DIM,
    SCALE,
    THETA,
    TINY,
    _bf16,
    _f64,
    _rope_tolerance,
    _step_buffer,
)
from test_kernel_attention_splits import expected_split_length

from lily.device import Graph
from lily.engine import reference
from lily.kernels.attention import (
    HEAD_DIM,
    INT8_GROUP,
    cache_bytes,
    decode_splits,
    partial_out_bytes,
    partial_stats_bytes,
    record_attention_chunk,
    record_attention_combine,
    record_attention_decode,
    record_attention_decode_fused,
    record_attention_prepare,
    row_bytes,
)

ROW_BYTES = row_bytes("int8")
GROUPS = HEAD_DIM // INT8_GROUP
# Bytes no append writes in these tests: codes -1 and NaN scales.
POISON = 0xFF


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def encode_rows(x: np.ndarray) -> np.ndarray:
    """Rows [..., 256] of float32 values as the int8 format's bytes [..., 272]."""
    x = np.asarray(x, dtype=np.float32)
    grouped = x.reshape(*x.shape[:-1], GROUPS, INT8_GROUP)
    scales = (np.abs(grouped).max(axis=-1) / np.float32(127)).astype(np.float16)
    step = scales.astype(np.float32)
    divisor = np.where(step > 0, step, np.float32(1))[..., None]
    codes = np.clip(np.rint(grouped / divisor), -127, 127).astype(np.int8)
    rows = np.empty((*x.shape[:-1], ROW_BYTES), dtype=np.uint8)
    rows[..., :HEAD_DIM] = codes.reshape(*x.shape[:-1], HEAD_DIM).view(np.uint8)
    rows[..., HEAD_DIM:] = scales.view(np.uint8).reshape(*x.shape[:-1], 2 * GROUPS)
    return rows


def decode_rows(rows: np.ndarray) -> np.ndarray:
    """The float64 values [..., 256] that int8 rows [..., 272] stand for."""
    codes = rows[..., :HEAD_DIM].view(np.int8).astype(np.float64)
    scales = np.ascontiguousarray(rows[..., HEAD_DIM:]).view(np.float16).astype(np.float64)
    grouped = codes.reshape(*codes.shape[:-1], GROUPS, INT8_GROUP) * scales[..., None]
    return grouped.reshape(codes.shape)


def poisoned_cache(num_kv: int, capacity: int) -> np.ndarray:
    cache = np.full((num_kv, capacity, ROW_BYTES), POISON, dtype=np.uint8)
    assert cache.nbytes == cache_bytes(num_kv, capacity, "int8")
    return cache


def random_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random rows with some large-magnitude dims (as real keys have) and an all-zero group."""
    x = rng.standard_normal((*shape, HEAD_DIM), dtype=np.float32)
    x[..., ::5, 7] *= 30
    x[..., ::11, 64:96] = 0
    return encode_rows(x)


def test_encode_rows_follows_the_format() -> None:
    """The test's encoder against hand-made values: a group's max maps to 127, the scale is
    fp16, an all-zero group has scale 0."""
    x = np.zeros(HEAD_DIM, dtype=np.float32)
    x[:4] = [1.27, -0.635, 0.3, 0.0]
    row = encode_rows(x)
    scales = row[HEAD_DIM:].view(np.float16)
    assert scales[0] == np.float16(0.01) and np.all(scales[1:] == 0)
    codes = row[:HEAD_DIM].view(np.int8)
    # fp16(0.01) = 0.0100021: -0.635 is -63.49 of its steps (-63, where an exact scale of 0.01
    # would tie to even at -64), 0.3 is 29.99 (30).
    assert codes[:4].tolist() == [127, -63, 30, 0] and not np.any(codes[4:])
    np.testing.assert_allclose(decode_rows(row)[:3], [1.27, -0.63, 0.3], rtol=1e-3)


# --------------------------------------------------------------------------------------------
# the append: attention_prepare_int8 and the fused kernel's
# --------------------------------------------------------------------------------------------


def _projections(rng: np.random.Generator, heads: tuple[int, int], tokens: int):
    num_q, num_kv = heads
    q_proj = rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(np.float32)
    k_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    v_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(np.float32)
    # A value outlier and an all-zero value group.
    v_proj[..., 3] *= 50
    v_proj[..., 128:160] = 0
    q_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    k_norm = _bf16(1 + rng.normal(0, 0.1, HEAD_DIM))
    return q_proj, k_proj, v_proj, q_norm, k_norm


def _normed_rotated(x: np.ndarray, gain: np.ndarray, positions) -> np.ndarray:
    """[T, H, 256] -> [T, H, 256], float64."""
    normed = reference.rms_norm(x.astype(np.float64), _f64(gain), EPS)
    return reference.apply_rope(normed.transpose(1, 0, 2), positions, ROTARY_DIM, THETA).transpose(
        1, 0, 2
    )


def assert_appended_key(rows: np.ndarray, expected: np.ndarray, position: int) -> None:
    """Keys are computed in fp32 by the kernel and float64 here: each group's scale is the fp16
    rounding of its max / 127 (within one fp16 ulp of the float64 one), each value within half a
    step of the key (plus the fp32 error)."""
    scales = np.ascontiguousarray(rows[..., HEAD_DIM:]).view(np.float16).astype(np.float64)
    group_max = np.abs(expected).reshape(*expected.shape[:-1], GROUPS, INT8_GROUP).max(axis=-1)
    np.testing.assert_allclose(scales, group_max / 127, rtol=2.0**-10)
    tol = _rope_tolerance(position)
    half_step = np.repeat(scales, INT8_GROUP, axis=-1) / 2
    assert np.all(np.abs(decode_rows(rows) - expected) <= half_step * (1 + 2.0**-10) + tol)


@pytest.mark.parametrize(
    ("heads", "tokens", "position"), [(REAL, 1, 0), (TINY, 1, 4095), (REAL, 5, 30), (TINY, 40, 9)]
)
def test_prepare_appends_int8_rows(device, heads, tokens: int, position: int) -> None:
    num_q, num_kv = heads
    capacity = position + tokens + 2
    q_proj, k_proj, v_proj, q_norm, k_norm = _projections(
        np.random.default_rng(position), heads, tokens
    )
    queries = np.full((tokens, num_q, HEAD_DIM), np.nan, dtype=np.float32)
    k_cache, v_cache = poisoned_cache(num_kv, capacity), poisoned_cache(num_kv, capacity)
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
        kv_cache="int8",
    )
    device.run(graph)
    positions = position + np.arange(tokens)
    written = slice(position, position + tokens)
    # Queries stay fp32, as with a bf16 cache.
    expected_q = _normed_rotated(q_proj[:, :, 0], q_norm, positions)
    np.testing.assert_allclose(queries, expected_q, rtol=1e-5, atol=_rope_tolerance(position))
    expected_k = _normed_rotated(k_proj, k_norm, positions).transpose(1, 0, 2)
    assert_appended_key(k_cache[:, written], expected_k, position + tokens)
    # The values are the kernel's input, exact: the same bytes as the format's definition.
    np.testing.assert_array_equal(v_cache[:, written], encode_rows(v_proj.transpose(1, 0, 2)))
    untouched = np.ones(capacity, dtype=bool)
    untouched[written] = False
    assert np.all(k_cache[:, untouched] == POISON) and np.all(v_cache[:, untouched] == POISON)


# --------------------------------------------------------------------------------------------
# decode: attention_decode_int8 (split partials) and the combine
# --------------------------------------------------------------------------------------------


class Int8DecodeCase:
    """Random queries over an int8 cache of `context` rows (poison past them), the engine's
    splits for the capacity."""

    def __init__(self, heads: tuple[int, int], context: int, capacity: int, seed: int) -> None:
        num_q, num_kv = heads
        self.heads, self.context, self.capacity = heads, context, capacity
        self.num_splits = decode_splits(capacity)
        rng = np.random.default_rng(seed)
        self.k_cache, self.v_cache = (
            poisoned_cache(num_kv, capacity),
            poisoned_cache(num_kv, capacity),
        )
        self.k_cache[:, :context] = random_rows(rng, (num_kv, context))
        self.v_cache[:, :context] = random_rows(rng, (num_kv, context))
        self.queries = rng.normal(0, 2, (num_q, HEAD_DIM)).astype(np.float32)
        self.q_proj = np.full((num_q, 2, HEAD_DIM), np.nan, dtype=np.float32)
        self.q_proj[:, 1] = rng.normal(0, 2, (num_q, HEAD_DIM))
        self.out = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
        self.partial_out = np.full(
            partial_out_bytes(num_q, self.num_splits) // 4, np.nan, np.float32
        )
        self.partial_stats = np.full(
            partial_stats_bytes(num_q, self.num_splits) // 4, np.nan, np.float32
        )

    def run(self, device) -> None:
        num_q, num_kv = self.heads
        partial_out, partial_stats = device.wrap(self.partial_out), device.wrap(self.partial_stats)
        step = device.wrap(_step_buffer(self.context - 1))
        graph = Graph()
        record_attention_decode(
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
            kv_cache="int8",
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
        )
        device.run(graph)

    def split_partials(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float64 (max, sum, weighted values) per query head and reached split."""
        num_q, num_kv = self.heads
        group = num_q // num_kv
        length = expected_split_length(self.context, self.num_splits)
        splits = -(-self.context // length)
        k = np.repeat(decode_rows(self.k_cache[:, : self.context]), group, 0)
        v = np.repeat(decode_rows(self.v_cache[:, : self.context]), group, 0)
        scores = np.einsum("hd,hpd->hp", self.queries.astype(np.float64), k) * SCALE
        maxima, sums = np.empty((num_q, splits)), np.empty((num_q, splits))
        weighted = np.empty((num_q, splits, HEAD_DIM))
        for s in range(splits):
            part = slice(s * length, min((s + 1) * length, self.context))
            maxima[:, s] = scores[:, part].max(axis=1)
            w = np.exp(scores[:, part] - maxima[:, s, None])
            sums[:, s] = w.sum(axis=1)
            weighted[:, s] = np.einsum("hp,hpd->hd", w, v[:, part])
        return maxima, sums, weighted

    def expected(self) -> np.ndarray:
        k = decode_rows(self.k_cache[:, : self.context])
        v = decode_rows(self.v_cache[:, : self.context])
        attended = reference.attention(
            self.queries.astype(np.float64)[:, None], k, v, SCALE, [self.context - 1]
        )[:, 0]
        return attended * reference.sigmoid(self.q_proj[:, 1].astype(np.float64))


@pytest.mark.parametrize(
    ("heads", "context", "capacity"),
    [(REAL, n, n + 3) for n in (1, 7, 31, 32, 33, 257, 4097)]
    + [(REAL, 8193, 8196), (TINY, 1025, 1028), (GROUP_OF_3, 257, 300)],
)
def test_decode_split_partials_match_reference(device, heads, context: int, capacity: int):
    """Ends mid-tile (7, 31), at and one past a split boundary (32, 33, 257), over a full grid
    with one position left for the last split (8193)."""
    case = Int8DecodeCase(heads, context, capacity, seed=context)
    case.run(device)
    maxima, sums, weighted = case.split_partials()
    num_q, splits = maxima.shape
    stats = case.partial_stats.reshape(num_q, case.num_splits, 2)
    partials = case.partial_out.reshape(num_q, case.num_splits, HEAD_DIM)
    np.testing.assert_allclose(stats[:, :splits, 0], maxima, rtol=0, atol=1e-5)
    np.testing.assert_allclose(stats[:, :splits, 1], sums, rtol=1e-5)
    np.testing.assert_allclose(
        partials[:, :splits] / stats[:, :splits, 1:],
        weighted / sums[..., None],
        rtol=DECODE_RTOL,
        atol=DECODE_ATOL,
    )
    assert np.all(np.isnan(stats[:, splits:])) and np.all(np.isnan(partials[:, splits:]))
    np.testing.assert_allclose(case.out, case.expected(), rtol=DECODE_RTOL, atol=DECODE_ATOL)


# --------------------------------------------------------------------------------------------
# the fused decode step: attention_decode_fused_int8
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "position", "capacity"),
    [(REAL, 0, 3), (REAL, 9, 12), (REAL, 32, 35), (TINY, 256, 259), (GROUP_OF_3, 300, 303)],
)
def test_fused_decode_equals_prepare_then_decode(device, heads, position: int, capacity: int):
    """The fused kernel stages the current row in the cache's format and reads it as if from
    the cache: the same cache bytes and partials, bit for bit, as prepare then decode, and the
    combined output is float64 attention over the values the cache stands for."""
    num_q, num_kv = heads
    splits = decode_splits(capacity)
    rng = np.random.default_rng(position)
    q_proj, k_proj, v_proj, q_norm, k_norm = _projections(rng, heads, 1)
    q_proj, k_proj, v_proj = q_proj[0], k_proj[0], v_proj[0]
    cache = poisoned_cache(num_kv, capacity)
    cache[:, :position] = random_rows(rng, (num_kv, position))
    common = dict(
        step=device.wrap(_step_buffer(position)),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        kv_cache="int8",
    )
    projections = dict(
        q_proj=device.wrap(q_proj),
        k_proj=device.wrap(k_proj),
        v_proj=device.wrap(v_proj),
        q_norm=device.wrap(q_norm),
        k_norm=device.wrap(k_norm),
    )
    rope = dict(rotary_dim=ROTARY_DIM, rope_theta=THETA, norm_eps=EPS)

    def outputs():
        return [
            np.full(partial_out_bytes(num_q, splits) // 4, np.nan, np.float32),
            np.full(partial_stats_bytes(num_q, splits) // 4, np.nan, np.float32),
            cache.copy(),
            cache.copy(),
        ]

    fused = outputs()
    graph = Graph()
    record_attention_decode_fused(
        graph,
        device,
        **common,
        **projections,
        **rope,
        k_cache=device.wrap(fused[2]),
        v_cache=device.wrap(fused[3]),
        partial_out=device.wrap(fused[0]),
        partial_stats=device.wrap(fused[1]),
        num_splits=splits,
    )
    device.run(graph)

    separate = outputs()
    queries = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
    caches = dict(k_cache=device.wrap(separate[2]), v_cache=device.wrap(separate[3]))
    graph = Graph()
    record_attention_prepare(
        graph,
        device,
        **common,
        **projections,
        **rope,
        **caches,
        queries=device.wrap(queries),
    )
    graph.barrier()
    record_attention_decode(
        graph,
        device,
        **common,
        **caches,
        queries=device.wrap(queries),
        partial_out=device.wrap(separate[0]),
        partial_stats=device.wrap(separate[1]),
        num_splits=splits,
    )
    device.run(graph)
    for name, got, expected in zip(("partials", "stats", "k", "v"), fused, separate, strict=True):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    changed = np.any(fused[2] != cache, axis=(0, 2))
    assert np.flatnonzero(changed).tolist() == [position]

    out = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
    graph = Graph()
    record_attention_combine(
        graph,
        device,
        partial_out=device.wrap(fused[0]),
        partial_stats=device.wrap(fused[1]),
        q_proj=device.wrap(q_proj),
        step=device.wrap(_step_buffer(position)),
        out=device.wrap(out),
        num_q_heads=num_q,
        num_splits=splits,
    )
    device.run(graph)
    expected_k = _normed_rotated(k_proj[None], k_norm, [position])[0]
    assert_appended_key(fused[2][:, position], expected_k, position)
    q = _normed_rotated(q_proj[None, :, 0], q_norm, [position]).transpose(1, 0, 2)
    k, v = decode_rows(fused[2][:, : position + 1]), decode_rows(fused[3][:, : position + 1])
    attended = reference.attention(q, k, v, SCALE, [position])[:, 0]
    gated = attended * reference.sigmoid(q_proj[:, 1].astype(np.float64))
    np.testing.assert_allclose(out, gated, rtol=DECODE_RTOL, atol=DECODE_ATOL)


# --------------------------------------------------------------------------------------------
# a chunk of prompt tokens: attention_chunk_int8 (also the speculative verify pass)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "tokens", "position"),
    [
        (TINY, 1, 0),
        (TINY, 7, 13),
        (GROUP_OF_3, 37, 0),
        (REAL, 9, 100),
        (REAL, 70, 333),
        ((2, 1), 300, 41),
    ],
)
def test_chunk_matches_reference(device, heads, tokens: int, position: int) -> None:
    """Causal attention of the chunk's queries over the values the int8 cache stands for; the
    contexts end mid-way through the kernel's 16-key tiles, and the rows past them are poison."""
    num_q, num_kv = heads
    context = position + tokens
    capacity = context + 3
    rng = np.random.default_rng(tokens + position)
    k_cache, v_cache = poisoned_cache(num_kv, capacity), poisoned_cache(num_kv, capacity)
    k_cache[:, :context] = random_rows(rng, (num_kv, context))
    v_cache[:, :context] = random_rows(rng, (num_kv, context))
    queries = rng.normal(0, 2, (tokens, num_q, HEAD_DIM)).astype(np.float32)
    q_proj = np.full((tokens, num_q, 2, HEAD_DIM), np.nan, dtype=np.float32)
    q_proj[:, :, 1] = rng.normal(0, 2, (tokens, num_q, HEAD_DIM))
    out = np.full((tokens + 1, num_q * HEAD_DIM), np.nan, dtype=np.float32)
    graph = Graph()
    record_attention_chunk(
        graph,
        device,
        queries=device.wrap(queries),
        q_proj=device.wrap(q_proj),
        k_cache=device.wrap(k_cache),
        v_cache=device.wrap(v_cache),
        step=device.wrap(_step_buffer(position)),
        out=device.wrap(out),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        capacity=capacity,
        tokens=tokens,
        kv_cache="int8",
    )
    device.run(graph)
    k, v = decode_rows(k_cache[:, :context]), decode_rows(v_cache[:, :context])
    q = queries.astype(np.float64).transpose(1, 0, 2)
    attended = reference.attention(q, k, v, SCALE, position + np.arange(tokens))
    gated = attended.transpose(1, 0, 2) * reference.sigmoid(q_proj[:, :, 1].astype(np.float64))
    # The bf16 cache's bound (half Q), and P V's: V's codes are exact in half and P times each
    # key's scale rounds to half, every weight off by up to 2^-11 of itself, uncompensated by
    # the denominator (the bf16 cache's is), so output dim d moves by up to 2^-11 of the largest
    # |v[d]| its kv head holds (~100 in the dims these rows make large). A missed key or scale
    # moves it by a whole weight times |v|.
    largest = np.abs(v).max(axis=1)[np.arange(num_q) // (num_q // num_kv)]  # [num_q, HEAD_DIM]
    error = np.abs(out[:tokens].reshape(tokens, num_q, HEAD_DIM) - gated)
    bound = CHUNK_ATOL + CHUNK_RTOL * np.abs(gated) + 2.0**-11 * largest
    assert np.all(error <= bound), np.max(error - bound)
    assert np.all(np.isnan(out[tokens]))


def test_an_unknown_cache_type_is_refused(device) -> None:
    with pytest.raises(ValueError, match="kv_cache must be 'bf16' or 'int8', not 'fp8'"):
        record_attention_chunk(
            Graph(),
            device,
            queries=device.alloc(4),
            q_proj=device.alloc(4),
            k_cache=device.alloc(4),
            v_cache=device.alloc(4),
            step=device.alloc(4),
            out=device.alloc(4),
            num_q_heads=4,
            num_kv_heads=2,
            capacity=1,
            tokens=1,
            kv_cache="fp8",
        )
