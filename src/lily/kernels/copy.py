"""Launching word-for-word copies of device memory (`metal/copy.metal`), in order with the
dispatches around them (the benchmarks' and tests' data movement on the device)."""

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
    threads: int = COPY_THREADS,
) -> None:
    """destination[:nbytes] = source[:nbytes] (a whole number of 4-byte words)."""
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"a copy takes a positive whole number of 4-byte words, got {nbytes} B")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    for name, ref in (("source", source), ("destination", destination)):
        buffer, offset = binding(ref)
        if offset % 4 or buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at a word offset, got offset {offset}")
    words = nbytes // 4
    graph.dispatch(
        device.kernel("copy_words"),
        threadgroups=(ceil_div(words, threads * WORDS_PER_THREAD), 1, 1),
        threads=(threads, 1, 1),
        buffers={1: binding(source), 2: binding(destination)},
        bytes={0: pack_params("I", words)},
    )


def record_copy_flagged_rows(
    graph: Graph,
    device: Device,
    *,
    flags: BufferRef,
    staged: BufferRef,
    rows: BufferRef,
    count: int,
    row_bytes: int,
    threads: int = COPY_THREADS,
) -> None:
    """rows[t] = staged[t] for each of the first `count` rows whose uint32 flag is non-zero
    (rows of `row_bytes`, a whole number of words); the other rows are left as they are."""
    if count <= 0 or row_bytes <= 0 or row_bytes % 4:
        raise ValueError(f"{count} rows of {row_bytes} B: need rows of a positive word count")
    graph.dispatch(
        device.kernel("copy_flagged_rows"),
        threadgroups=(count, 1, 1),
        threads=(threads, 1, 1),
        buffers={1: binding(flags), 2: binding(staged), 3: binding(rows)},
        bytes={0: pack_params("I", row_bytes // 4)},
    )
