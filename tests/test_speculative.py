"""Speculative decoding on the device engine: verify passes over drafted tokens, the hybrid
state's rollback after a rejection, and the host's acceptance rule.

What "lossless" means here, precisely: a verify pass runs the chunk kernels (GEMM, the chunk
GDN scan and attention) where plain decoding runs the decode step's, and the two agree to float
rounding (about 1e-3 on these logits, as for prefill: tests/test_prefill.py), not bit for bit.
So greedy output with drafts equals plain decoding's token for token wherever plain decoding's
top-1/top-2 margin exceeds that; the tests compare up to the first position where it does not
(`decided`), and require that to cover most of the answer. Which tokens the drafts were, and
whether they were accepted, must never matter: each case below drafts differently (all right,
all wrong, partly right, prompt lookup, a prediction) and expects the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from test_kernel_sampling import P_VALUE_THRESHOLD, chi_square_p_value
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import (
    AUTO_IDLE_LOOKUPS,
    NgramIndex,
    SourceCounts,
    Speculation,
    accept_drafts,
    check_speculative,
    lookup,
)
from lily.kernels.step import POSITION

MAX_SEQ = 256
ANSWER = 24
MARGIN = 1e-2


# ---- acceptance on synthetic distributions -------------------------------------------------------


def _one_hot(token: int, vocab: int = 8) -> np.ndarray:
    p = np.zeros(vocab)
    p[token] = 1.0
    return p


@pytest.mark.parametrize(
    ("model", "drafts", "expected"),
    [
        ([3, 5, 1, 2], [3, 5, 1], [3, 5, 1, 2]),  # all accepted, plus the next token
        ([3, 5, 1, 2], [4, 5, 1], [3]),  # the first rejected: the model's token instead
        ([3, 5, 1, 2], [3, 5, 0], [3, 5, 1]),  # partly accepted
        ([6], [], [6]),  # nothing drafted: one token
    ],
)
def test_greedy_acceptance_is_the_longest_matching_prefix(model, drafts, expected):
    assert accept_drafts(drafts, lambda i: _one_hot(model[i]), None) == expected


def _first_tokens(p: np.ndarray, draft: int, trials: int) -> np.ndarray:
    tokens = [
        accept_drafts([draft], lambda i: p, lambda i, s=seed: np.random.default_rng([s, i]))[0]
        for seed in range(trials)
    ]
    return np.bincount(tokens, minlength=p.size)


TARGET = np.array([0.05, 0.4, 0.25, 0.0, 0.2, 0.1])


@pytest.mark.parametrize("draft", [1, 4, 3])  # likely, unlikely, impossible
def test_sampled_acceptance_draws_from_the_target_distribution(draft):
    counts = _first_tokens(TARGET, draft, 4000)
    assert chi_square_p_value(counts, TARGET) > P_VALUE_THRESHOLD


def test_the_chi_square_test_sees_a_rule_biased_towards_the_draft():
    """Always taking the draft when it has any probability would be a wrong rule: the test's
    statistics must reject what it produces, or the test above proves nothing."""
    biased = TARGET.copy()
    biased[4] += 0.1
    biased /= biased.sum()
    counts = _first_tokens(biased, 4, 4000)
    assert chi_square_p_value(counts, TARGET) < P_VALUE_THRESHOLD


def test_sampled_acceptance_matches_the_target_at_every_row():
    """The second token, after the first draft was accepted or not, is again the target's."""
    rows = [TARGET, np.roll(TARGET, 2), np.roll(TARGET, 4)]
    seconds = []
    for seed in range(4000):
        out = accept_drafts(
            [1, 2], lambda i: rows[i], lambda i, s=seed: np.random.default_rng([s, i])
        )
        if len(out) > 1:
            seconds.append(out[1])
    counts = np.bincount(seconds, minlength=TARGET.size)
    assert chi_square_p_value(counts, rows[1]) > P_VALUE_THRESHOLD


# ---- drafting ----------------------------------------------------------------------------------


def test_lookup_continues_the_latest_longest_match():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 5, 0, 2, 3]
    # "2 3" occurs twice before the end (the 3-gram "0 2 3" does not): the later one wins.
    assert lookup(context, context, 3, 2, 4) == (7, [7, 5, 0])
    assert lookup(context, context, 3, 2, 4, prefer_from=0) == (3, [9, 1, 2])
    assert lookup([4, 4], context, 3, 2, 4) == (0, [])
    # The context's own ending is no occurrence of itself.
    assert lookup([5, 6, 5, 6], [5, 6, 5, 6], 2, 2, 4) == (2, [5, 6])
    assert lookup([5, 6], [5, 6], 2, 2, 4) == (0, [])


