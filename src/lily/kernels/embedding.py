"""Launching the quantized embedding lookup (`metal/embedding.metal`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, pack_params, threads_within
from lily.kernels.quantized import QuantWeight

if TYPE_CHECKING:
    from lily.device import Device, Graph

THREADS_PER_THREADGROUP = 64


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
    words_per_row = table.in_dim * table.bits // 32
    kernel = device.kernel(f"embedding_{table.bits}")
    threads = threads_within(kernel, THREADS_PER_THREADGROUP)
    graph.dispatch(
        kernel,
        threadgroups=(ceil_div(words_per_row, threads), token_count, 1),
        threads=(threads, 1, 1),
        buffers={
            1: binding(tokens),
            2: binding(table.weight),
            3: binding(table.scales),
            4: binding(table.biases),
            5: binding(out),
            6: binding(first),
        },
        bytes={0: pack_params("II", table.in_dim, table.rows)},
    )
