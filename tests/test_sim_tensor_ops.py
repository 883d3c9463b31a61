"""The sim's emulation of Metal 4 tensor ops (`mpp::tensor_ops::matmul2d`,
csrc/sim/include/lily_sim_tensor_ops.h) on the test kernel tests/sim_kernels/tensor_ops.metal: a
product against numpy and the product counter, and the misuses it must refuse as Apple's
documentation does (shapes, layouts, the execution scope) or as the checking sim does for any
kernel (a missing barrier, an accumulator never zeroed)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, as_float32, float_buffer, sim_device

from lily.device import Graph, KernelError, MatrixProducts, open_device

M, N, K = 32, 64, 64


def run_matmul(device, mode: int, threads: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, (M, K)).astype(np.float16)
    b = rng.normal(0, 1, (N, K)).astype(np.float16)
    out = float_buffer(device, M * N)
    graph = Graph()
    graph.dispatch(
        device.kernel("test_tensor_matmul"),
        threadgroups=1,
        threads=threads,
        buffers={1: device.wrap(a), 2: device.wrap(b), 3: out},
        bytes={0: np.uint32(mode).tobytes()},
    )
    device.run(graph)
    return a, b, as_float32(out, M * N).reshape(M, N)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_matmul_against_numpy_and_counted(lane_order):
    """Half operands, fp32 sums: within K fp32 roundings of the exact product, every element
    written once (the layout covers C), and M N K / 512 products under tensor_op."""
    device = sim_device(lane_order)
    device.matrix_products()
    a, b, out = run_matmul(device, mode=0)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    assert np.all(np.abs(out - exact) <= K * np.finfo(np.float32).eps * magnitude)
    assert device.matrix_products() == {
        "test_tensor_matmul": MatrixProducts(tensor_op=M * N * K // 512)
    }


def test_wrong_extents_are_refused():
    """A right tensor of M rows where the descriptor says N: refused, not read in part."""
    with pytest.raises(KernelError, match="right tensor's extents"):
        run_matmul(open_device("sim"), mode=1)


def test_scope_must_be_the_whole_threadgroup():
    """execution_simdgroups<4> in a threadgroup of 2 SIMD-groups."""
    with pytest.raises(KernelError, match="execution_simdgroups"):
        run_matmul(open_device("sim"), mode=0, threads=64)


def test_missing_barrier_is_a_race():
    """The op does not synchronise SIMD-groups: without a barrier, a SIMD-group's product reads
    tile rows other SIMD-groups have not written yet (or races with their writes), which the
    checking sim reports."""
    with pytest.raises(KernelError, match="no thread has written|another SIMD-group"):
        run_matmul(open_device("sim", check=True, lane_order="random"), mode=2)


def test_unzeroed_accumulator_shows():
    """Destination elements start undefined (NaN here): accumulating into them without zeroing
    gives NaN, not a plausible product."""
    _, _, out = run_matmul(open_device("sim"), mode=3)
    assert np.all(np.isnan(out))
