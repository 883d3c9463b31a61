"""Sampling and log-probabilities on the device (`metal/sampling.metal`).

`record_sample` replaces the greedy argmax at the end of a decode step. What it computes, with
every quantity in fp32:

1. ``z = logits * inverse_temperature``, where the host rounds ``1 / temperature`` to fp32.
   A temperature below `GREEDY_TEMPERATURE` (0 included) selects greedy decoding: the index of
   the largest logit, ties to the lowest index.
2. top-k (``top_k`` = 0 or >= vocab: off): keep the tokens whose z is at least the k-th largest
   z. Tokens tied with the k-th value are all kept.
3. top-p (``top_p`` = 1: off): over the tokens top-k kept, with probabilities renormalised,
   keep the smallest set of most likely tokens whose mass is >= top_p; tokens tied with the
   last one taken are all kept. The masses are fp32 sums of ``exp(z - max z)``, so a token
   whose cumulative mass lies within fp32 rounding of top_p may fall on either side.
4. min-p (``min_p`` = 0: off): keep the tokens with ``z - max z >= log(min_p)`` (the relative
   probability test in log space; the host takes the log), i.e. probability >= min_p times the
   largest probability.
5. Draw one kept token with probability proportional to ``exp(z)``: the Gumbel-max argmax of
   ``z_i - log(E_i)``, E_i ~ Exp(1) built from the first word of Philox4x32-10 with key
   ``seed`` (low word first) and counter ``(token id, position, 0, 0)``. The position is read
   from the step buffer, so a (seed, position) pair always gives the same token and no
   generator state exists. The 32-bit variates cut the Gumbel tail: a token more than about
   25 nats below the most likely one can never be drawn (its true probability is < 1e-11).

0. When the request adjusts the logits (`SamplingParams.adjusts_logits`), each logit l is first
   replaced as `lily.engine.sampling.adjusted_logits` defines it, in fp32: ``l + bias``; then, for a
   token the prompt or the completion so far holds, divided by the repetition penalty when
   positive, else multiplied by it; then less ``frequency * count + (count > 0) * presence``.
   The bias is a dense fp32 vector, the counts a uint32 vector that the decode step's draw
   increments on the device (`StepBookkeeping`), so a pipelined decode needs no host writes, and
   the prompt's tokens a bitmask (`write_logit_adjustments` writes all three per request). A
   bias of -100 bans the token: the host clears it from the token mask.

A token mask (`write_token_mask`; the hook is `lily.engine.constraint.TokenConstraint`) applies
before
step 1 when the host switched it on for the draw: a disallowed token counts as a -inf logit, so
it is never the greedy choice, the filters see only the allowed tokens, and it is never drawn.
The draws of one dispatch read one mask, or each its own (`mask_stride`, `write_token_masks`):
the rows of a verify pass under a grammar, whose state differs after each drafted token.

The most likely (allowed) token always survives the filters. Ties in the sampling race go to the
lowest id (probability ~0). A -inf logit is a token that cannot be drawn. A row holding a NaN or
+inf logit (allowed or not) is refused: the draw is `NO_TOKEN` and no log-probabilities are
written (the engine then raises `NonFiniteLogitsError`).

Log-probabilities (when requested) are those of the model's own distribution, the log_softmax of
the raw logits (before the mask, temperature and filtering, as OpenAI reports them): the chosen
token's, then the `top_logprobs` most likely tokens (largest logit first, ties to the lowest
id). They are written to a ring of `ring_slots` slots, slot ``position % ring_slots``, each
`LOGPROB_ENTRIES` (token uint32, logprob fp32) pairs, so the host can read step N's while step
N+1 runs.

How it runs: a draw is two dispatches. The first spreads the vocabulary over up to `MAX_SLICES`
threadgroups (122 for 248320 tokens), each reducing its slice to the few numbers the rest needs:
its argmax, the race's winner when neither top-k nor top-p applies, its `SLICE_CANDIDATES` most
likely tokens when a filter applies, its largest raw logits and a partial log_softmax sum when
log-probabilities are wanted. The second (one threadgroup per draw) finishes from those: greedy
and the unfiltered race are reductions over the slices; top-k, top-p and min-p run over the
gathered candidates whenever the thresholds they find provably lie where the candidates hold
every token, which they do unless the kept set is larger than about a thousand tokens or tied
at the boundary; otherwise over the logits in device memory, in one threadgroup, as before. The
token is the same either way: the thresholds are the same keys (found by bisection on an
order-preserving integer image of z, 32 reduction passes each, never by sorting), and each
token's race score the same fp32 expression. Only fp32 sums are taken in another order: the
log_softmax normaliser and top-p's total mass without top-k (slices' sums rescaled from their
own maximum), which can move a top-p boundary lying within fp32 rounding of top_p, as the
definition allows.

A verify pass of speculative decoding records one draw per logits row (`logits_stride`), row g
keyed on position + g and counting the g drafted tokens before it for the penalties (`drafts`),
then `record_accept_drafts`: the drafts up to the first row whose draw differs, and that draw.
A draw equal to a draft accepts it with exactly the probability the rejection rule for a
deterministic draft asks (lily.engine.speculative explains why).

Limits, checked when a graph is recorded or parameters are packed: threadgroups of at most
1024 threads (a multiple of 32); at most `MAX_TOP_LOGPROBS` alternatives; the vocab below
2^32 - 1; top_k is not bounded.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lily.engine.constraint import mask_from_tokens, mask_words
from lily.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams, token_counts
from lily.kernels import BufferRef, RowSlots, binding, ceil_div, pack_params, threads_within
from lily.kernels.step import STEP_FIELDS

if TYPE_CHECKING:
    from lily.device import Buffer, Device, Graph

SAMPLE_THREADS = 1024
# sampling.metal's slices: each threadgroup of the first dispatch reduces about SLICE_TOKENS
# tokens with SLICE_THREADS threads; a vocabulary of 248320 spreads over 122 of them. A slice
# lists its SLICE_CANDIDATES most likely tokens for the filters, so that at most MAX_SLICES
# slices' candidates fit the finishing threadgroup's GATHER_CAPACITY.
SLICE_TOKENS = 2048
SLICE_THREADS = 256
SLICE_CANDIDATES = 16
# The most drafts one verify pass checks (its rows are one more): `record_accept_drafts`' bound.
MAX_DRAFTS = 8
# The draw of a refused row (a NaN or +inf logit): no token id.
NO_TOKEN = 0xFFFFFFFF
# sampling.metal's GATHER_CAPACITY: tokens the finishing threadgroup holds in its memory, the
# slices' candidates or, falling back to the logits, those at or above a lower bound on the
# top-k threshold (the k-th largest candidate key) when at most this many.
GATHER_CAPACITY = 2048
MAX_SLICES = GATHER_CAPACITY // SLICE_CANDIDATES
# Entries of one ring slot: the chosen token, then the alternatives.
LOGPROB_ENTRIES = 1 + MAX_TOP_LOGPROBS
LOGPROB_ENTRY = np.dtype([("token", "<u4"), ("logprob", "<f4")])
# The SamplingParams struct of sampling.metal: 12 four-byte fields.
SAMPLING_PARAMS_FORMAT = "<fIffIIIIfffI"
SAMPLING_PARAMS_BYTES = struct.calcsize(SAMPLING_PARAMS_FORMAT)
# sampling.metal's SlicePartial: ten four-byte fields, then SLICE_CANDIDATES and
# MAX_TOP_LOGPROBS (token, value) pairs.
SLICE_PARTIAL_BYTES = 4 * 10 + 8 * (SLICE_CANDIDATES + MAX_TOP_LOGPROBS)

_LOWEST_FLOAT32 = float(np.finfo(np.float32).min)
# The token mask buffer: a word saying whether the mask applies, then the bitmask.
MASK_HEADER_WORDS = 1


def token_mask_words(vocab: int) -> int:
    """The uint32 words of one draw's token mask: the header, then the bitmask."""
    return MASK_HEADER_WORDS + mask_words(vocab)


