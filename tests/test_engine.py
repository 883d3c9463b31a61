"""The device engine (every decode kernel, the recorded graph, the step loop) against the numpy
reference model, on tiny random checkpoints converted by mlx-lm. The device is the sim unless
LILY_DEVICE names another (the macOS workflow sets metal)."""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine, ReferenceEngine
from lily.errors import ContextLengthError, GenerationCancelled

PROMPT_LENGTH = 31
DECODE_STEPS = 32
TOLERANCE = 1e-2


def _greedy(engine, prompt, steps, stop_token_ids=()) -> list[int]:
    return [t.id for t in engine.generate(prompt, steps, stop_token_ids)]


def _prompt(vocab_size: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, PROMPT_LENGTH).tolist()


MAX_SEQ = PROMPT_LENGTH + DECODE_STEPS + 1


def _device_engine(checkpoint) -> DeviceEngine:
    device = open_test_device()
    return DeviceEngine(checkpoint, device, MAX_SEQ, checkpoint.config.vocab_size)


@pytest.fixture(scope="module", params=["small", "wide"])
def checkpoint(request):
    return load_checkpoint(tiny_checkpoint(request.param))


@pytest.fixture(scope="module")
def engines(checkpoint):
    sim = _device_engine(checkpoint)
    reference = ReferenceEngine(checkpoint, MAX_SEQ, checkpoint.config.vocab_size)
    yield sim, reference
    sim.close()


def test_teacher_forced_logits_match_reference(engines):
    sim, reference = engines
    prompt = _prompt(sim.config.vocab_size, seed=1)
    continuation = _greedy(reference, prompt, DECODE_STEPS)
    tokens = prompt + continuation
    expected = reference.teacher_forced_logits(tokens)
    actual = sim.teacher_forced_logits(tokens)
    assert actual.shape == expected.shape
    worst = np.abs(actual - expected).max()
    assert worst < TOLERANCE, f"largest logit difference {worst:.2e}"


