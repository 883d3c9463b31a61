"""The Metal 4 tensor-op quantized GEMMs (`metal/quantized_gemm_tensor_ops.metal`), run on the
sim's emulation of matmul2d (a sim opened with ``tensor_ops=True``), against the same float64
reference as the simdgroup-matrix kernels (`test_kernel_quantized_gemm.py`: half operands, fp32
sums, the range guard's powers of two), under the three lane orders and the checked build; and
their product counts: every product a tensor op, none a simdgroup-matrix one."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, float_buffer, random_quantized, run, sim_device
from test_kernel_quantized_gemm import check_grouped, check_qgemm, random_choices

from lily.device import MatrixProducts
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized_gemm import BAND_TOKENS, record_qgemm


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "in_dim", "rows", "bits", "guarded"),
    [
        (1, 64, [40], 4, False),
        (7, 128, [72, 200], 8, True),
        (64, 192, [40, 1, 72], 4, False),
        (300, 64, [200, 40, 72, 8], 8, True),
    ],
)
def test_qgemm_tensor_ops(lane_order, tokens, in_dim, rows, bits, guarded):
    check_qgemm(lane_order, tokens, in_dim, rows, bits, guarded=guarded, tensor_ops=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_qgemm_tensor_ops_launch_bands(lane_order):
    """Two launch bands (16 and 2 tiles of 64 tokens) over three weight tiles, guarded."""
    check_qgemm(lane_order, BAND_TOKENS + 76, 64, [200, 72], 8, guarded=True, tensor_ops=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("bits", "swiglu"), [(4, True), (8, False)])
def test_grouped_tensor_ops_empty_experts(lane_order, bits, swiglu):
    """Experts 0, 2-4, 7 and 10 get nothing (their NaN scales must never be read)."""
    rng = np.random.default_rng(1)
    choices = random_choices(rng, 29, 2, np.array([1, 5, 6, 8, 9]))
    check_grouped(lane_order, choices, 11, 64, 40, bits, swiglu, spare_rows=3, tensor_ops=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_tensor_ops_one_expert_takes_all(lane_order, swiglu):
    """70 assignments of one expert: tiles of 64 and 8 (run as 32 rows)."""
    choices = np.full((70, 1), 3)
    check_grouped(lane_order, choices, 8, 128, 72, 4, swiglu, seed=2, tensor_ops=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_grouped_tensor_ops_tile_sizes_guarded(lane_order):
    """Experts of 0, 1, 9, 17, 49 and 130 assignments, each tile size, rows of any range."""
    counts = [0, 1, 9, 17, 49, 130]
    choices = np.repeat(np.arange(len(counts)), counts)[:, None]
    np.random.default_rng(6).shuffle(choices)
    check_grouped(
        lane_order,
        choices,
        len(counts),
        64,
        200,
        8,
        False,
        gather=False,
        seed=6,
        guarded=True,
        tensor_ops=True,
    )


def test_tensor_ops_count_only_tensor_products():
    """A 7-token chunk, in_dim 128, rows 72 and 200: one 32-row token tile times 1 + 2 weight
    tiles of 128 rows; per tile and 64 inputs two 32 x 64 x 64 products (512 8x8x8 units in all)."""
    device = sim_device("forward", tensor_ops=True)
    assert device.tensor_ops
    device.matrix_products()
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (7, 128)).astype(np.float32)
    projections = []
    for rows in (72, 200):
        weight = wrap_quant_weight(device, *random_quantized(rng, rows, 128, 4))
        projections.append((weight, float_buffer(device, 7 * rows)))
    run(device, lambda g: record_qgemm(g, device, device.wrap(x), projections, 7))
    weight_tiles, stages, products_per_stage = 3, 128 // 64, 2 * (32 * 64 * 64 // 512)
    assert device.matrix_products() == {
        "qgemm_tensor_4_32": MatrixProducts(tensor_op=weight_tiles * stages * products_per_stage)
    }


def test_qgemm_tensor_ops_4097_tokens():
    """65 tiles of 64 tokens, the last with one."""
    check_qgemm("random", 4097, 64, [24], 4, guarded=True, tensor_ops=True)
