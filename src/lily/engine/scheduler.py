"""Continuous batching: the generations of many callers (threads) on one device engine at once.

`BatchScheduler` stands in for a `DeviceEngine` (the `Engine` protocol) for callers on any
thread, such as the server's request threads or a web app's workers sharing one `Lily`. A thread
of its own owns the engine, and each round of its loop:

- admits the waiting generations, oldest first, while slots are free: each is prefilled on
  the engine's sequence state (the prefix cache serves it as for any generation) in chunks,
  draws its first token, and moves into a free slot of a `BatchedDecoder`, its images' rotary
  positions with it (each slot has its own table, which the batched pass's attention reads).
  Between two batched passes of the decoding streams at most `SLICE_TOKENS` prompt tokens are
  fed, however many prompts they belong to: a chunk that would pass that budget waits for a
  pass first;
- runs one batched pass over the slots whose callers are ready for a token (a caller may be at
  most `RUN_AHEAD` tokens behind; one with a constraint is told each token before the next
  draw, so it runs in step with its caller);
- gives the generation that drafts alone (below) its next token.

Drafters (a client's prediction, the MTP head, prompt lookup) do not draft for batched
streams: drafts are checked by a verify pass, which is a single sequence's, so a stream
decodes one token per pass. A generation with a drafter that finds nothing else running or
waiting therefore runs alone, drafting as with `parallel=1`, until another caller arrives (a
generation, or a call that uses the engine's state: `cached_prefix_length` runs beside it): it
is then driven to the end of its current pass (whose tokens the engine has drawn already), and its
state moves into a slot (`BatchedDecoder.join_from_engine`), where it decodes batched. When
it (or any stream with such a drafter) is the only stream left, nothing waits or calls, and
it may still generate `REDRAFT_MIN_TOKENS` tokens, its state moves back onto the engine's
(`BatchedDecoder.leave_to_engine`) between two of its passes and it drafts alone again
(`DeviceEngine.resume`), until the next caller moves it into a slot again. Prompt lookup
drafts from the history alone; the MTP head's KV cache lacks right rows for the positions
decoded batched (a batched pass keeps no hidden states for it), so it drafts over stale ones
there: its acceptance may drop, never a token changes. A prediction drafts from the reply so
far, wherever it was decoded, and OpenAI's counts of its tokens are read from the whole reply
at the end (`PredictedText.read`): they do not depend on where it ran.

A decoding stream waits at most `SLICE_TOKENS` prompt tokens' prefill (of one or several
prompts), or the encoding of one image of a newcomer's prompt (the vision encoder runs on this
thread, when the prefill first reaches the image), plus its own pass between two tokens.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from lily.engine.batch import BatchedDecoder
from lily.engine.engine import GREEDY, DeviceEngine, PrefillSlices, check_fits
from lily.engine.image_input import ImagePatches
from lily.engine.sampling import GeneratedToken, SamplingParams
from lily.engine.speculative import Speculation
from lily.errors import GenerationCancelled

T = TypeVar("T")

# The most prompt tokens prefilled between two batched passes while streams decode.
SLICE_TOKENS = 512
# How many tokens a stream may be drawn ahead of what its caller has taken.
RUN_AHEAD = 4
# The fewest tokens a stream left alone in a slot must still be allowed to generate (its budget,
# an upper bound: a stop token may end it sooner) to move back onto the engine's state and
# draft. A move copies its state once each way (on the real model 66 MB of recurrent state
# plus 20 KB of KV rows per context token, docs/benchmarks.md); drafting saves 0.2-0.4 of a
# decode step per token by the Mac model, so a short rest of an answer does not repay it.
REDRAFT_MIN_TOKENS = 32
# How often the scheduler asks waiting and paused generations' `should_stop` when idle.
POLL_SECONDS = 0.05

_END = object()


@dataclass(eq=False)
class _Generation:
    """One caller's `generate`, as the scheduler's thread sees it."""

    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: Collection[int]
    sampling: SamplingParams
    options: dict[str, Any]  # the rest of `Engine.generate`'s arguments
    results: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    asked: int = 0  # tokens the caller has asked for
    delivered: int = 0
    closed: bool = False  # the caller closed its iterator
    stream: int | None = None  # its BatchedDecoder stream, once in a slot
    alone: Iterator[GeneratedToken] | None = None  # its tokens while it drafts alone
    last: int | None = None  # the last token delivered
    thread: int = field(default_factory=threading.get_ident)  # the caller's

    @property
    def drafts(self) -> bool:
        return self.options.get("drafter") is not None

    @property
    def in_step(self) -> bool:
        """Whether it runs in step with its caller (a constraint: told each token first)."""
        return self.options.get("constraint") is not None

    def cancelled(self) -> bool:
        should_stop = self.options.get("should_stop")
        return should_stop is not None and should_stop()

    @property
    def finished(self) -> bool:
        """Whether its last token ended it (a stop token, or its budget)."""
        return self.delivered == self.max_new_tokens or self.last in self.stop_token_ids

    def deliver(self, item: object) -> None:
        if isinstance(item, GeneratedToken):
            self.delivered += 1
            self.last = item.id
        self.results.put(item)


class BatchScheduler:
    """`engine`'s generations, from any threads, batched in up to `slots` slots (see the
    module's docstring). `close()` stops the scheduler's thread and closes the engine."""

    def __init__(self, engine: DeviceEngine, slots: int) -> None:
        self.engine = engine
        self.config = engine.config
        self.max_seq = engine.max_seq
        self.slots = slots
        self._decoder = BatchedDecoder(engine, slots)
        self._changed = threading.Condition()
        self._waiting: deque[_Generation] = deque()
        self._batched: list[_Generation] = []
        self._alone: _Generation | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        # Calls that only read the prefix cache's index, which a generation running alone
        # leaves alone between its tokens: they run beside it rather than move it.
        self._reads: deque[tuple[Callable[[], Any], Future]] = deque()
        # The generation each caller thread waits on for its next token.
        self._reading: dict[int, _Generation] = {}
        # Prompt tokens prefilled since the last batched pass (`_before_chunk`).
        self._fed_since_pass = 0
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="lily-batch", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        """Generations past their admission and not ended."""
        return len(self._batched) + (self._alone is not None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        **options: Any,
    ) -> Iterator[GeneratedToken]:
        """`Engine.generate`, run by the scheduler's thread among the other callers'."""
        prompt = [int(t) for t in prompt]
        check_fits(len(prompt), max_new_tokens, self.max_seq)
        if max_new_tokens == 0:
            return
        generation = _Generation(prompt, max_new_tokens, stop_token_ids, sampling, options)
        with self._changed:
            if self._closing:
                raise RuntimeError("this engine has been closed")
            self._waiting.append(generation)
        try:
            while True:
                with self._changed:
                    generation.asked += 1
                    self._reading[threading.get_ident()] = generation
                    self._changed.notify()
                try:
                    item = generation.results.get()
                finally:
                    with self._changed:
                        del self._reading[threading.get_ident()]
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            with self._changed:
                generation.closed = True
                self._changed.notify()

    def cached_prefix_length(
        self,
        prompt: Sequence[int],
        cache_key: str | None = None,
        images: Sequence[ImagePatches] = (),
    ) -> int:
        return self._call(
            lambda: self.engine.cached_prefix_length(prompt, cache_key, images), reads_only=True
        )

    def teacher_forced_logits(
        self, tokens: Sequence[int], reuse: bool = False, images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        return self._call(lambda: self.engine.teacher_forced_logits(tokens, reuse, images))

    def prompt_logits(
        self, prompt: Sequence[int], images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        return self._call(lambda: self.engine.prompt_logits(prompt, images))

    def pass_cost(self, drafts: int) -> float:
        return self.engine.pass_cost(drafts)

    def stop(self) -> None:
        """Stops the scheduler's thread: what runs or waits ends with an error; the engine
        stays open."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def close(self) -> None:
        self.stop()
        self.engine.close()

    def _call(self, work: Callable[[], T], reads_only: bool = False) -> T:
        """Runs `work` on the scheduler's thread between two rounds: with no generation running
        alone, whose state it could touch, unless it `reads_only` the prefix cache's index."""
        done: Future = Future()
        with self._changed:
            if self._closing:
                raise RuntimeError("this engine has been closed")
            (self._reads if reads_only else self._calls).append((work, done))
            self._changed.notify()
        return done.result()

    # --- the scheduler's thread ----------------------------------------------------------

    def _serve(self) -> None:
        error = RuntimeError("this engine has been closed")
        try:
            while True:
                with self._changed:
                    while not self._closing and not self._has_work():
                        self._changed.wait(POLL_SECONDS)
                        if self._cancellations():
                            break
                    if self._closing:
                        break
                self._drop_closed()
                self._run_calls()
                self._admit()
                self._return_to_drafting()
                self._decode()
        except BaseException as exc:  # a fault of its own: every caller hears of it, with its cause
            error = RuntimeError(f"the batch scheduler stopped: {exc!r}")
            error.__cause__ = exc
        finally:
            with self._changed:
                self._closing = True  # no later caller waits for a thread that is gone
            self._end_all(error)

    def _can_admit(self) -> bool:
        """Whether the oldest waiting generation can start now."""
        return bool(self._waiting) and self._alone is None and self._decoder.free_slots > 0

    def _ready(self, generation: _Generation) -> bool:
        """Whether the generation's caller may be given another token now: while it is at most
        `RUN_AHEAD` tokens behind (in step, none), or, not in step, while its caller's thread
        waits on another generation of its own. A thread may hold more open generations than
        there are slots and read them in turn: the ones in slots then run ahead of it, rather
        than wait for it as it waits for a slot."""
        g = generation
        if g.closed:
            return False
        if g.delivered < g.asked + (1 if g.in_step else RUN_AHEAD) - 1:
            return True
        waits_on = self._reading.get(g.thread)
        return not g.in_step and waits_on is not None and waits_on is not g

    def _held_by_its_own_caller(self) -> _Generation | None:
        """A waiting generation whose thread waits on it while every slot (and the generation
        drafting alone) holds a generation of that thread's that runs in step and is not read:
        nothing would ever free them."""
        alone = self._alone
        holders = [*self._batched, *([alone] if alone is not None else [])]
        # A generation drafting alone moves into a slot once others wait, whatever its caller.
        free = self._decoder.free_slots - (1 if alone is not None else 0)
        for generation in self._waiting:
            if self._reading.get(generation.thread) is not generation:
                continue
            if free > 0:
                continue
            if all(h.thread == generation.thread and not self._ready(h) for h in holders):
                return generation
        return None

    def _has_work(self) -> bool:
        admissible = self._can_admit()
        calls = self._reads or (self._calls and self._alone is None)
        ready = any(self._ready(g) for g in self._batched) or (
            self._alone is not None and self._ready(self._alone)
        )
        closed = any(g.closed for g in self._batched) or (
            self._alone is not None and self._alone.closed
        )
        held = self._held_by_its_own_caller() is not None
        return bool(admissible or calls or ready or closed or held or self._others_wait())

    def _others_wait(self) -> bool:
        """Whether a generation drafting alone must move into a slot: others are waiting."""
        alone = self._alone
        return alone is not None and self._others_arrived()

    def _others_arrived(self) -> bool:
        """Whether a generation or a call waits (what ends a drafting generation's run alone,
        its engine's `pause`)."""
        return bool(self._waiting or self._calls)

    def _cancellations(self) -> bool:
        """Whether a waiting or paused generation's caller asked it to stop."""
        return any(g.cancelled() for g in (*self._waiting, *self._batched)) or (
            self._alone is not None and self._alone.cancelled()
        )

    def _drop_closed(self) -> None:
        for generation in [g for g in self._batched if g.closed]:
            self._leave(generation)
        alone = self._alone
        if alone is not None and alone.closed:
            self._end_alone()
        with self._changed:  # callers append to the queue meanwhile
            cancelled = [g for g in self._waiting if g.cancelled()]
            for generation in cancelled:
                self._waiting.remove(generation)
            held = self._held_by_its_own_caller()
            if held is not None:
                self._waiting.remove(held)
        for generation in cancelled:
            generation.deliver(GenerationCancelled())
        if held is not None:
            held.deliver(
                RuntimeError(
                    "this thread waits for a generation while every slot holds one of its own "
                    "that it is not reading, under a constraint (which runs in step with its "
                    "reader): read or close one of them first"
                )
            )

    def _run_calls(self) -> None:
        while self._reads or (self._calls and self._alone is None):
            work, done = (self._reads or self._calls).popleft()
            try:
                done.set_result(work())
            except BaseException as exc:  # the caller's error, raised in the caller's thread
                done.set_exception(exc)

    def _slices(self) -> PrefillSlices:
        return PrefillSlices(SLICE_TOKENS, self._before_chunk)

    def _before_chunk(self, tokens: int) -> None:
        """Before a prefill chunk of `tokens` prompt tokens: a batched pass of the decoding
        streams first if, with the chunk, more than SLICE_TOKENS prompt tokens would have been
        fed since their last pass."""
        if self._fed_since_pass + tokens > SLICE_TOKENS:
            self._batched_pass()
        self._fed_since_pass += tokens

    def _admit(self) -> None:
        """Starts the waiting generations that can start now, oldest first. Their prompts'
        chunks share one budget of SLICE_TOKENS tokens between two passes of the decoding
        streams (`_before_chunk`): short prompts that arrive together start together, and
        then decode (and end) together, with no partly filled passes between them."""
        while self._can_admit():
            self._admit_oldest()

    def _admit_oldest(self) -> None:
        generation = self._waiting.popleft()
        if generation.drafts and not (self._batched or self._others_arrived()):
            # Nobody else decodes: no slices for its prefill.
            self._start_alone(generation, pause=self._others_arrived)
            return
        options = {k: v for k, v in generation.options.items() if k != "drafter"}
        try:
            stream = self._decoder.join(
                generation.prompt,
                generation.max_new_tokens,
                generation.stop_token_ids,
                generation.sampling,
                **options,
                prefill_slices=self._slices(),
            )
        except Exception as exc:  # the request's error (cancelled, no allowed token, ...)
            generation.deliver(exc)
            return
        generation.stream = stream
        (first,) = self._decoder.generated(stream)
        generation.deliver(first)
        if self._decoder.finished(stream):
            self._decoder.leave(stream)
            generation.deliver(_END)
        else:
            self._batched.append(generation)

    def _start_alone(self, generation: _Generation, **how: Any) -> None:
        """Starts the generation on the engine's sequence state, `how` going to its
        `DeviceEngine.generate`."""
        g = generation
        g.alone = self.engine.generate(
            g.prompt, g.max_new_tokens, g.stop_token_ids, g.sampling, **g.options, **how
        )
        self._alone = generation

    def _decode(self) -> None:
        self._batched_pass()
        alone = self._alone
        moving = self._others_wait()
        if alone is None or not (moving or self._ready(alone)):
            return
        assert alone.alone is not None
        try:
            # Moving, the rest of its current pass: tokens the engine has drawn (and told its
            # constraint) already, so they reach its caller ahead of `RUN_AHEAD`; its engine's
            # `pause` then ends it.
            for token in alone.alone:
                alone.deliver(token)
                if not moving:
                    return
        except Exception as exc:
            self._end_alone(exc)
            return
        # It also ends at its `pause` when another caller arrives between `_others_wait` and
        # its next token.
        if not alone.finished:
            self._move_into_batch(alone)
        else:
            self._end_alone()

    def _batched_pass(self) -> None:
        """One batched pass over the streams whose callers are ready for a token."""
        self._fed_since_pass = 0
        for generation in [g for g in self._batched if g.cancelled()]:
            self._leave(generation, GenerationCancelled())
        ready = {g.stream: g for g in self._batched if self._ready(g)}
        if not ready:
            return
        drawn = self._decoder.step(ready)
        for stream, generation in ready.items():
            if stream in drawn:
                generation.deliver(drawn[stream])
            if self._decoder.finished(stream):
                # Its stop token, its budget, or its own error (a constraint allowing nothing).
                self._leave(generation, self._decoder.error(stream))

    def _move_into_batch(self, alone: _Generation) -> None:
        """Moves the state of the generation that drafted alone, which its engine's `pause`
        ended before its end, into a slot, where it goes on batched."""
        self._alone, alone.alone = None, None
        try:
            alone.stream = self._decoder.join_from_engine(
                len(alone.prompt),
                alone.delivered,
                alone.max_new_tokens,
                alone.stop_token_ids,
                alone.sampling,
                alone.options.get("constraint"),
            )
        except Exception as exc:
            alone.deliver(exc)
            return
        self._batched.append(alone)

    def _return_to_drafting(self) -> None:
        """Moves the one stream left in a slot back onto the engine's state, to draft alone
        with its drafter, when nothing else waits or calls and the move pays (`_redrafts`)."""
        if self._alone is not None or len(self._batched) != 1 or self._others_arrived():
            return
        (generation,) = self._batched
        if not self._redrafts(generation):
            return
        g = generation
        assert g.stream is not None
        try:
            self._decoder.leave_to_engine(g.stream)
        except Exception as exc:
            self._leave(g, exc)
            return
        self._batched.remove(g)
        g.stream = None
        g.alone = self.engine.resume(
            len(g.prompt),
            g.delivered,
            g.max_new_tokens,
            g.options["drafter"],
            g.stop_token_ids,
            g.sampling,
            constraint=g.options.get("constraint"),
            should_stop=g.options.get("should_stop"),
            pause=self._others_arrived,
        )
        self._alone = g

    @staticmethod
    def _redrafts(generation: _Generation) -> bool:
        """Whether moving the batched `generation` back onto the engine's state pays: it may
        still generate REDRAFT_MIN_TOKENS tokens, and its drafter would draft there: a client's
        prediction, the MTP head or prompt lookup, unless "auto" dropped it (the DFlash drafter
        needs rows of every position, which batched passes do not keep; any other drafter,
        unless it gave up).

        A prediction always would: "auto" never drops it, and it cannot be judged from here.
        Where the reply lines up with it, its drafts are the answer the client expects, kept
        whole when the reply copies it (an edit's unchanged text); where the reply has left
        it, a pass drafts nothing and costs about the decode step it replaces, until the
        reply's last characters rejoin it and it drafts again. So it pays while it still lines
        up and costs little while it does not."""
        g = generation
        drafter = g.options.get("drafter")
        if g.closed or g.cancelled() or drafter is None:
            return False
        if g.max_new_tokens - g.delivered < REDRAFT_MIN_TOKENS:
            return False
        if isinstance(drafter, Speculation):
            if drafter.prediction is not None:
                return True
            sources = [s for s in ("mtp", "ngram") if s in drafter.counts]
            return any(drafter.verdict(s) is not False for s in sources)
        return not drafter.exhausted

    def _leave(self, generation: _Generation, error: BaseException | None = None) -> None:
        assert generation.stream is not None
        self._decoder.leave(generation.stream)
        self._batched.remove(generation)
        generation.deliver(_END if error is None else error)

    def _end_alone(self, error: BaseException | None = None) -> None:
        alone = self._alone
        assert alone is not None and alone.alone is not None
        self._alone = None
        try:
            alone.alone.close()
        finally:
            alone.deliver(_END if error is None else error)

    def _end_all(self, error: BaseException) -> None:
        with self._changed:
            waiting, self._waiting = list(self._waiting), deque()
            calls = [*self._calls, *self._reads]
            self._calls, self._reads = deque(), deque()
        for generation in waiting:
            generation.deliver(error)
        for _, done in calls:
            done.set_exception(error)
        for generation in list(self._batched):
            self._leave(generation, error)
        if self._alone is not None:
            self._end_alone(error)
