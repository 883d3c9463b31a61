"""How each kernel in `metal/` is launched, as one small `record_*` function per kernel.

A record function appends a kernel's dispatch to a Graph: it packs the kernel's parameter struct,
computes the grid and threadgroup sizes, and binds buffers at byte offsets, so weights are used
where they lie in the checkpoint. The tests and the engine's decode graph both go through these
functions: they are the one description of how every kernel is launched.

A buffer argument is a `BufferRef`: a device Buffer, or a `(Buffer, byte_offset)` pair.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from lily.device import Buffer, Kernel

BufferRef = Union["Buffer", tuple["Buffer", int]]


@dataclass(frozen=True)
class RowSlots:
    """A batched decode pass's per-row table, for the kernels that run every row of the pass in
    one dispatch on each row's own sequence state: row r of the pass is sequence slot
    `table[r]`, and each kind of state (conv windows, GDN states, KV caches, steps) holds its
    slots one after another in one buffer, so that a kernel finds slot s at s times one
    sequence's size of it."""

    table: BufferRef  # uint32 [rows]
    rows: int


# Activation element types a kernel may be instantiated for, by the name its host name uses.
_ELEMENT_TYPES = {"float32": "float", "float": "float", "bfloat16": "bfloat", "bfloat": "bfloat"}


def binding(ref: BufferRef) -> tuple[Buffer, int]:
    """The `(buffer, byte_offset)` pair of a buffer argument."""
    if isinstance(ref, tuple):
        buffer, offset = ref
        return buffer, int(offset)
    return ref, 0


def offset_by(ref: BufferRef, nbytes: int) -> tuple[Buffer, int]:
    """The same buffer, `nbytes` further in."""
    buffer, offset = binding(ref)
    return buffer, offset + nbytes


def require_aligned(ref: BufferRef, alignment: int, what: str) -> None:
    """Kernels load some operands as 16-byte vectors; a misaligned binding would fault or read
    garbage on the GPU, so refuse it when the graph is recorded."""
    _, offset = binding(ref)
    if offset % alignment:
        raise ValueError(f"{what} is bound at byte offset {offset}, not a multiple of {alignment}")


def element_type(dtype: str) -> str:
    """The MSL element type name (`float`, `bfloat`) of an activation dtype name."""
    try:
        return _ELEMENT_TYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unsupported activation dtype {dtype!r}") from None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def threads_within(kernel: Kernel, preferred: int) -> int:
    """Threads per threadgroup for a kernel that works with any whole number of SIMD-groups:
    `preferred`, or fewer when the pipeline allows fewer. Metal's limit
    (maxTotalThreadsPerThreadgroup) depends on the compiled kernel's register use, so it is
    only known once the pipeline exists; kernels that need an exact count are refused with a
    clear error by the device instead."""
    limit = kernel.max_threads_per_threadgroup // 32 * 32
    if limit < 32:
        raise ValueError(
            f"the pipeline allows {kernel.max_threads_per_threadgroup} threads per "
            "threadgroup, less than one SIMD-group"
        )
    return min(preferred, limit)


def pack_params(fmt: str, *values: int | float) -> bytes:
    """A kernel's parameter struct: `fmt` uses `I` (uint) and `f` (float) fields only, so the
    layout matches the MSL struct field for field with no padding."""
    return struct.pack("<" + fmt, *values)
