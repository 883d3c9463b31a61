"""Launching the quantized GEMMs of batched prefill (`metal/quantized_gemm.metal`).

`record_qgemm` multiplies a chunk of tokens by up to four projections that share the input;
`record_qgemm_grouped` multiplies the MoE assignments of a chunk, sorted by expert, by their
experts' weights, optionally with the SwiGLU of a gate and an up projection fused. Both read fp32
activations [rows, in_dim] and write fp32 [rows, out_rows], row-major, and sum in fp32. Their
operands are fp32 (what the engine runs) or, at 4 bits, `operands="bfloat16"` or `"float16"`:
activations and dequantized weights rounded to bfloat or half in threadgroup memory
(metal/quantized_gemm.h says why the engine does not use them yet).

Tiles are 8, 16, 32 or 64 token rows by 128 weight rows. `dense_tile_tokens` picks the dense
GEMMs' size from the chunk's length; the grouped GEMM sizes each expert's tiles by its count on
the device, and `grouped_tile_tokens` says which tiles that gives (for estimates and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from lily.kernels import BufferRef, binding, ceil_div, pack_params, require_aligned
from lily.kernels.quant_weight import QuantWeight

if TYPE_CHECKING:
    from lily.device import Device, Graph

MAX_PROJECTIONS = 4
# Must match the tile sizes, QGEMM_WEIGHT_ROWS and QGEMM_THREADS in quantized_gemm.h.
TILE_TOKENS = (8, 16, 32, 64)
MAX_TILE_TOKENS = TILE_TOKENS[-1]
WEIGHT_ROWS_PER_TILE = 128
THREADS_PER_THREADGROUP = 128
OPERANDS = ("float32", "bfloat16", "float16")
# The dense GEMMs take the largest token tile that pads a chunk by at most this fraction.
MAX_DENSE_PADDING = 0.25


def dense_tile_tokens(tokens: int) -> int:
    """Token rows per tile of the dense GEMMs for a chunk of `tokens`: the largest of 8, 16, 32
    and 64 whose padding of the last tile is at most a quarter of the chunk (8 otherwise)."""
    for size in reversed(TILE_TOKENS):
        if ceil_div(tokens, size) * size <= (1 + MAX_DENSE_PADDING) * tokens:
            return size
    return TILE_TOKENS[0]


def grouped_tile_tokens(assignments: int) -> list[int]:
    """The tiles (their token rows, in order) the grouped GEMM gives an expert with
    `assignments` rows, as qgemm_expert_tiles and qgemm_find_tile in quantized_gemm.metal cut
    them: assignments // 64 tiles of 64, then the rest rounded up to a multiple of 8 as one tile
    of 64 if that makes 64, else one tile of each of 32, 16 and 8 its binary digits name."""
    full, rest = divmod(assignments, MAX_TILE_TOKENS)
    rest = ceil_div(rest, 8) * 8
    tiles = [MAX_TILE_TOKENS] * full
    if rest == MAX_TILE_TOKENS:
        return [*tiles, MAX_TILE_TOKENS]
    return tiles + [size for size in (32, 16, 8) if rest & size]


def _kernel_prefix(operands: str, bits: int) -> str:
    if operands not in OPERANDS:
        raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")
    if operands == "float32":
        return "qgemm"
    if bits != 4:
        raise ValueError(f"{operands} operands exist for 4-bit weights only")
    return "qgemm_bfloat" if operands == "bfloat16" else "qgemm_half"


def _check_same_shape(weights: Sequence[QuantWeight], what: str) -> QuantWeight:
    first = weights[0]
    for w in weights:
        if (w.in_dim, w.bits) != (first.in_dim, first.bits):
            raise ValueError(f"{what} need the same input dimension and bit width")
    return first


def record_qgemm(
    graph: Graph,
    device: Device,
    x: BufferRef,
    projections: Sequence[tuple[QuantWeight, BufferRef]],
    tokens: int,
    operands: str = "float32",
) -> None:
    """y_i [tokens, W_i.rows] = x [tokens, in_dim] W_i^T (fp32 in and out) for each `(W_i, y_i)`;
    all W_i share in_dim and bit width. `operands`: the products' operand type."""
    if not 1 <= len(projections) <= MAX_PROJECTIONS:
        raise ValueError(f"between 1 and {MAX_PROJECTIONS} projections, got {len(projections)}")
    if tokens < 1:
        raise ValueError(f"at least one token, got {tokens}")
    first = _check_same_shape([w for w, _ in projections], "projections sharing one dispatch")
    require_aligned(x, 16, "GEMM input")  # read as float4
    rows = [w.rows for w, _ in projections]
    first_tile = np.concatenate([[0], np.cumsum([ceil_div(r, WEIGHT_ROWS_PER_TILE) for r in rows])])
    # Unused slots repeat the first projection so that every declared buffer is bound.
    slots = list(projections) + [projections[0]] * (MAX_PROJECTIONS - len(projections))
    padding = [0] * (MAX_PROJECTIONS - len(projections))
    params = pack_params(
        "III4I4I",
        first.in_dim,
        tokens,
        len(projections),
        *(rows + padding),
        *(list(first_tile[:-1]) + padding),
    )
    buffers = {1: binding(x)}
    for i, (weight, out) in enumerate(slots):
        buffers[2 + 4 * i] = binding(weight.weight)
        buffers[3 + 4 * i] = binding(weight.scales)
        buffers[4 + 4 * i] = binding(weight.biases)
        buffers[5 + 4 * i] = binding(out)
    tile_tokens = dense_tile_tokens(tokens)
    graph.dispatch(
        device.kernel(f"{_kernel_prefix(operands, first.bits)}_{first.bits}_{tile_tokens}"),
        threadgroups=(ceil_div(tokens, tile_tokens), int(first_tile[-1]), 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers=buffers,
        bytes={0: params},
    )


def grouped_tile_bound(max_assignments: int, experts: int) -> int:
    """Threadgroup rows of a grouped GEMM: an upper bound on its tiles (`grouped_tile_tokens`).
    Over all experts the 64-row tiles cut from whole 64s number at most A // 64 (A assignments);
    each non-empty expert has one more tile, a second only with at least 17 assignments past its
    64s and a third with at least 49."""
    a = max_assignments
    return a // MAX_TILE_TOKENS + sum(min(experts, a // least) for least in (1, 17, 49))


def record_qgemm_grouped(
    graph: Graph,
    device: Device,
    x: BufferRef,
    weights: Sequence[QuantWeight],
    out: BufferRef,
    expert_offsets: BufferRef,
    row_index: BufferRef | None,
    max_assignments: int,
    operands: str = "float32",
) -> None:
    """The expert projections of MoE assignments sorted by expert.

    `expert_offsets` uint32 [experts + 1]: expert e owns sorted assignments [offsets[e],
    offsets[e + 1]) (non-decreasing; offsets past `max_assignments` are clamped to it).
    `row_index` uint32 [max_assignments]: the row of x assignment a reads, or None for row a.
    `weights`: one stacked [experts, rows, ...] weight W, out[a] = x[row(a)] W_e^T; or two, gate
    and up, out[a] = silu(x[row(a)] G_e^T) * (x[row(a)] U_e^T). `out` fp32 [max_assignments, rows]
    in sorted-assignment order; rows of assignments past offsets[experts] are left untouched.
    The grid is fixed here from `max_assignments`; the tiles are found on the device.
    `operands`: the products' operand type.
    """
    if len(weights) not in (1, 2):
        raise ValueError(f"one weight, or gate and up, got {len(weights)}")
    first = _check_same_shape(weights, "gate and up")
    if any((w.rows, w.experts) != (first.rows, first.experts) for w in weights):
        raise ValueError("gate and up need the same rows and experts")
    if max_assignments < 1:
        raise ValueError(f"at least one assignment, got {max_assignments}")
    require_aligned(x, 16, "GEMM input")  # read as float4
    swiglu = len(weights) == 2
    out_columns = WEIGHT_ROWS_PER_TILE // 2 if swiglu else WEIGHT_ROWS_PER_TILE
    gate, up = weights[0], weights[-1]
    buffers = {
        1: binding(x),
        2: binding(expert_offsets),
        # Without a row index the kernel never reads slot 3; it still needs a binding.
        3: binding(expert_offsets if row_index is None else row_index),
        4: binding(gate.weight),
        5: binding(gate.scales),
        6: binding(gate.biases),
        7: binding(up.weight),
        8: binding(up.scales),
        9: binding(up.biases),
        10: binding(out),
    }
    params = pack_params(
        "IIIII",
        first.in_dim,
        first.rows,
        first.experts,
        max_assignments,
        int(row_index is not None),
    )
    kind = "grouped_swiglu" if swiglu else "grouped"
    graph.dispatch(
        device.kernel(f"{_kernel_prefix(operands, first.bits)}_{kind}_{first.bits}"),
        threadgroups=(
            ceil_div(first.rows, out_columns),
            grouped_tile_bound(max_assignments, first.experts),
            1,
        ),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers=buffers,
        bytes={0: params},
    )
