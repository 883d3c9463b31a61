"""A model (not a measurement: nothing here runs on a GPU) of prefill time on Apple GPUs, chunk by
chunk over a whole prompt, for `bench_prefill.py --context`.

**A chunk.** Its kernel groups run one after another (a layer's kernels depend on each other);
each takes the longer of its bytes at the memory bandwidth and its executed FLOPs at the rate of
what runs them. Chunk attention's executed FLOPs are those of the kernel that runs
(`attention_flops`): `attention_chunk`'s SIMD-groups multiply 8 rows by every 16-key tile up to
the last position the SIMD-group's last token sees; `attention_chunk_tensor`'s threadgroups (the
M5's tensor ops, a bf16 cache) 64 rows by every 32-key tile up to their last token's. On top:
the Gated DeltaNet scan's serial work (`gdn_scan_model.py`), a drain per barrier level (the
tensor-op attention adds one per attention layer, between packing the queries and the kernel)
and a gap per command buffer. The bytes counted:

- weights (`bench_prefill.weight_bytes_per_chunk`): the routed experts once per chunk, the
  dense projections once per 1,024-token launch band of their GEMMs (`BAND_TOKENS`: a band's
  token tiles run side by side over every weight tile in turn, so the GEMM's input is read
  about once, as the activations below count it, at up to 4 reads of the 0.8 GB of projections
  per 4,096-token chunk; launched x-major, as before, the weights were read once but the 32 MiB
  fp32 input of a 4,096-token chunk streamed once per 128-row weight tile unless the system
  cache held it, which the model did not count);
- the KV cache as `attention_chunk` reads it: a threadgroup takes 64 (token, query head) rows of
  one KV head (`CHUNK_ROWS`: 8 tokens, as 8 query heads share a KV head) and streams the K and V
  rows of every position its last token sees, once, in 16-key tiles; so each attention layer
  reads the cache about T / 8 times per KV head, not once (T / 4 with the 32-row tiles it had
  before). `attention_chunk_tensor` streams it alike (64 rows, 32-key tiles). Caches may serve
  part of it; the model counts it all from memory;
- the tensor-op attention's queries (`query_bytes`): packed once per layer (fp32 read, half
  written and read back), then its 64 x 256 half tile read again by every 32-key tile's
  S = Q K^T, as matmul2d takes it from device memory (32 KiB, the whole threadgroup memory, so
  it cannot be staged). Those re-reads equal the K and V bytes; a threadgroup's tile is 32 KiB,
  ~2.5 MB for the 80 threadgroups of a 40-core GPU, which the model takes as served by the GPU's
  caches in its central and fast cases and counts from memory in its slow one;
- activations: every buffer the pass hands between its dispatches (`activation_widths`, the MoE
  chunk scratch) written once and read once by each layer that uses it, fp32 today (about 20 MB
  per token over the 40 layers); half with issue 40's item 2 (not built).

**A whole prompt** is prefilled from position 0 in chunks of up to 4,096 tokens, each the
longest whose costliest layer fits the Mac's command-buffer budget (`longest_chunk`,
`command_buffer_budget`): late in a long prompt chunks get shorter and the weights are re-read
per chunk. Its average is the prompt's tokens over the sum of its chunks' times: what the
anchors publish (docs/benchmarks.md), so the two compare like with like.

**GPU figures** (published specifications, not measured here): memory bandwidth; the fp32 rate
cores x 128 lanes x 2 x clock (`command_buffer_budget.fp32_flops`; half-precision simdgroup
FMAs issue at the same rate up to the M4, Philip Turner's metal-benchmarks); the M5's tensor
units at 4x that rate for half operands (Apple: the M5 GPU's neural accelerators give over 4x
the M4's peak GPU compute for AI).

**Efficiencies** are assumptions, given as (slow, central, fast) fractions of the peak rather
than one figure, so every estimate is a range:
- quantized GEMMs on half simdgroup tiles 40-60-70%: MLX's authors report its steel GEMMs at
  60-70% of the M-series peak; ours dequantize 4-bit weights in the loop, hence the low end;
- tensor-op GEMMs 30-50-60% of the tensor units' peak (never compiled by Apple's compiler yet);
- chunk attention 25-40-50% of the rate of what runs its products: the online softmax sits
  between its two products, and each SIMD-group of `attention_chunk` holds 8 rows, so every K or
  V fragment it loads from threadgroup memory feeds one product (a GEMM reuses a loaded fragment
  across a 2x2 or larger block). For comparison, metal-flash-attention's README (Philip Turner)
  reports its dense FlashAttention forward at 90.5% of the ALU peak on an M1 Max at small head
  dims, and names register pressure at head dim 256 as its limit; the range stays below that.
  The same range for `attention_chunk_tensor` on the tensor units: nothing published measures
  attention on them (Apple's figure is end to end: up to ~4x the M4's time to first token with
  MLX, Apple Machine Learning Research, "Exploring LLMs with MLX and the Neural Accelerators in
  the M5 GPU"), and its softmax between the products runs on the ALUs, with 4 barriers per tile
  and O's 128 fp32 accumulators per thread;
- memory 70-80-85% of peak bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gdn_scan_model import Gpu as ScanGpu
from gdn_scan_model import chunkwise_kernel, per_token_seconds

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig
from lily.engine.command_buffer_budget import command_buffer_flops, fp32_flops, gpu_clock_hz
from lily.engine.model_graph import (
    DEFAULT_MAX_CHUNK,
    activation_widths,
    command_buffer_starts,
    longest_chunk,
    token_macs,
)
from lily.kernels.attention import (
    CHUNK_ROWS,
    CHUNK_TILE_KEYS,
    TENSOR_CHUNK_ROWS,
    TENSOR_CHUNK_TILE_KEYS,
    packed_queries_bytes,
)
from lily.kernels.moe_chunk import moe_chunk_scratch_bytes

SLOW, CENTRAL, FAST = 0, 1, 2
MEMORY_EFFICIENCY = (0.7, 0.8, 0.85)
LEVEL_SECONDS = 2e-6  # a memory barrier in a concurrent encoder drains the GPU
COMMAND_BUFFER_SECONDS = 30e-6  # commit and schedule gap between command buffers
TENSOR_UNIT_SPEEDUP = 4.0
# attention_chunk's SIMD-groups: (token, query head) rows each, the products' 8x8 fragments.
SIMDGROUP_ROWS = 8
# Activations only a GDN layer or only an attention layer passes (the rest every layer does).
GDN_ACTIVATIONS = ("qkv_projected", "qkv", "z", "a", "b", "gdn_out")
ATTENTION_ACTIVATIONS = ("q", "k", "v", "queries", "attn_out")


@dataclass(frozen=True)
class Gpu:
    name: str  # as the tables print it
    metal_name: str  # as Metal names it, which the command-buffer budget reads
    cores: int
    bandwidth: float  # bytes/s
    tensor_units: bool

    @property
    def fp32_rate(self) -> float:
        return fp32_flops(self.metal_name, self.cores)

    @property
    def command_buffer_flops(self) -> float:
        return command_buffer_flops(self.metal_name, self.cores)


GPUS = (
    Gpu("M1 Pro", "Apple M1 Pro", 16, 200e9, False),
    Gpu("M4 Max", "Apple M4 Max", 40, 546e9, False),
    Gpu("M5 Max", "Apple M5 Max", 40, 614e9, True),
)


@dataclass(frozen=True)
class Path:
    """How the prefill kernels run: what executes the products, at which efficiencies, the
    chunk attention's query tile and the activations' element size."""

    name: str
    gemm_efficiency: tuple[float, float, float]  # of the rate of what runs the GEMMs
    attention_efficiency: tuple[float, float, float]
    tensor_ops: bool  # the GEMMs run on tensor units
    attention_tensor_ops: bool  # so do attention's two products
    query_rows: int  # (token, query head) rows of a chunk-attention threadgroup
    activation_bytes: int  # per element
    built: bool  # False: an estimate for kernels that do not exist yet


HALF_GEMM, TENSOR_GEMM, ATTENTION = (0.4, 0.6, 0.7), (0.3, 0.5, 0.6), (0.25, 0.4, 0.5)
# The built kernels: on every Mac the GEMMs and chunk attention on simdgroup matrices (64-row
# tiles); on an M5 both on tensor ops with a bf16 cache, and with an int8 cache the GEMMs only
# (its chunk attention keeps attention_chunk).
SIMDGROUP = Path("simdgroup tiles", HALF_GEMM, ATTENTION, False, False, CHUNK_ROWS, 4, True)
TENSOR_OPS = Path("tensor ops", TENSOR_GEMM, ATTENTION, True, True, TENSOR_CHUNK_ROWS, 4, True)
TENSOR_GEMMS = Path(
    "tensor-op GEMMs, simdgroup attention: an int8 cache",
    TENSOR_GEMM,
    ATTENTION,
    True,
    False,
    CHUNK_ROWS,
    4,
    True,
)
# Not built: issue 40's item 2 (half activations) on top, at the same efficiencies.
LEAN = Path(
    "tensor ops, half activations", TENSOR_GEMM, ATTENTION, True, True, TENSOR_CHUNK_ROWS, 2, False
)


@dataclass(frozen=True)
class Group:
    name: str
    bytes: float
    flops: float  # executed, not only useful
    attention: bool = False
    # Re-reads the model takes as cache hits, except in its slow case (from memory there).
    cached_bytes: float = 0.0


def _tiled_keys(
    c: ModelConfig, start: int, tokens: int, rows: int, tile_keys: int = CHUNK_TILE_KEYS
) -> int:
    """Keys summed over the row blocks of one KV head of a chunk of `tokens` starting at
    `start`: each block of `rows` consecutive (token, query head) rows takes every key its last
    token sees, rounded up to whole tiles of `tile_keys`."""
    group = c.num_attention_heads // c.num_key_value_heads
    total_rows = tokens * group
    total = 0
    for first in range(0, total_rows, rows):
        visible = start + (min(first + rows, total_rows) - 1) // group + 1
        total += math.ceil(visible / tile_keys) * tile_keys
    return total


def kv_bytes(
    c: ModelConfig, start: int, tokens: int, query_rows: int, tile_keys: int = CHUNK_TILE_KEYS
) -> float:
    """Bytes of K and V (bf16) the chunk attention of every attention layer reads for a chunk of
    `tokens` starting at `start`: each threadgroup of `query_rows` rows streams every key its last
    token sees, rounded up to whole tiles of `tile_keys`."""
    row = 2 * c.head_dim * 2  # a position's K and V of one KV head
    keys = _tiled_keys(c, start, tokens, query_rows, tile_keys)
    return float(len(c.full_attention_layers) * c.num_key_value_heads * row * keys)


def attention_flops(c: ModelConfig, start: int, tokens: int, tensor_ops: bool = False) -> float:
    """FLOPs the chunk attention of every attention layer executes for a chunk of `tokens`
    starting at `start`, head_dim multiply-adds per row and key for S = Q K^T and as many for
    P V: `attention_chunk`'s SIMD-groups multiply their 8 rows (query rows past a group's or the
    chunk's end included) by every 16-key tile up to their last token's position; with
    `tensor_ops`, `attention_chunk_tensor`'s threadgroups their 64 rows by every 32-key tile."""
    if tensor_ops:
        rows, keys = TENSOR_CHUNK_ROWS, TENSOR_CHUNK_TILE_KEYS
    else:
        rows, keys = SIMDGROUP_ROWS, CHUNK_TILE_KEYS
    per_kv_head = rows * _tiled_keys(c, start, tokens, rows, keys) * 2 * c.head_dim * 2
    return float(len(c.full_attention_layers) * c.num_key_value_heads * per_kv_head)


