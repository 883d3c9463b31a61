"""Engines turn token ids into next-token predictions. Two implement one small interface:

- `DeviceEngine` replays the recorded decode graph on a device (sim or metal), one native call per
  token, keeping up to two steps in flight: step N+1 is queued before step N's token is read,
  which works because the graph itself advances its step buffer.
- `ReferenceEngine` runs the numpy reference model: the oracle, and a device-free fallback that a
  user must ask for by name (`device="reference"`).

Prompts are fed through the decode graph one token at a time (batched prefill comes later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lily.decode_graph import LOGPROB_RING_SLOTS, DecodeGraph
from lily.errors import ContextLengthError
from lily.kernels.sampling import read_logprobs, write_sampling_params
from lily.kernels.step import POSITION, PROMPT_END, TOKEN
from lily.reference import ReferenceModel
from lily.sampling import (
    GeneratedToken,
    SamplingParams,
    TokenLogprobs,
    sampling_distribution,
    top_logprobs,
)

GREEDY = SamplingParams(temperature=0.0)

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint
    from lily.config import ModelConfig
    from lily.device import Device

PIPELINE_DEPTH = 2


class Engine(Protocol):
    config: ModelConfig
    max_seq: int

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
    ) -> Iterator[GeneratedToken]:
        """Yields the tokens generated after `prompt` (a fresh sequence), stopping after a stop
        token; with `sampling.top_logprobs` set, each carries its logprob and that many
        alternatives. Closing the iterator stops the generation."""
        ...

    def teacher_forced_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), vocab] of a fresh sequence fed `tokens`: row i predicts i + 1."""
        ...

    def close(self) -> None: ...


def _check_fits(prompt_length: int, max_new_tokens: int, max_seq: int) -> None:
    if prompt_length == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if prompt_length + max_new_tokens > max_seq:
        raise ContextLengthError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"context of {max_seq} tokens; load with a larger max_seq or ask for fewer tokens"
        )


class DeviceEngine:
    def __init__(
        self, checkpoint: Checkpoint, device: Device, max_seq: int, token_count: int
    ) -> None:
        """`token_count`: how many ids the tokenizer can produce; only those are generated."""
        self.config = checkpoint.config
        self.device = device
        self.max_seq = max_seq
        self._decode = DecodeGraph(checkpoint, device, max_seq, token_count)

    def _start(self, tokens: Sequence[int], prompt_end: int) -> None:
        """Clears the recurrent state and points the step buffer at the first token."""
        for buffer in self._decode.state.recurrent_buffers():
            buffer.numpy()[:] = 0
        history = self._decode.history_view()
        history[: len(tokens)] = tokens
        step = self._decode.step_view()
        step[POSITION], step[PROMPT_END], step[TOKEN] = 0, prompt_end, tokens[0]

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
    ) -> Iterator[GeneratedToken]:
        prompt = [int(t) for t in prompt]
        _check_fits(len(prompt), max_new_tokens, self.max_seq)
        if max_new_tokens == 0:
            return
        state = self._decode.state
        write_sampling_params(state.sampling_params, sampling.with_seed())
        self._start(prompt, prompt_end=len(prompt))
        history = self._decode.history_view()
        graph = self._decode.graph
        # Step s consumes token s and predicts token s + 1; the first prediction that is not
        # prompt comes from step len(prompt) - 1.
        last_step = len(prompt) - 2 + max_new_tokens
        in_flight: deque[tuple[int, int]] = deque()
        next_step = 0
        try:
            while True:
                while next_step <= last_step and len(in_flight) < PIPELINE_DEPTH:
                    in_flight.append((next_step, self.device.submit(graph)))
                    next_step += 1
                if not in_flight:
                    return
                step, ticket = in_flight.popleft()
                self.device.wait(ticket)
                if step + 1 < len(prompt):
                    continue
                token = int(history[step + 1])
                logprobs = None
                if sampling.top_logprobs is not None:
                    (_, logprob), alternatives = read_logprobs(
                        state.logprob_ring, LOGPROB_RING_SLOTS, step, sampling.top_logprobs
                    )
                    logprobs = TokenLogprobs(logprob, tuple(alternatives))
                yield GeneratedToken(token, logprobs)
                if token in stop_token_ids:
                    return
        finally:
            # A speculative step may still be running (after a stop token, or when the caller
            # closed the iterator); it only writes state the next generation clears.
            for _, pending in in_flight:
                self.device.wait(pending)

    def teacher_forced_logits(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        _check_fits(len(tokens), 0, self.max_seq)
        self._start(tokens, prompt_end=len(tokens))
        logits = np.empty((len(tokens), self.config.vocab_size), np.float32)
        for i in range(len(tokens)):
            self.device.run(self._decode.graph)
            logits[i] = self._decode.logits_view()
        return logits

    def close(self) -> None:
        self._decode = None  # type: ignore[assignment]


class ReferenceEngine:
    def __init__(self, checkpoint: Checkpoint, max_seq: int, token_count: int) -> None:
        """`token_count`: how many ids the tokenizer can produce; only those are generated."""
        self.config = checkpoint.config
        self.max_seq = max_seq
        self.token_count = token_count
        self._model = ReferenceModel(checkpoint.config, checkpoint.tensors)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
    ) -> Iterator[GeneratedToken]:
        _check_fits(len(prompt), max_new_tokens, self.max_seq)
        if max_new_tokens == 0:
            return
        sampling = sampling.with_seed()
        logits, state = self._model.prefill(prompt)
        next_logits = logits[-1, : self.token_count]
        for produced in range(max_new_tokens):
            position = len(prompt) + produced
            if sampling.greedy:
                token = int(np.argmax(next_logits))
            else:
                # One generator per (seed, position): a seed reproduces a run, step by step.
                rng = np.random.default_rng([sampling.seed, position])
                p = sampling_distribution(next_logits, sampling)
                token = int(rng.choice(p.size, p=p))
            logprobs = None
            if sampling.top_logprobs is not None:
                logprobs = top_logprobs(next_logits, token, sampling.top_logprobs)
            yield GeneratedToken(token, logprobs)
            if token in stop_token_ids or produced + 1 == max_new_tokens:
                return
            next_logits = self._model.decode(token, state)[: self.token_count]

    def teacher_forced_logits(self, tokens: Sequence[int]) -> np.ndarray:
        _check_fits(len(tokens), 0, self.max_seq)
        logits, _ = self._model.prefill(tokens)
        return logits.astype(np.float32)

    def close(self) -> None:
        self._model = None  # type: ignore[assignment]