def token_mask_bytes(vocab: int, draws: int = 1) -> int:
    """Bytes of a token mask buffer holding `draws` masks, one after the other."""
    return 4 * draws * token_mask_words(vocab)


def write_token_mask(buffer: BufferRef, mask: np.ndarray | None) -> None:
    """Store the allowed tokens of the next draw (a bitmask as `lily.engine.constraint` defines it,
    its bits past the vocabulary clear), or None for no mask. Write it only while no
    submitted pass that samples is still running."""
    target, offset = binding(buffer)
    words = target.numpy()[offset:].view(np.uint32)
    if mask is None:
        words[0] = 0
        return
    words[0] = 1
    words[MASK_HEADER_WORDS : MASK_HEADER_WORDS + mask.size] = mask


def write_token_masks(buffer: BufferRef, masks: Sequence[np.ndarray | None], vocab: int) -> None:
    """Store draw g's allowed tokens as `masks[g]` (as `write_token_mask` does one), for draws
    that each read their own: `record_sample` with `mask_stride=token_mask_words(vocab)`."""
    target, offset = binding(buffer)
    stride = 4 * token_mask_words(vocab)
    if target.size - offset < stride * len(masks):
        raise ValueError(f"{len(masks)} token masks need {stride * len(masks)} bytes: too small")
    for g, mask in enumerate(masks):
        if mask is not None and mask.size > mask_words(vocab):
            raise ValueError(f"a mask over {vocab} tokens is {mask_words(vocab)} words at most")
        write_token_mask((target, offset + g * stride), mask)


