"""What Lily's tensor-op kernels (metal/quantized_gemm_tensor_ops.metal and
metal/attention_tensor_ops.metal) take from Apple's
MetalPerformancePrimitives headers, as the sim emulates it (include/lily_sim_tensor_ops.h): the
one table of it. tools/check_macos_build.py --mpp-headers checks each entry against a copy of a
macOS 26 SDK's headers; tests/test_sim_tensor_ops.py holds the sim's emulation to the operand
types.

Read from the macOS 26.2 SDK's MPPTensorOpsMatMul2d.h and __impl/MPPTensorOpsMatMul2dImpl.h.
The tensor, extents and cooperative-tensor types themselves (metal::tensor, dextents,
tensor_inline, cooperative_tensor's get_capacity/is_valid_element/get_multidimensional_index,
execution_simdgroups) come from <metal_tensor>, which ships with the Metal compiler, not the SDK:
no copy of it is checked here."""

from __future__ import annotations

from dataclasses import dataclass

MATMUL2D_HEADER = "MPPTensorOpsMatMul2d.h"
MATMUL2D_IMPL = "MPPTensorOpsMatMul2dImpl.h"


@dataclass(frozen=True)
class Declaration:
    """One thing the kernels rely on: `pattern` (a regular expression, matched with every run of
    whitespace in the header made one space) must occur in `header`."""

    what: str
    header: str
    pattern: str


# (A, B, C) rows of Apple's table of matmul2d operand types, as far as float, half and bfloat go
# (the int8 rows are not emulated). The GEMMs use half x half -> float; chunk attention that for
# S = Q K^T and bfloat x bfloat -> float for O += P V.
OPERAND_TYPES: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("half", "half", "half"),
        ("half", "half", "float"),
        ("half", "float", "float"),
        ("float", "half", "float"),
        ("float", "float", "float"),
        ("bfloat", "bfloat", "bfloat"),
        ("bfloat", "bfloat", "float"),
        ("bfloat", "float", "float"),
        ("float", "bfloat", "float"),
        ("bfloat", "half", "bfloat"),
        ("bfloat", "half", "half"),
        ("bfloat", "half", "float"),
        ("half", "bfloat", "bfloat"),
        ("half", "bfloat", "half"),
        ("half", "bfloat", "float"),
    }
)
KERNEL_OPERAND_TYPES: tuple[tuple[str, str, str], ...] = (
    ("half", "half", "float"),
    ("bfloat", "bfloat", "float"),
)

DECLARATIONS: tuple[Declaration, ...] = (
    Declaration(
        "matmul2d_descriptor's fields, in this order and of these types",
        MATMUL2D_HEADER,
        r"struct matmul2d_descriptor \{ enum class mode \{ multiply, multiply_accumulate, \}; "
        r"int m, n, k; bool transpose_left, transpose_right; bool relaxed_precision; "
        r"mode matmul_mode;",
    ),
    Declaration(
        "matmul2d_descriptor(m, n, k, transpose_left, transpose_right, relaxed_precision, mode)",
        MATMUL2D_HEADER,
        r"constexpr matmul2d_descriptor\(int __m, int __n, int __k = [^,]+, "
        r"bool __transpose_left = false, bool __transpose_right = false, "
        r"bool __relaxed_precision = false, mode __matmul_mode = mode::multiply\)",
    ),
    Declaration(
        "matmul2d<descriptor, scope>: a descriptor value and an execution scope",
        MATMUL2D_HEADER,
        r"template <matmul2d_descriptor Descriptor, typename Scope, class\.\.\. Args> "
        r"class matmul2d\b",
    ),
    Declaration(
        "run(left, right, destination) takes its operands by non-const reference",
        MATMUL2D_HEADER,
        r"void run\(thread LeftOperandType &left, thread RightOperandType &right, "
        r"thread DestinationOperandType &destination\) thread const",
    ),
    Declaration(
        "get_destination_cooperative_tensor<left tensor, right tensor, element type>()",
        MATMUL2D_HEADER,
        r"template <typename LeftOperandType, typename RightOperandType, "
        r"typename ElementType, typename CoordType = int,(?:(?!template <).)*"
        r"get_destination_cooperative_tensor\(\) thread const",
    ),
    Declaration(
        "the destination records its operands' value types (without const)",
        MATMUL2D_IMPL,
        r"__cooperative_tensor_destination_t = __cooperative_tensor_t<descriptor, "
        r"__matmul2d_cooperative_operand_index::destination, scope, typename "
        r"__tensor_ops_detail::__remove_addrspace_t<__tensor_ops_detail::__remove_reference_t"
        r"<left_operand>>::value_type,",
    ),
    Declaration(
        "run compares its operands' element types (with const) against them",
        MATMUL2D_IMPL,
        r"using leftValueType = __tensor_ops_detail::__remove_addrspace_t< "
        r"__tensor_ops_detail::__remove_reference_t< typename leftTensorType::element_type>>;",
    ),
    Declaration(
        "and refuses operands of other types than the destination was made for",
        MATMUL2D_IMPL,
        r"static_assert\(__tensor_ops_detail::__is_same_v<_leftType, leftValueType>, "
        r"\"Input types must match cooperative tensor types\"\);",
    ),
    Declaration(
        "tensors are indexed by int",
        MATMUL2D_IMPL,
        r"__is_same_v<typename leftTensorType::index_type, int>, \"Index type must be int\"",
    ),
    Declaration(
        "threadgroup half x threadgroup half into a cooperative float destination",
        MATMUL2D_IMPL,
        r"__tensorops_impl_matmul2d_op_run_cooperative_tg_f16_tg_f16_f32\(",
    ),
    Declaration(
        "device half x threadgroup half into a cooperative float destination (chunk attention's "
        "S = Q K^T: the packed queries are read from device memory)",
        MATMUL2D_IMPL,
        r"__tensorops_impl_matmul2d_op_run_cooperative_dv_f16_tg_f16_f32\(",
    ),
    Declaration(
        "threadgroup bfloat x threadgroup bfloat into a cooperative float destination (chunk "
        "attention's O += P V)",
        MATMUL2D_IMPL,
        r"__tensorops_impl_matmul2d_op_run_cooperative_tg_b16_tg_b16_f32\(",
    ),
    Declaration(
        "a destination cooperative tensor's accessors (capacity, validity, coordinates)",
        MATMUL2D_IMPL,
        r"static uint16_t get_capacity\(const_thread_storage_t storage\).*"
        r"static bool is_valid_element\(const_thread_storage_t storage, index_t idx\).*"
        r"get_multidimensional_index\(const_thread_storage_t storage, index_t idx\)",
    ),
)
