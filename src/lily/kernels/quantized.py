"""Launching the quantized GEMV (`metal/quantized_gemv.metal`): up to four projections that share
one input, computed in one dispatch, for one token or a verify pass's few, with the norm before
them, the residual add after them and the GDN's conv folded in as the pass needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from lily.kernels import (
    BufferRef,
    binding,
    ceil_div,
    element_type,
    pack_params,
    require_aligned,
)
from lily.kernels.conv1d import FoldedConvStep, tail_rows
from lily.kernels.embedding import EmbeddedInput
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import QuantWeight

if TYPE_CHECKING:
    from lily.device import Device, Graph

MAX_PROJECTIONS = 4
# Must match QGEMV_MAX_TOKENS: the most tokens one qgemv_tokens dispatch takes (a verify pass's
# last accepted token and its 8 drafts).
MAX_TOKENS = 9
# Must match QGEMV_ROWS_PER_SIMDGROUP (quantized_gemv.metal) and MOE_ROWS_PER_SIMDGROUP (moe.metal).
ROWS_PER_SIMDGROUP = 4
SIMD_WIDTH = 32
# Dispatches of fewer SIMD-groups than this run one SIMD-group per threadgroup, larger ones two.
FEW_SIMDGROUPS = 2048


def gemv_simdgroups(simdgroups: int) -> int:
    """SIMD-groups per threadgroup for a GEMV dispatch of `simdgroups` SIMD-groups in all.

    Two (64 threads) unless the dispatch has few threadgroups per GPU core: cores take
    threadgroups in rounds, and a last round only partly filled idles the rest.
    A 2048-row projection in threadgroups of two is 256 of them, 6.4 per core of a 40-core GPU,
    so the 7th round runs 40% full (the busiest core does 7 where 6.4 would be even: +9%). One
    SIMD-group per threadgroup gives 512, 12.8 per core (+1.6%; on 16 cores exactly 32), and
    lifts the router with the shared-expert gate (256 + 1 rows) from 33 threadgroups, fewer than
    40 cores, to 65. The kernels' threadgroup memory is each SIMD-group's own and their
    barriers are the SIMD-group's, so the size changes nothing but scheduling (and the
    threadgroup memory, at most 21 KiB: two SIMD-groups of moe_gate_up_union's gate and up
    rows of 9 tokens)."""
    return 1 if simdgroups < FEW_SIMDGROUPS else 2


def lane_sums_stride(values: int) -> int:
    """quantized.h's lane_sums_stride: the floats between two lanes' runs of `values` shared
    values (odd, so that the lanes' writes of one value fall in distinct banks)."""
    return values | 1


def lane_sums_bytes(simdgroups: int, values: int, extra_floats: int = 0) -> int:
    """The threadgroup memory of a dispatch whose SIMD-groups each reduce `values` floats per
    lane in one exchange (quantized.h's lane_sum): per SIMD-group, SIMD_WIDTH lanes' runs of
    lane_sums_stride(values) floats, then `extra_floats` of its own, in whole 16-byte units as
    Metal requires."""
    floats = SIMD_WIDTH * lane_sums_stride(values) + extra_floats
    return ceil_div(4 * simdgroups * floats, 16) * 16


def require_vector_aligned(x: BufferRef, x_dtype: str, norm: FoldedNorm | None = None) -> None:
    """The GEMVs read x (and a folded norm's bf16 gain) four elements at a time (load_chunk in
    quantized.h), so those bindings must be aligned to four elements."""
    x_bytes = 4 if element_type(x_dtype) == "float" else 2
    require_aligned(x, 4 * x_bytes, "GEMV input")
    if norm is not None:
        require_aligned(norm.gain, 4 * 2, "folded norm gain")


def record_qgemv(
    graph: Graph,
    device: Device,
    x: BufferRef | EmbeddedInput,
    projections: Sequence[tuple[QuantWeight, BufferRef]],
    x_dtype: str = "float32",
    norm: FoldedNorm | None = None,
    accumulate: bool = False,
    conv: FoldedConvStep | None = None,
    tokens: int = 1,
) -> None:
    """y_i = W_i x (fp32 out) for each `(W_i, y_i)`; all W_i share x's length and bit width.

    With `tokens` > 1 (at most MAX_TOKENS), x is fp32 [tokens, in_dim] and each y_i
    [tokens, W_i.rows]: each weight is read once for all the tokens, and each token's rows are
    the single-token GEMV's, norm and accumulation included.

    With `norm`, x (fp32) is normed on the fly: y_i = W_i rms_norm(x), per token. With
    `accumulate`, the result is added to what y_i holds (y_i += W_i x): a residual add folded
    into the GEMV. With `conv`, y_0 = silu(conv1d of W_0 x), one channel per row: the step
    shifting the window at one token, and over several (a verify pass) the tokens in turn from
    the window, which stays as it is, the conv's tail left for `record_conv1d_commit`
    (`FoldedConvStep`). An `EmbeddedInput` x is the embedding row of a token, read from the
    table by the GEMV (which also writes it to the input's residual); it needs `norm`, as the
    first layer's input norm always follows it, and one token."""
    if not 1 <= len(projections) <= MAX_PROJECTIONS:
        raise ValueError(f"between 1 and {MAX_PROJECTIONS} projections, got {len(projections)}")
    first = projections[0][0]
    for weight, _ in projections:
        if (weight.in_dim, weight.bits) != (first.in_dim, first.bits):
            raise ValueError("projections sharing one dispatch need the same input and bits")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"a GEMV takes 1 to {MAX_TOKENS} tokens, got {tokens}")
    if tokens > 1 and isinstance(x, EmbeddedInput):
        raise ValueError("a GEMV over several tokens reads them from x, not the embedding table")
    if tokens > 1 and element_type(x_dtype) != "float":
        raise ValueError("a GEMV over several tokens reads an fp32 x")
    if conv is not None and (conv.tail is None) != (tokens == 1):
        raise ValueError("a conv over several tokens leaves a tail (and only then)")
    if conv is not None and tokens > 1 and not 1 <= conv.candidates <= tokens:
        raise ValueError(f"a conv's tail needs 1 to {tokens} candidates, got {conv.candidates}")
    rows = [w.rows for w, _ in projections]
    simdgroups = gemv_simdgroups(sum(ceil_div(r, ROWS_PER_SIMDGROUP) for r in rows))
    rows_per_threadgroup = simdgroups * ROWS_PER_SIMDGROUP
    first_threadgroup = np.concatenate(
        [[0], np.cumsum([ceil_div(r, rows_per_threadgroup) for r in rows])]
    )
    # Unused slots repeat the first projection so that every declared buffer is bound.
    slots = list(projections) + [projections[0]] * (MAX_PROJECTIONS - len(projections))
    padding = [0] * (MAX_PROJECTIONS - len(projections))
    if norm is not None and element_type(x_dtype) != "float":
        raise ValueError("a folded norm reads an fp32 residual")
    embedded = x if isinstance(x, EmbeddedInput) else None
    if embedded is not None:
        if norm is None:
            raise ValueError("an embedded input is read with its layer's input norm folded in")
        if embedded.table.in_dim != first.in_dim:
            raise ValueError(
                f"embedding rows of {embedded.table.in_dim} for projections of {first.in_dim} "
                "inputs"
            )
        x = embedded.residual  # bound at x's slot, written with the row
    require_vector_aligned(x, x_dtype, norm)
    # What a lane shares for its one reduction: its partial dot products of ROWS_PER_SIMDGROUP
    # rows for each token, and, normed, each token's partial sum of squares; after them the
    # totals a conv reads back (quantized_gemv.metal's qgemv_scratch_floats).
    lane_values = ROWS_PER_SIMDGROUP * tokens + (tokens if norm is not None else 0)
    params = pack_params(
        "II4I4IfIIIIII",
        first.in_dim,
        len(projections),
        *(rows + padding),
        *(list(first_threadgroup[:-1]) + padding),
        norm.eps if norm is not None else 0.0,
        int(accumulate),
        int(conv is not None),
        embedded.table.rows if embedded is not None else 0,
        tokens,
        tail_rows(conv.candidates) if conv is not None and conv.tail is not None else 0,
        lane_sums_stride(lane_values),
    )
    # Slots a call does not use are bound to x, unread, so every declared buffer is bound.
    buffers = {1: binding(x)}
    buffers[18] = binding(norm.gain if norm is not None else x)
    buffers[19] = binding(conv.weight if conv is not None else x)
    buffers[20] = binding(conv.window if conv is not None else x)
    if tokens > 1:
        buffers[21] = binding(conv.tail if conv is not None and conv.tail is not None else x)
    for i, (weight, out) in enumerate(slots):
        buffers[2 + 4 * i] = binding(weight.weight)
        buffers[3 + 4 * i] = binding(weight.scales)
        buffers[4 + 4 * i] = binding(weight.biases)
        buffers[5 + 4 * i] = binding(out)
    if embedded is not None:
        buffers[21] = binding(embedded.tokens)
        buffers[22] = binding(embedded.position)
        buffers[23] = binding(embedded.table.weight)
        buffers[24] = binding(embedded.table.scales)
        buffers[25] = binding(embedded.table.biases)
        kernel = device.kernel(f"qgemv_embedded_{first.bits}_{embedded.table.bits}")
    elif tokens > 1:
        variant = "qgemv_tokens_normed" if norm is not None else "qgemv_tokens"
        kernel = device.kernel(f"{variant}_{first.bits}")
    else:
        variant = "qgemv_normed" if norm is not None else "qgemv"
        kernel = device.kernel(f"{variant}_{first.bits}_{element_type(x_dtype)}")
    graph.dispatch(
        kernel,
        threadgroups=(int(first_threadgroup[-1]), 1, 1),
        threads=(simdgroups * SIMD_WIDTH, 1, 1),
        buffers=buffers,
        bytes={0: params},
        threadgroup_memory={
            0: lane_sums_bytes(simdgroups, lane_values, ROWS_PER_SIMDGROUP * tokens)
        },
    )
