"""The model as recorded graphs of dispatches: one builder for every token count.

A decode step and a prefill chunk are the same 40-layer walk at T = 1 and T > 1 tokens; this
module records both from one place, choosing kernels by T (GEMV for one token, GEMM for a
chunk; the step kernels of the Gated DeltaNet and attention, or their chunk forms; the
one-token MoE, or the grouped chunk MoE). A graph for a given T is recorded once, kept, and
replayed at any position: every kernel that needs the position reads it from the step buffer.

A pass over T tokens starting at `position` (the step buffer's first field) reads their ids from
the token history, runs the layers, and then:
- when it `predicts` (the decode step, and the chunk holding the prompt's last token): only the
  last token goes through the final norm, `lm_head` and the sampler, and the step buffer advances
  to the predicted token, which is appended to the history;
- otherwise (an earlier prompt chunk) it skips them and advances by T.
The host therefore only submits; it never writes between passes, and a chunk leaves the conv
windows, GDN state, KV cache and step buffer exactly as the decode step expects them.

The decode step (T = 1) has no norm dispatches: every residual add and RMSNorm is folded into its
neighbours. The layer's output projections (and the MoE down kernel) add their result to the
residual in place, and the projections that consume a norm read the residual and apply the norm
themselves (`FoldedNorm`); that removes two dependent levels per layer. Likewise the GDN's conv
step runs in the epilogue of its input projection (`FoldedConvStep`), the MoE routing inside the
expert gate/up kernel, and attention's prepare (q/k norms, RoPE, KV append) inside the
split-context decode kernel. Nor has the decode step an embedding dispatch: layer 0's first GEMV
(GDN or attention) reads the token's embedding row from the quantized table itself and writes it
to the residual (`EmbeddedInput`, `_Recorder.decode_layer_input`). A chunk keeps those
dispatches: its GEMMs read the normed activations many times over, and its kernels already
amortise their levels over T tokens. A verify pass (at most 9 tokens, through the GEMV-shaped
kernels) folds them as the decode step does, per token, but for the embedding lookup (one
dispatch) and attention's prepare (a level before the multi-query attention).

Activations stay fp32 between kernels (decode is bound by reading weights, so this costs nothing
and keeps the engine close to the reference); the KV cache is bf16 or int8 (`kv_cache`, the
formats of kernels/attention.py) and the GDN state fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig
from lily.checkpoint.mtp import (
    MTP_FC,
    MTP_FINAL_NORM,
    MTP_LAYER,
    MTP_NORM_EMBEDDING,
    MTP_NORM_HIDDEN,
)
from lily.device import Graph
from lily.engine.command_buffer_budget import command_buffer_flops
from lily.engine.constraint import mask_words
from lily.engine.device_weights import DeviceWeights
from lily.kernels import BufferRef, RowSlots, attention, offset_by
from lily.kernels.conv1d import (
    FoldedConvStep,
    record_conv1d_chunk,
    record_conv1d_commit,
    record_conv1d_step,
    tail_bytes,
    window_bytes,
)
from lily.kernels.copy import record_copy, record_copy_flagged_rows
from lily.kernels.embedding import EmbeddedInput, record_embedding, record_embedding_rows
from lily.kernels.gdn import (
    CHUNK_SUB_CHUNK,
    VerifyUpdates,
    record_gdn_chunk,
    record_gdn_commit,
    record_gdn_gated_norm,
    record_gdn_step,
    record_gdn_tokens,
    state_bytes,
    verify_updates_bytes,
)
from lily.kernels.gdn_out_proj import record_gdn_out_proj
from lily.kernels.moe import MoeScratch, MoeWeights, record_moe
from lily.kernels.moe_chunk import MoeChunkScratch, moe_chunk_scratch_bytes, record_moe_chunk
from lily.kernels.norm import FoldedNorm, record_add_rms_norm, record_rms_norm
from lily.kernels.quant_weight import GROUP_SIZE, QuantWeight, copy_quant_weight
from lily.kernels.quantized import MAX_TOKENS as GEMV_MAX_TOKENS
from lily.kernels.quantized import record_qgemv
from lily.kernels.quantized_gemm import record_qgemm, record_qgemm_row_exponents
from lily.kernels.sampling import (
    MAX_DRAFTS,
    SAMPLING_PARAMS_BYTES,
    LogitAdjustments,
    PassOutcome,
    StepBookkeeping,
    accepted_bytes,
    logprob_ring_bytes,
    outcome_ring_bytes,
    read_outcome,
    record_accept_drafts,
    record_draft_argmax,
    record_follow_kept_row,
    record_sample,
    sample_partials_bytes,
    token_mask_bytes,
    token_mask_words,
)
from lily.kernels.step import STEP_FIELDS, record_step_advance

if TYPE_CHECKING:
    from lily.checkpoint.loader import Checkpoint
    from lily.device import Buffer, Device

MODEL = "language_model.model."
# Log-probability slots the sampler cycles through, keyed by position: the engine reads a decode
# step's slot with at most one more step in flight, and a verify pass's 9 rows (positions in a
# row) all at once after it, so 16 leave margin for both.
LOGPROB_RING_SLOTS = 16
# Verify passes' outcomes the host reads, keyed by position (`record_accept_drafts`): two passes
# in flight start at most 9 positions apart, so neither overwrites the other's entry.
OUTCOME_RING_SLOTS = 16
LM_HEAD = "language_model.lm_head"
EMBED_TOKENS = MODEL + "embed_tokens"
# Prefill chunk lengths, longest first: each weight is read once per chunk, so longer chunks
# amortise it better and fill the experts' tiles; the scratch grows with the chunk (1.1 GiB at
# 4,096 tokens for the real model), so `lily.load` takes the longest the memory allows.
PREFILL_CHUNKS = (4096, 2048, 1024, 512)
DEFAULT_MAX_CHUNK = PREFILL_CHUNKS[0]
# The default budget of a command buffer's estimated work: the slowest supported GPU's
# (`command_buffer_budget`); `lily.load` gives the metal device its own Mac's.
COMMAND_BUFFER_FLOPS = command_buffer_flops("", 0)
# The sim has no watchdog, but cancellation and prompt progress are checked between command
# buffers, and the sim is about a thousand times slower: the demo model runs about 1.2e9
# estimated flops a second on a loaded 2-core x86 machine, so command buffers of at most this
# much work take well under a second there (a 4,096-token chunk in one command buffer took
# over a minute before its first progress report).
SIM_COMMAND_BUFFER_FLOPS = 5.0e8
# The most drafted tokens one verify pass checks; its logits rows are one more (the last
# accepted token's prediction comes first).
MAX_DRAFT_TOKENS = MAX_DRAFTS
# The MTP head drafts from the first this many ids of the vocabulary: byte-level BPE numbers its
# tokens in merge order, so the low ids are the common ones (the real vocabulary's 248,320 ids
# append rarer, mostly multilingual, tokens), and the head's lm_head, 0.29 GB at the real dims,
# the largest read of a draft, shrinks to a quarter. A draft is only a proposal: the verify pass
# reads the whole lm_head, so the output is the same; a token past the draft vocabulary is just
# never drafted.
MTP_DRAFT_VOCAB = 65536


class SlotRegion(tuple):
    """One batched-decode slot's part of a `_SlotPool` buffer: a `(buffer, byte_offset)` pair,
    which the recorders take as any BufferRef, with a Buffer's `numpy()` and `size`, so that the
    host reads and writes a slot's state as it does a sequence's own buffers."""

    size: int

    def __new__(cls, buffer: Buffer, offset: int, size: int) -> SlotRegion:
        region = super().__new__(cls, (buffer, offset))
        region.size = size
        return region

    def numpy(self) -> np.ndarray:
        buffer, offset = self
        return buffer.numpy()[offset : offset + self.size]


@dataclass
class SequenceState:
    """Device buffers a pass reads and writes, besides the weights: the sequence's state (a
    batched-decode slot's, all but its logits, are `SlotRegion`s of its `_SlotPool`)."""

    step: Buffer | SlotRegion  # uint32 [position, prompt_end, token]
    history: Buffer | SlotRegion  # uint32 [capacity]: prompt then generated ids
    logits: Buffer  # fp32 [vocab]: the last predicting pass's
    predicted: Buffer | SlotRegion  # uint32 [1]: the token the last predicting pass sampled
    # the sampler's settings, written by the host between generations
    sampling_params: Buffer | SlotRegion
    logprob_ring: Buffer | SlotRegion  # per-step log-probabilities, LOGPROB_RING_SLOTS slots
    # the allowed tokens of the next draw, written by the host before it
    token_mask: Buffer | SlotRegion
    adjustments: LogitAdjustments  # logit bias and penalty inputs, written per generation
    # GDN layer -> fp32 [K-1, C]
    conv_windows: dict[int, Buffer | SlotRegion] = field(default_factory=dict)
    # GDN layer -> fp32 [Hv, Dv, Dk]
    recurrent: dict[int, Buffer | SlotRegion] = field(default_factory=dict)
    # attention layer -> KV rows
    k_cache: dict[int, Buffer | SlotRegion] = field(default_factory=dict)
    v_cache: dict[int, Buffer | SlotRegion] = field(default_factory=dict)

    def recurrent_buffers(self) -> list[Buffer | SlotRegion]:
        """Everything that must start from zero for a new sequence (the KV cache needs no
        clearing: attention reads only positions already written)."""
        return [*self.conv_windows.values(), *self.recurrent.values()]


# A slot's per-sequence kinds of state in a `_SlotPool`, as SequenceState names them (the
# adjustments' in LogitAdjustments' order).
_SEQUENCE_KINDS = ("step", "history", "predicted", "sampling_params", "logprob_ring", "token_mask")
_ADJUSTMENT_KINDS = ("bias", "counts", "prompt_tokens")


