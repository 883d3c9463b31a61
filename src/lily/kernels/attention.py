"""Recording of gated full attention (`metal/attention.metal`).

For one decoded token, three dispatches, each needing a barrier before the next:

1. `record_attention_prepare`: q/k RMSNorm, partial RoPE, and the append of the rotated key and
   the value to the cache at the position held in the step buffer;
2. `record_attention_decode`: attention over the whole context, split into ranges of positions
   (attention.metal's `split_length`) that run as separate threadgroups and leave partial
   results in a scratch buffer; the grid has `decode_splits(capacity)` splits, and the kernel
   derives from the step buffer how many of them the context reaches (the rest exit at once);
3. `record_attention_combine`: merges the partials of the splits the context reaches and applies
   the sigmoid output gate.

The decode step runs the first two as one, `record_attention_decode_fused`: every split prepares
its own queries and the current key and value, and the split holding the current position
appends them to the cache, so prepare costs no dependent level of its own.

For a verify pass's few tokens (T up to `MAX_DECODE_TOKENS`), three: `record_attention_prepare`
with `tokens=T`, `record_attention_decode_tokens`, the decode grid and splits with each token's
causal end, reading every cached row once for all T tokens, and `record_attention_combine` with
`tokens=T`.

For a chunk of T prompt tokens, two: `record_attention_prepare` with `tokens=T` (token t at
position + t), then `record_attention_chunk`, causal attention of the T queries over the cache
with the output gate applied. On a device whose `tensor_ops` is set (an M5, or a sim opened with
``tensor_ops=True``) a bf16 cache's chunk attention runs on Metal 4 tensor ops
(`metal/attention_tensor_ops.metal`), in two dispatches: `attention_chunk_queries` packs the
scaled queries as half per kv head into a scratch buffer (`packed_queries_bytes`), then
`attention_chunk_tensor`; an int8 cache keeps the simdgroup-matrix kernel there too.

The KV cache of a layer is two arrays (K and V) of [num_kv_heads, capacity] rows in one of two
formats (`KV_CACHE_TYPES`, attention.metal): "bf16", 256 bf16 values (512 bytes), or "int8", 256
int8 codes then 8 fp16 scales, one per group of 32 dims (272 bytes). Every launcher that touches
the cache takes `kv_cache` and records the kernel of that format. The step buffer is uint32
[position, ...] and the context after the append is position + T tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, RowSlots, binding, ceil_div, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Every head is covered by one simdgroup holding 8 dims per lane.
HEAD_DIM = 256
SIMD_WIDTH = 32
# The cache formats, and the dims per fp16 scale of the int8 one (kInt8Group in attention.metal).
KV_CACHE_TYPES = ("bf16", "int8")
INT8_GROUP = 32
# Must match kDecodeThreads, kMaxGroup, kSplitPositions, kMinSplits, kRound and kCombineDims in
# attention.metal: the decode kernels' threads (4 simdgroups), the most query heads per kv head
# (the rows of their fragments), the positions per split while the grid has splits to spare,
# the splits a short context is still spread over (64 threadgroups on the real model's 2 kv
# heads), the unit of split lengths (a tile of 8 positions for each simdgroup), and the dims per
# combine threadgroup.
DECODE_THREADS = 128
MAX_GROUP = 8
SPLIT_POSITIONS = 256
MIN_SPLITS = 32
SPLIT_ROUND = 32
COMBINE_DIMS = 64
# The most splits a decode grid gets: 128 splits of the real model's 2 kv heads are 256
# threadgroups of 4 simdgroups, 25 simdgroups per core on a 40-core GPU; more would add
# threadgroups that cannot run at once anyway while growing the partials the combine reads back
# (16 heads x 1 KB per split). Past 128 * 256 = 32768 positions the splits lengthen instead.
MAX_SPLITS = 128
# Must match kMaxDecodeTokens in attention.metal: the most tokens attention_decode_tokens takes,
# one simdgroup each (a verify pass's last accepted token and its 8 drafts).
MAX_DECODE_TOKENS = 9
DECODE_TOKENS_MAX_THREADS = MAX_DECODE_TOKENS * SIMD_WIDTH
# Must match kChunkRows and kChunkThreads in attention.metal: (token, query head) rows per
# threadgroup of the chunk kernel (8 tokens of the real model's 8 query heads per kv head, which
# share every K/V tile the threadgroup reads), and its threads (8 SIMD-groups of 8 rows).
CHUNK_ROWS = 64
CHUNK_THREADS = 256
# kChunkKeys in attention.metal: the positions of one K/V tile of the chunk kernel's online
# softmax (lily.engine.reference.attention_in_tiles models its rounding per tile).
CHUNK_TILE_KEYS = 16
# Must match kTensorChunkRows, kTensorChunkThreads and kTensorChunkKeys in
# attention_tensor_ops.metal: the tensor-op chunk kernel's rows per threadgroup (and the padding
# of the packed queries), threads (4 SIMD-groups), and keys per tile.
TENSOR_CHUNK_ROWS = 64
TENSOR_CHUNK_THREADS = 128
TENSOR_CHUNK_TILE_KEYS = 32


def decode_splits(capacity: int) -> int:
    """The splits of a decode grid for a cache of `capacity` positions: one per SPLIT_POSITIONS,
    at least MIN_SPLITS, at most MAX_SPLITS. The kernels lengthen the splits when the context
    outgrows them."""
    return min(MAX_SPLITS, max(MIN_SPLITS, ceil_div(capacity, SPLIT_POSITIONS)))


def split_length(context: int, num_splits: int) -> int:
    """Positions per split at `context` tokens over a grid of `num_splits` splits, as the decode
    kernels and the combine compute it (attention.metal's split_length): the context spread over
    MIN_SPLITS splits of SPLIT_ROUND to SPLIT_POSITIONS positions, then SPLIT_POSITIONS per
    split until the grid runs out, then evenly more; always whole rounds."""
    spread = min(SPLIT_POSITIONS, max(SPLIT_ROUND, ceil_div(context, MIN_SPLITS)))
    return ceil_div(max(spread, ceil_div(context, num_splits)), SPLIT_ROUND) * SPLIT_ROUND


def check_kv_cache(kv_cache: str) -> None:
    """Refuses a cache format the kernels do not have."""
    if kv_cache not in KV_CACHE_TYPES:
        choices = " or ".join(repr(t) for t in KV_CACHE_TYPES)
        raise ValueError(f"kv_cache must be {choices}, not {kv_cache!r}")


def row_bytes(kv_cache: str) -> int:
    """Bytes of one cached row (a kv head at one position) in the format `kv_cache`."""
    check_kv_cache(kv_cache)
    if kv_cache == "int8":
        return HEAD_DIM + 2 * (HEAD_DIM // INT8_GROUP)
    return 2 * HEAD_DIM


def cache_bytes(num_kv_heads: int, capacity: int, kv_cache: str = "bf16") -> int:
    """Size of one of a layer's two cache arrays (K or V)."""
    return num_kv_heads * capacity * row_bytes(kv_cache)


def _kernel_name(name: str, kv_cache: str) -> str:
    check_kv_cache(kv_cache)
    return name if kv_cache == "bf16" else f"{name}_{kv_cache}"


def partial_out_bytes(num_q_heads: int, num_splits: int, tokens: int = 1) -> int:
    """Scratch for the unnormalised per-split outputs of `tokens` tokens, reusable across
    layers."""
    return tokens * num_q_heads * num_splits * HEAD_DIM * 4


def partial_stats_bytes(num_q_heads: int, num_splits: int, tokens: int = 1) -> int:
    """Scratch for the per-split running max and sum of `tokens` tokens, reusable across
    layers."""
    return tokens * num_q_heads * num_splits * 2 * 4


def _check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if head_dim != HEAD_DIM:
        raise ValueError(f"the attention kernels need {HEAD_DIM}-dim heads, not {head_dim}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not share {num_kv_heads} kv heads")


def _check_splits_positive(num_splits: int) -> None:
    if num_splits <= 0:
        raise ValueError("num_splits must be positive")


def _check_decode(num_q_heads: int, num_kv_heads: int, num_splits: int) -> None:
    if num_q_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"the decode kernels take at most {MAX_GROUP} query heads per kv head")
    _check_splits_positive(num_splits)