def test_the_ngram_index_drafts_what_lookup_finds_as_the_context_grows():
    rng = np.random.default_rng(0)
    for trial in range(20):
        context = rng.integers(0, 5, 60).tolist()  # a small alphabet: many repeats
        index = NgramIndex(2, 4)
        for length in range(1, len(context) + 1, 1 + trial % 3):
            grown = context[:length]
            assert index.draft(grown, 3) == lookup(grown, grown, 3, 2, 4)[1]
    # A context that is not the one indexed so far (another conversation) starts it again.
    assert index.draft([7, 8, 9, 7, 8], 2) == [9, 7]


def test_speculation_prefers_the_prediction_and_counts_per_source():
    spec = Speculation(draft_tokens=3, ngram=True, prediction=[10, 11, 12, 13], anchor=[1, 2])
    assert spec.draft([7, 1, 2], 8) == [10, 11, 12]
    spec.verified([10, 11, 12], 2)
    assert spec.draft([7, 1, 2, 10, 11, 5], 8) == []  # lost: "11 5" is in neither
    assert spec.draft([7, 1, 2, 10, 11, 5, 7, 1], 8) == [2, 10, 11]  # prompt lookup
    spec.verified([2, 10, 11], 0)
    assert spec.accepted_prediction_tokens == 2
    assert spec.rejected_prediction_tokens == 2
    assert spec.counts["ngram"].passes == 1 and spec.counts["ngram"].drafted == 3
    # The sum over both sources, as `lily bench` reports it.
    assert spec.total == SourceCounts(passes=2, drafted=6, accepted=2)
    assert Speculation(ngram=True).total == SourceCounts()


def test_auto_stops_drafting_from_a_source_that_does_not_pay():
    spec = Speculation(draft_tokens=2, ngram=True, auto=True)
    context = [1, 2, 3, 1, 2]
    for _ in range(4):
        assert spec.draft(context, 8) == [3, 1]
        spec.verified([3, 1], 0)
    assert spec.draft(context, 8) == []
    assert spec.exhausted
    paying = Speculation(draft_tokens=2, ngram=True, auto=True)
    for _ in range(6):
        assert paying.draft(context, 8) == [3, 1]
        paying.verified([3, 1], 1)
    assert not paying.exhausted
    # Lookups that keep finding nothing end it too; a prediction is never dropped.
    idle = Speculation(draft_tokens=2, ngram=True, auto=True)
    unseen = [1, 2]
    for token in range(100, 100 + AUTO_IDLE_LOOKUPS):
        assert idle.draft(unseen, 8) == []
        unseen.append(token)
    assert idle.exhausted and idle.draft([1, 2, 1], 8) == []
    assert not Speculation(ngram=True, auto=True, prediction=[5]).exhausted
    assert not Speculation(ngram=True).exhausted


@pytest.mark.parametrize(
    ("mode", "k", "message"),
    [
        ("eagle", 4, "speculative must be one of"),
        ("ngram", 0, "draft_tokens must be 1 to 8"),
        ("ngram", 9, "draft_tokens must be 1 to 8"),
        ("auto", True, "draft_tokens must be an integer"),
    ],
)
def test_bad_speculative_settings_are_refused_by_name(mode, k, message):
    with pytest.raises(ValueError, match=message):
        check_speculative(mode, k)


# ---- the device engine -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["small", "wide"])
def checkpoint(request):
    return load_checkpoint(tiny_checkpoint(request.param))


def _engine(checkpoint, max_chunk: int = 64) -> DeviceEngine:
    vocab = checkpoint.config.vocab_size
    return DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return _engine(checkpoint)


def _prompt(checkpoint, seed: int = 4) -> list[int]:
    """A prompt that repeats itself, so that prompt lookup finds matches."""
    words = np.random.default_rng(seed).integers(0, checkpoint.config.vocab_size, 12).tolist()
    return words + words[:7] + words + words[:5]


class _Permissive:
    """A constraint allowing everything: it makes plain decoding run one pass at a time, so
    the state can be read at each token."""

    def allowed_tokens(self):
        return None

    def consume(self, token):
        pass


@pytest.fixture(scope="module")
def plain(checkpoint, engine):
    return plain_decoding(engine, _prompt(checkpoint))


