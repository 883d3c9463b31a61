"""Batched decode: several sequences decoded together, one pass over the weights per step
(`ModelGraph.batch_graph`).

A sequence joins by being prefilled alone (the engine's own `generate`, which also draws its
first token) and having that state moved into a free slot, or, having generated alone on the
engine's state so far (drafting), by having that state moved between two of its passes
(`join_from_engine`); it finishes when it draws a stop token or reaches its token budget,
leaves when its caller has gone, or moves back onto the engine's state to draft alone again
(`leave_to_engine`), freeing the slot for the next. Between passes the set of active slots may
change; each set's graph is recorded on first use."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lily.device import Buffer
from lily.engine.constraint import TokenConstraint, draw_mask
from lily.engine.engine import GREEDY, DeviceEngine, banned_tokens_mask, check_fits
from lily.engine.model_graph import LOGPROB_RING_SLOTS, ModelGraph, SequenceState
from lily.engine.sampling import GeneratedToken, SamplingParams, TokenLogprobs
from lily.errors import NonFiniteLogitsError
from lily.kernels.attention import row_bytes
from lily.kernels.sampling import NO_TOKEN, read_logprobs, write_token_mask
from lily.kernels.step import POSITION, PROMPT_END, TOKEN

DEFAULT_SLOTS = 8


@dataclass
class _Stream:
    slot: int | None  # None once finished
    position: int  # of the newest token, which the slot's state has not consumed
    remaining: int  # tokens it may still generate
    stop_token_ids: frozenset[int]
    top_logprobs: int | None  # alternatives its tokens carry, when it asks for log-probabilities
    generated: list[GeneratedToken] = field(default_factory=list)
    constraint: TokenConstraint | None = None
    bans: np.ndarray | None = None  # the tokens its sampling settings ban
    error: Exception | None = None  # what ended it, if not a stop token or its budget


def _buffers(state: SequenceState) -> list[Buffer]:
    """What a decode step of a sequence reads besides its KV cache: everything but its last
    logits, its last draw and its log-probabilities (the pass writes the slot's own, read after
    it)."""
    adjustments = state.adjustments
    return [
        state.step,
        state.history,
        state.sampling_params,
        state.token_mask,
        adjustments.bias,
        adjustments.counts,
        adjustments.prompt_tokens,
        *state.conv_windows.values(),
        *state.recurrent.values(),
    ]


def _logprobs(slot: SequenceState, stream: _Stream) -> TokenLogprobs | None:
    """The log-probabilities of the stream's newest token, if it asks for them: the slot's ring
    keys them by the position of the token the pass consumed, the one before, as a decode
    step's."""
    if stream.top_logprobs is None:
        return None
    (_, logprob), alternatives = read_logprobs(
        slot.logprob_ring, LOGPROB_RING_SLOTS, stream.position - 1, stream.top_logprobs
    )
    return TokenLogprobs(logprob, tuple(alternatives))


def _kv_rows(model: ModelGraph, state: SequenceState) -> list[np.ndarray]:
    """The model's KV cache buffers as [kv_heads, capacity, row bytes] views (not the MTP
    head's, which slots do not have)."""
    shape = (model.config.num_key_value_heads, model.capacity, row_bytes(model.kv_cache))
    layers = model.config.full_attention_layers
    buffers = [*(state.k_cache[i] for i in layers), *(state.v_cache[i] for i in layers)]
    return [b.numpy().view(np.uint8)[: np.prod(shape)].reshape(shape) for b in buffers]


