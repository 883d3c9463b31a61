"""Launching the DFlash drafter's attention (`metal/dflash_attention.metal`): the prepare of its
queries and its cache rows, and the block's attention over context and block keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

HEAD_DIM = 128
SIMD_WIDTH = 32
# A block pass has the newest token and at most MAX_DRAFT_TOKENS drafts (the verify pass's).
MAX_BLOCK_ROWS = 9


@dataclass(frozen=True)
class DraftRope:
    """dflash_attention.h's DraftRopeParams: YaRN over all 128 dims (pairs below ramp_low
    extrapolated, from ramp_high interpolated by `factor`), queries and keys then scaled by
    `attention_factor`. lily.engine.dflash_reference.draft_rope makes it from a config."""

    theta: float
    factor: float
    ramp_low: float
    ramp_high: float
    attention_factor: float

    def packed(self) -> bytes:
        return pack_params(
            "fffff", self.theta, self.factor, self.ramp_low, self.ramp_high, self.attention_factor
        )


def cache_bytes(num_kv_heads: int, capacity: int) -> int:
    """One layer's keys (or values): bf16 rows [Hkv, capacity, 128]."""
    return 2 * HEAD_DIM * num_kv_heads * capacity


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_q_heads < 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not share {num_kv_heads} KV heads evenly")


def record_dflash_prepare(
    graph: Graph,
    device: Device,
    *,
    q_proj: BufferRef | None,
    k_proj: BufferRef,
    v_proj: BufferRef,
    q_norm: BufferRef,
    k_norm: BufferRef,
    first: BufferRef,
    queries: BufferRef | None,
    k_cache: BufferRef,
    v_cache: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    rows: int,
    rope: DraftRope,
    norm_eps: float,
) -> None:
    """Normalise and rotate the keys of `rows` rows and write them with the values into the
    caches, row r at position first[0] + r (positions past the capacity are not written); with
    `num_q_heads` > 0 also the queries into `queries` (fp32 [rows, Hq, 128]). q_proj, k_proj,
    v_proj fp32 [rows, heads, 128]; q_norm, k_norm bf16 [128] (stored gains); first uint32."""
    _check_heads(num_q_heads, num_kv_heads)
    if num_q_heads and (q_proj is None or queries is None):
        raise ValueError("query heads need q_proj and queries")
    if rows < 1:
        raise ValueError(f"a pass has at least one row, not {rows}")
    # Without query heads, q_proj and queries are not read: bind the keys in their place.
    graph.dispatch(
        device.kernel("dflash_prepare"),
        threadgroups=(num_q_heads + num_kv_heads, rows, 1),
        threads=(SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(k_proj if q_proj is None else q_proj),
            2: binding(k_proj),
            3: binding(v_proj),
            4: binding(q_norm),
            5: binding(k_norm),
            6: binding(first),
            7: binding(k_proj if queries is None else queries),
            8: binding(k_cache),
            9: binding(v_cache),
        },
        bytes={
            0: pack_params("IIIf", num_q_heads, num_kv_heads, capacity, norm_eps) + rope.packed()
        },
    )


def record_dflash_attention(
    graph: Graph,
    device: Device,
    *,
    queries: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    first: BufferRef,
    out: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    block_rows: int,
    causal: bool,
    window: int | None,
    scale: float,
) -> None:
    """out[r] = the attention of block row r (at position first[0] + r) over the cache's keys:
    the context rows before first[0] (only those less than `window` behind it, if given) and
    the block's rows (all of them, or up to r if `causal`). queries and out fp32
    [block_rows, Hq, 128]; caches bf16 [Hkv, capacity, 128], the block's rows already written."""
    _check_heads(num_q_heads, num_kv_heads)
    if not 1 <= block_rows <= MAX_BLOCK_ROWS:
        raise ValueError(f"a block has 1 to {MAX_BLOCK_ROWS} rows, not {block_rows}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window covers at least one position, not {window}")
    graph.dispatch(
        device.kernel("dflash_attention"),
        threadgroups=(num_q_heads, block_rows, 1),
        threads=(SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(queries),
            2: binding(k_cache),
            3: binding(v_cache),
            4: binding(first),
            5: binding(out),
        },
        bytes={
            0: pack_params(
                "IIIIIIf",
                num_q_heads,
                num_kv_heads,
                capacity,
                block_rows,
                int(causal),
                window or 0,
                scale,
            )
        },
    )
