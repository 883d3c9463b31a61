"""Launching the quantized embedding lookup (`metal/embedding.metal`), and the description of an
embedding row that the GEMV consuming it reads itself (`EmbeddedInput`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, RowSlots, binding, ceil_div, pack_params, threads_within

if TYPE_CHECKING:
    from lily.device import Device, Graph
    from lily.kernels.quant_weight import QuantWeight

THREADS_PER_THREADGROUP = 64


@dataclass(frozen=True)
class EmbeddedInput:
    """A GEMV's input x as the embedding row of one token, which the GEMV dequantizes from the
    table itself (`qgemv_embedded_*`, the decode step's first GEMV) with no lookup dispatch
    before it. The token is `tokens[position[0]]`, clamped to the table as `record_embedding`
    does; the GEMV also writes the fp32 row to `residual`, bit for bit what `record_embedding`
    would have written there."""

    tokens: BufferRef  # uint32 ids (the token history)
    position: BufferRef  # one uint32, the token's index in `tokens` (the step buffer's position)
    table: QuantWeight  # the quantized embedding table, 4 or 8 bits
    residual: BufferRef  # fp32 [table.in_dim], written


def record_embedding(
    graph: Graph,
    device: Device,
    tokens: BufferRef,
    first: BufferRef,
    table: QuantWeight,
    out: BufferRef,
    token_count: int = 1,
) -> None:
    """out[t] = dequantized row tokens[first + t] of `table` (fp32 [token_count, table.in_dim]);
    the uint32 ids and `first` (one uint32, e.g. the step buffer's position) are read on the
    device."""
    _record_lookup(graph, device, "embedding", tokens, first, table, out, token_count)


def record_embedding_rows(
    graph: Graph, device: Device, steps: BufferRef, table: QuantWeight, out: BufferRef,
    row_slots: RowSlots,
) -> None:  # fmt: skip
    """Every row of a batched decode pass in one dispatch: out[r] = the dequantized row of the
    token of sequence slot s = `row_slots.table[r]`, the token field of its step buffer in
    `steps` (the slots' steps one after another, STEP_FIELDS uint32 each)."""
    _record_lookup(
        graph, device, "embedding_rows", steps, row_slots.table, table, out, row_slots.rows
    )


def _record_lookup(
    graph: Graph, device: Device, name: str, tokens: BufferRef, index: BufferRef,
    table: QuantWeight, out: BufferRef, rows: int,
) -> None:  # fmt: skip
    words_per_row = table.in_dim * table.bits // 32
    kernel = device.kernel(f"{name}_{table.bits}")
    threads = threads_within(kernel, THREADS_PER_THREADGROUP)
    graph.dispatch(
        kernel,
        threadgroups=(ceil_div(words_per_row, threads), rows, 1),
        threads=(threads, 1, 1),
        buffers={
            1: binding(tokens),
            2: binding(table.weight),
            3: binding(table.scales),
            4: binding(table.biases),
            5: binding(out),
            6: binding(index),
        },
        bytes={0: pack_params("II", table.in_dim, table.rows)},
    )