def plain_decoding(engine, prompt: list[int]):
    """Plain greedy decoding: the answer, the recurrent state when each token was yielded (the
    state then has consumed every token before it), and how far the answer is decided."""
    recurrent = [b.numpy() for b in engine._model.state.recurrent_buffers()]
    answer, states = [], []
    for token in engine.generate(prompt, ANSWER, constraint=_Permissive()):
        answer.append(token.id)
        states.append([a.copy() for a in recurrent])
    logits = engine.teacher_forced_logits(prompt + answer[:-1])[len(prompt) - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near = np.flatnonzero(top2[:, 1] - top2[:, 0] <= MARGIN)
    decided = int(near[0]) if near.size else ANSWER
    assert decided >= ANSWER // 2, "the fixture's answer is undecided too early to test"
    return prompt, answer, states, decided


class _Scripted:
    """Drafts the plain answer's next tokens, the first `right` of each draft as they are and
    the rest changed; records the engine's state and step position at each call."""

    def __init__(self, engine, prompt, answer, right: int, k: int = 4):
        self.engine, self.prompt, self.answer, self.right, self.k = engine, prompt, answer, right, k
        self.calls: list[tuple[int, int, list[np.ndarray]]] = []
        self.outcomes: list[tuple[int, int]] = []
        self.exhausted = False

    def draft(self, tokens, limit):
        model = self.engine._model
        recurrent = [b.numpy().copy() for b in model.state.recurrent_buffers()]
        self.calls.append((len(tokens), int(model.step_view()[POSITION]), recurrent))
        done = len(tokens) - len(self.prompt)
        truth = self.answer[done : done + min(limit, self.k)]
        vocab = self.engine._model.token_count
        return truth[: self.right] + [(t + 1) % vocab for t in truth[self.right :]]

    def verified(self, drafted, accepted):
        self.outcomes.append((len(drafted), accepted))


def _same_as_plain(tokens, plain) -> None:
    _, answer, _, decided = plain
    assert tokens[:decided] == answer[:decided]
    assert len(tokens) == len(answer)


@pytest.mark.parametrize("right", [4, 0, 2], ids=["all accepted", "all rejected", "partly"])
def test_greedy_output_is_plain_decoding_whatever_the_drafts(engine, plain, right):
    prompt, answer, _, decided = plain
    drafter = _Scripted(engine, prompt, answer, right)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    # Each verify pass accepted exactly the drafts that were right (inside the decided part).
    assert drafter.outcomes
    done = 1
    for drafted, accepted in drafter.outcomes:
        if done + drafted < decided:
            assert accepted == min(right, drafted)
        done += accepted + 1


def test_a_rejection_restores_the_recurrent_state_and_then_matches_plain_decoding(engine, plain):
    prompt, answer, states, decided = plain
    drafter = _Scripted(engine, prompt, answer, right=1)
    list(engine.generate(prompt, ANSWER, drafter=drafter))
    # Rejected passes followed directly by another verify pass (after two rejections in a row a
    # catch-up pass without drafts comes between, and yields one more token).
    calls, outcomes = drafter.calls, drafter.outcomes
    rejected_then = [
        i
        for i, (drafted, accepted) in enumerate(outcomes[:-1])
        if accepted < drafted and calls[i + 1][0] == calls[i][0] + accepted + 1
    ]
    assert rejected_then
    for i in rejected_then:
        # The call after a rejected pass sees the state from before that pass, bit for bit,
        # with the step buffer back at the first token it has not consumed.
        (_, before_position, before), (_, after_position, after) = calls[i : i + 2]
        assert after_position == before_position
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)
    caught_up = [
        (length, state)
        for length, position, state in drafter.calls
        if position == length - 1 and length - len(prompt) <= decided
    ]
    assert len(caught_up) >= 3
    for length, state in caught_up:
        # Consumed every token before the newest, like plain decoding when it yielded it; the
        # chunk kernels sum in another order than the decode step's, and gdn_chunk's half
        # operands put its state about 2^-11 of the largest entry from it (measured up to 2e-4
        # of it here; tests/test_prefill.py's GDN_STATE_DRIFT).
        expected = states[length - len(prompt) - 1]
        for a, b in zip(state, expected, strict=True):
            a, b = a.view(np.float32), b.view(np.float32)
            assert np.abs(a - b).max() <= 2.0**-9 * max(1.0, np.abs(b).max())


def test_prompt_lookup_and_a_prediction_give_plain_decoding(engine, plain):
    prompt, answer, _, _ = plain
    lookup_drafts = Speculation(draft_tokens=4, ngram=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=lookup_drafts)]
    # A random model's answer hardly ever repeats the prompt, so lookup rarely drafts here
    # (test_lookup_* cover what it drafts); whatever it drafts must not change the answer.
    _same_as_plain(tokens, plain)
    predicted = Speculation(draft_tokens=8, prediction=answer, anchor=prompt[-2:])
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=predicted)]
    _same_as_plain(tokens, plain)
    # The answer as the prediction: accepted whole (the first token is the prompt's own pass,
    # and a pass never drafts past the requested length).
    assert predicted.accepted_prediction_tokens >= ANSWER - 2 - ANSWER // 8