def query_bytes(c: ModelConfig, start: int, tokens: int) -> tuple[float, float]:
    """(memory, re-read) bytes of the tensor-op chunk attention's queries over every attention
    layer: attention_chunk_queries reads the fp32 queries and writes them as half, padded per
    KV head to whole 64-row tiles, which attention_chunk_tensor reads back; then every further
    32-key tile of a threadgroup reads its 64 x 256 half tile again (the re-reads)."""
    q_heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    packed = packed_queries_bytes(q_heads, kv_heads, tokens)
    memory = 4 * tokens * q_heads * c.head_dim + 2 * packed
    tiles = _tiled_keys(c, start, tokens, TENSOR_CHUNK_ROWS, TENSOR_CHUNK_TILE_KEYS)
    tiles //= TENSOR_CHUNK_TILE_KEYS
    reads = kv_heads * tiles * TENSOR_CHUNK_ROWS * c.head_dim * 2
    layers = len(c.full_attention_layers)
    return float(layers * memory), float(layers * (reads - packed))


def activation_traffic(c: ModelConfig, tokens: int, element_bytes: int) -> tuple[float, float]:
    """(dense, MoE) activation bytes of a chunk: each buffer a layer uses written once and read
    once. The MoE chunk scratch's few index words are scaled with the rest."""
    widths = activation_widths(c, max(tokens, 2))
    shared = sum(w for n, w in widths.items() if n not in GDN_ACTIVATIONS + ATTENTION_ACTIVATIONS)
    gdn = sum(widths[n] for n in GDN_ACTIVATIONS)
    attention = sum(widths[n] for n in ATTENTION_ACTIVATIONS)
    attention_layers = len(c.full_attention_layers)
    gdn_layers = c.num_hidden_layers - attention_layers
    per_token = shared * c.num_hidden_layers + gdn * gdn_layers + attention * attention_layers
    moe_shape = (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
        c.hidden_size,
    )
    moe_per_token = (
        moe_chunk_scratch_bytes(*moe_shape, 1) - moe_chunk_scratch_bytes(*moe_shape, 0)
    ) // 4  # 4-byte words
    dense = 2.0 * element_bytes * per_token * tokens
    moe = 2.0 * element_bytes * moe_per_token * c.num_hidden_layers * tokens
    return dense, moe