def _check_tokens(tokens: int) -> None:
    if tokens <= 0:
        raise ValueError(f"a chunk needs at least one token, not {tokens}")


def _check_rows(row_slots: RowSlots) -> None:
    # The rows share the decode partials, which hold MAX_DECODE_TOKENS tokens' at most.
    if not 1 <= row_slots.rows <= MAX_DECODE_TOKENS:
        raise ValueError(
            f"a batched pass takes 1 to {MAX_DECODE_TOKENS} rows, not {row_slots.rows}"
        )


def record_attention_prepare(
    graph: Graph,
    device: Device,
    *,
    q_proj: BufferRef,
    k_proj: BufferRef,
    v_proj: BufferRef,
    q_norm: BufferRef,
    k_norm: BufferRef,
    step: BufferRef,
    queries: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    rotary_dim: int,
    rope_theta: float,
    norm_eps: float = 1e-6,
    tokens: int = 1,
    kv_cache: str = "bf16",
    head_dim: int = HEAD_DIM,
    rope_table: BufferRef | None = None,
    mrope_bounds: tuple[int, int] = (0, 0),
) -> None:
    """Normalise and rotate q and k of `tokens` tokens, write the queries, and append k and v to
    the cache; token t is at position step[0] + t.

    q_proj fp32 [T, Hq, 2, 256] (query | gate per head); k_proj, v_proj fp32 [T, Hkv, 256];
    q_norm, k_norm bf16 [256] (stored gains); queries fp32 [T, Hq, 256]; caches [Hkv, capacity]
    rows of the format `kv_cache`. Positions past the capacity are not written. `rope_table`,
    if given, is uint32 [capacity, 3]: the multimodal rotary positions of each cache slot, the
    streams interleaved below `mrope_bounds` (ModelConfig.mrope_bounds); without it a token
    rotates by its slot.
    """
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    _check_tokens(tokens)
    _check_rope(rotary_dim, capacity, rope_table)
    graph.dispatch(
        device.kernel(_kernel_name("attention_prepare", kv_cache)),
        threadgroups=(num_q_heads + num_kv_heads, tokens, 1),
        threads=(SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(q_proj),
            2: binding(k_proj),
            3: binding(v_proj),
            4: binding(q_norm),
            5: binding(k_norm),
            6: binding(step),
            7: binding(queries),
            8: binding(k_cache),
            9: binding(v_cache),
            10: binding(step if rope_table is None else rope_table),
        },
        bytes={
            0: pack_params(
                "IIIIff", num_q_heads, num_kv_heads, capacity, rotary_dim, rope_theta, norm_eps
            )
            + _mrope_params(rope_table, mrope_bounds)
        },
    )


