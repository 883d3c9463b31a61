"""Continuous batching (`lily.engine.scheduler`): callers on their own threads share one device
engine, and each gets exactly the tokens the engine gives its request alone. On the sim unless
LILY_DEVICE names another device."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from device_testing import open_test_device
from test_batched_decode import FiveTokens, assert_same_logprobs
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine import scheduler as scheduler_module
from lily.engine.batch import BatchedDecoder
from lily.engine.constraint import NoAllowedTokenError, mask_from_tokens
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import SamplingParams
from lily.engine.scheduler import BatchScheduler
from lily.errors import GenerationCancelled

MAX_SEQ = 64
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engine() -> Iterator[DeviceEngine]:
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    engine = DeviceEngine(
        checkpoint, open_test_device(), MAX_SEQ, checkpoint.config.vocab_size, max_chunk=16
    )
    yield engine
    engine.close()


@pytest.fixture
def scheduler(engine: DeviceEngine) -> Iterator[BatchScheduler]:
    scheduler = BatchScheduler(engine, slots=3)
    yield scheduler
    scheduler.stop()


def _prompts(engine: DeviceEngine, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, engine.config.vocab_size, n).tolist() for n in lengths]


def _ids(tokens: Iterator[Any]) -> list[int]:
    return [t.id for t in tokens]


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Runs each call on its own thread, all at once; their results in order (or errors)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def test_callers_on_threads_get_their_tokens_alone(engine, scheduler):
    """More callers than slots, greedy and seeded, one with a stop token, one stepped in lock
    with a constraint, and one asking for log-probabilities (batched like the others)."""
    prompts = _prompts(engine, [5, 30, 9, 23, 3, 12], seed=1)
    seeded = SamplingParams(temperature=1.0, seed=5)
    logprobs = SamplingParams(temperature=0.0, top_logprobs=2)
    stop = _ids(engine.generate(prompts[2], NEW_TOKENS))[2]
    vocab = engine.config.vocab_size
    requests: list[dict[str, Any]] = [
        dict(prompt=prompts[0], max_new_tokens=NEW_TOKENS),
        dict(prompt=prompts[1], max_new_tokens=NEW_TOKENS, sampling=seeded),
        dict(prompt=prompts[2], max_new_tokens=NEW_TOKENS, stop_token_ids=[stop]),
        dict(prompt=prompts[3], max_new_tokens=NEW_TOKENS, constraint=FiveTokens(vocab, 1)),
        dict(prompt=prompts[4], max_new_tokens=NEW_TOKENS, sampling=logprobs),
        dict(prompt=prompts[5], max_new_tokens=1),
    ]

    def fresh(request: dict[str, Any]) -> dict[str, Any]:
        constraint = request.get("constraint")
        return {**request, "constraint": constraint and FiveTokens(vocab, 1)}

    alone = [list(engine.generate(**fresh(r))) for r in requests]
    together = _together([lambda r=r: list(scheduler.generate(**fresh(r))) for r in requests])
    assert [_ids(t) for t in together] == [_ids(t) for t in alone]
    assert len(together[2]) == 3  # ended at the stop token
    assert_same_logprobs(together[4], alone[4])


def test_a_logprobs_request_decodes_beside_newcomers(engine, scheduler):
    """A request asking for log-probabilities takes a slot: a request arriving while it
    decodes, its reader waiting on the other's tokens, is served meanwhile (behind a generation
    running alone it would wait for that one's end)."""
    logged_prompt, other = _prompts(engine, [7, 5], seed=9)
    sampling = SamplingParams(temperature=0.0, top_logprobs=2)
    expected = list(engine.generate(logged_prompt, 40, sampling=sampling))
    other_alone = _ids(engine.generate(other, 4))
    logged = scheduler.generate(logged_prompt, 40, sampling=sampling)
    first = next(logged)
    served: list[list[int]] = []
    newcomer = threading.Thread(target=lambda: served.append(_ids(scheduler.generate(other, 4))))
    newcomer.start()
    newcomer.join(60)
    assert served == [other_alone]
    assert_same_logprobs([first, *logged], expected)


