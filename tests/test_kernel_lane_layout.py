"""The lane-layout self-test (`metal/lane_layout.metal`, lily.kernels.lane_layout) on the sim.

On Apple's layout (the sim's, under the three lane orders) its products equal numpy's exactly
and every lane holds the elements Apple's layout gives it, written out here from the spec
(devices.md) rather than taken from common.h. On a sim playing a GPU with another layout
(`matrix_lanes`) it reports which lanes hold which elements; that GPU is a consistent one, on
which a kernel that only uses simdgroup_load/store stays right while one that fills fragments
lane by lane goes wrong, which is what the self-test protects.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, as_float32, float_buffer, run, sim_device

from lily.device import open_device
from lily.diagnostics.doctor import run_check
from lily.diagnostics.kernel_checks import CHECKS
from lily.kernels.gemm import record_gemm_nt
from lily.kernels.lane_layout import (
    OPERAND_TYPES,
    run_lane_layout_self_test,
    self_test_inputs,
)

# A GPU on which lanes 5 and 6 trade their elements.
SWAPPED = [6 if lane == 5 else 5 if lane == 6 else lane for lane in range(32)]
# One on which every lane holds the elements of lane 31 - l.
MIRRORED = [31 - lane for lane in range(32)]


def apple_elements() -> np.ndarray:
    """[32, 2]: the element (row * 8 + column) lane l holds as thread_elements()[i] in Apple's
    layout: row ((l / 4) & 4) + (l / 2) % 4, columns ((l / 4) & 2) * 2 + (l % 2) * 2 and +1."""
    lane = np.arange(32)
    row = ((lane // 4) & 4) + (lane // 2) % 4
    col = ((lane // 4) & 2) * 2 + (lane % 2) * 2
    return np.stack([row * 8 + col, row * 8 + col + 1], axis=1)


@pytest.fixture(scope="module")
def swapped():
    return open_device("sim", matrix_lanes=SWAPPED)


def test_apple_s_layout_puts_every_element_in_exactly_one_lane():
    assert sorted(apple_elements().ravel()) == list(range(64))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_the_self_test_passes_on_apple_s_layout(lane_order):
    result = run_lane_layout_self_test(sim_device(lane_order))
    a, b, c = result.inputs.astype(np.float64)
    for t in range(len(OPERAND_TYPES)):
        np.testing.assert_array_equal(result.products[t], a @ b + c)
        np.testing.assert_array_equal(result.held[t], apple_elements())
    np.testing.assert_array_equal(result.expected, apple_elements())
    assert result.mismatch() is None


def test_the_inputs_catch_a_transposed_layout_too():
    # A GPU holding the transpose of each fragment would compute (A^T B^T + C^T)^T = B A + C.
    a, b, c = self_test_inputs().astype(np.float64)
    assert np.count_nonzero(b @ a + c != a @ b + c) == 64


def test_a_gpu_that_swaps_two_lanes_is_caught(swapped):
    result = run_lane_layout_self_test(swapped)
    message = result.mismatch()
    assert message is not None
    # Lane 5 holds Apple's lane 6 elements, (3, 0) and (3, 1), where common.h says (2, 2), (2, 3).
    for operand in OPERAND_TYPES:
        assert (
            f"{operand} fragments: 4 of 64 elements elsewhere (lane 5 element 0 holds (row 3, "
            "column 0), not (row 2, column 2); lane 5 element 1 holds (row 3, column 1), not "
            "(row 2, column 3); lane 6 element 0 holds (row 2, column 2), not (row 3, column 0), "
            "...)"
        ) in message
        assert f"the {operand}-operand product A B + C through those helpers differs" in message
    assert "metal/common.h" in message and "decode attention" in message
    np.testing.assert_array_equal(result.expected, apple_elements())


def test_a_wrong_product_alone_is_reported():
    good = run_lane_layout_self_test(sim_device("forward"))
    products = good.products.copy()
    products[1, 2, 3] += 1
    message = dataclasses.replace(good, products=products).mismatch()
    assert (
        "the half-operand product A B + C through those helpers differs from numpy's in 1 of 64 "
        f"elements (at row 2, column 3: {products[1, 2, 3]:g}, expected {good.products[1, 2, 3]:g})"
    ) in message
    assert "fragments:" not in message


def test_a_gpu_whose_every_lane_differs_is_caught():
    result = run_lane_layout_self_test(open_device("sim", matrix_lanes=MIRRORED))
    assert "64 of 64 elements elsewhere" in result.mismatch()
    assert np.all(result.held[0] == apple_elements()[::-1])


def test_the_swapped_gpu_is_consistent_so_load_store_kernels_stay_right(swapped):
    # gemm_nt uses only simdgroup_load, multiply and simdgroup_store: any layout suits it.
    rng = np.random.default_rng(0)
    m, n, k = 32, 32, 16
    a = rng.integers(-4, 5, (m, k)).astype(np.float32)
    b = rng.integers(-4, 5, (n, k)).astype(np.float32)
    c = float_buffer(swapped, m * n)
    run(
        swapped,
        lambda g: record_gemm_nt(g, swapped, swapped.wrap(a), swapped.wrap(b), c, m, n, k),
    )
    np.testing.assert_array_equal(as_float32(c, m * n).reshape(m, n), a @ b.T)


def test_on_the_swapped_gpu_decode_attention_is_wrong(swapped):
    (decode,) = [c for c in CHECKS if c.kernel == "attention_decode_fused+combine"]
    assert run_check(sim_device("forward"), decode).passed
    wrong = run_check(swapped, decode)
    assert wrong.error is None and not wrong.comparison.passed


def test_matrix_lanes_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation of 0..31"):
        open_device("sim", matrix_lanes=[0] * 32)
