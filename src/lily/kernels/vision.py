"""Launching the vision tower's kernels (`metal/vision.metal`): LayerNorm with a bias, the position
embedding's resampling, the linear maps with their epilogues, the 2-D rotary embedding and
attention over a frame's patches."""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

import numpy as np

from lily.kernels import BufferRef, binding, ceil_div, pack_params, threads_within
from lily.kernels.norm import threads_for

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match LINEAR_TILE / LINEAR_THREADS and the ATTENTION_* constants in vision.metal.
LINEAR_TILE = 32
LINEAR_THREADS = 128
ATTENTION_THREADS = 128
ATTENTION_ROWS = 32
ATTENTION_MAX_HEAD_DIM = 80


class Epilogue(enum.IntEnum):
    """What vision_linear does with y = x W^T + b (EPILOGUE_* in vision.metal)."""

    STORE = 0
    GELU_TANH = 1
    GELU_ERF = 2
    ADD = 3  # out += y


def record_layer_norm(
    graph: Graph,
    device: Device,
    x: BufferRef,
    weight: BufferRef,
    bias: BufferRef,
    out: BufferRef,
    rows: int,
    dim: int,
    eps: float,
) -> None:
    """out[r] = (x[r] - mean) / sqrt(var + eps) * weight + bias; x and out fp32, weight and bias
    bf16."""
    kernel = device.kernel("vision_layer_norm")
    graph.dispatch(
        kernel,
        threadgroups=(rows, 1, 1),
        threads=(threads_within(kernel, threads_for(dim)), 1, 1),
        buffers={1: binding(x), 2: binding(weight), 3: binding(bias), 4: binding(out)},
        bytes={0: pack_params("If", dim, eps)},
    )


def record_position_embedding(
    graph: Graph,
    device: Device,
    table: BufferRef,
    out: BufferRef,
    grid_thw: tuple[int, int, int],
    merge: int,
    side: int,
    dim: int,
) -> None:
    """out [t*h*w, dim] fp32 = the learned [side x side, dim] bf16 grid resampled bilinearly to
    the h x w patches (corners aligned), in merge-block order, the same for each of t frames."""
    t, h, w = grid_thw
    kernel = device.kernel("vision_position_embedding")
    graph.dispatch(
        kernel,
        threadgroups=(t * h * w, 1, 1),
        threads=(threads_within(kernel, threads_for(dim)), 1, 1),
        buffers={1: binding(table), 2: binding(out)},
        bytes={0: pack_params("IIIII", h, w, merge, side, dim)},
    )


def record_linear(
    graph: Graph,
    device: Device,
    x: BufferRef,
    weight: BufferRef,
    bias: BufferRef,
    out: BufferRef,
    m: int,
    n: int,
    k: int,
    epilogue: Epilogue = Epilogue.STORE,
) -> None:
    """out [m, n] fp32 = epilogue(x [m, k] fp32 @ weight [n, k]^T + bias [n]), weight and bias
    bf16 as stored; with Epilogue.ADD, out (the residual stream) is added to."""
    graph.dispatch(
        device.kernel("vision_linear"),
        threadgroups=(ceil_div(n, LINEAR_TILE), ceil_div(m, LINEAR_TILE), 1),
        threads=(LINEAR_THREADS, 1, 1),
        buffers={1: binding(x), 2: binding(weight), 3: binding(bias), 4: binding(out)},
        bytes={0: pack_params("IIII", m, n, k, int(epilogue))},
    )


def rotary_tables(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cos and sin tables vision_rotary reads, [rows, head_dim / 2] float32, from the
    patches' angles (lily.engine.vision_reference.rotary_angles): they depend only on the grid,
    so the host computes them once per image, in float64 as the reference does."""
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def record_rotary(
    graph: Graph,
    device: Device,
    qkv: BufferRef,
    cos_table: BufferRef,
    sin_table: BufferRef,
    rows: int,
    heads: int,
    head_dim: int,
) -> None:
    """Rotates the q and k parts of the fused qkv rows [rows, 3 x heads x head_dim] in place."""
    kernel = device.kernel("vision_rotary")
    pairs = heads * head_dim  # (q and k) x heads x head_dim / 2
    graph.dispatch(
        kernel,
        threadgroups=(rows, 1, 1),
        threads=(threads_within(kernel, min(1024, ceil_div(pairs, 32) * 32)), 1, 1),
        buffers={1: binding(qkv), 2: binding(cos_table), 3: binding(sin_table)},
        bytes={0: pack_params("III", heads, head_dim, 3 * heads * head_dim)},
    )


def record_attention(
    graph: Graph,
    device: Device,
    qkv: BufferRef,
    out: BufferRef,
    frames: int,
    frame: int,
    heads: int,
    head_dim: int,
    queries: range | None = None,
) -> None:
    """out [frames x frame, heads x head_dim] = bidirectional softmax attention of each patch over
    the `frame` patches of its own frame, per head; q, k and v from the fused (rotated) qkv rows.
    `queries`: only these query rows of each frame (all by default), whole blocks of
    ATTENTION_ROWS (the last may end at the frame's end), so that a large image's attention can
    be split across command buffers."""
    if head_dim > ATTENTION_MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(
            f"head dim {head_dim}: vision_attention takes multiples of 8 up to "
            f"{ATTENTION_MAX_HEAD_DIM}"
        )
    queries = range(frame) if queries is None else queries
    whole_blocks = all(q % ATTENTION_ROWS == 0 for q in (queries.start, queries.stop % frame))
    if not whole_blocks or queries.step != 1 or not 0 <= queries.start < queries.stop <= frame:
        raise ValueError(f"queries {queries} are not whole {ATTENTION_ROWS}-row blocks of {frame}")
    scale = 1 / math.sqrt(head_dim)
    graph.dispatch(
        device.kernel("vision_attention"),
        threadgroups=(ceil_div(len(queries), ATTENTION_ROWS), heads, frames),
        threads=(ATTENTION_THREADS, 1, 1),
        buffers={1: binding(qkv), 2: binding(out)},
        bytes={0: pack_params("IIIfI", frame, heads, head_dim, scale, queries.start)},
    )
