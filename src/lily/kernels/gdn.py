"""Recording of the fused Gated DeltaNet mixer, per decoded token or per prompt chunk
(`metal/gdn.metal`).

One dispatch takes the conv output (q | k | v), z, a and b of one layer and produces the gated,
normalised readout [Hv * Dv] per token that out_proj consumes, updating the fp32 state
[Hv, Dv, Dk] in place. The chunk kernel scans its tokens in order with the state held on chip,
doing per token the same arithmetic as the step kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

# The kernel keeps a head's key vector in registers, 4 dims per lane.
KEY_HEAD_DIM = 128
VALUE_HEAD_DIM = 128
# Both kernels need exactly 32 simdgroups of 4 state rows each (their 4 rows' dot products
# reduced as one float4): many simdgroups per head keep more of the state in flight at once,
# which is what a pass over 2 MiB of state per layer is bound by, and the chunk kernel holds a
# head's state in these threads' registers.
THREADS_PER_THREADGROUP = 1024
CHUNK_THREADS_PER_THREADGROUP = 1024


def state_bytes(num_value_heads: int) -> int:
    """Size of one layer's recurrent state."""
    return num_value_heads * VALUE_HEAD_DIM * KEY_HEAD_DIM * 4


def record_gdn_step(
    graph: Graph,
    device: Device,
    *,
    qkv: BufferRef,
    z: BufferRef,
    a: BufferRef,
    b: BufferRef,
    a_log: BufferRef,
    dt_bias: BufferRef,
    norm_weight: BufferRef,
    state: BufferRef,
    out: BufferRef,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int = KEY_HEAD_DIM,
    value_head_dim: int = VALUE_HEAD_DIM,
    norm_eps: float = 1e-6,
) -> None:
    """One Gated DeltaNet step for every value head.

    qkv: fp32 conv output [q Hk*128 | k Hk*128 | v Hv*128]; z fp32 [Hv*128]; a, b fp32 [Hv];
    a_log fp32 [Hv]; dt_bias bf16 [Hv]; norm_weight bf16 [128]; state fp32 [Hv, 128, 128];
    out fp32 [Hv*128].
    """
    _check_heads(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    graph.dispatch(
        device.kernel("gdn_step"),
        threadgroups=(num_value_heads, 1, 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers=_bindings(qkv, z, a, b, a_log, dt_bias, norm_weight, state, out),
        bytes={0: pack_params("IIf", num_key_heads, num_value_heads, norm_eps)},
    )


def record_gdn_chunk(
    graph: Graph,
    device: Device,
    *,
    qkv: BufferRef,
    z: BufferRef,
    a: BufferRef,
    b: BufferRef,
    a_log: BufferRef,
    dt_bias: BufferRef,
    norm_weight: BufferRef,
    state: BufferRef,
    out: BufferRef,
    num_key_heads: int,
    num_value_heads: int,
    tokens: int,
    key_head_dim: int = KEY_HEAD_DIM,
    value_head_dim: int = VALUE_HEAD_DIM,
    norm_eps: float = 1e-6,
) -> None:
    """`tokens` Gated DeltaNet steps in order, in one dispatch, as `tokens` record_gdn_step
    dispatches would compute them.

    qkv: fp32 conv output [tokens, q Hk*128 | k Hk*128 | v Hv*128]; z fp32 [tokens, Hv*128];
    a, b fp32 [tokens, Hv]; a_log fp32 [Hv]; dt_bias bf16 [Hv]; norm_weight bf16 [128];
    state fp32 [Hv, 128, 128], read at the start and left after the last token;
    out fp32 [tokens, Hv*128].
    """
    _check_heads(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    if tokens <= 0:
        raise ValueError(f"a chunk needs at least one token, not {tokens}")
    graph.dispatch(
        device.kernel("gdn_chunk"),
        threadgroups=(num_value_heads, 1, 1),
        threads=(CHUNK_THREADS_PER_THREADGROUP, 1, 1),
        buffers=_bindings(qkv, z, a, b, a_log, dt_bias, norm_weight, state, out),
        bytes={0: pack_params("IIIf", num_key_heads, num_value_heads, tokens, norm_eps)},
    )


def _check_heads(
    num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int
) -> None:
    if (key_head_dim, value_head_dim) != (KEY_HEAD_DIM, VALUE_HEAD_DIM):
        raise ValueError(
            f"the GDN kernels are built for {KEY_HEAD_DIM}-dim heads, "
            f"not key {key_head_dim} / value {value_head_dim}"
        )
    if num_key_heads <= 0 or num_value_heads % num_key_heads:
        raise ValueError(f"{num_value_heads} value heads do not share {num_key_heads} key heads")


def _bindings(*buffers: BufferRef) -> dict:
    """Both kernels bind qkv, z, a, b, a_log, dt_bias, norm_weight, state, out at 1..9."""
    return {index: binding(ref) for index, ref in enumerate(buffers, start=1)}
