"""Recording of the fused Gated DeltaNet step (`metal/gdn.metal`).

One dispatch takes the conv output (q | k | v), z, a and b of one layer and produces the gated,
normalised readout [Hv * Dv] that out_proj consumes, updating the fp32 state [Hv, Dv, Dk] in
place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

# The kernel keeps a head's key vector in registers, 4 dims per lane.
KEY_HEAD_DIM = 128
VALUE_HEAD_DIM = 128
# 32 simdgroups, 4 state rows each: a simdgroup walks its rows one after another (two dependent
# reductions per row), so more simdgroups per head means more of the state in flight at once,
# which is what a pass over 2 MiB of state per layer is bound by.
THREADS_PER_THREADGROUP = 1024


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
    if (key_head_dim, value_head_dim) != (KEY_HEAD_DIM, VALUE_HEAD_DIM):
        raise ValueError(
            f"the GDN kernel is built for {KEY_HEAD_DIM}-dim heads, "
            f"not key {key_head_dim} / value {value_head_dim}"
        )
    if num_key_heads <= 0 or num_value_heads % num_key_heads:
        raise ValueError(f"{num_value_heads} value heads do not share {num_key_heads} key heads")
    graph.dispatch(
        device.kernel("gdn_step"),
        threadgroups=(num_value_heads, 1, 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            1: binding(qkv),
            2: binding(z),
            3: binding(a),
            4: binding(b),
            5: binding(a_log),
            6: binding(dt_bias),
            7: binding(norm_weight),
            8: binding(state),
            9: binding(out),
        },
        bytes={0: pack_params("IIf", num_key_heads, num_value_heads, norm_eps)},
    )