def groups(
    c: ModelConfig,
    start: int,
    tokens: int,
    weight_bytes: dict[str, float],
    expert_executed_ratio: float,
    path: Path,
    predicts: bool,
) -> list[Group]:
    """The work per kernel group of a chunk of `tokens` starting at `start`, reading the weights
    `weight_bytes` names (bench_prefill.weight_bytes_per_chunk), the routed experts executing
    `expert_executed_ratio` times their useful matrix work (tile padding); the lm_head only
    when the chunk `predicts` (the prompt's last)."""
    macs = token_macs(c)
    attention_layers = len(c.full_attention_layers)
    gdn_layers = c.num_hidden_layers - attention_layers
    projections = gdn_layers * macs.gdn + attention_layers * macs.attention
    dense_activations, moe_activations = activation_traffic(c, tokens, path.activation_bytes)
    work = [
        Group(
            "dense projections",
            weight_bytes.get("projections", 0.0) + dense_activations,
            2.0 * tokens * (projections + c.num_hidden_layers * macs.shared),
        ),
        Group(
            "routed experts",
            weight_bytes.get("routed experts", 0.0) + moe_activations,
            2.0 * tokens * c.num_hidden_layers * macs.experts * expert_executed_ratio,
        ),
    ]
    if path.attention_tensor_ops:
        queries, rereads = query_bytes(c, start, tokens)
        kv = kv_bytes(c, start, tokens, path.query_rows, TENSOR_CHUNK_TILE_KEYS)
        work.append(
            Group(
                "chunk attention",
                kv + queries,
                attention_flops(c, start, tokens, tensor_ops=True),
                attention=True,
                cached_bytes=rereads,
            )
        )
    else:
        work.append(
            Group(
                "chunk attention",
                kv_bytes(c, start, tokens, path.query_rows),
                attention_flops(c, start, tokens),
                attention=True,
            )
        )
    if predicts:
        lm_head = 2.0 * c.hidden_size * c.vocab_size
        work.append(Group("lm_head (1 token)", weight_bytes.get("lm_head", 0.0), lm_head))
    return work