def test_newcomers_waiting_together_start_together(engine, scheduler, monkeypatch):
    """Short prompts waiting at the same round are all prefilled before the next batched pass
    (their chunks fit one SLICE_TOKENS budget), so the first pass carries every stream rather
    than a pass after each join; each stream's tokens are its own."""
    prompts = _prompts(engine, [5, 6, 7], seed=11)
    alone = [_ids(engine.generate(p, NEW_TOKENS)) for p in prompts]
    events: list[object] = []
    join, step = BatchedDecoder.join, BatchedDecoder.step

    def joining(self: BatchedDecoder, *args: Any, **kwargs: Any) -> int:
        if not events:  # the first: hold it until the other two wait behind it
            deadline = time.monotonic() + 60
            while scheduler.waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        events.append("join")
        return join(self, *args, **kwargs)

    def stepping(self: BatchedDecoder, streams: Any = None) -> dict:
        drawn = step(self, streams)
        events.append(len(drawn))
        return drawn

    monkeypatch.setattr(BatchedDecoder, "join", joining)
    monkeypatch.setattr(BatchedDecoder, "step", stepping)
    got = _together([lambda p=p: _ids(scheduler.generate(p, NEW_TOKENS)) for p in prompts])
    assert got == alone
    assert events[:4] == ["join", "join", "join", 3]


def test_a_long_prompt_is_prefilled_in_slices_between_the_others_passes(
    engine, scheduler, monkeypatch
):
    """A prompt of 6 slices joins while two streams decode: they get tokens during its
    prefill, and every stream's tokens are still its own."""
    monkeypatch.setattr(scheduler_module, "SLICE_TOKENS", 8)
    short, other, long = _prompts(engine, [4, 6, 48], seed=2)
    alone = [_ids(engine.generate(p, n)) for p, n in ((short, 30), (other, 30), (long, 4))]
    got: dict[str, list[int]] = {"short": [], "other": []}
    tokens_when_long_started: list[int] = []
    decoding = [scheduler.generate(short, 30), scheduler.generate(other, 30)]
    got["short"].append(next(decoding[0]).id)
    got["other"].append(next(decoding[1]).id)

    def read(name: str, tokens: Iterator[Any]) -> None:
        got[name].extend(t.id for t in tokens)

    readers = [
        threading.Thread(target=read, args=(name, tokens))
        for name, tokens in zip(got, decoding, strict=True)
    ]
    for reader in readers:
        reader.start()
    long_tokens = scheduler.generate(long, 4)
    tokens_when_long_started.append(len(got["short"]))
    first = next(long_tokens).id
    produced_during_prefill = len(got["short"]) - tokens_when_long_started[0]
    rest = _ids(long_tokens)
    for reader in readers:
        reader.join(120)
    assert [got["short"], got["other"], [first, *rest]] == alone
    # Five slice boundaries, a pass at each (the streams run at most RUN_AHEAD ahead of
    # their readers, who read at once); prefilled whole, it gets one or two.
    assert produced_during_prefill >= 5


def test_a_caller_that_closes_or_cancels_frees_its_slot(engine, scheduler):
    prompts = _prompts(engine, [5, 7, 9, 11], seed=3)
    closed = scheduler.generate(prompts[0], 40)
    next(closed)
    closed.close()
    stop = threading.Event()
    cancelled = scheduler.generate(prompts[1], 40, should_stop=stop.is_set)
    next(cancelled)
    stop.set()
    with pytest.raises(GenerationCancelled):
        list(cancelled)
    # Three slots, so both freed ones are taken again by these three.
    expected = [_ids(engine.generate(p, NEW_TOKENS)) for p in prompts[1:]]
    together = _together([lambda p=p: _ids(scheduler.generate(p, NEW_TOKENS)) for p in prompts[1:]])
    assert together == expected


def test_a_waiting_caller_can_be_cancelled(engine, scheduler):
    prompts = _prompts(engine, [5, 7, 9, 11], seed=4)
    running = [scheduler.generate(p, 40) for p in prompts[:3]]
    for tokens in running:
        next(tokens)  # the three slots are taken
    stop = threading.Event()
    waiting = scheduler.generate(prompts[3], 4, should_stop=stop.is_set)
    stop.set()
    with pytest.raises(GenerationCancelled):
        next(waiting)
    for tokens in running:
        tokens.close()


class AllowsThenNothing:
    """Allows every token for `draws` draws, then none."""

    def __init__(self, vocab: int, draws: int) -> None:
        self.vocab, self.draws = vocab, draws

    def allowed_tokens(self) -> np.ndarray:
        self.draws -= 1
        return mask_from_tokens(range(self.vocab) if self.draws >= 0 else [], self.vocab)

    def consume(self, token: int) -> None:
        pass