class BatchedDecoder:
    """Up to `slots` sequences of one engine decoded in one pass per step. Runs with the
    engine's lock held by its user, one decoder per engine at a time (they would share the
    slots); other generations may run between passes (`join` itself prefills in the engine's
    state), as the streams own their slots."""

    def __init__(self, engine: DeviceEngine, slots: int = DEFAULT_SLOTS) -> None:
        self.engine = engine
        self._model = engine.model_graph
        self._model.allocate_slots(slots)
        self.slots = slots
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()

    @property
    def free_slots(self) -> int:
        return self.slots - len(self._active())

    def join(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        constraint: TokenConstraint | None = None,
        **prefill: Any,
    ) -> int:
        """Prefills `prompt` and draws its first token; returns the stream's id. The stream
        takes a slot unless that first token already ends it. `constraint` limits each of its
        draws, asked before every pass and told every token, as in `DeviceEngine.generate`,
        which prefills with the `prefill` options it takes (snapshot_at, should_stop,
        cache_key, reply_so_far, progress, images, prefill_slices)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_fits(len(prompt), max_new_tokens, self.engine.max_seq)
        taken = {s.slot for s in self._active()}
        free = [i for i in range(self.slots) if i not in taken]
        if not free:
            raise RuntimeError(f"all {self.slots} slots are decoding")
        stops = frozenset(int(t) for t in stop_token_ids)
        (first,) = self.engine.generate(
            prompt, 1, stops, sampling, constraint=constraint, **prefill
        )
        bans = banned_tokens_mask(sampling, self._model.token_count)
        stream = _Stream(
            free[0], len(prompt), max_new_tokens - 1, stops, sampling.top_logprobs, [first],
            constraint, bans,
        )  # fmt: skip
        stream_id = next(self._ids)
        self._streams[stream_id] = stream
        if stream.remaining == 0 or first.id in stops:
            stream.slot = None
            return stream_id
        self._move_into(free[0], len(prompt))
        return stream_id

    def join_from_engine(
        self,
        prompt_length: int,
        generated: int,
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        constraint: TokenConstraint | None = None,
    ) -> int:
        """Moves the engine's sequence into a free slot, where it goes on batched; returns the
        stream's id. The sequence is a generation that ran on the engine's own state
        (`DeviceEngine.generate`, drafting) and ended by its `pause` after `generated` tokens
        of its `max_new_tokens` (the newest waits in the history, not yet consumed): the
        slot takes its KV rows, conv windows, GDN states, token history, sampler settings
        (its seed among them), mask, penalty counts and rotary-position table (an image's
        positions, or identity). Its arguments are the generation's;
        `constraint` has been told exactly the `generated` tokens. The stream's `tokens` are
        those it draws from here on."""
        if not 1 <= generated < max_new_tokens:
            raise ValueError(
                f"a generation that paused has 1 to {max_new_tokens - 1} tokens, got {generated}"
            )
        taken = {s.slot for s in self._active()}
        free = [i for i in range(self.slots) if i not in taken]
        if not free:
            raise RuntimeError(f"all {self.slots} slots are decoding")
        newest = prompt_length + generated - 1
        bans = banned_tokens_mask(sampling, self._model.token_count)
        stops = frozenset(int(t) for t in stop_token_ids)
        stream = _Stream(
            free[0], newest, max_new_tokens - generated, stops, sampling.top_logprobs, [],
            constraint, bans,
        )  # fmt: skip
        stream_id = next(self._ids)
        self._streams[stream_id] = stream
        self._move_into(free[0], newest)
        return stream_id

    def _move_into(self, slot_index: int, newest: int) -> None:
        """Copies the engine's sequence state into slot `slot_index`: the token at `newest`
        (in the history) is the one it has not consumed."""
        model, slot = self._model, self._model.slots[slot_index]
        for source, target in zip(_buffers(model.state), _buffers(slot), strict=True):
            target.numpy()[:] = source.numpy()
        # Only the rows filled before the newest token: a cache holds the whole context.
        for source, target in zip(_kv_rows(model, model.state), _kv_rows(model, slot), strict=True):
            target[:, :newest] = source[:, :newest]
        step = slot.step.numpy().view("uint32")
        token = model.history_view()[newest]
        step[POSITION], step[PROMPT_END], step[TOKEN] = newest, newest + 1, token
        if model.rope_table is not None:
            # Its rotary positions: an image's, or identity for text (a slot an image's
            # sequence held before must not rotate the next one by them).
            model.slot_rope_table_view(slot_index)[:] = model.rope_table_view()

    def leave_to_engine(self, stream: int) -> None:
        """Moves active stream `stream` out of its slot into the engine's sequence state, the
        reverse of `join_from_engine`: its KV rows, conv windows, GDN states, token history
        (the newest token waiting, not consumed), sampler settings with the seed, mask,
        penalty counts and rotary-position table, for `DeviceEngine.resume` to go on from.
        Its slot is free, the stream forgotten; its constraint has been told every token it
        generated."""
        moving = self._streams[stream]
        if moving.slot is None:
            raise ValueError(f"stream {stream} has finished: nothing to move")
        model, slot = self._model, self._model.slots[moving.slot]
        rope_table = None if model.rope_table is None else model.slot_rope_table_view(moving.slot)
        self.engine.adopt_sequence(rope_table)
        newest = moving.position
        for source, target in zip(_buffers(slot), _buffers(model.state), strict=True):
            target.numpy()[:] = source.numpy()
        for source, target in zip(_kv_rows(model, slot), _kv_rows(model, model.state), strict=True):
            target[:, :newest] = source[:, :newest]
        step = model.step_view()
        step[POSITION], step[PROMPT_END] = newest, newest + 1
        step[TOKEN] = model.history_view()[newest]
        del self._streams[stream]

    def step(self, streams: Collection[int] | None = None) -> dict[int, GeneratedToken]:
        """One pass: each active stream's next token (of `streams` only, if given), by id, with
        its log-probabilities when the stream asks for them, as `DeviceEngine.generate` gives
        them. A stream whose constraint allows no token, or whose logits are not finite, ends
        instead (`error`); the others go on."""
        chosen = self._streams if streams is None else {i: self._streams[i] for i in streams}
        ids = {id(s): i for i, s in chosen.items()}
        active = [s for s in chosen.values() if s.slot is not None]
        for stream in active:
            if stream.constraint is not None:
                assert stream.slot is not None
                try:
                    mask = draw_mask(
                        stream.constraint, stream.bans, self._model.token_count, stream.position + 1
                    )
                except Exception as exc:  # the stream's own grammar failing it
                    stream.slot, stream.error = None, exc
                    continue
                write_token_mask(self._model.slots[stream.slot].token_mask, mask)
        active = [s for s in active if s.slot is not None]
        if not active:
            return {}
        self.engine.device.run(self._model.batch_graph([s.slot for s in active]))
        drawn: dict[int, GeneratedToken] = {}
        for stream in active:
            assert stream.slot is not None
            slot = self._model.slots[stream.slot]
            stream.position += 1
            token = int(slot.history.numpy().view("uint32")[stream.position])
            if token == NO_TOKEN:
                stream.slot, stream.error = None, NonFiniteLogitsError(stream.position)
                continue
            generated = GeneratedToken(token, _logprobs(slot, stream))
            stream.generated.append(generated)
            if stream.constraint is not None:
                stream.constraint.consume(token)
            stream.remaining -= 1
            if stream.remaining == 0 or token in stream.stop_token_ids:
                stream.slot = None
            drawn[ids[id(stream)]] = generated
        return drawn

    def generated(self, stream: int) -> list[GeneratedToken]:
        """What stream `stream` has generated so far (its stop token included), with the
        log-probabilities it asks for."""
        return list(self._streams[stream].generated)

    def tokens(self, stream: int) -> list[int]:
        """The ids of `generated(stream)`."""
        return [t.id for t in self._streams[stream].generated]

    def finished(self, stream: int) -> bool:
        return self._streams[stream].slot is None

    def error(self, stream: int) -> Exception | None:
        """What ended the stream early (`step`), if anything did."""
        return self._streams[stream].error

    def leave(self, stream: int) -> None:
        """Forgets the stream, finished or not (its caller has gone): its slot is free."""
        del self._streams[stream]

    def _active(self) -> list[_Stream]:
        return [s for s in self._streams.values() if s.slot is not None]
