"""Recording of the Gated DeltaNet's causal conv1d, per decoded token or per prompt chunk
(`metal/conv1d.metal`).

The window holds the last 3 pre-conv rows as fp32 [3, channels], oldest first, and is updated in
place by both kernels, so one buffer per layer carries the convolution state across steps and
chunks, in any mix. A verify pass's chunk leaves it alone and writes its last rows to a tail,
from which `conv1d_commit` takes the window after the position the acceptance keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, RowSlots, binding, ceil_div, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

KERNEL_TAPS = 4
THREADS_PER_THREADGROUP = 256
# Tokens each thread of the chunk kernel convolves (kConvChunkTokensPerThread in the kernel).
CHUNK_TOKENS_PER_THREAD = 16


@dataclass(frozen=True)
class FoldedConvStep:
    """The conv1d folded into the GEMV that produces its input: each output row (channel) goes
    through the conv and SiLU. At one token (the decode step) it shifts the window, as
    `record_conv1d_step`; over a verify pass's tokens it leaves the window alone and writes the
    tail `record_conv1d_chunk` writes for `candidates`, for `record_conv1d_commit`."""

    weight: BufferRef  # bf16 [channels, 4, 1] as stored in the checkpoint
    window: BufferRef  # fp32 [3, channels], updated in place at one token
    tail: BufferRef | None = None  # fp32 [candidates + 2, channels], over several tokens
    candidates: int = 0


def window_bytes(channels: int) -> int:
    """Size of one layer's conv window."""
    return (KERNEL_TAPS - 1) * channels * 4


def record_conv1d_step(
    graph: Graph,
    device: Device,
    *,
    x: BufferRef,
    weight: BufferRef,
    window: BufferRef,
    out: BufferRef,
    channels: int,
    row_slots: RowSlots | None = None,
) -> None:
    """`out = silu(conv(window ++ x))` per channel, then shift x into the window.

    x, out: fp32 [channels]; weight: bf16 [channels, 4, 1] as stored in the checkpoint;
    window: fp32 [3, channels]. With `row_slots`, every row of a batched pass in one dispatch:
    x and out are [rows, channels] and row r steps window slot `row_slots.table[r]` of
    `window`, fp32 [slots, 3, channels].
    """
    groups = ceil_div(channels, THREADS_PER_THREADGROUP)
    buffers = {1: binding(x), 2: binding(weight), 3: binding(window), 4: binding(out)}
    if row_slots is not None:
        buffers[5] = binding(row_slots.table)
    graph.dispatch(
        device.kernel("conv1d_step" if row_slots is None else "conv1d_step_rows"),
        threadgroups=(groups, 1 if row_slots is None else row_slots.rows, 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers=buffers,
        bytes={0: pack_params("I", channels)},
    )


def record_conv1d_chunk(
    graph: Graph,
    device: Device,
    *,
    x: BufferRef,
    weight: BufferRef,
    window: BufferRef,
    out: BufferRef,
    channels: int,
    tokens: int,
    tail: BufferRef | None = None,
    candidates: int = 0,
) -> None:
    """The convolution of `tokens` consecutive rows continuing from the window, then SiLU; the
    window is left holding the last 3 rows of (window ++ x), as `tokens` steps would leave it.
    A verify pass's (`candidates` > 0, its last tokens among which the acceptance chooses where
    the sequence ends) leaves the window alone and writes the last candidates + 2 rows of
    (window ++ x) to `tail` [candidates + 2, channels], for `record_conv1d_commit`.

    x, out: fp32 [tokens, channels]; weight: bf16 [channels, 4, 1]; window: fp32 [3, channels].
    One dispatch; out must not alias x or the window.
    """
    if tokens <= 0:
        raise ValueError(f"a chunk needs at least one token, not {tokens}")
    if (tail is None) != (candidates == 0) or not 0 <= candidates <= tokens:
        raise ValueError(f"a tail needs 1 to {tokens} candidates, got {candidates}")
    graph.dispatch(
        device.kernel("conv1d_chunk"),
        threadgroups=(
            ceil_div(channels, THREADS_PER_THREADGROUP),
            ceil_div(tokens, CHUNK_TOKENS_PER_THREAD),
            1,
        ),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            1: binding(x),
            2: binding(weight),
            3: binding(window),
            4: binding(out),
            # Unread without candidates: the window stands in.
            5: binding(window if tail is None else tail),
        },
        bytes={0: pack_params("III", channels, tokens, candidates and tail_rows(candidates))},
    )


def tail_rows(candidates: int) -> int:
    """Rows of a verify pass's tail: the window after any of its `candidates` positions."""
    return candidates + KERNEL_TAPS - 2


def tail_bytes(channels: int, candidates: int) -> int:
    """Size of one layer's tail for a verify pass of `candidates` candidates."""
    return tail_rows(candidates) * channels * 4


def record_conv1d_commit(
    graph: Graph,
    device: Device,
    *,
    accepted: BufferRef,
    tail: BufferRef,
    window: BufferRef,
    channels: int,
    candidates: int,
) -> None:
    """After `record_accept_drafts`: the window after the verify pass's last waiting token and
    the accepted drafts, rows n .. n + 2 (n the accepted count) of the tail that
    `record_conv1d_chunk` wrote."""
    graph.dispatch(
        device.kernel("conv1d_commit"),
        threadgroups=(ceil_div(channels, THREADS_PER_THREADGROUP), 1, 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers={1: binding(accepted), 2: binding(tail), 3: binding(window)},
        bytes={0: pack_params("II", channels, candidates)},
    )
