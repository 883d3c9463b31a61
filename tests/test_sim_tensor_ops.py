"""The sim's emulation of Metal 4 tensor ops (`mpp::tensor_ops::matmul2d`,
csrc/sim/include/lily_sim_tensor_ops.h) on the test kernel tests/sim_kernels/tensor_ops.metal: a
product against numpy and the product counter, and the misuses it must refuse as Apple's
documentation does (shapes, layouts, the execution scope) or as the checking sim does for any
kernel (a missing barrier, an accumulator never zeroed); and, at compile time, the operand types
Apple's macOS 26.2 header refuses (csrc/sim/tensor_ops_declarations.py holds its table)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, as_float32, float_buffer, sim_device
from sim_compile import OPERAND_TYPES, sim_compile

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


# A kernel for the sim's compile alone (never run): a 32 x 64 x 64 product of tensors over
# LEFT and RIGHT elements into a destination made for MADE_LEFT x MADE_RIGHT operands.
TYPED_MATMUL = """
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

[[kernel]] void typed_matmul(LEFT* a [[buffer(0)]], RIGHT* b [[buffer(1)]],
                             device float* out [[buffer(2)]]) {
  constexpr auto desc = matmul2d_descriptor(32, 64, 64, false, true, false,
                                            matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto a_tensor = tensor(a, dextents<int32_t, 2>(64, 32));
  auto b_tensor = tensor(b, dextents<int32_t, 2>(64, 64));
  auto made_left = tensor((device MADE_LEFT*)nullptr, dextents<int32_t, 2>(64, 32));
  auto made_right = tensor((device MADE_RIGHT*)nullptr, dextents<int32_t, 2>(64, 64));
  auto acc =
      op.get_destination_cooperative_tensor<decltype(made_left), decltype(made_right), float>();
  op.run(a_tensor, b_tensor, acc);
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) out[i] = acc[i];
  }
}
"""


def typed_matmul_errors(tmp_path, left: str, right: str, made_left: str, made_right: str):
    source = tmp_path / "typed_matmul.metal"
    types = {"MADE_LEFT": made_left, "MADE_RIGHT": made_right, "LEFT": left, "RIGHT": right}
    text = TYPED_MATMUL
    for name, value in types.items():
        text = text.replace(name, value)
    source.write_text(text)
    return [error.message for error in sim_compile(source, tmp_path)]


def test_legal_mixed_operands_compile(tmp_path):
    """half x bfloat into float is a row of Apple's table: the emulation takes it when the
    destination was made for those operand types, in that order."""
    assert typed_matmul_errors(tmp_path, "device half", "device bfloat", "half", "bfloat") == []


@pytest.mark.parametrize(
    ("left", "right", "made_left", "made_right", "refusal"),
    [
        # The operands swapped against the destination's (the mistake llama.cpp's M5 kernels
        # made): Apple's header static_asserts "Input types must match cooperative tensor types".
        ("device bfloat", "device half", "half", "bfloat", "Input types must match"),
        ("device half", "device half", "half", "bfloat", "Input types must match"),
        # A const operand: the destination records its value type (half), run compares its
        # element type (const half), and Apple's header refuses it with the same message.
        ("device const half", "device half", "const half", "half", "Input types must match"),
        ("constant half", "device half", "half", "half", "Input types must match"),
    ],
)
def test_the_sim_refuses_what_apples_header_refuses(
    tmp_path, left, right, made_left, made_right, refusal
):
    errors = typed_matmul_errors(tmp_path, left, right, made_left, made_right)
    assert any(refusal in message for message in errors), errors


def test_the_sims_operand_types_are_apples_table(tmp_path):
    """Every float/half/bfloat (A, B, C) combination, one per line: the sim refuses exactly those
    outside the table tools/check_macos_build.py --mpp-headers holds Apple's header to."""
    kinds = ("float", "half", "bfloat")
    combinations = [(a, b, c) for a in kinds for b in kinds for c in kinds]
    lines = [
        "#include <metal_stdlib>",
        "#include <metal_tensor>",
        "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>",
        "using namespace metal;",
        "using namespace mpp::tensor_ops;",
        "[[kernel]] void every_type(device float* f [[buffer(0)]], device half* h [[buffer(1)]],",
        "                           device bfloat* b [[buffer(2)]]) {",
        "  constexpr auto desc = matmul2d_descriptor(32, 64, 64);",
        "  matmul2d<desc, execution_simdgroups<4>> op;",
        "  auto float_tensor = tensor(f, dextents<int32_t, 2>(64, 64));",
        "  auto half_tensor = tensor(h, dextents<int32_t, 2>(64, 64));",
        "  auto bfloat_tensor = tensor(b, dextents<int32_t, 2>(64, 64));",
    ]
    first = len(lines) + 1
    lines += [
        f"  op.get_destination_cooperative_tensor<decltype({a}_tensor), "
        f"decltype({b}_tensor), {c}>();"
        for a, b, c in combinations
    ]
    lines.append("}")
    source = tmp_path / "every_type.metal"
    source.write_text("\n".join(lines) + "\n")
    refused = {
        combinations[note.line - first]
        for error in sim_compile(source, tmp_path)
        if "outside Apple's table" in error.message
        for note in error.notes
        if note.path.endswith(source.name) and note.line >= first
    }
    assert refused == set(combinations) - OPERAND_TYPES
