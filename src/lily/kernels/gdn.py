"""Recording of the fused Gated DeltaNet mixer, per decoded token or per prompt chunk
(`metal/gdn.metal`).

One dispatch takes the conv output (q | k | v), a and b of one layer, updates the fp32 state
[Hv, Dv, Dk] in place and writes the readout [Hv * Dv] per token. The chunk kernel also applies
the gated RMSNorm (with z) and writes what out_proj consumes; the step kernel leaves the norm to
`gdn_out_proj`, which lets it split each head's rows over several threadgroups. The chunk kernel
scans its tokens in order with the state held on chip, doing per token the same arithmetic as
the step kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params, require_aligned

if TYPE_CHECKING:
    from lily.device import Device, Graph

# The kernel keeps a head's key vector in registers, 4 dims per lane.
KEY_HEAD_DIM = 128
VALUE_HEAD_DIM = 128
# A simdgroup owns 4 state rows (their dot products reduced as one float4). The step kernel
# needs exactly 4 simdgroups per threadgroup, 16 rows, so a head's 128 rows are 8 threadgroups:
# 256 at the real model's 32 heads, enough to keep every GPU core streaming state. The chunk
# kernel needs exactly 32 simdgroups: it holds a head's whole state in their registers.
STEP_THREADS_PER_THREADGROUP = 128
STEP_ROWS_PER_THREADGROUP = 16
CHUNK_THREADS_PER_THREADGROUP = 1024


def state_bytes(num_value_heads: int) -> int:
    """Size of one layer's recurrent state."""
    return num_value_heads * VALUE_HEAD_DIM * KEY_HEAD_DIM * 4


def record_gdn_step(
    graph: Graph,
    device: Device,
    *,
    qkv: BufferRef,
    a: BufferRef,
    b: BufferRef,
    a_log: BufferRef,
    dt_bias: BufferRef,
    state: BufferRef,
    readout: BufferRef,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int = KEY_HEAD_DIM,
    value_head_dim: int = VALUE_HEAD_DIM,
) -> None:
    """One Gated DeltaNet step for every value head, up to the readout S q (the gated RMSNorm
    is `record_gdn_out_proj`'s).

    qkv: fp32 conv output [q Hk*128 | k Hk*128 | v Hv*128]; a, b fp32 [Hv]; a_log fp32 [Hv];
    dt_bias bf16 [Hv]; state fp32 [Hv, 128, 128]; readout fp32 [Hv*128].
    """
    _check_heads(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    # q, k, state rows and the readout are accessed 16 bytes at a time.
    for ref, what in ((qkv, "GDN qkv"), (state, "GDN state"), (readout, "GDN readout")):
        require_aligned(ref, 16, what)
    graph.dispatch(
        device.kernel("gdn_step"),
        threadgroups=(num_value_heads * VALUE_HEAD_DIM // STEP_ROWS_PER_THREADGROUP, 1, 1),
        threads=(STEP_THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            index: binding(ref)
            for index, ref in enumerate((qkv, a, b, a_log, dt_bias, state, readout), start=1)
        },
        bytes={0: pack_params("II", num_key_heads, num_value_heads)},
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
    # q, k and state rows are read 16 bytes at a time.
    for ref, what in ((qkv, "GDN qkv"), (state, "GDN state")):
        require_aligned(ref, 16, what)
    graph.dispatch(
        device.kernel("gdn_chunk"),
        threadgroups=(num_value_heads, 1, 1),
        threads=(CHUNK_THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            index: binding(ref)
            for index, ref in enumerate(
                (qkv, z, a, b, a_log, dt_bias, norm_weight, state, out), start=1
            )
        },
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
