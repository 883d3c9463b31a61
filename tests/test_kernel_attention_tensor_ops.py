"""The tensor-op chunk attention (`metal/attention_tensor_ops.metal`: attention_chunk_queries and
attention_chunk_tensor) on the sim's emulation of Metal 4 tensor ops, against float64: at ragged
chunk lengths (rows not a multiple of the 64-row tile, contexts not of the 32-key tile), prefix
offsets and GQA groups of 1, 2, 3 and 8 query heads per kv head, under the three lane orders (the
random one on the checking sim). The engine's prefill on tensor ops is checked in
test_prefill.py."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device
from test_kernel_attention import (
    CHUNK_ATOL,
    CHUNK_RTOL,
    GROUP_OF_3,
    HEAD_DIM,
    REAL,
    TINY,
    ChunkCase,
    _bf16,
    _f64,
    _step_buffer,
)

from lily.device import Graph, MatrixProducts
from lily.kernels.attention import (
    TENSOR_CHUNK_ROWS,
    TENSOR_CHUNK_TILE_KEYS,
    chunk_attention_on_tensor_ops,
    packed_queries_bytes,
    record_attention_chunk,
    row_bytes,
)


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param, tensor_ops=True)


@pytest.mark.parametrize(
    ("heads", "tokens", "position"),
    [
        (TINY, 1, 0),
        (TINY, 7, 13),
        # 69 rows: the second threadgroup holds 5 rows, and a token's group straddles the tiles.
        (GROUP_OF_3, 23, 41),
        (REAL, 13, 5),
        # 8 whole threadgroups, the context (164 keys) ending inside a tile.
        (REAL, 64, 100),
        (REAL, 300, 37),
        # One query head per kv head: 513 rows, a context of 813 keys.
        ((2, 1), 513, 300),
    ],
)
def test_tensor_chunk_matches_reference(device, heads: tuple[int, int], tokens: int, position):
    case = ChunkCase(heads, tokens, position, seed=tokens + position)
    case.run(device)
    np.testing.assert_allclose(case.out[:tokens], case.expected(), rtol=CHUNK_RTOL, atol=CHUNK_ATOL)
    assert np.all(np.isnan(case.out[tokens]))


@pytest.mark.parametrize(
    ("heads", "tokens", "position"), [(TINY, 7, 13), (REAL, 64, 100), ((2, 1), 513, 300)]
)
def test_tensor_chunk_rounds_where_the_modelling_reference_does(
    heads: tuple[int, int], tokens: int, position: int
) -> None:
    """reference.attention_in_tiles with 32-key tiles rounds where the tensor-op kernel does
    (Q and K half, each tile's weights bfloat under the running maximum): its outputs sit far
    closer to that model than to exact attention, as attention_chunk's do to its 16-key one."""
    case = ChunkCase(heads, tokens, position, seed=tokens + position)
    case.run(sim_device("forward", tensor_ops=True))
    modelled = case.expected(in_tiles=True, tile_keys=TENSOR_CHUNK_TILE_KEYS)
    exact_error = np.abs(case.out[:tokens] - case.expected())
    modelled_error = np.abs(case.out[:tokens] - modelled)
    assert np.median(modelled_error) < 1e-2 * np.median(exact_error)
    assert np.quantile(modelled_error, 0.99) < 2e-5


def test_tensor_chunk_holds_values_past_half_range(device) -> None:
    """Values of ~1e6 (past half's 65504): P V's bfloat operands take them exactly."""
    magnitude = 2.0**20
    case = ChunkCase(TINY, 7, 13, seed=3)
    case.v_cache = _bf16(_f64(case.v_cache) * magnitude)
    case.run(device)
    np.testing.assert_allclose(
        case.out[:7] / magnitude, case.expected() / magnitude, rtol=CHUNK_RTOL, atol=CHUNK_ATOL
    )


def _record(device, heads, tokens, position, kv_cache="bf16", packed=True) -> Graph:
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
        packed_queries=device.alloc(packed_queries_bytes(num_q, num_kv, tokens))
        if packed
        else None,
    )
    return graph


@pytest.mark.parametrize(
    ("heads", "tokens", "position", "tiles"),
    [
        # 14 rows, one threadgroup per kv head, a context of 20 keys: one tile.
        (TINY, 7, 13, 1),
        # 128 rows, two threadgroups per kv head, whose last tokens see 18 and 26 keys: one tile.
        (REAL, 16, 10, 2),
        # 64 rows of 8 tokens from position 60: the threadgroup's last token sees 68 keys, 3 tiles.
        (REAL, 8, 60, 3),
    ],
)
def test_tensor_chunk_products_are_tensor_ops(
    heads: tuple[int, int], tokens: int, position: int, tiles: int
) -> None:
    """Every product is a tensor-op one: per threadgroup and 32-key tile, S (64 x 32 x 256) and
    P V (64 x 256 x 32), 64 x 32 x 256 / 512 = 1,024 units of 8x8x8 each; no tile past the
    threadgroup's last token."""
    device = sim_device("forward", tensor_ops=True)
    graph = _record(device, heads, tokens, position)
    device.matrix_products()  # what earlier runs left
    device.run(graph)
    per_tile = 2 * TENSOR_CHUNK_ROWS * TENSOR_CHUNK_TILE_KEYS * HEAD_DIM // 512
    expected = heads[1] * tiles * per_tile
    assert device.matrix_products() == {
        "attention_chunk_tensor": MatrixProducts(tensor_op=expected)
    }


def test_int8_cache_keeps_the_simdgroup_kernel() -> None:
    device = sim_device("forward", tensor_ops=True)
    assert chunk_attention_on_tensor_ops(device, "bf16")
    assert not chunk_attention_on_tensor_ops(device, "int8")
    assert not chunk_attention_on_tensor_ops(sim_device("forward"), "bf16")
    graph = _record(device, TINY, 7, 13, kv_cache="int8", packed=False)
    device.matrix_products()
    device.run(graph)
    assert list(device.matrix_products()) == ["attention_chunk_int8"]


def test_tensor_chunk_needs_its_packed_queries() -> None:
    device = sim_device("forward", tensor_ops=True)
    with pytest.raises(ValueError, match="packed_queries"):
        _record(device, TINY, 7, 13, packed=False)
    num_q, num_kv = REAL
    # 13 tokens of 8 heads: 104 rows, padded to 128 per kv head, in half.
    assert packed_queries_bytes(num_q, num_kv, 13) == 2 * num_kv * 128 * HEAD_DIM
