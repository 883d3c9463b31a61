"""Launching the end-of-step bookkeeping (`metal/step.metal`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

# uint32 fields of the step buffer, by index.
POSITION, PROMPT_END, TOKEN = 0, 1, 2
STEP_FIELDS = 3


def record_step_advance(
    graph: Graph,
    device: Device,
    step: BufferRef,
    history: BufferRef,
    predicted: BufferRef,
    capacity: int,
    count: int = 1,
) -> None:
    """position += count; token = history[position] inside the prompt, else the predicted id,
    which is also appended to the history (uint32 [capacity])."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    graph.dispatch(
        device.kernel("step_advance"),
        threadgroups=(1, 1, 1),
        threads=(1, 1, 1),
        buffers={1: binding(step), 2: binding(history), 3: binding(predicted)},
        bytes={0: pack_params("II", capacity, count)},
    )
