"""Launching word-for-word copies of device memory (`metal/copy.metal`): a verify pass's backup
of the recurrent state, and its restore after a rejected draft."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

COPY_THREADS = 256
# copy.metal's COPY_WORDS_PER_THREAD.
WORDS_PER_THREAD = 64


def record_copy(
    graph: Graph,
    device: Device,
    source: BufferRef,
    destination: BufferRef,
    nbytes: int,
    *,
    if_rejected: tuple[BufferRef, int] | None = None,
    threads: int = COPY_THREADS,
) -> None:
    """destination[:nbytes] = source[:nbytes] (a whole number of 4-byte words). With
    `if_rejected` = (accepted, drafts), only when the count `record_accept_drafts` wrote to
    `accepted` is below `drafts`, i.e. when the verify pass rejected a draft."""
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"a copy takes a positive whole number of 4-byte words, got {nbytes} B")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    for name, ref in (("source", source), ("destination", destination)):
        buffer, offset = binding(ref)
        if offset % 4 or buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at a word offset, got offset {offset}")
    words = nbytes // 4
    buffers = {1: binding(source), 2: binding(destination)}
    drafts = 0
    if if_rejected is not None:
        accepted, drafts = if_rejected
        buffers[3] = binding(accepted)
    graph.dispatch(
        device.kernel("copy_words" if if_rejected is None else "restore_if_rejected"),
        threadgroups=(ceil_div(words, threads * WORDS_PER_THREAD), 1, 1),
        threads=(threads, 1, 1),
        buffers=buffers,
        bytes={0: pack_params("II", words, drafts)},
    )
