"""The sim's count of simdgroup-matrix products (Device.matrix_products), against kernels whose
count follows from their shapes by arithmetic: a test kernel issuing each operand type a known
number of times, the fp32 GEMM tile, and the quantized GEMMs, whose grouped form sizes each
expert's tiles by its number of assignments (8, 16, 32 or 64 rows); and a prefill chunk of the
engine, whose GEMMs all multiply half operands."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import as_float32, float_buffer, random_quantized, run, sim_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.device import Graph, MatrixProducts, open_device
from lily.engine.model_graph import ModelGraph
from lily.kernels.gemm import record_gemm_nt
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized_gemm import grouped_tile_tokens, record_qgemm, record_qgemm_grouped


# Per stage of 32 inputs a SIMD-group of the quantized GEMM multiplies 4 depth steps of
# (tokens / 8) x 4 fragments; a threadgroup has 4 SIMD-groups.
def qgemm_products(tile_tokens: int, in_dim: int) -> int:
    return 4 * (in_dim // 32) * 4 * (tile_tokens // 8) * 4


@pytest.mark.parametrize("lane_order", ["forward", "random"])
def test_products_by_operand_type(lane_order):
    device = sim_device(lane_order)
    device.matrix_products()  # what earlier tests left
    rounds, groups, simdgroups = 3, 5, 2
    out = float_buffer(device, groups * simdgroups * 64)
    graph = Graph()
    graph.dispatch(
        device.kernel("test_matrix_products_by_type"),
        threadgroups=groups,
        threads=32 * simdgroups,
        buffers={1: out},
        bytes={0: np.uint32(rounds).tobytes()},
    )
    device.run(graph)
    np.testing.assert_array_equal(as_float32(out, groups * simdgroups * 64), 7 * 8 * rounds)
    per_simdgroup = groups * simdgroups * rounds
    assert device.matrix_products() == {
        "test_matrix_products_by_type": MatrixProducts(
            fp32=2 * per_simdgroup, half=2 * per_simdgroup, bfloat=3 * per_simdgroup
        )
    }
    assert device.matrix_products() == {}, "a second call starts from zero"


def test_gemm_nt_counts_fp32_products():
    """32x32 tiles of 4 SIMD-groups, each 2x2 fragments per 8 of depth."""
    device = open_device("sim")
    m, n, k = 37, 70, 40
    a = np.ones((m, k), np.float32)
    b = np.ones((n, k), np.float32)
    c = float_buffer(device, m * n)
    run(device, lambda g: record_gemm_nt(g, device, device.wrap(a), device.wrap(b), c, m, n, k))
    tiles = 2 * 3  # ceil(37 / 32) x ceil(70 / 32)
    stages = 3  # ceil(40 / 16), two depth steps of 8 each
    assert device.matrix_products() == {
        "gemm_nt_float": MatrixProducts(fp32=tiles * stages * 4 * 2 * 2 * 2)
    }


@pytest.mark.parametrize(
    ("tokens", "tile_tokens", "bits"), [(1, 8, 4), (16, 16, 8), (40, 16, 4), (300, 64, 8)]
)
def test_dense_qgemm_counts(tokens, tile_tokens, bits):
    """The dense GEMM's token tile follows the chunk's length (at most a quarter padded); its
    products are half's, at either bit width."""
    device = open_device("sim")
    rng = np.random.default_rng(tokens)
    in_dim, rows = 64, [200, 40]
    x = rng.normal(0, 1, (tokens, in_dim)).astype(np.float32)
    weights = [wrap_quant_weight(device, *random_quantized(rng, r, in_dim, bits)) for r in rows]
    projections = [(w, float_buffer(device, tokens * w.rows)) for w in weights]
    run(device, lambda g: record_qgemm(g, device, device.wrap(x), projections, tokens))
    weight_tiles = 2 + 1  # ceil(200 / 128) + ceil(40 / 128)
    token_tiles = -(-tokens // tile_tokens)
    expected = token_tiles * weight_tiles * qgemm_products(tile_tokens, in_dim)
    assert device.matrix_products() == {
        f"qgemm_{bits}_{tile_tokens}": MatrixProducts(half=expected)
    }


def test_grouped_tiles_follow_each_experts_count():
    """Experts of 0, 1, 8, 9, 17, 33, 49, 57, 64 and 130 assignments: no tile; tiles of 8; 8; 16;
    16+8; 32+8; 32+16+8; 64; 64; 64+64+8 rows (the rest past whole 64s rounded up to 8 rows and
    cut into 32, 16 and 8). With SwiGLU a tile is 64 output columns, without 128."""
    device = open_device("sim")
    rng = np.random.default_rng(7)
    counts = [0, 1, 8, 9, 17, 33, 49, 57, 64, 130]
    tile_rows = [0, 8, 8, 16, 16 + 8, 32 + 8, 32 + 16 + 8, 64, 64, 64 + 64 + 8]
    tiles_by_size = {8: 6, 16: 3, 32: 2, 64: 4}
    experts, in_dim, rows = len(counts), 64, 72
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    assignments = int(offsets[-1])
    x = rng.normal(0, 1, (assignments, in_dim)).astype(np.float32)
    gate, up = (
        wrap_quant_weight(device, *random_quantized(rng, rows, in_dim, 4, experts)) for _ in "gu"
    )
    out = float_buffer(device, assignments * rows)
    # ceil(72 / 64) column tiles with SwiGLU, ceil(72 / 128) without.
    for weights, column_tiles, kernel in (
        ([gate, up], 2, "qgemm_grouped_swiglu_4"),
        ([gate], 1, "qgemm_grouped_4"),
    ):
        run(
            device,
            lambda g, weights=weights: record_qgemm_grouped(
                g, device, device.wrap(x), weights, out, device.wrap(offsets), None, assignments
            ),
        )
        expected = column_tiles * sum(
            n * qgemm_products(size, in_dim) for size, n in tiles_by_size.items()
        )
        assert device.matrix_products() == {kernel: MatrixProducts(half=expected)}
    # The host's mirror of the cut, which the benchmarks' estimates use, agrees.
    assert [sum(grouped_tile_tokens(n)) for n in counts] == tile_rows
    # Executed rows exceed the assignments by at most 7 per expert.
    assert sum(tile_rows) == sum(n * size for size, n in tiles_by_size.items())
    assert all(0 <= r - c <= 7 for r, c in zip(tile_rows[1:], counts[1:], strict=True))


def test_a_prefill_chunks_gemms_multiply_half_operands():
    """Every quantized GEMM of a chunk (dense 4- and 8-bit, grouped) counts half products and
    nothing else; the range guard's exponents come before each mixer output projection and
    each MoE block's two down projections, three per layer."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config
    tokens = 40
    model = ModelGraph(checkpoint, open_device("sim"), 64, c.vocab_size, tokens)
    history, step = model.history_view(), model.step_view()
    prompt = np.random.default_rng(8).integers(0, c.vocab_size, tokens).tolist()
    history[:tokens] = prompt
    step[:3] = 0, tokens, prompt[0]
    graph = model.graph(tokens, predicts=True)
    model.device.matrix_products()  # from zero
    model.device.run(graph)
    counted = model.device.matrix_products()
    gemms = {kernel: p for kernel, p in counted.items() if kernel.startswith("qgemm")}
    assert {"qgemm_4_", "qgemm_8_", "qgemm_grouped_swiglu_", "qgemm_grouped_"} <= {
        kernel.rstrip("0123456789") for kernel in gemms
    }
    for kernel, products in gemms.items():
        assert products == MatrixProducts(half=products.half), kernel
        assert products.half > 0, kernel
    names = [d.kernel for d in graph.dispatches]
    assert names.count("qgemm_row_exponents") == 3 * c.num_hidden_layers
