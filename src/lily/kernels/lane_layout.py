"""The lane-layout self-test (`metal/lane_layout.metal`): does the GPU lay out simdgroup_matrix
fragments the way the kernels assume (`fragment_row`, `fragment_col` in metal/common.h)?

Apple documents no layout; the kernels use the empirical one (which MLX relies on too) to fill
fragments lane by lane and read results back, so a GPU that differs would make decode attention
and other kernels compute wrong results, not fail. `lily.load` runs this on the metal device
before it loads any weights (and refuses the GPU, or with device "auto" falls back to the sim),
and `lily doctor` reports it: one dispatch of one SIMD-group, compared exactly with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lily.device import Graph
from lily.kernels import BufferRef, binding

if TYPE_CHECKING:
    from lily.device import Device

THREADS = 32
# Operand types the kernel multiplies, in the order of its outputs.
OPERAND_TYPES = ("float", "half")
ELEMENTS = 64  # of an 8x8 fragment
# Lanes or products named in a report before "...".
SHOWN = 3


def record_lane_layout_self_test(
    graph: Graph,
    device: Device,
    inputs: BufferRef,
    products: BufferRef,
    held: BufferRef,
    expected: BufferRef,
) -> None:
    """`inputs`: A, B and C as float32 [3, 8, 8]. Writes `products` float32 [2, 8, 8] (A B + C
    with float, then half operands, through common.h's layout), `held` float32 [2, 32, 2] (the
    element r * 8 + c that simdgroup_load put in each lane's thread_elements()[i], per operand
    type) and `expected` uint32 [32, 2] (the element common.h says that is)."""
    graph.dispatch(
        device.kernel("lane_layout_self_test"),
        threadgroups=1,
        threads=THREADS,
        buffers={
            0: binding(inputs),
            1: binding(products),
            2: binding(held),
            3: binding(expected),
        },
    )


def self_test_inputs() -> np.ndarray:
    """A, B, C [3, 8, 8]: small integers (every operand exact in half, every product and sum in
    float32) with A B != B A, so that even a transposed layout changes the product; the layout
    readout (`held`) shows any other difference."""
    index = np.arange(ELEMENTS, dtype=np.float32).reshape(8, 8)
    a = (index * 5) % 17 - 8
    b = (index * 7) % 19 - 9
    c = (index * 3) % 11 - 5
    return np.stack([a, b, c]).astype(np.float32)


def reference_products(inputs: np.ndarray) -> np.ndarray:
    """A B + C in float64 for each operand type: the same for both, since every input is exact
    in half."""
    a, b, c = (m.astype(np.float64) for m in inputs)
    return np.stack([a @ b + c] * len(OPERAND_TYPES))


@dataclass(frozen=True)
class LaneLayoutResult:
    """What one run of the self-test kernel wrote (shapes as `record_lane_layout_self_test`)."""

    inputs: np.ndarray
    products: np.ndarray
    held: np.ndarray
    expected: np.ndarray

    def mismatch(self) -> str | None:
        """None when the GPU's layout is common.h's and the products are numpy's; otherwise
        what differed, as a sentence that continues 'the GPU "<name>" '."""
        differences = []
        for t, operand in enumerate(OPERAND_TYPES):
            wrong = np.argwhere(self.held[t] != self.expected)
            if len(wrong):
                lanes = [
                    f"lane {lane} element {i} holds {_position(self.held[t, lane, i])}, not "
                    f"{_position(self.expected[lane, i])}"
                    for lane, i in wrong[:SHOWN]
                ]
                more = ", ..." if len(wrong) > SHOWN else ""
                differences.append(
                    f"{operand} fragments: {len(wrong)} of {ELEMENTS} elements elsewhere "
                    f"({'; '.join(lanes)}{more})"
                )
        expected_products = reference_products(self.inputs)
        for t, operand in enumerate(OPERAND_TYPES):
            wrong = np.argwhere(self.products[t] != expected_products[t])
            if len(wrong):
                row, col = wrong[0]
                differences.append(
                    f"the {operand}-operand product A B + C through those helpers differs from "
                    f"numpy's in {len(wrong)} of {ELEMENTS} elements (at row {row}, column "
                    f"{col}: {self.products[t, row, col]:g}, expected "
                    f"{expected_products[t, row, col]:g})"
                )
        if not differences:
            return None
        return (
            "lays out simdgroup_matrix fragments differently from what Lily's kernels assume "
            "(fragment_row and fragment_col in metal/common.h), so decode attention and other "
            f"kernels would compute wrong results: {'; '.join(differences)}"
        )


def _position(element: float) -> str:
    if not (np.isfinite(element) and element == int(element) and 0 <= element < ELEMENTS):
        return f"the value {element:g}, no element of the matrix"
    row, col = divmod(int(element), 8)
    return f"(row {row}, column {col})"


def run_lane_layout_self_test(device: Device) -> LaneLayoutResult:
    """Runs the self-test kernel once on `device` and returns its outputs."""
    inputs = self_test_inputs()
    count = len(OPERAND_TYPES) * ELEMENTS
    products = device.scratch(4 * count)
    held = device.scratch(4 * count)
    expected = device.scratch(4 * ELEMENTS)
    graph = Graph()
    record_lane_layout_self_test(graph, device, device.wrap(inputs), products, held, expected)
    device.run(graph)
    types = len(OPERAND_TYPES)
    return LaneLayoutResult(
        inputs,
        products.numpy().view(np.float32).reshape(types, 8, 8).copy(),
        held.numpy().view(np.float32).reshape(types, THREADS, 2).copy(),
        expected.numpy().view(np.uint32).reshape(THREADS, 2).copy(),
    )