def rope_table_bytes(capacity: int) -> int:
    """The rope-position table of `capacity` slots: three uint32 positions each."""
    return 3 * 4 * capacity


def _check_rope(rotary_dim: int, capacity: int, rope_table: BufferRef | None) -> None:
    if rotary_dim <= 0 or rotary_dim % (2 * SIMD_WIDTH) or rotary_dim > HEAD_DIM:
        raise ValueError(f"rotary_dim {rotary_dim} must be a positive multiple of 64 up to 256")
    if rope_table is not None:
        buffer, offset = binding(rope_table)
        if buffer.size - offset < rope_table_bytes(capacity):
            raise ValueError(f"the rope table needs {rope_table_bytes(capacity)} bytes")


def _mrope_params(rope_table: BufferRef | None, bounds: tuple[int, int]) -> bytes:
    """attention.metal's MropeParams."""
    return pack_params("III", int(rope_table is not None), *bounds)


def record_attention_decode(
    graph: Graph,
    device: Device,
    *,
    queries: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    step: BufferRef,
    partial_out: BufferRef,
    partial_stats: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    num_splits: int,
    kv_cache: str = "bf16",
    head_dim: int = HEAD_DIM,
) -> None:
    """Per-split softmax partials of every query head over the cached context (scale 1/16):
    partials fp32 [Hq, num_splits, 256] and stats [Hq, num_splits, 2] (max, sum), of which the
    splits the context reaches are written (`decode_splits(capacity)` covers the capacity)."""
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    _check_decode(num_q_heads, num_kv_heads, num_splits)
    graph.dispatch(
        device.kernel(_kernel_name("attention_decode", kv_cache)),
        threadgroups=(num_splits, num_kv_heads, 1),
        threads=(DECODE_THREADS, 1, 1),
        buffers={
            1: binding(queries),
            2: binding(k_cache),
            3: binding(v_cache),
            4: binding(step),
            5: binding(partial_out),
            6: binding(partial_stats),
        },
        bytes={
            0: pack_params("IIIIf", num_q_heads, num_kv_heads, capacity, num_splits, head_dim**-0.5)
        },
    )