def test_greedy_tokens_match_reference_where_decided(engines):
    sim, reference = engines
    prompt = _prompt(sim.config.vocab_size, seed=2)
    expected = _greedy(reference, prompt, DECODE_STEPS)
    actual = _greedy(sim, prompt, DECODE_STEPS)
    assert len(actual) == DECODE_STEPS
    # Compare up to the first position where the reference's top-2 margin is within tolerance:
    # there either choice is right, and the sequences may legitimately diverge after it.
    logits = reference.teacher_forced_logits(prompt + expected)[PROMPT_LENGTH - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > TOLERANCE
    undecided = np.flatnonzero(~decided)
    horizon = int(undecided[0]) if undecided.size else DECODE_STEPS
    assert horizon > 0, "the reference's first token is a near-tie; pick another seed"
    assert actual[:horizon] == expected[:horizon]


def test_generation_stops_after_a_stop_token(engines):
    sim, reference = engines
    prompt = _prompt(sim.config.vocab_size, seed=3)
    expected = _greedy(reference, prompt, 8)
    stop = expected[3]
    produced = _greedy(sim, prompt, 8, {stop})
    assert produced == expected[: expected.index(stop) + 1]


def test_a_new_generation_starts_from_a_clean_state(engines):
    sim, _ = engines
    prompt = _prompt(sim.config.vocab_size, seed=4)
    first = _greedy(sim, prompt, 6)
    _greedy(sim, _prompt(sim.config.vocab_size, seed=5), 6)
    assert _greedy(sim, prompt, 6) == first


def test_context_overflow_is_refused_before_running(engines):
    sim, _ = engines
    with pytest.raises(ContextLengthError, match="exceeds the context"):
        _greedy(sim, [1] * sim.max_seq, 1)
    with pytest.raises(ValueError, match="empty"):
        _greedy(sim, [], 1)


@pytest.mark.parametrize("kind", ["device", "reference"])
def test_a_snapshot_spares_the_shared_prefix_and_changes_nothing(checkpoint, engines, kind):
    sim, reference = engines
    engine = sim if kind == "device" else reference
    vocab = checkpoint.config.vocab_size
    first = _prompt(vocab, seed=6)
    second = first[:20] + _prompt(vocab, seed=7)[:11]
    assert engine.cached_prefix_length(second) == 0
    assert len(list(engine.generate(first, 3, snapshot_at=20))) == 3
    assert engine.cached_prefix_length(second) == 20
    assert engine.cached_prefix_length(first[:20]) == 0  # its last token must still be fed
    reused = _greedy(engine, second, 8)
    # A fresh engine has no snapshot and feeds all of `second`: the same tokens must come out.
    if kind == "device":
        fresh = _device_engine(checkpoint)
    else:
        fresh = ReferenceEngine(checkpoint, MAX_SEQ, vocab)
    assert fresh.cached_prefix_length(second) == 0
    assert _greedy(fresh, second, 8) == reused


def test_a_snapshot_is_reused_after_another_sequence_overwrote_the_kv_cache(checkpoint):
    engine = _device_engine(checkpoint)
    vocab = checkpoint.config.vocab_size
    first = _prompt(vocab, seed=8)
    second = first[:20] + _prompt(vocab, seed=9)[:11]
    list(engine.generate(first, 2, snapshot_at=20))
    assert engine.cached_prefix_length(second) == 20
    list(engine.generate(_prompt(vocab, seed=10), 2))  # another conversation in between
    # Its KV rows were copied out of the cache before the other conversation overwrote them.
    assert engine.cached_prefix_length(second) == 20
    fed = engine.prompt_tokens_fed
    assert _greedy(engine, second, 6) == _greedy(_device_engine(checkpoint), second, 6)
    assert engine.prompt_tokens_fed - fed == len(second) - 20


class StopAfter:
    """A `should_stop` that answers True from its `calls`-th call on, counting its calls."""

    def __init__(self, calls: int):
        self.limit = calls
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.limit


def test_should_stop_is_asked_before_every_prefill_chunk_and_every_token():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    device = open_test_device()
    engine = DeviceEngine(checkpoint, device, MAX_SEQ, checkpoint.config.vocab_size, max_chunk=4)
    prompt = _prompt(engine.config.vocab_size, seed=7)
    chunks = -(-PROMPT_LENGTH // 4)
    try:
        expected = _greedy(engine, prompt, 6)
        # Cancelled during the prompt: chunks after the second are never run, nothing is yielded.
        mid_prompt = StopAfter(3)
        generated = []
        with pytest.raises(GenerationCancelled):
            generated.extend(engine.generate(prompt, 6, should_stop=mid_prompt))
        assert generated == [] and mid_prompt.calls == 3
        # Cancelled while decoding: the tokens before the refused pass arrive, then it stops.
        mid_decode = StopAfter(chunks + 3)
        with pytest.raises(GenerationCancelled):
            generated.extend(t.id for t in engine.generate(prompt, 6, should_stop=mid_decode))
        assert generated == expected[: len(generated)] and 1 <= len(generated) < 6
        # Never stopping: asked once per pass, and the engine is as good as new.
        never = StopAfter(10**9)
        assert [t.id for t in engine.generate(prompt, 6, should_stop=never)] == expected
        assert never.calls == chunks + 5
    finally:
        engine.close()


def test_the_reference_engine_honours_should_stop():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    engine = ReferenceEngine(checkpoint, MAX_SEQ, checkpoint.config.vocab_size)
    prompt = _prompt(engine.config.vocab_size, seed=7)
    expected = _greedy(engine, prompt, 6)
    generated = []
    with pytest.raises(GenerationCancelled):
        generated.extend(t.id for t in engine.generate(prompt, 6, should_stop=StopAfter(3)))
    assert generated == expected[:2]