def pack_sampling_params(params: SamplingParams) -> bytes:
    """The bytes of the device-side SamplingParams struct. The seed (which must be set, in
    [0, 2^64)) is split into its low and high 32 bits."""
    if params.seed is None:
        raise ValueError("the device sampler needs a concrete seed (SamplingParams.with_seed)")
    inverse_temperature = 0.0 if params.greedy else 1.0 / params.temperature
    log_min_p = math.log(params.min_p) if params.min_p > 0 else _LOWEST_FLOAT32
    seed = params.seed % 2**64
    return struct.pack(
        SAMPLING_PARAMS_FORMAT,
        inverse_temperature,
        params.top_k,
        params.top_p,
        max(log_min_p, _LOWEST_FLOAT32),
        seed & 0xFFFFFFFF,
        seed >> 32,
        int(params.top_logprobs is not None),
        params.top_logprobs or 0,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        int(params.adjusts_logits),
    )


def write_sampling_params(buffer: BufferRef, params: SamplingParams) -> None:
    """Store `params` in the device-resident parameter buffer the recorded graph reads. Write it
    only while no submitted step is still running."""
    target, offset = binding(buffer)
    data = pack_sampling_params(params)
    target.numpy()[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


@dataclass(frozen=True)
class LogitAdjustments:
    """The per-token buffers the adjustments read: `bias` fp32 [vocab], `counts` uint32 [vocab]
    (the completion's tokens so far), `prompt_tokens` a bitmask (`lily.engine.constraint`) of the
    prompt's tokens."""

    bias: Buffer
    counts: Buffer
    prompt_tokens: Buffer

    @staticmethod
    def allocate(device: Device, vocab: int) -> LogitAdjustments:
        return LogitAdjustments(
            device.alloc(4 * vocab), device.alloc(4 * vocab), device.alloc(4 * mask_words(vocab))
        )


def write_logit_adjustments(
    adjustments: LogitAdjustments,
    params: SamplingParams,
    prompt: Sequence[int],
    vocab: int,
    generated: Sequence[int] = (),
) -> None:
    """Prepare the buffers for a completion of `prompt` under `params`: its bias, the tokens
    `generated` so far (none for a new completion), the prompt's tokens. Nothing is written when
    `params` adjusts nothing (the sampler then reads none of them). Write only while no
    submitted pass that samples runs."""
    if not params.adjusts_logits:
        return
    bias = adjustments.bias.numpy()[: 4 * vocab].view(np.float32)
    bias[:] = 0
    for token, value in params.logit_bias:
        bias[token] += value
    counts = adjustments.counts.numpy()[: 4 * vocab].view(np.uint32)
    counts[:] = token_counts(generated, vocab)
    words = adjustments.prompt_tokens.numpy()[: 4 * mask_words(vocab)].view(np.uint32)
    words[:] = mask_from_tokens(sorted(set(prompt)), vocab)


def logprob_ring_bytes(ring_slots: int) -> int:
    return ring_slots * LOGPROB_ENTRIES * LOGPROB_ENTRY.itemsize


def read_logprobs(
    ring: Buffer, ring_slots: int, position: int, top_logprobs: int
) -> tuple[tuple[int, float], list[tuple[int, float]]]:
    """The (token, logprob) of the token chosen at step `position`, and its `top_logprobs`
    alternatives, most likely first. Valid until the ring wraps round to that slot again."""
    entries = ring.numpy()[: logprob_ring_bytes(ring_slots)].view(LOGPROB_ENTRY)
    slot = entries.reshape(ring_slots, LOGPROB_ENTRIES)[position % ring_slots]
    pairs = [(int(e["token"]), float(e["logprob"])) for e in slot[: 1 + top_logprobs]]
    return pairs[0], pairs[1:]


@dataclass(frozen=True)
class StepBookkeeping:
    """What the finishing dispatch needs to end a decode step itself: the token history
    (uint32 [capacity]) the step buffer's advance appends the drawn token to."""

    history: BufferRef
    capacity: int


def slice_layout(vocab: int, slices: int | None = None) -> tuple[int, int]:
    """(slices, tokens per slice) of a draw over `vocab` tokens: `slices` as asked (default
    about `SLICE_TOKENS` tokens each, at most `MAX_SLICES`), fewer if needed so none is empty."""
    asked = slices if slices is not None else min(MAX_SLICES, ceil_div(vocab, SLICE_TOKENS))
    if not 1 <= asked <= MAX_SLICES:
        raise ValueError(f"slices must be in [1, {MAX_SLICES}], got {asked}")
    slice_tokens = ceil_div(vocab, asked)
    return ceil_div(vocab, slice_tokens), slice_tokens


def sample_partials_bytes(vocab: int, draws: int = 1, slices: int | None = None) -> int:
    """Bytes of the scratch `record_sample` passes the slices' partial results through."""
    return slice_layout(vocab, slices)[0] * draws * SLICE_PARTIAL_BYTES


def record_sample(
    graph: Graph,
    device: Device,
    *,
    logits: BufferRef,
    vocab: int,
    params: BufferRef,
    position: BufferRef,
    predicted: BufferRef,
    logprob_ring: BufferRef,
    ring_slots: int,
    token_mask: BufferRef,
    adjustments: LogitAdjustments,
    partials: BufferRef,
    draws: int = 1,
    threads: int = SAMPLE_THREADS,
    slices: int | None = None,
    slice_threads: int = SLICE_THREADS,
    bookkeeping: StepBookkeeping | None = None,
    logits_stride: int = 0,
    drafts: BufferRef | None = None,
    mask_stride: int = 0,
    row_slots: RowSlots | None = None,
) -> None:
    """predicted[g] (uint32) = the token sampled from `vocab` fp32 logits under the parameters
    in `params` (written by `write_sampling_params`), for g < `draws`. `position` points at the
    uint32 step position (the step buffer's first field). Draw g uses position + g as its
    counter and logprob ring slot: the decode graph records one draw, the tests many. Draw g
    reads the logits `logits_stride` * g floats on (0: every draw reads the same row). With
    `drafts` (a token history, uint32, holding the drafted tokens from position + 1 on), draw
    g also counts the g drafts before it as generated, for the penalties: the rows of a verify
    pass (`record_accept_drafts`).
    `token_mask` holds the mask the draws obey (`write_token_mask`); draw g reads the one
    `mask_stride` * g uint32 words on (0: every draw obeys the same; else at least
    `token_mask_words(vocab)`, as `write_token_masks` writes them). `adjustments` holds the bias
    and penalty inputs (`write_logit_adjustments`), read when `params` says so.

    Two dispatches with a barrier between them: `slices` threadgroups of `slice_threads` per
    draw reduce the vocabulary into `partials` (`sample_partials_bytes`), then one of `threads`
    per draw finishes. With `bookkeeping` (one draw, `position` the step buffer itself) the
    finish also counts the drawn token for the penalties (when the request adjusts logits) and
    does what `lily.kernels.step.record_step_advance` by one would after it.

    With `row_slots` (and `bookkeeping`), a batched decode pass's draws, one per row: draw g
    reads logits row g and is sequence slot s = `row_slots.table[g]`'s draw, each per-sequence
    argument holding the slots one after another (`params` one SamplingParams each, `position`
    the step buffers, STEP_FIELDS words each, `predicted` one word, `logprob_ring`, `token_mask`
    (`token_mask_words(vocab)` each: `mask_stride` is that), the adjustments and the history
    one each): the draw is slot s's as a decode step's is, at its own position, and ends its
    step."""
    if not 1 <= vocab < 2**32 - 1:
        raise ValueError(f"vocab must be in [1, 2^32 - 1), got {vocab}")
    for name, count in (("threads", threads), ("slice_threads", slice_threads)):
        if count % 32 or not 32 <= count <= 1024:
            raise ValueError(f"{name} must be a multiple of 32 in [32, 1024], got {count}")
    if draws < 1 or ring_slots < 1:
        raise ValueError(f"draws and ring_slots must be >= 1, got {draws} and {ring_slots}")
    if row_slots is not None:
        if bookkeeping is None or drafts is not None:
            raise ValueError("a batched pass's draws each end their sequence's decode step")
        draws, mask_stride = row_slots.rows, token_mask_words(vocab)
    elif bookkeeping is not None and draws != 1:
        raise ValueError(f"bookkeeping ends a decode step: one draw, got {draws}")
    if not (logits_stride == 0 or logits_stride >= vocab):
        raise ValueError(f"logits_stride must be 0 or at least the vocab, got {logits_stride}")
    if not (mask_stride == 0 or mask_stride >= token_mask_words(vocab)):
        raise ValueError(
            f"mask_stride must be 0 or at least {token_mask_words(vocab)} words, got {mask_stride}"
        )
    if drafts is not None and bookkeeping is not None:
        raise ValueError("drafts are a verify pass's, bookkeeping a decode step's: not both")
    slice_count, slice_tokens = slice_layout(vocab, slices)
    for name, ref, nbytes in (
        ("logits", logits, 4 * ((draws - 1) * logits_stride + vocab)),
        ("params", params, SAMPLING_PARAMS_BYTES),
        ("position", position, 4),
        ("predicted", predicted, 4 * draws),
        ("logprob_ring", logprob_ring, logprob_ring_bytes(ring_slots)),
        ("token_mask", token_mask, 4 * ((draws - 1) * mask_stride + token_mask_words(vocab))),
        ("bias", adjustments.bias, 4 * vocab),
        ("counts", adjustments.counts, 4 * vocab),
        ("prompt_tokens", adjustments.prompt_tokens, 4 * mask_words(vocab)),
        ("partials", partials, sample_partials_bytes(vocab, draws, slices)),
    ):
        buffer, offset = binding(ref)
        if buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at offset {offset}: too small")
    inputs = {
        1: binding(params),
        2: binding(logits),
        3: binding(position),
        4: binding(partials),
        6: binding(token_mask),
        7: binding(adjustments.bias),
        8: binding(adjustments.counts),
        9: binding(adjustments.prompt_tokens),
    }
    if drafts is not None:
        inputs[11] = binding(drafts)
    if row_slots is not None:
        inputs[12] = binding(row_slots.table)
    capacity = 0 if bookkeeping is None else bookkeeping.capacity
    shape = pack_params(
        "IIIIIIIII",
        vocab,
        ring_slots,
        slice_count,
        slice_tokens,
        capacity,
        int(bool(bookkeeping)),
        logits_stride,
        int(drafts is not None),
        mask_stride,
    )
    rows = "" if row_slots is None else "_rows"
    spread = device.kernel("sample_slices" + rows)
    graph.dispatch(
        spread,
        threadgroups=(slice_count, draws, 1),
        threads=(threads_within(spread, slice_threads), 1, 1),
        buffers=inputs,
        bytes={0: shape},
    )
    graph.barrier()
    finish = device.kernel("sample_token" + rows)
    outputs = {5: binding(predicted), 10: binding(logprob_ring)}
    if bookkeeping is not None:
        outputs[11] = binding(bookkeeping.history)
    graph.dispatch(
        finish,
        threadgroups=(draws, 1, 1),
        threads=(threads_within(finish, threads), 1, 1),
        buffers={**inputs, **outputs},
        bytes={0: shape},
    )


def accepted_bytes(drafts: int) -> int:
    """Bytes `record_accept_drafts` writes: the count, then up to drafts + 1 tokens."""
    return 4 * (drafts + 2)


# Words of one entry of the outcome ring `record_accept_drafts` writes: the count, the drafts,
# the tokens.
OUTCOME_WORDS = 2 * MAX_DRAFTS + 2


def outcome_ring_bytes(slots: int) -> int:
    return 4 * OUTCOME_WORDS * slots


@dataclass(frozen=True)
class PassOutcome:
    """What a verify pass decided, read from its entry of the outcome ring: the drafts it
    checked, then the accepted ones and the model's own token (`NO_TOKEN` when its row was
    refused)."""

    drafts: list[int]
    tokens: list[int]


def record_accept_drafts(
    graph: Graph,
    device: Device,
    *,
    drafts: int,
    vocab: int,
    params: BufferRef,
    position: BufferRef,
    drawn: BufferRef,
    history: BufferRef,
    capacity: int,
    counts: BufferRef,
    accepted: BufferRef,
    step: BufferRef,
    outcomes: BufferRef,
    outcome_slots: int,
) -> None:
    """A verify pass's acceptance (sampling.metal's `accept_drafts`), after `record_sample`
    drew `drawn[0..drafts]` (uint32), one token per row, draw g with the counter
    position + g: the history (uint32 [capacity]) holds the `drafts` drafted tokens from
    position + 1 on. accepted[0] = n, the longest prefix of drafts equal to the draws,
    accepted[1..n+1] = those drafts and draw n, which also goes into the history after them;
    when `params` adjusts logits, `counts` counts the n + 1 tokens for the penalties. Then what
    the next pass reads: position[0] and the sequence's `step` (STEP_FIELDS words) move to the
    model's own token (prompt_end one past it, token its id); and the outcome the host reads
    (`read_outcome`) goes to entry position % `outcome_slots` of `outcomes`."""
    if not 0 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"drafts must be 0 to {MAX_DRAFTS}, got {drafts}")
    if not 1 <= vocab < 2**32 - 1:
        raise ValueError(f"vocab must be in [1, 2^32 - 1), got {vocab}")
    if outcome_slots < 1:
        raise ValueError(f"outcome_slots must be >= 1, got {outcome_slots}")
    for name, ref, nbytes in (
        ("params", params, SAMPLING_PARAMS_BYTES),
        ("position", position, 4),
        ("drawn", drawn, 4 * (drafts + 1)),
        ("history", history, 4 * capacity),
        ("counts", counts, 4 * vocab),
        ("accepted", accepted, accepted_bytes(drafts)),
        ("step", step, 4 * STEP_FIELDS),
        ("outcomes", outcomes, outcome_ring_bytes(outcome_slots)),
    ):
        buffer, offset = binding(ref)
        if buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at offset {offset}: too small")
    graph.dispatch(
        device.kernel("accept_drafts"),
        threadgroups=(1, 1, 1),
        threads=(1, 1, 1),
        buffers={
            1: binding(params),
            2: binding(position),
            3: binding(drawn),
            4: binding(history),
            5: binding(counts),
            6: binding(accepted),
            7: binding(step),
            8: binding(outcomes),
        },
        bytes={0: pack_params("IIIII", drafts, vocab, capacity, outcome_slots, OUTCOME_WORDS)},
    )