class _SlotPool:
    """The batched-decode slots' state, which the per-row kernels reach through a `RowSlots`
    table: each kind (`_SEQUENCE_KINDS`, `_ADJUSTMENT_KINDS`, the rotary-position table of a
    model that takes images, and per layer the conv windows, GDN states, K and V caches) in one
    buffer holding the slots one after another, slot s at s times one sequence's size of it."""

    def __init__(
        self, c: ModelConfig, device: Device, capacity: int, token_count: int, kv_cache: str,
        count: int,
    ) -> None:  # fmt: skip
        # (kind, layer or None): one slot's bytes
        self.sizes: dict[tuple[str, int | None], int] = {
            ("step", None): 4 * STEP_FIELDS,
            ("history", None): 4 * capacity,
            ("predicted", None): 4,
            ("sampling_params", None): SAMPLING_PARAMS_BYTES,
            ("logprob_ring", None): logprob_ring_bytes(LOGPROB_RING_SLOTS),
            ("token_mask", None): token_mask_bytes(token_count),
            ("bias", None): 4 * token_count,
            ("counts", None): 4 * token_count,
            ("prompt_tokens", None): 4 * mask_words(token_count),
        }
        if c.takes_images:
            # Each slot's own (`ModelGraph.slot_rope_table_view`): an image's positions are its
            # sequence's, not those of the others decoding beside it.
            self.sizes[("rope_table", None)] = attention.rope_table_bytes(capacity)
        for i, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION:
                nbytes = attention.cache_bytes(c.num_key_value_heads, capacity, kv_cache)
                self.sizes[("k_cache", i)] = self.sizes[("v_cache", i)] = nbytes
            else:
                self.sizes[("conv_windows", i)] = window_bytes(c.linear_conv_dim)
                self.sizes[("recurrent", i)] = state_bytes(c.linear_num_value_heads)
        self.buffers = {key: device.alloc(count * size) for key, size in self.sizes.items()}

    def copy_from(self, smaller: _SlotPool) -> None:
        """The slots of a smaller pool keep their state in this one."""
        for key, buffer in smaller.buffers.items():
            self.buffers[key].numpy()[: buffer.size] = buffer.numpy()

    def region(self, slot: int, kind: str, layer: int | None = None) -> SlotRegion:
        size = self.sizes[(kind, layer)]
        return SlotRegion(self.buffers[(kind, layer)], slot * size, size)

    def sequence_fields(self, slot: int) -> dict:
        """Slot `slot`'s regions of the per-sequence kinds, by SequenceState's field names."""
        fields: dict = {kind: self.region(slot, kind) for kind in _SEQUENCE_KINDS}
        fields["adjustments"] = LogitAdjustments(
            *(self.region(slot, kind) for kind in _ADJUSTMENT_KINDS)
        )
        return fields

    def place(self, slot: int, state: SequenceState) -> None:
        """Points `state`'s buffers, all but its logits, at slot `slot`'s regions."""
        for name, region in self.sequence_fields(slot).items():
            setattr(state, name, region)
        for kind, layer in self.sizes:
            if layer is not None:
                getattr(state, kind)[layer] = self.region(slot, kind, layer)

    def buffer(self, kind: str, layer: int | None = None) -> Buffer:
        """Every slot's `kind`, the buffer a per-row kernel binds."""
        return self.buffers[(kind, layer)]

    def adjustments(self) -> LogitAdjustments:
        return LogitAdjustments(*(self.buffer(kind) for kind in _ADJUSTMENT_KINDS))


def recurrent_state_bytes(c: ModelConfig) -> int:
    """The conv windows and GDN states of every GDN layer."""
    return _gdn_layers(c) * (
        state_bytes(c.linear_num_value_heads) + window_bytes(c.linear_conv_dim)
    )


def _gdn_layers(c: ModelConfig) -> int:
    return c.num_hidden_layers - len(c.full_attention_layers)


def _candidate_bytes(c: ModelConfig, candidates: int) -> int:
    """One GDN layer's record of a verify pass's candidate positions: the GDN's updates
    (`VerifyUpdates`), then the conv's tail from `_tail_offset`."""
    return _tail_offset(c, candidates) + tail_bytes(c.linear_conv_dim, candidates)