def record_attention_decode_tokens(
    graph: Graph,
    device: Device,
    *,
    queries: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    step: BufferRef,
    partial_out: BufferRef,
    partial_stats: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    num_splits: int,
    tokens: int,
    kv_cache: str = "bf16",
    head_dim: int = HEAD_DIM,
) -> None:
    """`record_attention_decode` for `tokens` queries at once: query t (at position step[0] + t)
    attends to cache positions [0, step[0] + t], whose rows `record_attention_prepare` with the
    same `tokens` appended. queries fp32 [T, Hq, 256]; partials fp32 [T, Hq, num_splits, 256]
    and stats [T, Hq, num_splits, 2], the splits those of the context step[0] + T (a split a
    token does not see gets sum 0); `record_attention_combine` with `tokens=T` merges them.
    Scale 1/16."""
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    _check_decode(num_q_heads, num_kv_heads, num_splits)
    if not 1 <= tokens <= MAX_DECODE_TOKENS:
        raise ValueError(f"the kernel takes 1 to {MAX_DECODE_TOKENS} tokens, not {tokens}")
    graph.dispatch(
        device.kernel(_kernel_name("attention_decode_tokens", kv_cache)),
        threadgroups=(num_splits, num_kv_heads, 1),
        threads=(tokens * SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(queries),
            2: binding(k_cache),
            3: binding(v_cache),
            4: binding(step),
            5: binding(partial_out),
            6: binding(partial_stats),
        },
        bytes={
            0: pack_params(
                "IIIIIf", num_q_heads, num_kv_heads, capacity, num_splits, tokens, head_dim**-0.5
            )
        },
    )


