"""Recording of the fused Gated DeltaNet mixer, per decoded token or per prompt chunk
(`metal/gdn.metal`).

One dispatch takes the conv output (q | k | v), a and b of one layer, updates the fp32 state
[Hv, Dv, Dk] in place and writes the readout S q [Hv * Dv] per token. Neither kernel applies the
gated RMSNorm, which needs a whole head while both split a head's rows over threadgroups: after
a step `gdn_out_proj` applies it as it reads the readout, after a chunk `gdn_gated_norm` does, in
place. The step runs the recurrence token by token; so does a verify pass's `gdn_tokens`, which
keeps what its last tokens add to the state instead of writing it, for `gdn_commit` to apply
as many of them as the acceptance keeps. The chunk runs its chunkwise form
(`lily.diagnostics.kernel_checks.reference_gdn_chunkwise`): sub-chunks of 16 tokens whose
products are simdgroup-matrix multiplies, the state carried from one sub-chunk to the next on
chip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, RowSlots, binding, offset_by, pack_params, require_aligned

if TYPE_CHECKING:
    from lily.device import Device, Graph

# The kernel keeps a head's key vector in registers, 4 dims per lane.
KEY_HEAD_DIM = 128
VALUE_HEAD_DIM = 128
# A simdgroup owns 4 state rows (their dot products reduced as one float4). The step kernel
# needs exactly 4 simdgroups per threadgroup, 16 rows, so a head's 128 rows are 8 threadgroups:
# 256 at the real model's 32 heads, enough to keep every GPU core streaming state. The chunk
# kernel needs exactly 4 simdgroups of 8 rows (one 8x8 tile column of the state each): 4
# threadgroups per head, 128 at the real model's 32 heads.
STEP_THREADS_PER_THREADGROUP = 128
STEP_ROWS_PER_THREADGROUP = 16
CHUNK_THREADS_PER_THREADGROUP = 128
CHUNK_ROWS_PER_THREADGROUP = 32
# Tokens per sub-chunk of the chunkwise algorithm (kSubChunk in the kernel).
CHUNK_SUB_CHUNK = 16
# State rows that share one power of two when the chunk rounds S, V - K S^T and U to half
# operands: a SIMD-group's (lily.engine.reference.HalfOperands).
CHUNK_SCALE_ROWS = 8
# gdn_gated_norm: one simdgroup per (token, head) row, 8 rows per threadgroup.
NORM_ROWS_PER_THREADGROUP = 8
NORM_THREADS_PER_THREADGROUP = 256


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
    row_slots: RowSlots | None = None,
) -> None:
    """One Gated DeltaNet step for every value head, up to the readout S q (the gated RMSNorm
    is `record_gdn_out_proj`'s).

    qkv: fp32 conv output [q Hk*128 | k Hk*128 | v Hv*128]; a, b fp32 [Hv]; a_log fp32 [Hv];
    dt_bias bf16 [Hv]; state fp32 [Hv, 128, 128]; readout fp32 [Hv*128]. With `row_slots`,
    every row of a batched pass in one dispatch: qkv, a, b and readout are [rows, ...] and row r
    steps state slot `row_slots.table[r]` of `state`, fp32 [slots, Hv, 128, 128].
    """
    _check_heads(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    # q, k, state rows and the readout are accessed 16 bytes at a time.
    for ref, what in ((qkv, "GDN qkv"), (state, "GDN state"), (readout, "GDN readout")):
        require_aligned(ref, 16, what)
    buffers = {
        index: binding(ref)
        for index, ref in enumerate((qkv, a, b, a_log, dt_bias, state, readout), start=1)
    }
    if row_slots is not None:
        buffers[8] = binding(row_slots.table)
    graph.dispatch(
        device.kernel("gdn_step" if row_slots is None else "gdn_step_rows"),
        threadgroups=(
            num_value_heads * VALUE_HEAD_DIM // STEP_ROWS_PER_THREADGROUP,
            1 if row_slots is None else row_slots.rows,
            1,
        ),
        threads=(STEP_THREADS_PER_THREADGROUP, 1, 1),
        buffers=buffers,
        bytes={0: pack_params("II", num_key_heads, num_value_heads)},
    )


@dataclass(frozen=True)
class VerifyUpdates:
    """Where `record_gdn_tokens` keeps what each of a verify pass's candidate tokens adds to one
    layer's state, for `record_gdn_commit`: fp32 keys [candidates, Hk*128] (normalised), deltas
    [candidates, Hv*128] and decays [candidates, Hv], laid out in that order from `buffer`."""

    buffer: BufferRef
    num_key_heads: int
    num_value_heads: int
    candidates: int

    def parts(self) -> tuple[BufferRef, BufferRef, BufferRef]:
        keys = self.candidates * self.num_key_heads * KEY_HEAD_DIM * 4
        deltas = self.candidates * self.num_value_heads * VALUE_HEAD_DIM * 4
        return (
            self.buffer,
            offset_by(self.buffer, keys),
            offset_by(self.buffer, keys + deltas),
        )


def verify_updates_bytes(num_key_heads: int, num_value_heads: int, candidates: int) -> int:
    """Size of one layer's `VerifyUpdates`."""
    per_token = num_key_heads * KEY_HEAD_DIM + num_value_heads * (VALUE_HEAD_DIM + 1)
    return 4 * candidates * per_token


def record_gdn_tokens(
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
    updates: VerifyUpdates,
    tokens: int,
) -> None:
    """A verify pass's `tokens` Gated DeltaNet steps, token by token with the step's
    arithmetic, up to each token's readout S q; the state is left after the tokens before the
    last `updates.candidates`, and those candidates' updates go to `updates` for
    `record_gdn_commit` (gdn.metal's verify section).

    qkv: fp32 conv output [tokens, q Hk*128 | k Hk*128 | v Hv*128]; a, b fp32 [tokens, Hv];
    a_log fp32 [Hv]; dt_bias bf16 [Hv]; state fp32 [Hv, 128, 128]; readout fp32 [tokens, Hv*128].
    """
    hk, hv, candidates = updates.num_key_heads, updates.num_value_heads, updates.candidates
    _check_heads(hk, hv, KEY_HEAD_DIM, VALUE_HEAD_DIM)
    if not 1 <= candidates <= tokens:
        raise ValueError(
            f"a pass over {tokens} tokens keeps 1 to {tokens} candidates, got {candidates}"
        )
    keys, deltas, decays = updates.parts()
    for ref, what in (
        (qkv, "GDN qkv"),
        (state, "GDN state"),
        (readout, "GDN readout"),
        (keys, "GDN keys"),
        (deltas, "GDN deltas"),
    ):
        require_aligned(ref, 16, what)
    refs = (qkv, a, b, a_log, dt_bias, state, readout, keys, deltas, decays)
    graph.dispatch(
        device.kernel("gdn_tokens"),
        threadgroups=(hv * VALUE_HEAD_DIM // STEP_ROWS_PER_THREADGROUP, 1, 1),
        threads=(STEP_THREADS_PER_THREADGROUP, 1, 1),
        buffers={index: binding(ref) for index, ref in enumerate(refs, start=1)},
        bytes={0: pack_params("IIII", hk, hv, tokens, candidates)},
    )


def record_gdn_commit(
    graph: Graph,
    device: Device,
    *,
    accepted: BufferRef,
    state: BufferRef,
    updates: VerifyUpdates,
) -> None:
    """After `record_accept_drafts`: the first (accepted count + 1) candidate updates that
    `record_gdn_tokens` kept, applied to the state in place, which is then the state after the
    pass's last waiting token and its accepted drafts."""
    hk, hv = updates.num_key_heads, updates.num_value_heads
    keys, deltas, decays = updates.parts()
    for ref, what in ((state, "GDN state"), (keys, "GDN keys"), (deltas, "GDN deltas")):
        require_aligned(ref, 16, what)
    refs = (accepted, state, keys, deltas, decays)
    graph.dispatch(
        device.kernel("gdn_commit"),
        threadgroups=(hv * VALUE_HEAD_DIM // STEP_ROWS_PER_THREADGROUP, 1, 1),
        threads=(STEP_THREADS_PER_THREADGROUP, 1, 1),
        buffers={index: binding(ref) for index, ref in enumerate(refs, start=1)},
        bytes={0: pack_params("III", hk, hv, updates.candidates)},
    )


def record_gdn_chunk(
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
    tokens: int,
    key_head_dim: int = KEY_HEAD_DIM,
    value_head_dim: int = VALUE_HEAD_DIM,
) -> None:
    """`tokens` Gated DeltaNet steps in one dispatch, up to each token's readout S q (the gated
    RMSNorm is `record_gdn_gated_norm`'s); equal to `tokens` record_gdn_step dispatches within
    fp32 rounding.

    qkv: fp32 conv output [tokens, q Hk*128 | k Hk*128 | v Hv*128]; a, b fp32 [tokens, Hv];
    a_log fp32 [Hv]; dt_bias bf16 [Hv]; state fp32 [Hv, 128, 128], read at the start and left
    after the last token; readout fp32 [tokens, Hv*128].
    """
    _check_heads(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    if tokens <= 0:
        raise ValueError(f"a chunk needs at least one token, not {tokens}")
    # q, k are read 16 bytes at a time; the state goes through simdgroup matrix loads.
    for ref, what in ((qkv, "GDN qkv"), (state, "GDN state")):
        require_aligned(ref, 16, what)
    graph.dispatch(
        device.kernel("gdn_chunk"),
        threadgroups=(num_value_heads * VALUE_HEAD_DIM // CHUNK_ROWS_PER_THREADGROUP, 1, 1),
        threads=(CHUNK_THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            index: binding(ref)
            for index, ref in enumerate((qkv, a, b, a_log, dt_bias, state, readout), start=1)
        },
        bytes={0: pack_params("III", num_key_heads, num_value_heads, tokens)},
    )


def record_gdn_gated_norm(
    graph: Graph,
    device: Device,
    *,
    x: BufferRef,
    z: BufferRef,
    norm_weight: BufferRef,
    tokens: int,
    num_value_heads: int,
    norm_eps: float = 1e-6,
) -> None:
    """x = rmsnorm(x) * norm_weight * silu(z) per 128-wide head, in place: a chunk's readouts
    [tokens, Hv*128] become what out_proj consumes.

    x, z fp32 [tokens, Hv*128]; norm_weight bf16 [128], a plain gain.
    """
    if tokens <= 0:
        raise ValueError(f"a chunk needs at least one token, not {tokens}")
    require_aligned(x, 16, "GDN readout")
    rows = tokens * num_value_heads
    graph.dispatch(
        device.kernel("gdn_gated_norm"),
        threadgroups=(-(-rows // NORM_ROWS_PER_THREADGROUP), 1, 1),
        threads=(NORM_THREADS_PER_THREADGROUP, 1, 1),
        buffers={index: binding(ref) for index, ref in enumerate((x, z, norm_weight), start=1)},
        bytes={0: pack_params("If", rows, norm_eps)},
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