def seconds(
    c: ModelConfig,
    gpu: Gpu,
    path: Path,
    work: list[Group],
    levels: int,
    command_buffers: int,
    tokens: int,
    case: int = CENTRAL,
) -> dict[str, float]:
    """Seconds per kernel group, plus the Gated DeltaNet scan (its products and solve, as
    `gdn_scan_model.py` counts them) and the barrier and command-buffer overheads, for one
    chunk of `tokens` on `gpu` along `path`, at the `case` (SLOW, CENTRAL, FAST) efficiencies."""
    out = {group.name: max(group_terms(gpu, path, group, case)) for group in work}
    scan_gpu = ScanGpu(gpu.name, gpu.cores, gpu_clock_hz(gpu.metal_name), 64 * 1024, 1024)
    per_token, _, _ = per_token_seconds(chunkwise_kernel(), scan_gpu)
    out["GDN scan"] = per_token * tokens * gdn_layer_count(c)
    out["barrier levels"] = levels * LEVEL_SECONDS
    out["command buffers"] = command_buffers * COMMAND_BUFFER_SECONDS
    return out


def group_terms(gpu: Gpu, path: Path, group: Group, case: int = CENTRAL) -> tuple[float, float]:
    """(memory, compute) seconds of one kernel group on `gpu` along `path` at the `case`
    efficiencies: its bytes at the bandwidth, its executed FLOPs at the rate of what runs them.
    The group takes the longer."""
    if path.tensor_ops and not gpu.tensor_units:
        raise ValueError(f"{gpu.name} has no tensor units")
    tensor_rate = TENSOR_UNIT_SPEEDUP * gpu.fp32_rate if gpu.tensor_units else 0.0
    if group.attention:
        peak = tensor_rate if path.attention_tensor_ops else gpu.fp32_rate
        rate = peak * path.attention_efficiency[case]
    else:
        peak = tensor_rate if path.tensor_ops else gpu.fp32_rate
        rate = peak * path.gemm_efficiency[case]
    nbytes = group.bytes + (group.cached_bytes if case == SLOW else 0.0)
    return nbytes / (gpu.bandwidth * MEMORY_EFFICIENCY[case]), group.flops / rate


