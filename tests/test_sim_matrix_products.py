"""The sim's count of simdgroup-matrix products (Device.matrix_products), against kernels whose
count follows from their shapes by arithmetic: a test kernel issuing each operand type a known
number of times, and the fp32 GEMM tile."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import as_float32, float_buffer, run, sim_device

from lily.device import Graph, MatrixProducts, open_device
from lily.kernels.gemm import record_gemm_nt


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
