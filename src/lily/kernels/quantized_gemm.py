"""Launching the quantized GEMMs of batched prefill (`metal/quantized_gemm.metal`).

`record_qgemm` multiplies a chunk of tokens by up to four projections that share the input;
`record_qgemm_grouped` multiplies the MoE assignments of a chunk, sorted by expert, by their
experts' weights, optionally with the SwiGLU of a gate and an up projection fused. Both read fp32
activations [rows, in_dim] and write fp32 [rows, out_rows], row-major; they multiply half
operands (activations and dequantized weights rounded to half in threadgroup memory) and sum in
fp32.

Half ends at 65504. An input that is not bounded below it (not an RMSNorm's output) takes the
range guard: `record_qgemm_row_exponents` writes a power-of-two exponent e per row (int32), and
the GEMM given them as `x_exponents` stages row r times 2^-e[r] and multiplies its outputs by
2^e[r], exactly (metal/quantized_gemm.h says why and how e is chosen).

Tiles are 8, 16, 32 or 64 token rows by 128 weight rows. `dense_tile_tokens` picks the dense
GEMMs' size from the chunk's length; the grouped GEMM sizes each expert's tiles by its count on
the device, and `grouped_tile_tokens` says which tiles that gives (for estimates and tests). The
dense GEMMs run their tiles in bands of `BAND_TOKENS` token rows, every weight tile of a band in
turn, so the input is read about once and the weights once per band (`quantized_gemm.h`).

On a device whose `tensor_ops` is set (macOS 26.2 on an M5, or a sim opened with
``tensor_ops=True``) the same calls run the Metal 4 tensor-op kernels
(`metal/quantized_gemm_tensor_ops.metal`): same operands, bindings and grid, 32 or 64 token rows
per tile (`tensor_tile_tokens`; the grouped GEMM's 8- and 16-row tiles run as 32-row ones).
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
# Must match QGEMM_ROW_EXPONENT_THREADS (one SIMD-group per row), QGEMM_ROW_TOP and
# QGEMM_ROW_EXPONENT_LIMIT in quantized_gemm.h/.metal.
ROW_EXPONENT_THREADS = 128
ROWS_PER_EXPONENT_THREADGROUP = ROW_EXPONENT_THREADS // 32
ROW_TOP = 8
ROW_EXPONENT_LIMIT = 64
# Must match QGEMM_BAND_TOKENS in quantized_gemm.h: the dense GEMMs' launch bands.
BAND_TOKENS = 1024
# Must match qgemm_tensor_tile's sizes in quantized_gemm_tensor_ops.metal.
TENSOR_MIN_TILE_TOKENS = 32
# The dense GEMMs take the largest token tile that pads a chunk by at most this fraction.
MAX_DENSE_PADDING = 0.25


def dense_tile_tokens(tokens: int) -> int:
    """Token rows per tile of the dense GEMMs for a chunk of `tokens`: the largest of 8, 16, 32
    and 64 whose padding of the last tile is at most a quarter of the chunk (8 otherwise)."""
    for size in reversed(TILE_TOKENS):
        if ceil_div(tokens, size) * size <= (1 + MAX_DENSE_PADDING) * tokens:
            return size
    return TILE_TOKENS[0]


def tensor_tile_tokens(tile_tokens: int) -> int:
    """Token rows the tensor-op kernels multiply for a tile of `tile_tokens` (8 to 64): 64 for
    64, else 32, the smallest M of Apple's and the public examples' matmul2d tiles."""
    return MAX_TILE_TOKENS if tile_tokens == MAX_TILE_TOKENS else TENSOR_MIN_TILE_TOKENS


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
    x_exponents: BufferRef | None = None,
) -> None:
    """y_i [tokens, W_i.rows] = x [tokens, in_dim] W_i^T (fp32 in and out) for each `(W_i, y_i)`;
    all W_i share in_dim and bit width. `x_exponents`: int32 [tokens], the range guard's
    exponents of x's rows (`record_qgemm_row_exponents`), for an x not bounded in half."""
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
        "IIII4I4I",
        first.in_dim,
        tokens,
        int(x_exponents is not None),
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
    # Unguarded, the kernel never reads slot 18; it still needs a binding.
    buffers[18] = binding(x if x_exponents is None else x_exponents)
    tile_tokens = dense_tile_tokens(tokens)
    name = f"qgemm_{first.bits}_{tile_tokens}"
    if device.tensor_ops:
        tile_tokens = tensor_tile_tokens(tile_tokens)
        name = f"qgemm_tensor_{first.bits}_{tile_tokens}"
    graph.dispatch(
        device.kernel(name),
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
    x_exponents: BufferRef | None = None,
) -> None:
    """The expert projections of MoE assignments sorted by expert.

    `expert_offsets` uint32 [experts + 1]: expert e owns sorted assignments [offsets[e],
    offsets[e + 1]) (non-decreasing; offsets past `max_assignments` are clamped to it).
    `row_index` uint32 [max_assignments]: the row of x assignment a reads, or None for row a.
    `weights`: one stacked [experts, rows, ...] weight W, out[a] = x[row(a)] W_e^T; or two, gate
    and up, out[a] = silu(x[row(a)] G_e^T) * (x[row(a)] U_e^T). `out` fp32 [max_assignments, rows]
    in sorted-assignment order; rows of assignments past offsets[experts] are left untouched.
    The grid is fixed here from `max_assignments`; the tiles are found on the device.
    `x_exponents`: int32, one per row of x, the range guard's exponents
    (`record_qgemm_row_exponents`), for an x not bounded in half.
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
        11: binding(x if x_exponents is None else x_exponents),
    }
    params = pack_params(
        "IIIIII",
        first.in_dim,
        first.rows,
        first.experts,
        max_assignments,
        int(row_index is not None),
        int(x_exponents is not None),
    )
    kind = "grouped_swiglu" if swiglu else "grouped"
    if device.tensor_ops:
        kind += "_tensor"
    graph.dispatch(
        device.kernel(f"qgemm_{kind}_{first.bits}"),
        threadgroups=(
            ceil_div(first.rows, out_columns),
            grouped_tile_bound(max_assignments, first.experts),
            1,
        ),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers=buffers,
        bytes={0: params},
    )


def record_qgemm_row_exponents(
    graph: Graph, device: Device, x: BufferRef, rows: int, in_dim: int, exponents: BufferRef
) -> None:
    """exponents int32 [rows]: the range guard's exponent e of each row of x [rows, in_dim]
    (in_dim a multiple of 4): the row's largest |x| times 2^-e lies in [2^8, 2^9), |e| <= 64; 0
    for a row of zeros or one holding an inf or NaN. A GEMM given them reads x in a later
    barrier level."""
    if rows < 1:
        raise ValueError(f"at least one row, got {rows}")
    if in_dim % 4:
        raise ValueError(f"in_dim must be a multiple of 4, got {in_dim}")
    require_aligned(x, 16, "guarded GEMM input")  # read as float4
    graph.dispatch(
        device.kernel("qgemm_row_exponents"),
        threadgroups=(ceil_div(rows, ROWS_PER_EXPONENT_THREADGROUP), 1, 1),
        threads=(ROW_EXPONENT_THREADS, 1, 1),
        buffers={1: binding(x), 2: binding(exponents)},
        bytes={0: pack_params("II", rows, in_dim)},
    )