def record_attention_decode_fused(
    graph: Graph,
    device: Device,
    *,
    q_proj: BufferRef,
    k_proj: BufferRef,
    v_proj: BufferRef,
    q_norm: BufferRef,
    k_norm: BufferRef,
    step: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    partial_out: BufferRef,
    partial_stats: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    rotary_dim: int,
    rope_theta: float,
    norm_eps: float = 1e-6,
    num_splits: int,
    kv_cache: str = "bf16",
    head_dim: int = HEAD_DIM,
    rope_table: BufferRef | None = None,
    mrope_bounds: tuple[int, int] = (0, 0),
    row_slots: RowSlots | None = None,
) -> None:
    """`record_attention_prepare` (one token) then `record_attention_decode`, in one dispatch
    with the same results: the caches get the rotated key and the value at step[0] (unless past
    the capacity), the partials are those of the context including it.

    With `row_slots`, every row of a batched pass in one dispatch: q_proj, k_proj and v_proj
    are [rows, ...]; row r runs on sequence slot s = `row_slots.table[r]`: its step at word
    STEP_FIELDS * s of `step`, its caches at s * `cache_bytes(...)` of `k_cache` and
    `v_cache`, and with `rope_table` its table at s * `rope_table_bytes(capacity)` of it
    (each slot's positions its own: an image's or identity); it leaves its partials at row r
    of [rows, Hq, num_splits] (those of `record_attention_decode_tokens`), for
    `record_attention_combine` with the same `row_slots`."""
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    _check_decode(num_q_heads, num_kv_heads, num_splits)
    _check_rope(rotary_dim, capacity, rope_table)
    buffers = {
        1: binding(q_proj),
        2: binding(k_proj),
        3: binding(v_proj),
        4: binding(q_norm),
        5: binding(k_norm),
        6: binding(step),
        7: binding(k_cache),
        8: binding(v_cache),
        9: binding(partial_out),
        10: binding(partial_stats),
        11: binding(step if rope_table is None else rope_table),
    }
    name, rows = "attention_decode_fused", 1
    if row_slots is not None:
        _check_rows(row_slots)
        buffers[12] = binding(row_slots.table)
        name, rows = "attention_decode_fused_rows", row_slots.rows
    graph.dispatch(
        device.kernel(_kernel_name(name, kv_cache)),
        threadgroups=(num_splits, num_kv_heads, rows),
        threads=(DECODE_THREADS, 1, 1),
        buffers=buffers,
        bytes={
            0: pack_params(
                "IIIIfIff",
                num_q_heads,
                num_kv_heads,
                capacity,
                num_splits,
                head_dim**-0.5,
                rotary_dim,
                rope_theta,
                norm_eps,
            )
            + _mrope_params(rope_table, mrope_bounds)
        },
    )