def test_auto_decodes_pipelined_once_lookup_gave_up(engine, plain, monkeypatch):
    prompt, answer, _, _ = plain
    switched = []
    decode = DeviceEngine._decode

    def recording(self, position, count, *args):
        switched.append((position, count))
        return decode(self, position, count, *args)

    monkeypatch.setattr(DeviceEngine, "_decode", recording)
    drafter = Speculation(draft_tokens=4, ngram=True, auto=True)
    drafter._idle_lookups = AUTO_IDLE_LOOKUPS - 3  # about to give up
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.exhausted and len(switched) == 1
    position, count = switched[0]
    assert position + 1 - len(prompt) + count == ANSWER  # the rest of the answer, pipelined


def test_verify_passes_stay_within_the_chunk_length(checkpoint, plain):
    """With chunks of 4 tokens, the prompt is cut into many and a verify pass takes at most 4
    tokens: drafts are cut to fit beside the tokens waiting after a rejection."""
    prompt, answer, _, _ = plain
    engine = _engine(checkpoint, max_chunk=4)
    drafter = _Scripted(engine, prompt, answer, right=2, k=8)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert max(drafted for drafted, _ in drafter.outcomes) <= 3


def test_a_stop_token_inside_accepted_drafts_ends_the_generation(engine, plain):
    prompt, answer, _, decided = plain
    stop = answer[min(decided, 10) - 1]
    first = answer.index(stop)
    drafter = _Scripted(engine, prompt, answer, right=4)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, {stop}, drafter=drafter)]
    assert tokens == answer[: first + 1]


def test_a_rejection_right_after_a_prefix_cache_restore(checkpoint, plain):
    prompt, answer, _, _ = plain
    engine = _engine(checkpoint)
    list(engine.generate(prompt[:20], 2, snapshot_at=16))
    assert engine.cached_prefix_length(prompt) == 16
    drafter = _Scripted(engine, prompt, answer, right=0)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.outcomes[0] == (4, 0)


def test_penalties_and_logprobs_with_drafts(engine, plain):
    prompt, answer, _, _ = plain
    # A negative penalty favours the tokens already generated: the answer repeats them.
    params = SamplingParams(temperature=0.0, frequency_penalty=-2.0, top_logprobs=3)
    expected = list(engine.generate(prompt, 16, sampling=params))
    ids = [t.id for t in expected]
    drafter = _Scripted(engine, prompt, ids, right=2)
    got = list(engine.generate(prompt, 16, sampling=params, drafter=drafter))
    # The penalty changes the answer (so it is applied to the drafted rows too), and drafting
    # keeps the penalised answer.
    assert ids != answer[:16]
    assert [t.id for t in got] == ids
    for a, b in zip(got, expected, strict=True):
        assert abs(a.logprobs.logprob - b.logprobs.logprob) < 1e-2
        assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]


def test_sampled_output_with_drafts_is_reproducible_for_a_seed(engine, plain):
    prompt, answer, _, _ = plain
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    runs = [
        [t.id for t in engine.generate(prompt, 16, sampling=params, drafter=drafter)]
        for drafter in (
            Speculation(draft_tokens=4, ngram=True),
            Speculation(draft_tokens=4, ngram=True),
        )
    ]
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=8)
    drafter = Speculation(draft_tokens=4, ngram=True)
    assert [t.id for t in engine.generate(prompt, 16, sampling=other, drafter=drafter)] != runs[0]


def test_the_verify_rows_are_the_plain_logits(engine, plain):
    """Row i of a verify pass is what plain decoding predicts after the draft's first i + 1
    tokens (within the chunk kernels' rounding): the prompt prefilled as plain decoding
    prefills it (a chunk whose GEMMs take half operands), then the tokens after it. (Fed token
    by token through the decode step instead, the prompt's state may route a near-tied token to
    the other expert, which moved a row by 0.13 on `wide`.)"""
    prompt, answer, _, _ = plain
    drafter = _Scripted(engine, prompt, answer, right=4, k=4)
    list(engine.generate(prompt, 6, drafter=drafter))
    rows = engine._model.verify_logits_view(5).copy()
    reference = np.stack([engine.prompt_logits(prompt + answer[: i + 1]) for i in range(5)])
    assert np.abs(rows - reference).max() < 1e-2


def test_verify_passes_of_impossible_shapes_are_refused(engine):
    model = engine._model
    with pytest.raises(ValueError, match="a verify pass takes 2 to 64 tokens"):
        model.verify_graph(1, 1)
    with pytest.raises(ValueError, match="a verify pass takes 2 to 64 tokens"):
        model.verify_graph(65, 9)
    with pytest.raises(ValueError, match="over 12 tokens predicts 1 to 9 rows, got 10"):
        model.verify_graph(12, 10)
    with pytest.raises(ValueError, match="over 3 tokens predicts 1 to 3 rows, got 4"):
        model.verify_graph(3, 4)