def _tail_offset(c: ModelConfig, candidates: int) -> int:
    """Where the conv's tail starts in a layer's record: after the updates, 16-byte aligned."""
    updates = verify_updates_bytes(c.linear_num_key_heads, c.linear_num_value_heads, candidates)
    return -(-updates // 16) * 16


def verify_bytes(c: ModelConfig, token_count: int) -> int:
    """What verify passes allocate on first use: the rows' logits, the sampler's partials for
    one draw per row, the rows' token masks, the draws, the acceptance and its outcome ring, and
    each GDN layer's record of the candidate positions (`_candidate_bytes`; 16.7 MiB on the real
    model, where a copy of the recurrent state takes 63 MiB)."""
    rows = MAX_DRAFT_TOKENS + 1
    logits = 4 * rows * c.vocab_size
    sampler = sample_partials_bytes(token_count, rows) + token_mask_bytes(token_count, rows)
    sampler += 4 * rows + 4
    candidates = _gdn_layers(c) * _candidate_bytes(c, rows)
    acceptance = accepted_bytes(MAX_DRAFT_TOKENS) + outcome_ring_bytes(OUTCOME_RING_SLOTS)
    return logits + sampler + acceptance + candidates


@dataclass(frozen=True)
class VerifyStateTraffic:
    """The recurrent state's bytes a verify pass moves beyond its weights and activations."""

    copied: int  # copies of the state (a backup, a restore): none
    read: int
    written: int


def verify_state_traffic(c: ModelConfig, tokens: int, rows: int) -> VerifyStateTraffic:
    """What the recurrent state costs a verify pass over `tokens` tokens checking rows - 1
    drafts (`ModelGraph.verify_graph`): gdn_tokens reads each GDN state once, and writes it
    back only when tokens come before the candidates (tokens > rows; never in the engine, which
    feeds one waiting token); each candidate's update (key, deltas, decay) is written once;
    gdn_commit reads the state and those updates and writes the state once. The conv's windows
    are read, their tails written and read back (counted whole: the commits read fewer).
    Nothing is copied: on the real model 205, 209 and 212 MB at T = 2, 3 and 4 (the GDN state,
    63 MB, read twice and written once; 3.4 MB more per candidate), where the backup and
    restore this replaces moved 264 MB (the state, 66 MB with the windows, read and written by
    the backup and by the chunk kernels) and 395 MB after a rejection, before the re-feed of
    the accepted tokens."""
    gdn = _gdn_layers(c)
    state = gdn * state_bytes(c.linear_num_value_heads)
    windows = gdn * window_bytes(c.linear_conv_dim)
    candidates = gdn * _candidate_bytes(c, rows)
    rewritten = state if tokens > rows else 0
    return VerifyStateTraffic(
        copied=0,
        read=2 * state + windows + candidates,
        written=state + rewritten + windows + candidates,
    )


# Activations only a chunk passes between its dispatches: the decode step folds the norms and
# residual adds, the GDN's conv and attention's prepare into the kernels around them.
_CHUNK_ONLY_ACTIVATIONS = (
    "normed",
    "mixer_out",
    "moe_out",
    "qkv_projected",
    "queries",
    "guard_exponents",
)


def activation_widths(c: ModelConfig, max_chunk: int) -> dict[str, int]:
    """fp32 elements per token of each activation passed between the dispatches of passes of
    up to `max_chunk` tokens."""
    q_heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    widths = {
        "residual": c.hidden_size,
        "normed": c.hidden_size,
        "mixer_out": c.hidden_size,
        "moe_out": c.hidden_size,
        # Gated DeltaNet
        "qkv_projected": c.linear_conv_dim,
        "qkv": c.linear_conv_dim,
        "z": c.linear_value_dim,
        "a": c.linear_num_value_heads,
        "b": c.linear_num_value_heads,
        "gdn_out": c.linear_value_dim,
        # Gated attention
        "q": q_heads * 2 * c.head_dim,
        "k": kv_heads * c.head_dim,
        "v": kv_heads * c.head_dim,
        "queries": q_heads * c.head_dim,
        "attn_out": q_heads * c.head_dim,
        # int32: the range guard's exponent of each row of a mixer output the GEMM reads
        "guard_exponents": 1,
    }
    if max_chunk == 1:
        for name in _CHUNK_ONLY_ACTIVATIONS:
            del widths[name]
    return widths


def _moe_shape(c: ModelConfig) -> tuple[int, int, int, int]:
    return (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
    )


class _Scratch:
    """Activations passed between the dispatches of one pass, reused by every layer and sized
    for the longest chunk: [max_chunk, width] fp32 each (widths in `activation_widths`). The
    chunk-only ones are None when max_chunk is 1."""

    residual: Buffer
    normed: Buffer | None
    mixer_out: Buffer | None
    moe_out: Buffer | None
    qkv_projected: Buffer | None
    qkv: Buffer
    z: Buffer
    a: Buffer
    b: Buffer
    gdn_out: Buffer
    q: Buffer
    k: Buffer
    v: Buffer
    queries: Buffer | None
    attn_out: Buffer
    guard_exponents: Buffer | None
    packed_queries: Buffer | None
    decode_splits: int

    def __init__(
        self, c: ModelConfig, device: Device, max_chunk: int, capacity: int, kv_cache: str
    ) -> None:
        for name in _CHUNK_ONLY_ACTIVATIONS:
            setattr(self, name, None)
        for name, width in activation_widths(c, max_chunk).items():
            setattr(self, name, device.alloc(4 * width * max_chunk))
        q_heads = c.num_attention_heads
        # The half queries the tensor-op chunk attention packs per kv head.
        self.packed_queries = (
            device.alloc(_packed_queries_bytes(c, max_chunk))
            if max_chunk > attention.MAX_DECODE_TOKENS
            and attention.chunk_attention_on_tensor_ops(device, kv_cache)
            else None
        )
        # The decode attention's grid covers the capacity; its partials are sized for that grid
        # and, for a verify pass's attention, per token.
        self.decode_splits = splits = attention.decode_splits(capacity)
        attention_tokens = min(max_chunk, attention.MAX_DECODE_TOKENS)
        self.partial_out = device.alloc(
            attention.partial_out_bytes(q_heads, splits, attention_tokens)
        )
        self.partial_stats = device.alloc(
            attention.partial_stats_bytes(q_heads, splits, attention_tokens)
        )
        # A verify pass's or a batched pass's few tokens run the MoE's few-token kernels.
        few_tokens = min(max_chunk, GEMV_MAX_TOKENS)
        self.moe = MoeScratch.allocate(device, *_moe_shape(c), tokens=few_tokens)
        # Sized for the whole vocabulary, at least what the sampler's token count needs.
        self.sample_partials = device.alloc(sample_partials_bytes(c.vocab_size))
        self.moe_chunk = (
            MoeChunkScratch.allocate(device, *_moe_shape(c), c.hidden_size, max_chunk)
            if max_chunk > 1
            else None
        )


def _packed_queries_bytes(c: ModelConfig, max_chunk: int) -> int:
    return attention.packed_queries_bytes(c.num_attention_heads, c.num_key_value_heads, max_chunk)


def scratch_bytes(c: ModelConfig, max_chunk: int) -> int:
    """What the per-pass scratch of a ModelGraph allocates for chunks of up to `max_chunk`, at
    most: the packed queries of the tensor-op chunk attention are counted on every device."""
    activations = 4 * max_chunk * sum(activation_widths(c, max_chunk).values())
    chunk_moe = moe_chunk_scratch_bytes(*_moe_shape(c), c.hidden_size, max_chunk)
    sampler = 4 * c.vocab_size + sample_partials_bytes(c.vocab_size)
    packed = _packed_queries_bytes(c, max_chunk) if max_chunk > attention.MAX_DECODE_TOKENS else 0
    return activations + (chunk_moe if max_chunk > 1 else 0) + sampler + packed


def kv_cache_bytes_per_token(c: ModelConfig, kv_cache: str, mtp: bool = False) -> int:
    """One position's keys and values over every attention layer (and the MTP head's, with
    `mtp`), in the format `kv_cache`."""
    layers = len(c.full_attention_layers) + int(mtp)
    return 2 * layers * attention.cache_bytes(c.num_key_value_heads, 1, kv_cache)


def slot_bytes(c: ModelConfig, capacity: int, token_count: int, kv_cache: str = "bf16") -> int:
    """What one batched-decode slot (`ModelGraph.allocate_slots`) allocates: a whole sequence
    state for `capacity` tokens (its KV cache, conv windows and GDN states, step, history,
    logits, sampler settings, log-probability ring, token mask, logit adjustments, and for a
    model that takes images its rotary-position table) and its row of the batched pass's
    logits and sampler partials."""
    kv = capacity * kv_cache_bytes_per_token(c, kv_cache)
    adjustments = 2 * 4 * token_count + 4 * mask_words(token_count)
    sampler = SAMPLING_PARAMS_BYTES + logprob_ring_bytes(LOGPROB_RING_SLOTS)
    sampler += sample_partials_bytes(token_count)
    sampler += token_mask_bytes(token_count) + adjustments
    small = 4 * STEP_FIELDS + 4 * capacity + 4 + 2 * 4 * c.vocab_size
    if c.takes_images:
        small += attention.rope_table_bytes(capacity)
    return kv + recurrent_state_bytes(c) + sampler + small


def device_bytes(
    checkpoint: Checkpoint,
    capacity: int,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    kv_cache: str = "bf16",
    mtp: bool = False,
) -> int:
    """What a ModelGraph keeps on the device: the wrapped shards, the KV cache for `capacity`
    tokens in the format `kv_cache`, the recurrent state, (bounded above) the per-pass
    scratch, what verify passes allocate (`verify_bytes`, when chunks may take two tokens),
    and with `mtp` the MTP head's KV cache, hidden states, logits and fc halves."""
    c = checkpoint.config
    weights = sum(shard.size for shard in checkpoint.shards.values())
    kv = capacity * kv_cache_bytes_per_token(c, kv_cache, mtp)
    if mtp:
        h = c.hidden_size
        fc_halves = 2 * h * (h * 4 // 8 + 2 * 2 * (h // 64))  # 4-bit codes, bf16 scales, biases
        # hidden states, output, logits, fc halves, step, the drafts of one draft pass
        kv += 4 * h * (max_chunk + 1) + 4 * c.vocab_size + fc_halves + 4 + 4 * MAX_DRAFT_TOKENS
    splits = attention.decode_splits(capacity)
    attention_tokens = min(max_chunk, attention.MAX_DECODE_TOKENS)
    partials = attention.partial_out_bytes(c.num_attention_heads, splits, attention_tokens)
    partials += attention.partial_stats_bytes(c.num_attention_heads, splits, attention_tokens)
    small = partials + 4 * capacity + (1 << 20)
    if c.takes_images:
        # The rope-position table, and the staged image rows of a chunk with their flags.
        small += attention.rope_table_bytes(capacity) + 4 * (c.hidden_size + 1) * max_chunk
    # Verify passes need chunks of two tokens at least.
    verify = verify_bytes(c, c.vocab_size) if max_chunk > 1 else 0
    recurrent = recurrent_state_bytes(c)
    return weights + kv + recurrent + scratch_bytes(c, max_chunk) + small + verify


@dataclass(frozen=True)
class TokenMacs:
    """Multiply-adds one token costs in each kind of layer's projections (the model's weights
    in `layer_flops`, and the benchmarks' time models)."""

    gdn: int  # a GDN layer's in_proj qkv, z, a, b and out_proj
    attention: int  # an attention layer's q (with its gate), k, v and o projections
    shared: int  # a layer's router, shared-expert gate and shared expert
    experts: int  # a layer's chosen experts (gate, up and down each)


def token_macs(c: ModelConfig) -> TokenMacs:
    d = c.hidden_size
    gdn = d * (2 * c.linear_key_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return TokenMacs(
        gdn=gdn + c.linear_value_dim * d,
        attention=d * (2 * q + 2 * kv) + q * d,
        shared=d * (c.num_experts + 1) + 3 * d * c.shared_expert_intermediate_size,
        experts=c.num_experts_per_tok * 3 * d * c.moe_intermediate_size,
    )


# ALU instructions per weight: unpacking a code (shift, mask, convert) and one FMA per token.
# The decode step's GEMVs and the MoE's few-token path unpack per token (4 per weight and
# token); `qgemv_tokens` (a verify pass's projections and lm_head) unpacks once for all its
# tokens (3 + 1 per token).
UNPACK_OPS_PER_WEIGHT = 3
FMA_OPS_PER_WEIGHT_TOKEN = 1
# Where an Apple GPU turns from bandwidth- to ALU-bound: fp32 instructions per byte read at 80%
# of the peak bandwidth, an FMA being one instruction and two of the published FLOPs. 18.7 on
# an M5 Max (18.4 TFLOP/s, 614 GB/s), 18.5 on an M4 Max (16.2, 546), 16 on an M1 Pro (5.2,
# 200): benchmarks/prefill_model.py's figures, published specs.
RIDGE_OPS_PER_BYTE = 18.4e12 / 2 / (0.8 * 614e9)


@dataclass(frozen=True)
class PassTraffic:
    """What a pass of a few tokens costs a bandwidth-bound GPU: the weight bytes it reads and
    the ALU operations its GEMVs run."""

    weight_bytes: float
    gemv_ops: float


def pass_traffic(c: ModelConfig, tokens: int) -> PassTraffic:
    """A decode step's (1 token) or a verify pass's (2 to 9, run by the GEMV-shaped kernels)
    weight traffic: every projection and the lm_head read once, and each expert some token
    chose read once, at the expected number of distinct experts when each token chooses
    num_experts_per_tok of num_experts uniformly; the ALU work grows with every token (the
    projections' codes unpacked once, the experts' once per token)."""
    macs = token_macs(c)
    layers, d = c.num_hidden_layers, c.hidden_size
    attention_layers = len(c.full_attention_layers)

    def bytes_per_weight(path: str) -> float:
        spec = c.quant_for(path)
        return (spec.bits + 2 * 16 / spec.group_size) / 8  # codes, a bf16 scale and bias per group

    router = d * (c.num_experts + 1)  # the router and the shared-expert gate, often 8-bit
    dense = (layers - attention_layers) * macs.gdn + attention_layers * macs.attention
    dense += layers * (macs.shared - router)
    head = d * c.vocab_size
    expert = macs.experts // c.num_experts_per_tok
    chosen = c.num_experts_per_tok / c.num_experts
    distinct = c.num_experts * (1 - (1 - chosen) ** tokens)
    weights = dense + head + layers * distinct * expert
    weight_bytes = weights * bytes_per_weight(LM_HEAD)
    weight_bytes += layers * router * bytes_per_weight(MODEL + "layers.0.mlp.gate")
    projections = dense + head + layers * router
    experts = layers * c.num_experts_per_tok * expert
    per_token = UNPACK_OPS_PER_WEIGHT + FMA_OPS_PER_WEIGHT_TOKEN
    unpacked_once = UNPACK_OPS_PER_WEIGHT + FMA_OPS_PER_WEIGHT_TOKEN * tokens
    return PassTraffic(weight_bytes, projections * unpacked_once + experts * per_token * tokens)


def verify_cost_ratio(c: ModelConfig, drafts: int) -> float:
    """How many decode steps' time a verify pass checking `drafts` drafts costs, on a roofline
    at RIDGE_OPS_PER_BYTE: a pass takes max(bytes, ops / RIDGE_OPS_PER_BYTE) byte-times, the
    verify pass's bytes including what its recurrent state moves beyond a decode step's one
    read and write of it (`verify_state_traffic`). Drafting pays when a pass yields more tokens
    than this on average."""

    def byte_times(tokens: int, extra: float) -> float:
        traffic = pass_traffic(c, tokens)
        return max(traffic.weight_bytes + extra, traffic.gemv_ops / RIDGE_OPS_PER_BYTE)

    state = verify_state_traffic(c, drafts + 1, drafts + 1)
    extra = state.read + state.written - 2.0 * recurrent_state_bytes(c)
    return byte_times(drafts + 1, extra) / byte_times(1, 0.0)


def layer_flops(c: ModelConfig, start: int, tokens: int) -> list[float]:
    """Multiply-adds x 2 of each layer (mixer and MoE) in a pass over positions
    [start, start + tokens): every projection and the chosen experts per token, plus, in an
    attention layer, attention over each token's context (which makes a chunk late in a long
    prompt cost more than an early one)."""
    macs = token_macs(c)
    moe = macs.shared + macs.experts
    # Scores and weighted values: 2 * q-width multiply-adds per context position.
    contexts = tokens * start + tokens * (tokens + 1) // 2
    attention = tokens * (macs.attention + moe) + 2 * c.num_attention_heads * c.head_dim * contexts
    linear = tokens * (macs.gdn + moe)
    return [2.0 * (attention if kind == FULL_ATTENTION else linear) for kind in c.layer_types]


def command_buffer_starts(
    c: ModelConfig, capacity: int, tokens: int, budget: float | None = None
) -> set[int]:
    """The layers that start a new command buffer in a pass over `tokens` tokens: layers are
    grouped, in order, so that no group's estimated work exceeds `budget` (default
    COMMAND_BUFFER_FLOPS) at the longest context the pass can see (a graph is recorded once and
    replayed at any position). A decode step and a short chunk stay one command buffer; a layer
    over budget gets one of its own, and the engine keeps a chunk short enough that every layer
    fits (`DeviceEngine`)."""
    budget = COMMAND_BUFFER_FLOPS if budget is None else budget
    starts, pending = set(), 0.0
    for i, flops in enumerate(layer_flops(c, max(capacity - tokens, 0), tokens)):
        if i > 0 and pending + flops > budget:
            starts.add(i)
            pending = 0.0
        pending += flops
    return starts


def longest_chunk(c: ModelConfig, start: int, most: int, budget: float | None) -> int:
    """Tokens of the chunk starting at `start`: at most `most`, and the most whose costliest
    layer fits `budget` (one token at least), rounded down to whole GDN sub-chunks
    (CHUNK_SUB_CHUNK tokens) when there are any: such a cut changes no bit of what the prompt
    computes. No budget: `most`."""

    def costliest_layer(n: int) -> float:
        return max(layer_flops(c, start, n))

    if budget is None or costliest_layer(most) <= budget:
        return most
    fits, over = 1, most  # layer_flops grows with tokens: bisect
    while over - fits > 1:
        middle = (fits + over) // 2
        if costliest_layer(middle) <= budget:
            fits = middle
        else:
            over = middle
    return fits - fits % CHUNK_SUB_CHUNK if fits >= CHUNK_SUB_CHUNK else fits


def pass_flops(c: ModelConfig, start: int, tokens: int) -> float:
    """Multiply-adds x 2 of a pass over positions [start, start + tokens) (`layer_flops`
    summed). The lm_head is left out: a pass runs it for a few tokens at most."""
    return sum(layer_flops(c, start, tokens))


class ModelGraph:
    """The sequence state, the scratch, and the recorded pass graphs over them."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: Device,
        capacity: int,
        token_count: int,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        kv_cache: str = "bf16",
        mtp: bool = False,
        command_buffer_flops: float | None = None,
        draft_vocab: int = MTP_DRAFT_VOCAB,
        kept_layers: Sequence[int] = (),
    ) -> None:
        """`token_count`: ids the tokenizer can produce. The lm_head has padding rows past it
        (248320 vs 248077 on the real model) that must never be chosen. `max_chunk`: the most
        tokens one pass may take (1 records only the decode step). `kv_cache`: the KV cache's
        format, "bf16" or "int8". `mtp`: run the checkpoint's multi-token-prediction head
        (`mtp_graph`); every pass then also leaves the final-normed hidden state of each of its
        tokens in `mtp_hidden` for the head to read. `command_buffer_flops`: the most estimated
        work of one command buffer of a pass (`command_buffer_starts`; default
        COMMAND_BUFFER_FLOPS). `draft_vocab`: the head's lm_head reads only the rows of the
        first that many ids (`MTP_DRAFT_VOCAB`). `kept_layers`: layers whose outputs (the
        residual after them) every pass but a batched one copies into `layer_outputs`, what the
        DFlash drafter reads (docs/dflash.md); none by default."""
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        attention.check_kv_cache(kv_cache)
        if mtp and not checkpoint.has_mtp_head:
            raise ValueError("the checkpoint has no multi-token-prediction head (mtp.*)")
        if mtp and max_chunk < 2:
            raise ValueError("the MTP head drafts for verify passes, which need max_chunk >= 2")
        self.kv_cache = kv_cache
        self.mtp = mtp
        self.command_buffer_flops = command_buffer_flops
        self.config = checkpoint.config
        self.device = device
        self.capacity = capacity
        self.token_count = token_count
        self.draft_vocab = min(token_count, draft_vocab)
        self.max_chunk = max_chunk
        self.weights = DeviceWeights(checkpoint, device)
        self.state = self._allocate_state()
        self._scratch = _Scratch(self.config, device, max_chunk, capacity, kv_cache)
        self._graphs: dict[tuple[int, bool, int, bool], Graph] = {}
        self._batch_graphs: dict[tuple[int, ...], Graph] = {}
        self._verify: _VerifyBuffers | None = None
        # A model that takes images rotates by the rope-position table (M-RoPE; identity rows
        # until a prompt with images writes it), and a chunk holding image tokens copies their
        # rows, staged by the host, over the embeddings (`graph(..., images=True)`).
        self.rope_table: Buffer | None = None
        if self.config.takes_images:
            self.rope_table = device.alloc(attention.rope_table_bytes(capacity))
            self.rope_table_view()[:] = np.arange(capacity, dtype=np.uint32)[:, None]
            self.image_rows = device.alloc(4 * self.config.hidden_size * max_chunk)
            self.image_flags = device.alloc(4 * max_chunk)
        if mtp:
            self._allocate_mtp(checkpoint)
        # The last layer's output is left in the residual by predicting passes only.
        if any(not 0 <= i < self.config.num_hidden_layers - 1 for i in kept_layers):
            raise ValueError(
                f"kept layers must be below the last, {self.config.num_hidden_layers - 1}: "
                f"{list(kept_layers)}"
            )
        self.kept_layers = tuple(kept_layers)
        # [len(kept_layers), max_chunk, hidden]: a pass's rows of each kept layer, first rows on.
        self.layer_outputs = (
            device.alloc(4 * len(kept_layers) * max_chunk * self.config.hidden_size)
            if kept_layers
            else None
        )
        # Batched decode (`batch_graph`): the sequences' own states, and one logits row each.
        self.slots: list[SequenceState] = []
        self._slot_pool: _SlotPool | None = None
        self._batch_logits: Buffer | None = None
        self._batch_partials: Buffer | None = None
        self._row_slots: dict[tuple[int, ...], RowSlots] = {}
        self.decode = self.graph(1, predicts=True)

    def graph(self, tokens: int, *, predicts: bool, images: bool = False) -> Graph:
        """The pass over `tokens` tokens, recorded on first use. With `images` (2 tokens at
        least: a one-token pass reads its embedding inside its first GEMV), the rows
        `image_rows_view` flags in `image_flags_view` replace those tokens' embeddings."""
        if not 1 <= tokens <= self.max_chunk:
            raise ValueError(f"a pass takes 1 to {self.max_chunk} tokens, got {tokens}")
        if images and (tokens < 2 or self.rope_table is None):
            raise ValueError("a pass with image rows takes 2 tokens at least, on a model with them")
        key = (tokens, predicts, 0, images)
        if key not in self._graphs:
            self._graphs[key] = _Recorder(self, tokens, predicts, images=images).record()
        return self._graphs[key]

    def allocate_slots(self, count: int) -> None:
        """At least `count` sequence slots for batched decode, each a whole sequence state (its
        KV cache at the full capacity, conv windows, GDN states, step, history, sampling
        settings, mask and penalty counts: `slot_bytes`), apart from `state`, which prefills.
        Slots already allocated keep their state. Each kind of the slots' state (all but their
        logits) lies in one buffer (`_SlotPool`), where a batched pass's per-row kernels find
        each row's by its slot."""
        if self.max_chunk < 2:
            raise ValueError("batched decode needs max_chunk >= 2 (it uses the chunk activations)")
        most = min(self.max_chunk, GEMV_MAX_TOKENS)
        if not 1 <= count <= most:
            raise ValueError(
                f"batched decode takes 1 to {most} slots (max_chunk {self.max_chunk}), got {count}"
            )
        if count <= len(self.slots):
            return
        pool = _SlotPool(
            self.config, self.device, self.capacity, self.token_count, self.kv_cache, count
        )
        if self._slot_pool is not None:
            pool.copy_from(self._slot_pool)
        self._slot_pool = pool
        for slot, state in enumerate(self.slots):
            pool.place(slot, state)
        self.slots += [self._allocate_slot(pool, slot) for slot in range(len(self.slots), count)]
        self._batch_logits = self.device.alloc(4 * count * self.config.vocab_size)
        self._batch_partials = self.device.alloc(sample_partials_bytes(self.token_count, count))
        self._batch_graphs.clear()  # they use the smaller pool, logits and partials

    def batch_graph(self, slots: Sequence[int]) -> Graph:
        """One decode step of each slot in `slots` in one pass over the weights: row b of the
        pass is slot slots[b]'s newest token. The projections, the MoE and the lm_head read
        each weight once for all rows; the conv, the GDN step, attention and the sampler run per
        row on that slot's own state, each slot's step advancing as a decode step's does."""
        key = tuple(slots)
        if not key or len(set(key)) != len(key) or not all(0 <= i < len(self.slots) for i in key):
            raise ValueError(f"a batched pass takes distinct allocated slots, got {key}")
        if key not in self._batch_graphs:
            if key not in self._row_slots:
                table = self.device.alloc(4 * len(key))
                table.numpy().view(np.uint32)[:] = key
                self._row_slots[key] = RowSlots(table, len(key))
            rows = [self.slots[i] for i in key]
            recorder = _Recorder(self, len(rows), True, batch=rows, row_slots=self._row_slots[key])
            self._batch_graphs[key] = recorder.record()
        return self._batch_graphs[key]

    def rope_table_view(self) -> np.ndarray:
        """The multimodal rotary positions of each cache slot (uint32 [capacity, 3]: temporal,
        height, width), written by the host before it submits a generation's first pass."""
        assert self.rope_table is not None, "a text-only model rotates by the slot"
        return self.rope_table.numpy().view(np.uint32).reshape(self.capacity, 3)

    def slot_rope_table_view(self, slot: int) -> np.ndarray:
        """Batched-decode slot `slot`'s own `rope_table_view`, which a batched pass rotates its
        row by: written by the host when a sequence moves into the slot."""
        assert self._slot_pool is not None and self.rope_table is not None
        region = self._slot_pool.region(slot, "rope_table").numpy()
        return region.view(np.uint32).reshape(self.capacity, 3)

    def stage_image_rows(self, rows: np.ndarray, flags: np.ndarray) -> None:
        """The rows an images pass puts over its tokens' embeddings: `flags` [T] marks the
        tokens, `rows` [flags.sum(), hidden] are theirs in order. No pass may be in flight."""
        hidden = self.config.hidden_size
        staged = self.image_rows.numpy().view(np.float32).reshape(self.max_chunk, hidden)
        staged[: len(flags)][flags] = rows
        self.image_flags.numpy().view(np.uint32)[: len(flags)] = flags

    def verify_graph(self, tokens: int, rows: int) -> Graph:
        """The verify pass of speculative decoding: the pass over `tokens` tokens (2 to
        max_chunk) whose last `rows` (at most MAX_DRAFT_TOKENS + 1) go through the final norm
        and the lm_head into `verify_logits_view`; the history holds the rows - 1 drafts after
        the position in `verify_position_view` (the token row 0 consumes). The sampler draws one
        token per row, row g keyed on that position + g and obeying row g's mask in
        `verify_token_masks`, and `accept_drafts` keeps the drafts the draws agree with, for
        `pass_outcome` to read; all on the device. The recurrent state is
        then the state after the last token before the rows' drafts and the accepted drafts:
        the GDN and conv kernels keep what each of the last `rows` tokens adds to it, and
        after the acceptance apply as many as it kept (`record_gdn_commit`,
        `record_conv1d_commit`), so neither a copy of the state nor a re-feed is needed. The
        acceptance points the step buffer and the verify position at the first token the state
        has not consumed (the model's own token), so that the next pass may be queued before the
        host reads this one (`pass_outcome`)."""
        if not 2 <= tokens <= self.max_chunk:
            raise ValueError(f"a verify pass takes 2 to {self.max_chunk} tokens, got {tokens}")
        most = min(tokens, MAX_DRAFT_TOKENS + 1)
        if not 1 <= rows <= most:
            raise ValueError(
                f"a verify pass over {tokens} tokens predicts 1 to {most} rows, got {rows}"
            )
        key = (tokens, False, rows, False)
        if key not in self._graphs:
            if self._verify is None:
                self._verify = _VerifyBuffers(self.config, self.device, self.token_count)
            self._graphs[key] = _Recorder(self, tokens, False, verify_rows=rows).record()
        return self._graphs[key]

    def verify_position_view(self) -> np.ndarray:
        """The verify pass's position (uint32 [1]), written by the host before it submits."""
        return self._verify_buffers.position.numpy().view(np.uint32)

    @property
    def verify_token_masks(self) -> Buffer:
        """The verify pass's token masks, one per row (`write_token_masks`), written by the host
        before it submits."""
        return self._verify_buffers.token_masks

    def pass_outcome(self, position: int, drafts: int) -> PassOutcome:
        """What the verify pass of `drafts` drafts that consumed the token at `position` decided:
        the drafts, then its accepted drafts and the model's own token (`NO_TOKEN` when that
        row's logits were refused). Its entry outlives the pass queued behind it."""
        outcomes = self._verify_buffers.outcomes
        return read_outcome(outcomes, OUTCOME_RING_SLOTS, position, drafts)

    @property
    def _verify_buffers(self) -> _VerifyBuffers:
        if self._verify is None:
            raise RuntimeError("no verify pass has been recorded")
        return self._verify

    @property
    def mtp_layer(self) -> int:
        """The key of the MTP layer's KV cache in the state: the index after the main layers."""
        return self.config.num_hidden_layers

    def mtp_graph(self, rows: int, *, chained: bool, head: bool) -> Graph:
        """The MTP head over `rows` positions from `mtp_step_view()[0]` = p: row t pairs a hidden
        state with the embedding of the token at p + t + 1 in the history, and writes the head's
        KV row at p + t. The hidden states are the main pass's `mtp_hidden` rows 0..rows-1, or
        (`chained`, one row) the head's own last output. With `head`, the last row goes on
        through the MoE, the head's final norm (into the output `chained` reads) and the
        lm_head into `mtp_logits_view`; without, the pass only fills the head's KV cache."""
        if not self.mtp:
            raise RuntimeError("this ModelGraph was made without the MTP head")
        if not 1 <= rows <= self.max_chunk or (chained and rows != 1):
            raise ValueError(f"an MTP pass takes 1 to {self.max_chunk} rows (chained: 1)")
        key = (rows, chained, head)
        if key not in self._mtp_graphs:
            self._mtp_graphs[key] = _Recorder(self, rows, False).record_mtp(chained, head)
        return self._mtp_graphs[key]

    def mtp_draft_graph(self, rows: int, drafts: int) -> Graph:
        """`drafts` greedy drafts of the MTP head in one command buffer: the head over `rows`
        rows from `mtp_step_view()[0]` (as `mtp_graph(rows, chained=False, head=True)`), its
        argmax into the history after the newest token (`record_draft_argmax`, which also moves
        the head's step to that token), then `drafts - 1` chained passes, each followed by its
        argmax. The drafts are then in the history from the newest token's position + 1 on, and in
        `mtp_drafts_view()` (which a verify pass run after it leaves as they were): the host
        reads them after one round trip instead of one per draft."""
        if not self.mtp:
            raise RuntimeError("this ModelGraph was made without the MTP head")
        if not 1 <= rows <= self.max_chunk or not 1 <= drafts <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"a draft pass takes 1 to {self.max_chunk} rows and 1 to {MAX_DRAFT_TOKENS} drafts"
            )
        key = (rows, drafts)
        if key not in self._mtp_draft_graphs:
            graph = Graph()
            for index in range(drafts):
                self._record_head_draft(graph, rows if index == 0 else 1, index > 0, index)
            self._mtp_draft_graphs[key] = graph
        return self._mtp_draft_graphs[key]

    def mtp_follow_graph(self, rows: int, drafts: int) -> Graph:
        """`drafts` greedy drafts of the MTP head after a verify pass of `rows` rows that the
        host has not read, in one command buffer queued behind it: the head's step goes to the
        pass's first position (`record_follow_kept_row`), the head runs over all `rows` rows
        (`mtp_graph(rows, chained=False, head=False)`: the KV rows past the kept ones are
        rewritten by the next catch-up, as the main cache's are), then from the row the
        acceptance kept (its hidden state copied to the head's output, the step moved to it)
        `drafts` chained passes each followed by its argmax, as `mtp_draft_graph`'s. The drafts
        are in the history after the model's own token, where the verify pass queued after
        this reads them."""
        if not self.mtp:
            raise RuntimeError("this ModelGraph was made without the MTP head")
        most = min(self.max_chunk, MAX_DRAFT_TOKENS + 1)
        if not 2 <= rows <= most or not 1 <= drafts <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"a head following a verify pass takes 2 to {most} rows and 1 to "
                f"{MAX_DRAFT_TOKENS} drafts, got {rows} and {drafts}"
            )
        key = (rows, drafts)
        if key not in self._mtp_follow_graphs:
            verify, hidden = self._verify_buffers, self.config.hidden_size
            graph = Graph()
            follow = dict(
                position=verify.position,
                accepted=verify.accepted,
                rows=self.mtp_hidden,
                kept=self.mtp_out,
                head_step=self.mtp_step,
                hidden=hidden,
            )
            record_follow_kept_row(graph, self.device, kept_row=False, **follow)
            graph.barrier()
            _Recorder(self, rows, False, graph=graph).record_mtp(chained=False, head=False)
            graph.barrier()
            record_follow_kept_row(graph, self.device, kept_row=True, **follow)
            graph.barrier()
            for index in range(drafts):
                self._record_head_draft(graph, 1, True, index)
            self._mtp_follow_graphs[key] = graph
        return self._mtp_follow_graphs[key]

    def _record_head_draft(self, graph: Graph, tokens: int, chained: bool, index: int) -> None:
        """One pass of the head over `tokens` rows (from the main model's rows, or `chained`
        from its own previous draft) and the argmax over its last row that writes draft
        `index` into the history and `mtp_drafts`."""
        _Recorder(self, tokens, False, graph=graph).record_mtp(chained=chained, head=True)
        graph.barrier()
        record_draft_argmax(
            graph,
            self.device,
            logits=self.mtp_logits,
            vocab=self.draft_vocab,
            rows=tokens,
            step=self.mtp_step,
            history=self.state.history,
            capacity=self.capacity,
            drafts=self.mtp_drafts,
            index=index,
        )
        graph.barrier()

    def mtp_drafts_view(self) -> np.ndarray:
        """The last `mtp_draft_graph`'s drafts (uint32 [MAX_DRAFT_TOKENS], the first `drafts`)."""
        return self.mtp_drafts.numpy().view(np.uint32)

    def mtp_step_view(self) -> np.ndarray:
        """The MTP pass's first position (uint32 [1]), written by the host before it submits."""
        return self.mtp_step.numpy().view(np.uint32)

    def mtp_logits_view(self) -> np.ndarray:
        return self.mtp_logits.numpy().view(np.float32)

    def _allocate_mtp(self, checkpoint: Checkpoint) -> None:
        c, dev = self.config, self.device
        h = c.hidden_size
        nbytes = attention.cache_bytes(c.num_key_value_heads, self.capacity, self.kv_cache)
        self.state.k_cache[self.mtp_layer] = dev.alloc(nbytes)
        self.state.v_cache[self.mtp_layer] = dev.alloc(nbytes)
        self.mtp_hidden = dev.alloc(4 * h * self.max_chunk)
        self.mtp_out = dev.alloc(4 * h)
        self.mtp_step = dev.alloc(4)
        self.mtp_drafts = dev.alloc(4 * MAX_DRAFT_TOKENS)
        self.mtp_logits = dev.alloc(4 * c.vocab_size)
        self._mtp_graphs: dict[tuple[int, bool, bool], Graph] = {}
        self._mtp_draft_graphs: dict[tuple[int, int], Graph] = {}
        self._mtp_follow_graphs: dict[tuple[int, int], Graph] = {}
        # fc reads [embedding | hidden]: the halves of its inputs are separate GEMMs over
        # separate activations, so each half's columns are copied out once (they are
        # interleaved row by row in the stored matrix; groups of 64 never straddle the halves).
        tensors = checkpoint.tensors
        words = h * 4 // 32
        groups = h // GROUP_SIZE
        weight, scales = tensors[MTP_FC + ".weight"], tensors[MTP_FC + ".scales"]
        biases = tensors[MTP_FC + ".biases"]
        self.mtp_fc_embedding = copy_quant_weight(
            dev, weight[:, :words], scales[:, :groups], biases[:, :groups]
        )
        self.mtp_fc_hidden = copy_quant_weight(
            dev, weight[:, words:], scales[:, groups:], biases[:, groups:]
        )

    # -- buffers ----------------------------------------------------------------------------

    def _allocate_state(self) -> SequenceState:
        c, dev = self.config, self.device
        state = SequenceState(
            step=dev.alloc(4 * STEP_FIELDS),
            history=dev.alloc(4 * self.capacity),
            logits=dev.alloc(4 * c.vocab_size),
            predicted=dev.alloc(4),
            sampling_params=dev.alloc(SAMPLING_PARAMS_BYTES),
            logprob_ring=dev.alloc(logprob_ring_bytes(LOGPROB_RING_SLOTS)),
            token_mask=dev.alloc(token_mask_bytes(self.token_count)),
            adjustments=LogitAdjustments.allocate(dev, self.token_count),
        )
        for i, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION:
                nbytes = attention.cache_bytes(c.num_key_value_heads, self.capacity, self.kv_cache)
                state.k_cache[i] = dev.alloc(nbytes)
                state.v_cache[i] = dev.alloc(nbytes)
            else:
                state.conv_windows[i] = dev.alloc(window_bytes(c.linear_conv_dim))
                state.recurrent[i] = dev.alloc(state_bytes(c.linear_num_value_heads))
        return state

    def _allocate_slot(self, pool: _SlotPool, slot: int) -> SequenceState:
        """Slot `slot`'s state: its own logits, the rest in `pool`."""
        logits = self.device.alloc(4 * self.config.vocab_size)
        state = SequenceState(logits=logits, **pool.sequence_fields(slot))
        pool.place(slot, state)
        return state

    def step_view(self) -> np.ndarray:
        return self.state.step.numpy().view(np.uint32)

    def history_view(self) -> np.ndarray:
        return self.state.history.numpy().view(np.uint32)

    def logits_view(self) -> np.ndarray:
        return self.state.logits.numpy().view(np.float32)

    def verify_logits_view(self, rows: int) -> np.ndarray:
        """The logits [rows, vocab] the last verify pass wrote."""
        vocab = self.config.vocab_size
        logits = self._verify_buffers.logits.numpy()
        return logits[: 4 * rows * vocab].view(np.float32).reshape(rows, -1)


class _VerifyBuffers:
    """What verify passes use besides the scratch, allocated at the first (`verify_bytes`)."""

    def __init__(self, c: ModelConfig, device: Device, token_count: int) -> None:
        rows = MAX_DRAFT_TOKENS + 1
        self.logits = device.alloc(4 * rows * c.vocab_size)
        self.sample_partials = device.alloc(sample_partials_bytes(token_count, rows))
        # Row g's allowed tokens: under a grammar, its state after the g drafts before the row.
        self.token_masks = device.alloc(token_mask_bytes(token_count, rows))
        self.drawn = device.alloc(4 * rows)
        self.position = device.alloc(4)
        self.accepted = device.alloc(accepted_bytes(MAX_DRAFT_TOKENS))
        self.outcomes = device.alloc(outcome_ring_bytes(OUTCOME_RING_SLOTS))
        # Each GDN layer's record of the candidate positions, for the most rows a pass checks.
        layer_bytes = _candidate_bytes(c, rows)
        self.candidates = device.alloc(_gdn_layers(c) * layer_bytes)
        gdn_layers = [i for i, kind in enumerate(c.layer_types) if kind != FULL_ATTENTION]
        self.slot = {layer: n * layer_bytes for n, layer in enumerate(gdn_layers)}
        self.tail_offset = _tail_offset(c, rows)

    def updates(self, c: ModelConfig, layer: int, rows: int) -> VerifyUpdates:
        """Where GDN layer `layer` keeps its candidates' updates in a pass of `rows` rows."""
        return VerifyUpdates(
            (self.candidates, self.slot[layer]),
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            rows,
        )

    def tail(self, layer: int) -> BufferRef:
        """Where GDN layer `layer`'s conv leaves its tail in any pass."""
        return (self.candidates, self.slot[layer] + self.tail_offset)


class _Recorder:
    """Records one pass over `tokens` tokens: the layer walk, shared by decode and prefill."""

    def __init__(
        self,
        model: ModelGraph,
        tokens: int,
        predicts: bool,
        verify_rows: int = 0,
        images: bool = False,
        graph: Graph | None = None,
        batch: Sequence[SequenceState] = (),
        row_slots: RowSlots | None = None,
    ) -> None:
        self.m, self.c, self.s, self.w = model, model.config, model._scratch, model.weights
        # A batched decode pass: row b is the newest token of the sequence in batch[b], whose
        # slot `row_slots` gives the per-row kernels.
        self.batch, self.row_slots = batch, row_slots
        self.dev, self.state = model.device, model.state
        self.tokens, self.predicts, self.verify_rows = tokens, predicts, verify_rows
        self.images = images
        # A new graph, or (several passes in one command buffer) the graph being recorded.
        self.g = Graph() if graph is None else graph
        # Where attention reads its first position: the sequence's step buffer, or the MTP
        # head's own (record_mtp).
        self.step = model.state.step
        self.in_mtp = False
        # Where the final norm leaves the hidden states the lm_head reads: with the MTP head,
        # every token's, kept for the head's next pass; not a batched pass's, which the head
        # does not draft for (and which runs between the passes of a sequence it drafts for).
        self.final_normed = model.mtp_hidden if model.mtp and not batch else model._scratch.normed

    def hidden_row(self, buffer: Buffer, index: int) -> BufferRef:
        """Row `index` of a [tokens, hidden_size] activation."""
        return offset_by(buffer, 4 * self.c.hidden_size * index)

    @property
    def folds_norms(self) -> bool:
        """Whether residual adds and RMSNorms are folded into the GEMVs, and the GDN's conv (but
        in a batched pass) and gated norm into the projections around them: the decode step,
        a batched pass (of at most GEMV_MAX_TOKENS rows: `allocate_slots`) and a verify pass of
        up to GEMV_MAX_TOKENS tokens, whose GEMV-shaped kernels fold them per token (the MTP
        head's passes use the chunk kernels)."""
        if self.in_mtp:
            return False
        few = (self.verify_rows > 0 or bool(self.batch)) and self.tokens <= GEMV_MAX_TOKENS
        return self.tokens == 1 or few

    def folded_norm(self, weight: str) -> FoldedNorm:
        return FoldedNorm(self.w.tensor(weight), self.c.rms_norm_eps)

    def decode_layer_input(self, layer: int) -> BufferRef | EmbeddedInput:
        """What the first GEMV of `layer` reads at T = 1 (its input norm folded in): the
        residual, or for layer 0 the embedding row of the step's token, which that GEMV reads
        from the table and writes to the residual itself, so the decode step has no embedding
        dispatch (nor its barrier). A verify pass's tokens, and a batched pass's rows (each its
        own sequence's token), are in the residual already."""
        if layer > 0 or self.tokens > 1 or self.batch:
            return self.s.residual
        return EmbeddedInput(
            tokens=self.state.history,
            position=(self.state.step, 0),
            table=self.w.quantized(EMBED_TOKENS),
            residual=self.s.residual,
        )

    def project_normed(
        self, layer: int, norm_weight: str, projections: Sequence[tuple[QuantWeight, BufferRef]]
    ) -> None:
        """Projections of layer `layer`'s normed input: norm_weight's RMSNorm folded into the
        GEMV when the pass folds norms (see decode_layer_input); otherwise the preceding
        add_norm (or rms_norm, after the embedding) left it in `normed`."""
        if self.folds_norms:
            x = self.decode_layer_input(layer)
            norm = self.folded_norm(norm_weight)
            record_qgemv(self.g, self.dev, x, projections, norm=norm, tokens=self.tokens)
        else:
            self.project(self.s.normed, projections, self.tokens)

    def project(
        self,
        x: BufferRef,
        projections: Sequence[tuple[QuantWeight, BufferRef]],
        tokens: int,
        guarded: bool = False,
    ) -> None:
        """Projections of `tokens` rows of x: a GEMV that reads each weight once for all of them
        up to a verify pass's size (bound by reading the weights, as decode is), the GEMM's
        tiles beyond. The GEMM's operands are half: an x that an RMSNorm did not just bound
        (`guarded`) first gets the range guard's exponent per row, a level of its own."""
        if tokens <= GEMV_MAX_TOKENS:
            record_qgemv(self.g, self.dev, x, projections, tokens=tokens)
        elif guarded:
            in_dim = projections[0][0].in_dim
            exponents = self.s.guard_exponents
            record_qgemm_row_exponents(self.g, self.dev, x, tokens, in_dim, exponents)
            self.g.barrier()
            record_qgemm(self.g, self.dev, x, projections, tokens, x_exponents=exponents)
        else:
            record_qgemm(self.g, self.dev, x, projections, tokens)

    def project_into_residual(self, x: BufferRef, weight: QuantWeight) -> None:
        """The mixer's output projection: added to the residual in place when the pass folds
        norms, else written to `mixer_out` for the following add_norm. Its input (attention's
        output, or the GDN's gated by silu(z)) is not bounded in half: the GEMM takes the range
        guard."""
        if self.folds_norms:
            residual = [(weight, self.s.residual)]
            record_qgemv(self.g, self.dev, x, residual, accumulate=True, tokens=self.tokens)
        else:
            self.project(x, [(weight, self.s.mixer_out)], self.tokens, guarded=True)

    def row(self, buffer: Buffer, width: int, index: int) -> BufferRef:
        """Row `index` of a [tokens, width] fp32 activation."""
        return offset_by(buffer, 4 * width * index)

    def record(self) -> Graph:
        c, g, dev, s, w, T = self.c, self.g, self.dev, self.s, self.w, self.tokens
        # At T = 1 layer 0's first GEMV reads the embedding itself (decode_layer_input).
        if self.batch:
            assert self.m._slot_pool is not None and self.row_slots is not None
            steps = self.m._slot_pool.buffer("step")
            embed_tokens = w.quantized(EMBED_TOKENS)
            record_embedding_rows(g, dev, steps, embed_tokens, s.residual, self.row_slots)
            g.barrier()
        elif T > 1:
            position = (self.state.step, 0)
            embed_tokens = w.quantized(EMBED_TOKENS)
            record_embedding(g, dev, self.state.history, position, embed_tokens, s.residual, T)
            g.barrier()
        if not self.folds_norms:
            if self.images:
                # A device copy, not a host one: the residual is this pass's scratch, written
                # by the lookup just before and in use by the pass in flight ahead of it.
                record_copy_flagged_rows(
                    g,
                    dev,
                    flags=self.m.image_flags,
                    staged=self.m.image_rows,
                    rows=s.residual,
                    count=T,
                    row_bytes=4 * c.hidden_size,
                )
                g.barrier()
            record_rms_norm(
                g,
                dev,
                s.residual,
                w.tensor(MODEL + "layers.0.input_layernorm.weight"),
                s.normed,
                rows=T,
                dim=c.hidden_size,
                eps=c.rms_norm_eps,
            )
            g.barrier()
        starts_command_buffer = command_buffer_starts(
            c, self.m.capacity, T, self.m.command_buffer_flops
        )
        for i, kind in enumerate(c.layer_types):
            if i in starts_command_buffer:
                g.end_command_buffer()
            layer = f"{MODEL}layers.{i}."
            input_norm = layer + "input_layernorm.weight"
            if kind == FULL_ATTENTION:
                self.attention(i, layer + "self_attn.", input_norm)
            else:
                self.gated_deltanet(i, layer + "linear_attn.", input_norm)
            g.barrier()
            post_norm = layer + "post_attention_layernorm.weight"
            if not self.folds_norms:
                # h = x + mixer(x); normed = post_attention_layernorm(h)
                self.add_norm(s.mixer_out, post_norm, rows=T)
                g.barrier()
            self.moe(layer + "mlp.", post_norm)
            g.barrier()
            if self.folds_norms:
                self.keep_layer_output(i)
                continue
            # x = h + moe(h); normed = the next layer's input norm, or the final norm, which
            # only the predicting token needs.
            if i + 1 < c.num_hidden_layers:
                self.add_norm(s.moe_out, f"{MODEL}layers.{i + 1}.input_layernorm.weight", rows=T)
                g.barrier()
                self.keep_layer_output(i)
            elif self.predicts or self.verify_rows or self.m.mtp:
                rows = T if self.m.mtp else self.verify_rows or 1
                self.add_norm(
                    s.moe_out, MODEL + "norm.weight", rows, first=T - rows, out=self.final_normed
                )
                g.barrier()
        if self.folds_norms and self.m.mtp and not self.batch:
            # The lm_head reads the residual with the final norm folded in; the MTP head needs
            # the normed rows too, every token's (not a batched pass's: batched rows keep no
            # head state).
            record_rms_norm(
                g,
                dev,
                s.residual,
                w.tensor(MODEL + "norm.weight"),
                self.final_normed,
                rows=T,
                dim=c.hidden_size,
                eps=c.rms_norm_eps,
            )
        if self.verify_rows:
            self.verify_head()
        elif self.batch:
            self.batch_head()
        else:
            self.finish()
        return g

    def keep_layer_output(self, i: int) -> None:
        """Copies the residual, layer i's output, into its block of `layer_outputs` when i is
        a kept layer. No barrier follows: the residual's next write is a level or more on."""
        m = self.m
        if i not in m.kept_layers or self.batch or self.in_mtp:
            return
        block = 4 * m.kept_layers.index(i) * m.max_chunk * self.c.hidden_size
        row_bytes = 4 * self.c.hidden_size * self.tokens
        record_copy(self.g, self.dev, self.s.residual, (m.layer_outputs, block), row_bytes)

    def record_mtp(self, chained: bool, head: bool) -> Graph:
        """The MTP head's pass (ModelGraph.mtp_graph): fc over the normed embedding of each
        row's next token and the normed hidden state, then the head's decoder layer, recorded
        by the same attention and MoE walk as the main layers, with its own KV cache and step."""
        c, g, dev, s, w, m, T = self.c, self.g, self.dev, self.s, self.w, self.m, self.tokens
        self.in_mtp, self.step = True, m.mtp_step
        source = m.mtp_out if chained else m.mtp_hidden
        norm = dict(rows=T, dim=c.hidden_size, eps=c.rms_norm_eps)
        # Row t embeds the token after its own position: the history read one id further on.
        next_tokens = offset_by(self.state.history, 4)
        embed = w.quantized(EMBED_TOKENS)
        record_embedding(g, dev, next_tokens, (m.mtp_step, 0), embed, s.residual, T)
        record_rms_norm(g, dev, source, w.tensor(MTP_NORM_HIDDEN), s.moe_out, **norm)
        g.barrier()
        record_rms_norm(g, dev, s.residual, w.tensor(MTP_NORM_EMBEDDING), s.normed, **norm)
        g.barrier()
        self.project(s.normed, [(m.mtp_fc_embedding, s.residual)], T)
        self.project(s.moe_out, [(m.mtp_fc_hidden, s.mixer_out)], T)
        g.barrier()
        # residual = fc(...); normed = the layer's input norm of it
        self.add_norm(s.mixer_out, MTP_LAYER + "input_layernorm.weight", rows=T)
        g.barrier()
        self.attention(m.mtp_layer, MTP_LAYER + "self_attn.", MTP_LAYER + "input_layernorm.weight")
        if not head:
            return g  # the attention wrote the KV rows, all a pass without the head is for
        g.barrier()
        self.add_norm(s.mixer_out, MTP_LAYER + "post_attention_layernorm.weight", rows=T)
        g.barrier()
        self.moe(MTP_LAYER + "mlp.", MTP_LAYER + "post_attention_layernorm.weight")
        g.barrier()
        # Only the last row drafts: its final norm goes to the one-row output a chained pass reads.
        last_residual = self.hidden_row(s.residual, T - 1)
        record_add_rms_norm(
            g,
            dev,
            last_residual,
            self.hidden_row(s.moe_out, T - 1),
            w.tensor(MTP_FINAL_NORM),
            last_residual,
            m.mtp_out,
            rows=1,
            dim=c.hidden_size,
            eps=c.rms_norm_eps,
        )
        g.barrier()
        # Only the draft vocabulary's rows: the verify pass reads the whole lm_head.
        head = replace(w.quantized(self.head_weight), rows=m.draft_vocab)
        record_qgemv(g, dev, m.mtp_out, [(head, m.mtp_logits)])
        return g

    def verify_head(self) -> None:
        """The lm_head over the verified rows (the final norm is in `normed`), one GEMV over
        them; a draw per row; the acceptance; then the recurrent state taken to the last
        accepted position (`verify_graph`)."""
        g, dev, m, state, rows = self.g, self.dev, self.m, self.state, self.verify_rows
        verify = m._verify_buffers
        self.project_head(verify.logits, rows)
        g.barrier()
        record_sample(
            g,
            dev,
            logits=verify.logits,
            logits_stride=self.c.vocab_size,
            vocab=m.token_count,
            params=state.sampling_params,
            position=verify.position,
            predicted=verify.drawn,
            logprob_ring=state.logprob_ring,
            ring_slots=LOGPROB_RING_SLOTS,
            token_mask=verify.token_masks,
            mask_stride=token_mask_words(m.token_count),
            adjustments=state.adjustments,
            partials=verify.sample_partials,
            draws=rows,
            drafts=state.history,
        )
        g.barrier()
        record_accept_drafts(
            g,
            dev,
            drafts=rows - 1,
            vocab=m.token_count,
            params=state.sampling_params,
            position=verify.position,
            drawn=verify.drawn,
            history=state.history,
            capacity=m.capacity,
            counts=state.adjustments.counts,
            accepted=verify.accepted,
            step=state.step,
            outcomes=verify.outcomes,
            outcome_slots=OUTCOME_RING_SLOTS,
        )
        g.barrier()
        for i, window in state.conv_windows.items():
            tail = verify.tail(i)
            record_conv1d_commit(
                g,
                dev,
                accepted=verify.accepted,
                tail=tail,
                window=window,
                channels=self.c.linear_conv_dim,
                candidates=rows,
            )
            updates = verify.updates(self.c, i, rows)
            record_gdn_commit(
                g, dev, accepted=verify.accepted, state=state.recurrent[i], updates=updates
            )

    def batch_head(self) -> None:
        """The lm_head over every row of a batched pass, one GEMV; then every row's draw in one
        sampler pass through the slot table, each with its sequence's settings, mask and
        penalties, advancing its step as a decode step's does."""
        g, m, pool = self.g, self.m, self.m._slot_pool
        assert m._batch_logits is not None and m._batch_partials is not None
        assert pool is not None and self.row_slots is not None
        self.project_head(m._batch_logits, self.tokens)
        g.barrier()
        record_sample(
            g,
            self.dev,
            logits=m._batch_logits,
            logits_stride=self.c.vocab_size,
            vocab=m.token_count,
            params=pool.buffer("sampling_params"),
            position=pool.buffer("step"),
            predicted=pool.buffer("predicted"),
            logprob_ring=pool.buffer("logprob_ring"),
            ring_slots=LOGPROB_RING_SLOTS,
            token_mask=pool.buffer("token_mask"),
            adjustments=pool.adjustments(),
            partials=m._batch_partials,
            bookkeeping=StepBookkeeping(pool.buffer("history"), m.capacity),
            row_slots=self.row_slots,
        )

    def sample_step(self, state: SequenceState, logits: BufferRef) -> None:
        """A decode step's draw for `state` from `logits`, under its own settings and mask, and
        the step's advance (a batched pass draws its rows in `batch_head`)."""
        record_sample(
            self.g,
            self.dev,
            logits=logits,
            vocab=self.m.token_count,
            params=state.sampling_params,
            position=(state.step, 0),
            predicted=state.predicted,
            logprob_ring=state.logprob_ring,
            ring_slots=LOGPROB_RING_SLOTS,
            token_mask=state.token_mask,
            adjustments=state.adjustments,
            partials=self.s.sample_partials,
            bookkeeping=StepBookkeeping(state.history, self.m.capacity),
        )

    def batch_gated_deltanet(self, i: int, weights: dict) -> None:
        """Every row's conv and GDN step, each on its own sequence's window and state (the decode
        step's kernels, one dispatch each over the rows through the slot table), leaving the
        readouts for the gated norm over every row."""
        c, g, dev, s = self.c, self.g, self.dev, self.s
        pool = self.m._slot_pool
        assert pool is not None and self.row_slots is not None
        record_conv1d_step(
            g,
            dev,
            x=s.qkv_projected,
            weight=weights.pop("conv_weight"),
            window=pool.buffer("conv_windows", i),
            out=s.qkv,
            channels=c.linear_conv_dim,
            row_slots=self.row_slots,
        )
        g.barrier()
        record_gdn_step(
            g,
            dev,
            qkv=s.qkv,
            a=s.a,
            b=s.b,
            readout=s.gdn_out,
            state=pool.buffer("recurrent", i),
            row_slots=self.row_slots,
            **weights,
        )

    def batch_attention(self, i: int, prepare: dict, partials: dict) -> None:
        """Every row's decode attention over its own sequence's KV cache, position and rotary
        positions (the decode step's kernels, one dispatch each over the rows through the slot
        table)."""
        g, dev, s = self.g, self.dev, self.s
        pool = self.m._slot_pool
        assert pool is not None and self.row_slots is not None
        rows = dict(
            step=pool.buffer("step"),
            k_cache=pool.buffer("k_cache", i),
            v_cache=pool.buffer("v_cache", i),
            row_slots=self.row_slots,
        )
        if self.m.rope_table is not None:
            rows["rope_table"] = pool.buffer("rope_table")
        attention.record_attention_decode_fused(g, dev, **{**prepare, **rows}, **partials)
        g.barrier()
        attention.record_attention_combine(
            g,
            dev,
            **partials,
            q_proj=s.q,
            step=pool.buffer("step"),
            out=s.attn_out,
            num_q_heads=self.c.num_attention_heads,
            row_slots=self.row_slots,
        )

    def project_head(self, logits: Buffer, rows: int) -> None:
        """The lm_head over the pass's last `rows` rows, one GEMV over them: of the residual
        with the final norm folded in when the pass folds norms, else of the final-normed rows."""
        head = [(self.w.quantized(self.head_weight), logits)]
        first = self.tokens - rows
        if self.folds_norms:
            x = self.hidden_row(self.s.residual, first)
            norm = self.folded_norm(MODEL + "norm.weight")
            record_qgemv(self.g, self.dev, x, head, norm=norm, tokens=rows)
        else:
            self.project(self.hidden_row(self.final_normed, first), head, rows)

    @property
    def head_weight(self) -> str:
        return EMBED_TOKENS if self.c.tie_word_embeddings else LM_HEAD

    def add_norm(
        self, delta: Buffer, weight: str, rows: int, first: int = 0, out: Buffer | None = None
    ) -> None:
        """residual += delta; `out` (default `normed`) = the RMSNorm of the sum, rows
        [first, first + rows)."""
        s = self.s
        record_add_rms_norm(
            self.g,
            self.dev,
            self.hidden_row(s.residual, first),
            self.hidden_row(delta, first),
            self.w.tensor(weight),
            self.hidden_row(s.residual, first),
            self.hidden_row(s.normed if out is None else out, first),
            rows=rows,
            dim=self.c.hidden_size,
            eps=self.c.rms_norm_eps,
        )

    def finish(self) -> None:
        """The predicting token's lm_head and sample, and the step buffer's advance (by the
        sampler's last dispatch when the pass predicts)."""
        g, dev, m, state, T = self.g, self.dev, self.m, self.state, self.tokens
        advance = dict(
            step=state.step, history=state.history, predicted=state.predicted, capacity=m.capacity
        )
        if not self.predicts:
            record_step_advance(g, dev, **advance, count=T)
            return
        if T > 1:
            # The sampler keys its random numbers and log-probability slot on the position of
            # the token it consumes, the chunk's last.
            record_step_advance(g, dev, **advance, count=T - 1)
        self.project_head(state.logits, 1)
        g.barrier()
        self.sample_step(state, state.logits)

    def gated_deltanet(self, i: int, prefix: str, input_norm: str) -> None:
        c, g, dev, s, w, T = self.c, self.g, self.dev, self.s, self.w, self.tokens
        qkv_weight = w.quantized(prefix + "in_proj_qkv")
        gates = [
            (w.quantized(prefix + "in_proj_z"), s.z),
            (w.quantized(prefix + "in_proj_a"), s.a),
            (w.quantized(prefix + "in_proj_b"), s.b),
        ]
        conv_weight, window = w.tensor(prefix + "conv1d.weight"), self.state.conv_windows[i]
        # A verify pass leaves the window to the commit after its acceptance.
        verify = self.m._verify_buffers if self.verify_rows else None
        if self.folds_norms and not self.batch:
            # The conv is folded into the projection, which writes the conv's output (a batched
            # pass's rows step each their own slot's window: batch_gated_deltanet).
            conv = FoldedConvStep(conv_weight, window)
            if verify:
                conv = replace(conv, tail=verify.tail(i), candidates=self.verify_rows)
            record_qgemv(
                g,
                dev,
                self.decode_layer_input(i),
                [(qkv_weight, s.qkv), *gates],
                norm=self.folded_norm(input_norm),
                conv=conv,
                tokens=T,
            )
        else:
            self.project_normed(i, input_norm, [(qkv_weight, s.qkv_projected), *gates])
            g.barrier()
        if self.batch:
            weights = dict(
                conv_weight=conv_weight,
                a_log=w.tensor(prefix + "A_log"),
                dt_bias=w.tensor(prefix + "dt_bias"),
                num_key_heads=c.linear_num_key_heads,
                num_value_heads=c.linear_num_value_heads,
                key_head_dim=c.linear_key_head_dim,
                value_head_dim=c.linear_value_head_dim,
            )
            self.batch_gated_deltanet(i, weights)
        elif not self.folds_norms:
            record_conv1d_chunk(
                g,
                dev,
                x=s.qkv_projected,
                weight=conv_weight,
                window=window,
                out=s.qkv,
                channels=c.linear_conv_dim,
                tokens=T,
                tail=verify.tail(i) if verify else None,
                candidates=self.verify_rows,
            )
        g.barrier()
        gates_and_state = dict(
            a_log=w.tensor(prefix + "A_log"),
            dt_bias=w.tensor(prefix + "dt_bias"),
            state=self.state.recurrent[i],
        )
        weights = dict(
            **gates_and_state,
            num_key_heads=c.linear_num_key_heads,
            num_value_heads=c.linear_num_value_heads,
            key_head_dim=c.linear_key_head_dim,
            value_head_dim=c.linear_value_head_dim,
        )
        norm_weight, out_proj = w.tensor(prefix + "norm.weight"), w.quantized(prefix + "out_proj")
        if verify:
            # The step's recurrence over the pass's few tokens, keeping the candidates' updates
            # for the commit after the acceptance.
            updates = verify.updates(c, i, self.verify_rows)
            record_gdn_tokens(
                g, dev, qkv=s.qkv, a=s.a, b=s.b, readout=s.gdn_out, tokens=T, updates=updates,
                **gates_and_state,
            )  # fmt: skip
            g.barrier()
        elif not self.batch:  # a batched pass's GDN steps ran with its convs
            if self.folds_norms:
                record_gdn_step(g, dev, qkv=s.qkv, a=s.a, b=s.b, readout=s.gdn_out, **weights)
            else:
                record_gdn_chunk(
                    g, dev, qkv=s.qkv, a=s.a, b=s.b, readout=s.gdn_out, tokens=T, **weights
                )
            g.barrier()
        if self.folds_norms:
            # out_proj applies the gated RMSNorm as it reads the readout.
            record_gdn_out_proj(
                g,
                dev,
                readout=s.gdn_out,
                z=s.z,
                norm=FoldedNorm(norm_weight, c.rms_norm_eps),
                weight=out_proj,
                residual=s.residual,
                tokens=T,
            )
            return
        record_gdn_gated_norm(
            g,
            dev,
            x=s.gdn_out,
            z=s.z,
            norm_weight=norm_weight,
            tokens=T,
            num_value_heads=c.linear_num_value_heads,
            norm_eps=c.rms_norm_eps,
        )
        g.barrier()
        self.project_into_residual(s.gdn_out, out_proj)

    def attention(self, i: int, prefix: str, input_norm: str) -> None:
        c, g, dev, s, w, T = self.c, self.g, self.dev, self.s, self.w, self.tokens
        heads = dict(num_q_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads)
        self.project_normed(
            i,
            input_norm,
            [
                (w.quantized(prefix + "q_proj"), s.q),
                (w.quantized(prefix + "k_proj"), s.k),
                (w.quantized(prefix + "v_proj"), s.v),
            ],
        )
        g.barrier()
        caches = dict(
            k_cache=self.state.k_cache[i], v_cache=self.state.v_cache[i], kv_cache=self.m.kv_cache
        )
        prepare = dict(
            q_proj=s.q,
            k_proj=s.k,
            v_proj=s.v,
            q_norm=w.tensor(prefix + "q_norm.weight"),
            k_norm=w.tensor(prefix + "k_norm.weight"),
            step=self.step,
            capacity=self.m.capacity,
            rotary_dim=c.rotary_dim,
            rope_theta=c.rope_theta,
            norm_eps=c.rms_norm_eps,
            head_dim=c.head_dim,
            rope_table=self.m.rope_table,
            mrope_bounds=c.mrope_bounds,
            **caches,
            **heads,
        )
        # The decode grids cover the capacity; the kernels take the context from the step buffer.
        partials = dict(
            partial_out=s.partial_out,
            partial_stats=s.partial_stats,
            num_splits=s.decode_splits,
        )
        if self.batch:
            self.batch_attention(i, prepare, partials)
        elif self.folds_norms and T == 1:
            attention.record_attention_decode_fused(g, dev, **prepare, **partials)
            g.barrier()
            attention.record_attention_combine(
                g,
                dev,
                **partials,
                q_proj=s.q,
                step=self.state.step,
                out=s.attn_out,
                num_q_heads=c.num_attention_heads,
            )
        elif T <= attention.MAX_DECODE_TOKENS:
            # A verify pass (or the MTP head's, or a short prompt's last chunk): decode-shaped
            # attention reading every cached row once for all T tokens; the chunk kernel's tiles
            # of 32 rows would be mostly empty.
            attention.record_attention_prepare(g, dev, **prepare, queries=s.queries, tokens=T)
            g.barrier()
            attention.record_attention_decode_tokens(
                g,
                dev,
                queries=s.queries,
                step=self.step,
                capacity=self.m.capacity,
                head_dim=c.head_dim,
                tokens=T,
                **partials,
                **caches,
                **heads,
            )
            g.barrier()
            attention.record_attention_combine(
                g,
                dev,
                **partials,
                q_proj=s.q,
                step=self.step,
                out=s.attn_out,
                num_q_heads=c.num_attention_heads,
                tokens=T,
            )
        else:
            attention.record_attention_prepare(g, dev, **prepare, queries=s.queries, tokens=T)
            g.barrier()
            attention.record_attention_chunk(
                g,
                dev,
                queries=s.queries,
                q_proj=s.q,
                step=self.step,
                out=s.attn_out,
                capacity=self.m.capacity,
                head_dim=c.head_dim,
                tokens=T,
                packed_queries=s.packed_queries,
                **caches,
                **heads,
            )
        g.barrier()
        self.project_into_residual(s.attn_out, w.quantized(prefix + "o_proj"))

    def moe(self, prefix: str, norm_weight: str) -> None:
        """The MoE block of the post-attention-normed residual: when the pass folds norms (the
        decode step, a verify pass) with the norm and the residual add folded in (out is the
        residual itself); up to a verify pass's size with the same GEMV-shaped kernels, token by
        token (bound by reading the experts' weights, where the grouped GEMM's tiles would be
        nearly empty), a verify pass's or a batched pass's gate/up over the union of its tokens'
        experts (consecutive tokens of one text share experts; a batched pass's unrelated rows
        barely do, which about pays for the union's level, and each row is routed once); beyond,
        the grouped GEMM."""
        c, g, dev, s, T = self.c, self.g, self.dev, self.s, self.tokens
        weights = self.moe_weights(prefix)
        if self.folds_norms:
            record_moe(
                g,
                dev,
                s.residual,
                weights,
                c.num_experts_per_tok,
                s.moe,
                s.residual,
                normalize=c.norm_topk_prob,
                norm=self.folded_norm(norm_weight),
                accumulate=True,
                tokens=T,
                union=T > 1,
            )
        elif T <= GEMV_MAX_TOKENS:
            record_moe(
                g,
                dev,
                s.normed,
                weights,
                c.num_experts_per_tok,
                s.moe,
                s.moe_out,
                normalize=c.norm_topk_prob,
                tokens=T,
            )
        else:
            record_moe_chunk(
                g,
                dev,
                s.normed,
                weights,
                c.num_experts_per_tok,
                s.moe_chunk,
                s.moe_out,
                tokens=T,
                normalize=c.norm_topk_prob,
            )

    def moe_weights(self, prefix: str) -> MoeWeights:
        w = self.w
        return MoeWeights(
            router=w.quantized(prefix + "gate"),
            shared_expert_gate=w.quantized(prefix + "shared_expert_gate"),
            expert_gate=w.quantized(prefix + "switch_mlp.gate_proj"),
            expert_up=w.quantized(prefix + "switch_mlp.up_proj"),
            expert_down=w.quantized(prefix + "switch_mlp.down_proj"),
            shared_gate=w.quantized(prefix + "shared_expert.gate_proj"),
            shared_up=w.quantized(prefix + "shared_expert.up_proj"),
            shared_down=w.quantized(prefix + "shared_expert.down_proj"),
        )