@dataclass(frozen=True)
class WholePrompt:
    tokens_per_second: tuple[float, float, float]  # SLOW, CENTRAL, FAST
    chunks: list[int]  # tokens of each chunk, in order
    # The central case's seconds summed over the chunks, per kernel group as (memory, compute)
    # (`group_terms`; it took the longer) and for the scan and overheads as (0, seconds).
    central_terms: dict[str, tuple[float, float]]


# A chunk's weight bytes and executed/useful expert ratio, given its token count.
ChunkWeights = Callable[[int], tuple[dict[str, float], float]]


def whole_prompt(
    c: ModelConfig, gpu: Gpu, path: Path, prompt: int, chunk_weights: ChunkWeights, levels: int
) -> WholePrompt:
    """The average over a prompt of `prompt` tokens prefilled from position 0 in chunks of up to
    DEFAULT_MAX_CHUNK tokens within `gpu`'s command-buffer budget, each chunk's graph recorded
    for a context of `prompt` (its command buffers) with `levels` barrier levels on simdgroup
    attention, one more per attention layer on tensor-op attention."""
    budget = gpu.command_buffer_flops
    if path.attention_tensor_ops:
        levels += len(c.full_attention_layers)
    chunks, start = [], 0
    while start < prompt:
        tokens = longest_chunk(c, start, min(DEFAULT_MAX_CHUNK, prompt - start), budget)
        chunks.append(tokens)
        start += tokens
    totals = [0.0, 0.0, 0.0]
    central: dict[str, tuple[float, float]] = {}
    start = 0
    for tokens in chunks:
        weights, ratio = chunk_weights(tokens)
        predicts = start + tokens == prompt
        work = groups(c, start, tokens, weights, ratio, path, predicts)
        buffers = len(command_buffer_starts(c, prompt, tokens, budget)) + 1
        for case in (SLOW, CENTRAL, FAST):
            parts = seconds(c, gpu, path, work, levels, buffers, tokens, case)
            totals[case] += sum(parts.values())
        terms = {group.name: group_terms(gpu, path, group) for group in work}
        for name, spent in seconds(c, gpu, path, work, levels, buffers, tokens).items():
            memory, compute = terms.get(name, (0.0, spent))
            old = central.get(name, (0.0, 0.0))
            central[name] = (old[0] + memory, old[1] + compute)
        start += tokens
    rates = (prompt / totals[SLOW], prompt / totals[CENTRAL], prompt / totals[FAST])
    return WholePrompt(rates, chunks, central)


def gdn_layer_count(c: ModelConfig) -> int:
    return sum(1 for kind in c.layer_types if kind != FULL_ATTENTION)