@pytest.mark.parametrize("draws", [0, 3], ids=["at its prefill", "in a batched pass"])
def test_an_error_reaches_its_caller_alone(engine, scheduler, draws):
    """A constraint that runs out of tokens fails its own caller; the stream beside it and the
    next caller get their tokens alone."""
    vocab = engine.config.vocab_size
    beside, failing, after = _prompts(engine, [5, 7, 6], seed=6)
    expected = [_ids(engine.generate(p, NEW_TOKENS)) for p in (beside, after)]

    def fail() -> list[int]:
        return _ids(
            scheduler.generate(failing, NEW_TOKENS, constraint=AllowsThenNothing(vocab, draws))
        )

    got = _together([lambda: _ids(scheduler.generate(beside, NEW_TOKENS)), fail])
    assert got[0] == expected[0]
    assert isinstance(got[1], NoAllowedTokenError)
    assert _ids(scheduler.generate(after, NEW_TOKENS)) == expected[1]


def test_calls_other_than_generate_run_between_rounds(engine, scheduler):
    prompt = _prompts(engine, [9], seed=5)[0]
    np.testing.assert_array_equal(scheduler.prompt_logits(prompt), engine.prompt_logits(prompt))
    assert scheduler.cached_prefix_length(prompt) == engine.cached_prefix_length(prompt)


def test_a_fault_of_the_scheduler_reaches_every_caller(engine, monkeypatch):
    """Its thread failing (here: the device) ends the callers it serves and refuses later ones,
    instead of leaving them waiting."""
    scheduler = BatchScheduler(engine, slots=2)
    try:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError("the device is gone")

        monkeypatch.setattr(scheduler._decoder, "step", broken)
        with pytest.raises(RuntimeError, match="scheduler stopped: OSError"):
            _ids(scheduler.generate([1, 2, 3], NEW_TOKENS))
        with pytest.raises(RuntimeError, match="closed"):
            _ids(scheduler.generate([1, 2, 3], NEW_TOKENS))
    finally:
        scheduler.stop()


def _on_a_thread(work: Callable[[], Any], seconds: float = 120) -> Any:
    """`work()` on a thread of its own, failing the test if it has not returned in time
    (where the bug would leave the test waiting forever)."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(_result_or_error(work)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert results, f"still waiting after {seconds} s"
    return results[0]


def _result_or_error(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except Exception as exc:
        return exc


def test_one_thread_reads_more_open_generations_than_slots(engine, scheduler):
    """One thread opens five generations on three slots and reads them in turn, a token from
    each: the three admitted run ahead of it while it waits on the fourth, instead of all
    waiting on each other."""
    prompts = _prompts(engine, [4, 9, 6, 11, 7], seed=31)
    alone = [_ids(engine.generate(p, NEW_TOKENS)) for p in prompts]

    def read_in_turn() -> list[list[int]]:
        open_ = [scheduler.generate(p, NEW_TOKENS) for p in prompts]
        got: list[list[int]] = [[] for _ in prompts]
        for _ in range(NEW_TOKENS):
            for i, tokens in enumerate(open_):
                got[i].append(next(tokens).id)
        return got

    assert _on_a_thread(read_in_turn) == alone


def test_a_thread_holding_every_slot_in_step_is_told_so(engine):
    """Generations under a constraint run in step with their caller, so a thread that holds
    every slot with such generations and waits on another would wait forever: it is told."""
    vocab = engine.config.vocab_size
    scheduler = BatchScheduler(engine, slots=1)
    try:
        prompts = _prompts(engine, [5, 8], seed=32)

        held = scheduler.generate(prompts[0], NEW_TOKENS, constraint=FiveTokens(vocab, 1))

        def hold_then_open() -> Any:
            next(held)
            return next(scheduler.generate(prompts[1], NEW_TOKENS))

        error = _on_a_thread(hold_then_open)
        assert isinstance(error, RuntimeError) and "not reading" in str(error)
        held.close()  # as the error says: its slot is free again
        # The engine serves the next caller as usual.
        assert _ids(scheduler.generate(prompts[1], NEW_TOKENS)) == _ids(
            engine.generate(prompts[1], NEW_TOKENS)
        )
    finally:
        scheduler.stop()
