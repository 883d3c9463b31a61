"""The vision tower's kernels (`metal/vision.metal`) against the numpy reference's functions
(lily.engine.vision_reference) in float64, under the three lane orders (the random one on the
checking sim) at ragged sizes. bf16 weights are widened exactly, so the reference uses the same
values and every bound below is float32 rounding alone (the linear map's and attention's are
written in lily.diagnostics.kernel_checks, which `lily doctor` shares):

- linear: a length-k sum accumulated in fp32 is within (k + 8) ulps of sum |x w| (as gemm_nt's);
  the bias add is one more rounding. GELU propagates that error with its slope (at most 1.13 for
  both forms) and adds its own: tanh within a few ulps, the erf approximation within 1.5e-7
  absolute (under 2 ulps of 1), each scaled by |y| / 2, plus the products' roundings: 8 ulps of
  |y| covers both. The residual add is one rounding of |out|.
- position embedding: the fractions of the bilinear weights are computed in fp32, within 2 ulps
  of the largest position (side - 1) of the reference's fp64 ones, and each of the four corners'
  weights moves by at most twice that; the products and sums add 8 roundings. Bound:
  (4 (side - 1) + 8) ulps of the four corners' sum of magnitudes.
- LayerNorm: the mean is a fp32 sum (per thread, then the SIMD-group's and the threadgroup's
  partials: per_thread + 64 roundings) of values of mean magnitude mean|x|, so each centred value
  is within that many ulps of mean|x| and of its own rounding; the variance sums the same way and
  its relative error halves under the square root; scaling, weight and bias add a few roundings.
  Bound: (per_thread + 64 + 16) ulps of |w| (|x - mean| + mean|x|) / std + |b|.
- rotary: a c - b s from cos and sin rounded once to fp32: 4 ulps of |a| + |b|.
- attention: each score is a length-head_dim fp32 dot product, within (head_dim + 2) ulps of
  sum |q k| scale, and an error e in scores moves the softmax's weights by at most 2e relatively;
  the weighted values and the weights' sum are accumulated over the frame's keys in sequence
  (8 products per fragment multiply-accumulate), with a rescale per 32-key tile: fewer than
  2 frame + 16 roundings. All of it relative to the weighted mean of |v|, sum p |v| / sum p.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kernel_testing import (
    FLOAT32_EPS,
    LANE_ORDERS,
    as_float32,
    assert_within,
    assert_within_ulps,
    float_buffer,
    random_bf16,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32
from lily.diagnostics.kernel_checks import vision_attention_bound, vision_linear_bound
from lily.engine import vision_reference as ref
from lily.kernels.norm import threads_for
from lily.kernels.vision import (
    Epilogue,
    record_attention,
    record_layer_norm,
    record_linear,
    record_position_embedding,
    record_rotary,
    rotary_tables,
)

EPS = 1e-6


def widened(bits: np.ndarray) -> np.ndarray:
    return bf16_to_float32(bits).astype(np.float64)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "dim"), [(3, 64), (5, 100), (2, 1152), (1, 4608)])
def test_layer_norm(lane_order, rows, dim):
    rng = np.random.default_rng(rows * dim)
    device = sim_device(lane_order)
    # An offset mean, as the tower's residual stream has, makes the centring matter.
    x = rng.normal(1.5, 3.0, (rows, dim)).astype(np.float32)
    weight = random_bf16(rng, dim, scale=0.5, loc=1.0)
    bias = random_bf16(rng, dim, scale=0.5)
    out = float_buffer(device, rows * dim)
    run(
        device,
        lambda g: record_layer_norm(
            g, device, device.wrap(x), device.wrap(weight), device.wrap(bias), out, rows, dim, EPS
        ),
    )
    x64, w64, b64 = x.astype(np.float64), widened(weight), widened(bias)
    expected = ref.layer_norm(x64, w64, b64, EPS)
    mean = x64.mean(axis=-1, keepdims=True)
    std = np.sqrt(((x64 - mean) ** 2).mean(axis=-1, keepdims=True) + EPS)
    magnitude = np.abs(w64) * (np.abs(x64 - mean) + np.abs(x64).mean(-1, keepdims=True)) / std
    per_thread = -(-dim // threads_for(dim))
    actual = as_float32(out, rows * dim).reshape(rows, dim)
    assert_within_ulps(actual, expected, magnitude + np.abs(b64), per_thread + 64 + 16)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("grid", "side", "dim"),
    [
        ((1, 2, 2), 8, 64),  # the tiny tower's smallest image
        ((1, 4, 6), 8, 64),  # fewer patches than the grid has rows: every one interpolates
        ((2, 6, 4), 8, 100),  # two frames alike; a ragged width
        ((1, 16, 22), 8, 64),  # more patches than the grid has rows
        ((1, 48, 64), 48, 32),  # the real 48 x 48 grid at 768 x 1024 pixels (narrow dim)
    ],
    ids=str,
)
def test_position_embedding(lane_order, grid, side, dim):
    rng = np.random.default_rng(side * dim + sum(grid))
    device = sim_device(lane_order)
    table = random_bf16(rng, (side * side, dim))
    rows = math.prod(grid)
    out = float_buffer(device, rows * dim)
    run(
        device,
        lambda g: record_position_embedding(g, device, device.wrap(table), out, grid, 2, side, dim),
    )
    table64 = widened(table)
    expected = ref.interpolated_position_embedding(table64, grid, 2)
    # The four corners' magnitudes: the resampling of |table| with every weight 1.
    corners = np.abs(table64).reshape(side, side, dim)
    low = [np.linspace(0, side - 1, n).astype(np.int64) for n in grid[1:]]
    high = [np.minimum(axis + 1, side - 1) for axis in low]
    magnitude = sum(
        corners[rows_][:, cols] for rows_ in (low[0], high[0]) for cols in (low[1], high[1])
    )
    magnitude = np.tile(ref.block_order(magnitude, 2), (grid[0], 1))
    actual = as_float32(out, rows * dim).reshape(rows, dim)
    assert_within_ulps(actual, expected, magnitude, 4 * (side - 1) + 8)


def linear_case(rng, m: int, n: int, k: int):
    x = rng.normal(0, 1, (m, k)).astype(np.float32)
    weight = random_bf16(rng, (n, k), scale=1 / math.sqrt(k))
    bias = random_bf16(rng, n, scale=0.5)
    x64, w64, b64 = x.astype(np.float64), widened(weight), widened(bias)
    y = ref.linear(x64, w64, b64)
    magnitude = np.abs(x64) @ np.abs(w64).T + np.abs(b64)
    return x, weight, bias, y, magnitude


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 1, 1),
        (37, 45, 19),  # ragged in every dimension
        (24, 96, 64),  # the tiny tower's fc1
        (6, 64, 1536),  # the patch embedding's depth
    ],
)
@pytest.mark.parametrize("epilogue", list(Epilogue))
def test_linear(lane_order, m, n, k, epilogue):
    rng = np.random.default_rng(m * n + k)
    device = sim_device(lane_order)
    x, weight, bias, y, magnitude = linear_case(rng, m, n, k)
    residual = rng.normal(0, 2, (m, n)).astype(np.float32)
    out = device.wrap(residual.copy()) if epilogue == Epilogue.ADD else float_buffer(device, m * n)
    run(
        device,
        lambda g: record_linear(
            g,
            device,
            device.wrap(x),
            device.wrap(weight),
            device.wrap(bias),
            out,
            m,
            n,
            k,
            epilogue,
        ),  # fmt: skip
    )
    actual = as_float32(out, m * n).reshape(m, n)
    gelu = epilogue in (Epilogue.GELU_TANH, Epilogue.GELU_ERF)
    bound = vision_linear_bound(y, magnitude, k, gelu)
    if epilogue == Epilogue.STORE:
        assert_within(actual, y, bound)
    elif epilogue == Epilogue.ADD:
        expected = residual + y
        assert_within(actual, expected, bound + FLOAT32_EPS * np.abs(expected))
    else:
        expected = ref.gelu_tanh(y) if epilogue == Epilogue.GELU_TANH else ref.gelu_erf(y)
        assert_within(actual, expected, bound)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("grid", "heads", "head_dim"),
    [((1, 4, 6), 4, 16), ((2, 2, 4), 2, 16), ((1, 6, 8), 16, 72)],
)
def test_rotary(lane_order, grid, heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    device = sim_device(lane_order)
    rows = math.prod(grid)
    qkv = rng.normal(0, 2, (rows, 3, heads, head_dim)).astype(np.float32)
    angles = ref.rotary_angles(grid, 2, head_dim, 10_000.0)
    cos, sin = rotary_tables(angles)
    buffer = device.wrap(qkv.copy())
    run(
        device,
        lambda g: record_rotary(
            g, device, buffer, device.wrap(cos), device.wrap(sin), rows, heads, head_dim
        ),
    )
    actual = as_float32(buffer, qkv.size).reshape(qkv.shape)
    q64, k64 = qkv[:, 0].astype(np.float64), qkv[:, 1].astype(np.float64)
    for part, source in ((0, q64), (1, k64)):
        first, second = np.split(np.abs(source), 2, axis=-1)
        magnitude = np.tile(first + second, 2)
        assert_within_ulps(actual[:, part], ref.apply_rotary(source, angles), magnitude, 4)
    # v is left as it was.
    np.testing.assert_array_equal(actual[:, 2], qkv[:, 2])


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("frames", "frame", "heads", "head_dim"),
    [
        (1, 4, 1, 16),  # fewer keys than a tile, fewer queries than a threadgroup's rows
        (1, 37, 2, 16),  # ragged tiles
        (2, 24, 4, 16),  # two frames: neither attends to the other
        (1, 45, 2, 72),  # the real head dim
        (1, 100, 1, 72),  # four key tiles, four query blocks
    ],
)
def test_attention(lane_order, frames, frame, heads, head_dim):
    rng = np.random.default_rng(frame * heads + head_dim)
    device = sim_device(lane_order)
    rows = frames * frame
    qkv = rng.normal(0, 1, (rows, 3, heads, head_dim)).astype(np.float32)
    out = float_buffer(device, rows * heads * head_dim)
    run(
        device,
        lambda g: record_attention(
            g, device, device.wrap(qkv), out, frames, frame, heads, head_dim
        ),
    )
    actual = as_float32(out, rows * heads * head_dim).reshape(rows, heads, head_dim)
    q, k, v = (qkv[:, i].astype(np.float64) for i in range(3))
    for start in range(0, rows, frame):
        span = slice(start, start + frame)
        expected, bound = vision_attention_bound(q[span], k[span], v[span], 1 / math.sqrt(head_dim))
        np.testing.assert_allclose(expected, ref.attention(q[span], k[span], v[span]), atol=1e-12)
        assert_within(actual[span], expected, bound)


@pytest.mark.parametrize("head_dim", [128, 12])
def test_attention_refuses_a_head_dim_off_its_fragments(head_dim) -> None:
    device = sim_device("forward")
    buffer = float_buffer(device, 3 * head_dim)
    with pytest.raises(ValueError, match=f"head dim {head_dim}: "):
        run(device, lambda g: record_attention(g, device, buffer, buffer, 1, 1, 1, head_dim))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_attention_split_by_query_rows_writes_the_same(lane_order) -> None:
    # Two frames of 80 patches, their query rows in pieces of 32, 32 and the last 16: each
    # piece writes its rows of both frames and nothing else, exactly what the whole would.
    device = sim_device(lane_order)
    frames, frame, heads, head_dim = 2, 80, 2, 16
    rows, width = frames * frame, heads * head_dim
    qkv = device.wrap(np.random.default_rng(4).normal(0, 1, (rows, 3 * width)).astype(np.float32))
    whole = float_buffer(device, rows * width)
    run(device, lambda g: record_attention(g, device, qkv, whole, frames, frame, heads, head_dim))
    pieces = device.alloc(4 * rows * width)  # zeros: a row no piece writes stays zero
    for queries in (range(32, 64), range(0, 32), range(64, 80)):
        run(
            device,
            lambda g, q=queries: record_attention(
                g, device, qkv, pieces, frames, frame, heads, head_dim, q
            ),
        )
        if queries.start == 32:  # the first piece: its rows of each frame and no other
            written = as_float32(pieces, rows * width).reshape(frames, frame, width) != 0
            assert written[:, 32:64].all() and not written[:, :32].any()
            assert not written[:, 64:].any()
    np.testing.assert_array_equal(as_float32(pieces, rows * width), as_float32(whole, rows * width))


@pytest.mark.parametrize("queries", [range(16, 32), range(0, 20), range(32, 32)])
def test_attention_refuses_queries_off_the_blocks(queries) -> None:
    device = sim_device("forward")
    buffer = float_buffer(device, 40 * 3 * 16)
    with pytest.raises(ValueError, match="32-row blocks"):
        run(device, lambda g: record_attention(g, device, buffer, buffer, 1, 40, 1, 16, queries))
