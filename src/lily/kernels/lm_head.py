"""The end of a decode step (`metal/lm_head.metal`): logits = lm_head x, then the index of the
largest logit (ties to the lowest) written to a device buffer as the next token id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params
from lily.kernels.quantized import QuantWeight, record_qgemv

if TYPE_CHECKING:
    from lily.device import Device, Graph

ARGMAX_THREADS = 1024


def record_argmax(
    graph: Graph, device: Device, values: BufferRef, count: int, index: BufferRef
) -> None:
    """index (uint32) = argmax of `count` fp32 values, ties to the lowest index."""
    graph.dispatch(
        device.kernel("argmax"),
        threadgroups=(1, 1, 1),
        threads=(ARGMAX_THREADS, 1, 1),
        buffers={1: binding(values), 2: binding(index)},
        bytes={0: pack_params("I", count)},
    )


def record_lm_head(
    graph: Graph,
    device: Device,
    x: BufferRef,
    lm_head: QuantWeight,
    logits: BufferRef,
    token: BufferRef,
) -> None:
    """logits (fp32 [vocab]) = lm_head x, then token = argmax(logits). Records a barrier between
    the two dispatches; the caller places the one before (x ready) and after (token ready)."""
    record_qgemv(graph, device, x, [(lm_head, logits)])
    graph.barrier()
    record_argmax(graph, device, logits, lm_head.rows, token)