def record_attention_combine(
    graph: Graph,
    device: Device,
    *,
    partial_out: BufferRef,
    partial_stats: BufferRef,
    q_proj: BufferRef,
    step: BufferRef,
    out: BufferRef,
    num_q_heads: int,
    num_splits: int,
    tokens: int = 1,
    row_slots: RowSlots | None = None,
) -> None:
    """`out = attention * sigmoid(gate)`, fp32 [T, Hq, 256], gate read from q_proj's
    [T, Hq, 2, 256] second halves, for the partials of `record_attention_decode` (tokens 1) or
    `record_attention_decode_tokens`; `num_splits` is the decode grid's, and only the splits the
    context step[0] + tokens reaches are read. With `row_slots` (`tokens` left at 1), the
    partials of `record_attention_decode_fused` with the same table: T is its rows, and row r's
    context is that of the step of slot `row_slots.table[r]` in `step`."""
    _check_splits_positive(num_splits)
    _check_tokens(tokens)
    buffers = {
        1: binding(partial_out),
        2: binding(partial_stats),
        3: binding(q_proj),
        4: binding(out),
        5: binding(step),
    }
    name, rows = "attention_combine", tokens
    if row_slots is not None:
        if tokens != 1:
            raise ValueError("a batched pass's rows are one token each")
        _check_rows(row_slots)
        buffers[6] = binding(row_slots.table)
        name, rows = "attention_combine_rows", row_slots.rows
    graph.dispatch(
        device.kernel(name),
        threadgroups=(num_q_heads, HEAD_DIM // COMBINE_DIMS, rows),
        threads=(COMBINE_DIMS, 1, 1),
        buffers=buffers,
        bytes={0: pack_params("III", num_q_heads, num_splits, tokens)},
    )


def chunk_attention_on_tensor_ops(device: Device, kv_cache: str = "bf16") -> bool:
    """Whether `record_attention_chunk` records the tensor-op kernels on `device` for a cache of
    the format `kv_cache` (and so needs `packed_queries`)."""
    check_kv_cache(kv_cache)
    return device.tensor_ops and kv_cache == "bf16"


def packed_queries_bytes(num_q_heads: int, num_kv_heads: int, tokens: int) -> int:
    """The scratch the tensor-op chunk attention packs a chunk of `tokens` queries into: half
    [num_kv_heads, rows, 256], the rows (tokens x query heads per kv head) padded to whole
    threadgroups of TENSOR_CHUNK_ROWS."""
    rows = tokens * (num_q_heads // num_kv_heads)
    return 2 * num_kv_heads * ceil_div(rows, TENSOR_CHUNK_ROWS) * TENSOR_CHUNK_ROWS * HEAD_DIM


def record_attention_chunk(
    graph: Graph,
    device: Device,
    *,
    queries: BufferRef,
    q_proj: BufferRef,
    k_cache: BufferRef,
    v_cache: BufferRef,
    step: BufferRef,
    out: BufferRef,
    num_q_heads: int,
    num_kv_heads: int,
    capacity: int,
    tokens: int,
    kv_cache: str = "bf16",
    head_dim: int = HEAD_DIM,
    packed_queries: BufferRef | None = None,
) -> None:
    """Causal attention of a chunk's `tokens` queries, gated: `out = attention * sigmoid(gate)`.

    Query t (at position step[0] + t) attends to cache positions [0, step[0] + t], so the chunk's
    keys and values must already be appended (by `record_attention_prepare` with the same
    `tokens`) and step[0] + tokens <= capacity. queries fp32 [T, Hq, 256]; q_proj fp32
    [T, Hq, 2, 256], of which the gate halves are read; caches of the format `kv_cache`; out
    fp32 [T, Hq * 256], ready for o_proj. Scale 1/16.

    When `chunk_attention_on_tensor_ops`, the queries are first packed into `packed_queries`
    (at least `packed_queries_bytes`), then the tensor-op kernel runs, a barrier between them.
    """
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    _check_tokens(tokens)
    rows = tokens * (num_q_heads // num_kv_heads)
    params = pack_params("IIIIf", num_q_heads, num_kv_heads, capacity, tokens, head_dim**-0.5)
    caches_and_out = {
        2: binding(q_proj),
        3: binding(k_cache),
        4: binding(v_cache),
        5: binding(step),
        6: binding(out),
    }
    if not chunk_attention_on_tensor_ops(device, kv_cache):
        graph.dispatch(
            device.kernel(_kernel_name("attention_chunk", kv_cache)),
            threadgroups=(ceil_div(rows, CHUNK_ROWS), num_kv_heads, 1),
            threads=(CHUNK_THREADS, 1, 1),
            buffers={1: binding(queries), **caches_and_out},
            bytes={0: params},
        )
        return
    if packed_queries is None:
        raise ValueError("chunk attention on tensor ops needs a packed_queries buffer")
    buffer, offset = binding(packed_queries)
    needed = packed_queries_bytes(num_q_heads, num_kv_heads, tokens)
    if buffer.size - offset < needed:
        raise ValueError(
            f"packed_queries holds {buffer.size - offset} bytes, {tokens} tokens need {needed}"
        )
    tiles = ceil_div(rows, TENSOR_CHUNK_ROWS)
    graph.dispatch(
        device.kernel("attention_chunk_queries"),
        threadgroups=(tiles * TENSOR_CHUNK_ROWS, num_kv_heads, 1),
        threads=(SIMD_WIDTH, 1, 1),
        buffers={1: binding(queries), 2: binding(packed_queries)},
        bytes={0: params},
    )
    graph.barrier()
    graph.dispatch(
        device.kernel("attention_chunk_tensor"),
        threadgroups=(tiles, num_kv_heads, 1),
        threads=(TENSOR_CHUNK_THREADS, 1, 1),
        buffers={1: binding(packed_queries), **caches_and_out},
        bytes={0: params},
    )
