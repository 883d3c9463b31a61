"""Batched decode: several sequences decoded together, one pass over the weights per step
(`ModelGraph.batch_graph`).

A sequence joins by being prefilled alone (the engine's own `generate`, which also draws its
first token) and having that state moved into a free slot; it leaves when it draws a stop token
or reaches its token budget, freeing the slot for the next. Between passes the set of active
slots may change; each set's graph is recorded on first use."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from lily.device import Buffer
from lily.engine.constraint import TokenConstraint, draw_mask
from lily.engine.engine import GREEDY, DeviceEngine, banned_tokens_mask, check_fits
from lily.engine.model_graph import SequenceState
from lily.engine.sampling import SamplingParams
from lily.errors import NonFiniteLogitsError
from lily.kernels.sampling import NO_TOKEN, write_token_mask
from lily.kernels.step import POSITION, PROMPT_END, TOKEN

DEFAULT_SLOTS = 8


@dataclass
class _Stream:
    slot: int | None  # None once finished
    position: int  # of the newest token, which the slot's state has not consumed
    remaining: int  # tokens it may still generate
    stop_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    constraint: TokenConstraint | None = None
    bans: np.ndarray | None = None  # the tokens its sampling settings ban


def _buffers(state: SequenceState) -> list[Buffer]:
    """What a decode step of a sequence reads: everything but its last logits, its last draw
    and its log-probabilities (which batched decode does not report)."""
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
        *state.k_cache.values(),
        *state.v_cache.values(),
    ]


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
        self._streams: list[_Stream] = []

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
    ) -> int:
        """Prefills `prompt` and draws its first token; returns the stream's id. The stream
        takes a slot unless that first token already ends it. `constraint` limits each of its
        draws, asked before every pass and told every token, as in `DeviceEngine.generate`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if sampling.top_logprobs is not None:
            raise ValueError("batched decode does not report log-probabilities")
        check_fits(len(prompt), max_new_tokens, self.engine.max_seq)
        taken = {s.slot for s in self._active()}
        free = [i for i in range(self.slots) if i not in taken]
        if not free:
            raise RuntimeError(f"all {self.slots} slots are decoding")
        stops = frozenset(int(t) for t in stop_token_ids)
        (first,) = self.engine.generate(prompt, 1, stops, sampling, constraint=constraint)
        bans = banned_tokens_mask(sampling, self._model.token_count)
        stream = _Stream(
            free[0], len(prompt), max_new_tokens - 1, stops, [first.id], constraint, bans
        )
        self._streams.append(stream)
        if stream.remaining == 0 or first.id in stops:
            stream.slot = None
            return len(self._streams) - 1
        slot = self._model.slots[free[0]]
        for source, target in zip(_buffers(self._model.state), _buffers(slot), strict=True):
            target.numpy()[:] = source.numpy()
        step = slot.step.numpy().view("uint32")
        step[POSITION], step[PROMPT_END], step[TOKEN] = len(prompt), len(prompt) + 1, first.id
        return len(self._streams) - 1

    def step(self) -> dict[int, int]:
        """One pass: each active stream's next token, by stream id."""
        active = self._active()
        if not active:
            return {}
        slots = [s.slot for s in active]
        for stream in active:
            if stream.constraint is not None:
                assert stream.slot is not None
                mask = draw_mask(
                    stream.constraint, stream.bans, self._model.token_count, stream.position + 1
                )
                write_token_mask(self._model.slots[stream.slot].token_mask, mask)
        self.engine.device.run(self._model.batch_graph(slots))
        drawn: dict[int, int] = {}
        for stream in active:
            assert stream.slot is not None
            stream.position += 1
            history = self._model.slots[stream.slot].history.numpy().view("uint32")
            token = int(history[stream.position])
            if token == NO_TOKEN:
                raise NonFiniteLogitsError(stream.position)
            stream.tokens.append(token)
            if stream.constraint is not None:
                stream.constraint.consume(token)
            stream.remaining -= 1
            if stream.remaining == 0 or token in stream.stop_token_ids:
                stream.slot = None
            drawn[self._streams.index(stream)] = token
        return drawn

    def tokens(self, stream: int) -> list[int]:
        """What stream `stream` has generated so far (its stop token included)."""
        return list(self._streams[stream].tokens)

    def finished(self, stream: int) -> bool:
        return self._streams[stream].slot is None

    def _active(self) -> list[_Stream]:
        return [s for s in self._streams if s.slot is not None]