def read_accepted(accepted: Buffer) -> list[int]:
    """The tokens `record_accept_drafts` wrote: the accepted drafts, then the model's own (which
    is `NO_TOKEN` when its row was refused)."""
    words = accepted.numpy()[: accepted_bytes(MAX_DRAFTS)].view(np.uint32)
    return [int(t) for t in words[1 : int(words[0]) + 2]]


def read_outcome(outcomes: Buffer, slots: int, position: int, drafts: int) -> PassOutcome:
    """The outcome `record_accept_drafts` wrote for the pass of `drafts` drafts that consumed
    the token at `position`."""
    words = outcomes.numpy()[: outcome_ring_bytes(slots)].view(np.uint32)
    entry = words[(position % slots) * OUTCOME_WORDS :][:OUTCOME_WORDS]
    count = int(entry[0])
    if count > drafts:
        raise RuntimeError(f"the outcome of the pass at {position} holds {count} > {drafts} drafts")
    tokens = entry[1 + drafts : 1 + drafts + count + 1]
    return PassOutcome([int(t) for t in entry[1 : 1 + drafts]], [int(t) for t in tokens])


# One threadgroup reads the head's logits: the most threads Metal allows in one.
DRAFT_ARGMAX_THREADS = 1024


def record_draft_argmax(
    graph: Graph,
    device: Device,
    *,
    logits: BufferRef,
    vocab: int,
    rows: int,
    step: BufferRef,
    history: BufferRef,
    capacity: int,
    drafts: BufferRef,
    index: int,
) -> None:
    """The MTP head's greedy draft on the device (sampling.metal's `draft_argmax`): after a head
    pass of `rows` rows from position step[0] (uint32), the argmax of `logits` (float32
    [vocab], ties to the lowest id, NaN never; 0 if all are NaN) goes into history[step[0] +
    rows + 1] (uint32 [capacity]; not past it) and drafts[index] (uint32), and step[0] becomes
    step[0] + rows: the newest token's position, where the next chained head pass starts."""
    if not 1 <= vocab < 2**32 - 1:
        raise ValueError(f"vocab must be in [1, 2^32 - 1), got {vocab}")
    if rows < 1 or not 0 <= index < MAX_DRAFTS:
        raise ValueError(f"rows must be >= 1 and index in [0, {MAX_DRAFTS}): {rows}, {index}")
    for name, ref, nbytes in (
        ("logits", logits, 4 * vocab),
        ("step", step, 4),
        ("history", history, 4 * capacity),
        ("drafts", drafts, 4 * (index + 1)),
    ):
        buffer, offset = binding(ref)
        if buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at offset {offset}: too small")
    threads = min(DRAFT_ARGMAX_THREADS, -(-vocab // 32) * 32)
    graph.dispatch(
        device.kernel("draft_argmax"),
        threadgroups=(1, 1, 1),
        threads=(threads, 1, 1),
        buffers={1: binding(logits), 2: binding(step), 3: binding(history), 4: binding(drafts)},
        bytes={0: pack_params("IIII", vocab, rows, capacity, index)},
    )


def record_follow_kept_row(
    graph: Graph,
    device: Device,
    *,
    position: BufferRef,
    accepted: BufferRef,
    rows: BufferRef,
    kept: BufferRef,
    head_step: BufferRef,
    hidden: int,
    kept_row: bool,
) -> None:
    """The MTP head following a verify pass the host has not read (sampling.metal's
    `follow_kept_row`), after `record_accept_drafts` moved position[0] to p + n + 1 (uint32;
    the pass consumed p and kept n = accepted[0] drafts): head_step[0] = p, or with `kept_row`
    head_step[0] = p + n and kept[:hidden] = rows[n] (float32 rows of `hidden`, the pass's
    hidden states)."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    for name, ref, nbytes in (
        ("position", position, 4),
        ("accepted", accepted, 4),
        ("rows", rows, 4 * hidden),
        ("kept", kept, 4 * hidden),
        ("head_step", head_step, 4),
    ):
        buffer, offset = binding(ref)
        if buffer.size - offset < nbytes:
            raise ValueError(f"{name} needs {nbytes} bytes at offset {offset}: too small")
    graph.dispatch(
        device.kernel("follow_kept_row"),
        threadgroups=(1, 1, 1),
        threads=(min(DRAFT_ARGMAX_THREADS, -(-hidden // 32) * 32), 1, 1),
        buffers={
            1: binding(position),
            2: binding(accepted),
            3: binding(rows),
            4: binding(kept),
            5: binding(head_step),
        },
        bytes={0: pack_params("II", hidden, int(kept_row))},
    )
