"""Speculative decoding on the device engine: verify passes over drafted tokens, accepted on the
device (the rule itself: tests/test_kernel_accept_drafts.py), the hybrid state's rollback after
a rejection, the draft sources, and "auto"'s cost-based policy.

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

import json

import numpy as np
import pytest
from device_testing import open_test_device
from test_validate import real_config_json
from tiny_models import echo_head_checkpoint, tiny_checkpoint

import lily.engine.engine
from lily.checkpoint.config import parse_config
from lily.checkpoint.loader import load_checkpoint
from lily.engine.constraint import mask_from_tokens
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import MAX_DRAFT_TOKENS, verify_cost_ratio
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import (
    AUTO_IDLE_LOOKUPS,
    AUTO_MAX_LOSS,
    AUTO_MAX_REST,
    AUTO_PASSES,
    DraftingHistory,
    NgramIndex,
    PredictedTokens,
    SourceCounts,
    Speculation,
    check_speculative,
    lookup,
)
from lily.kernels.step import POSITION, PROMPT_END, TOKEN

MAX_SEQ = 256
ANSWER = 24
MARGIN = 1e-2


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
    spec = Speculation(
        draft_tokens=3, ngram=True, prediction=PredictedTokens([10, 11, 12, 13], [1, 2])
    )
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


def test_the_dflash_block_drafts_after_the_prediction_and_before_lookup():
    asked: list[int] = []

    def block(n: int) -> list[int]:
        asked.append(n)
        return [40, 41, 42, 43, 44][:n]

    spec = Speculation(
        draft_tokens=3, dflash=True, ngram=True, prediction=PredictedTokens([10, 11], [1, 2])
    )
    spec.block = block
    alone = Speculation(dflash=True)
    assert alone.exhausted  # no block set: the engine sets it for its generation
    alone.block = block
    assert not alone.exhausted
    assert spec.draft([7, 1, 2], 8) == [10, 11] and asked == []  # the prediction first
    spec.verified([10, 11], 2)
    # Then the block, limited to draft_tokens, before prompt lookup (which would draft 2 10).
    assert spec.draft([7, 1, 2, 10, 11, 5, 7, 1], 8) == [40, 41, 42] and asked == [3]
    spec.verified([40, 41, 42], 1)
    assert spec.counts["dflash"] == SourceCounts(passes=1, drafted=3, accepted=1)
    spec.block = None
    assert spec.draft([7, 1, 2, 10, 11, 5, 7, 1], 8) == [2, 10, 11]


def _flat_cost(drafts: int) -> float:
    """A verify pass costing 1.5 decode steps, whatever it drafts."""
    return 1.5


def test_auto_stops_drafting_from_a_source_that_does_not_pay():
    spec = Speculation(draft_tokens=2, ngram=True, auto=True, pass_cost=_flat_cost)
    context = [1, 2, 3, 1, 2]
    for _ in range(4):
        assert spec.draft(context, 8) == [3]  # nothing kept: one draft a pass
        spec.verified([3], 0)  # 1 token per pass, for 1.5 steps' time
    assert spec.draft(context, 8) == []
    assert spec.exhausted
    paying = Speculation(draft_tokens=2, ngram=True, auto=True, pass_cost=_flat_cost)
    for _ in range(6):
        drafts = paying.draft(context, 8)
        paying.verified(drafts, 1)  # 2 tokens per pass
    assert not paying.exhausted
    # Lookups that keep finding nothing end it too; a prediction is never dropped.
    idle = Speculation(draft_tokens=2, ngram=True, auto=True, pass_cost=_flat_cost)
    unseen = [1, 2]
    for token in range(100, 100 + AUTO_IDLE_LOOKUPS):
        assert idle.draft(unseen, 8) == []
        unseen.append(token)
    assert idle.exhausted and idle.draft([1, 2, 1], 8) == []
    prediction = Speculation(
        ngram=True, auto=True, prediction=PredictedTokens([5]), pass_cost=_flat_cost
    )
    assert not prediction.exhausted
    assert not Speculation(ngram=True).exhausted
    with pytest.raises(ValueError, match="give pass_cost"):
        Speculation(ngram=True, auto=True)


@pytest.mark.parametrize(("cost", "kept"), [(2.2, False), (1.8, True)])
def test_auto_weighs_tokens_per_pass_against_what_a_pass_costs(cost, kept):
    """The same acceptance (2 tokens per pass: one of two drafts, and the model's own) pays
    when a pass costs less than two decode steps and not when it costs more; each pass is
    charged by what it drafted."""
    drafted = []

    def pass_cost(drafts: int) -> float:
        drafted.append(drafts)
        return cost

    spec = Speculation(draft_tokens=2, ngram=True, auto=True, pass_cost=pass_cost)
    context = [1, 2, 3, 1, 2]
    for _ in range(4):
        spec.verified(spec.draft(context, 8), 1)
    assert drafted == [1, 2, 2, 2]  # one draft first, two once the first was kept
    assert spec.exhausted is not kept


def test_auto_gives_up_a_source_once_trying_it_lost_more_than_it_may():
    """A pass that accepts nothing and costs 4 decode steps (a verify pass on the sim) loses 3:
    more than AUTO_MAX_LOSS, so the source is dropped after that one pass, not AUTO_PASSES."""
    spec = Speculation(draft_tokens=2, ngram=True, auto=True, pass_cost=lambda drafts: 4.0)
    context = [1, 2, 3, 1, 2]
    assert spec.draft(context, 8) == [3]
    spec.verified([3], 0)
    assert AUTO_MAX_LOSS <= 4.0 - 1 and AUTO_PASSES > 1
    assert spec.exhausted and spec.draft(context, 8) == []


def _losing(source: str) -> Speculation:
    """A generation under auto whose `source` was tried and dropped: its passes kept nothing."""
    spec = Speculation(draft_tokens=2, auto=True, pass_cost=lambda drafts: 4.0, **{source: True})
    spec.head = lambda n: [7] * n
    context = [1, 2, 3, 1, 2]
    spec.verified(spec.draft(context, 8), 0)
    assert spec.verdict(source) is False and spec.exhausted
    return spec


def _paying(source: str) -> Speculation:
    spec = Speculation(draft_tokens=2, auto=True, pass_cost=_flat_cost, **{source: True})
    spec.head = lambda n: [3] * n
    for _ in range(AUTO_PASSES):
        drafts = spec.draft([1, 2, 3, 1, 2], 8)
        spec.verified(drafts, len(drafts))
    assert spec.verdict(source) is True
    return spec


@pytest.mark.parametrize("source", ["mtp", "ngram"])
def test_auto_rests_a_source_that_did_not_pay_for_longer_each_time(source):
    """A source dropped in one generation sits out the next; dropped again when tried again,
    the next two; then four. One that paid rests one generation at its next drop."""
    history = DraftingHistory()
    assert history.next_generation(None) == frozenset()
    resting = []
    for _ in range(3):
        rest = history.next_generation(_losing(source))
        assert source in rest
        while rest:
            resting.append(rest)
            rest = history.next_generation(Speculation())  # a generation without it
        resting.append(None)  # tried again
    assert [r is None for r in resting] == [False, True, False, False, True] + [False] * 4 + [True]
    assert history.next_generation(_paying(source)) == frozenset()
    assert source in history.next_generation(_losing(source))
    assert history.next_generation(Speculation()) == frozenset()  # one generation's rest
    # A short generation that never judged the source leaves the history as it was.
    short = Speculation(draft_tokens=2, auto=True, pass_cost=_flat_cost, **{source: True})
    assert short.verdict(source) is None
    assert history.next_generation(short) == frozenset()
    rests = 0
    history = DraftingHistory()
    history.next_generation(_losing(source))
    for _ in range(12):
        rest = history.next_generation(_losing(source))
        while rest:
            rests += 1
            rest = history.next_generation(Speculation())
    assert rests >= AUTO_MAX_REST  # the rest is bounded: the source is tried again
    assert history._rest[source] == AUTO_MAX_REST


def test_auto_drafts_one_token_first_and_more_as_drafts_are_kept():
    """A source's first pass under auto drafts one token; all kept doubles the next pass's
    drafts, up to draft_tokens; some kept gives one more than were kept. Without auto, every
    pass drafts as many as it can."""
    spec = Speculation(draft_tokens=4, ngram=True, auto=True, pass_cost=_flat_cost)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    sizes = []
    for accepted in (1, 2, 4, 1, 2):
        drafts = spec.draft(context, 8)
        sizes.append(len(drafts))
        spec.verified(drafts, min(accepted, len(drafts)))
    assert sizes == [1, 2, 4, 4, 2]
    assert Speculation(draft_tokens=4, ngram=True).draft(context, 8) == [3, 4, 5, 6]


def test_the_cost_of_a_verify_pass_grows_with_its_drafts_on_the_real_model():
    """verify_cost_ratio at the real dims: a pass of 4 drafts costs about 2.3 decode steps
    (benchmarks/verify_pass_model.py's estimate of 7.7 ms against 3.4 on an M5 Max), more
    with every draft and less than one step per token drafted."""
    small = json.loads((tiny_checkpoint("small") / "config.json").read_text())
    config = parse_config(real_config_json(small))
    ratios = [verify_cost_ratio(config, drafts) for drafts in range(1, MAX_DRAFT_TOKENS + 1)]
    assert all(a < b for a, b in zip(ratios, ratios[1:], strict=False))
    assert 2.2 < ratios[3] < 2.45
    assert all(ratio < drafts + 1 for drafts, ratio in enumerate(ratios, start=1))


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


def _near_plain_state(state, expected) -> bool:
    """Whether a recurrent state is plain decoding's within the bound of a verify pass's kernels
    against the decode step's: they sum in another order (the GEMVs over several tokens, the
    norms unfolded), measured up to 2e-4 of the largest entry here."""
    for a, b in zip(state, expected, strict=True):
        a, b = a.view(np.float32), b.view(np.float32)
        if np.abs(a - b).max() > 2.0**-9 * max(1.0, np.abs(b).max()):
            return False
    return True


def test_a_rejected_pass_leaves_the_state_of_its_accepted_tokens(engine, plain):
    """After a verify pass that rejected a draft, the next pass follows at once with the
    pass's accepted tokens consumed, not fed again: every call sees the state plain decoding
    had when it yielded the newest token, and not the one a token earlier or later (what taking
    the wrong position would leave)."""
    prompt, answer, states, decided = plain
    drafter = _Scripted(engine, prompt, answer, right=1)
    list(engine.generate(prompt, ANSWER, drafter=drafter))
    calls, outcomes = drafter.calls, drafter.outcomes
    rejected = [i for i, (drafted, kept) in enumerate(outcomes[:-1]) if kept < drafted]
    assert len(rejected) >= 3
    for i in rejected:
        length, position, state = calls[i + 1]
        # The pass's accepted drafts and the model's own token, and no pass between.
        assert length == calls[i][0] + outcomes[i][1] + 1
        assert position == length - 1
        newest = length - len(prompt) - 1
        if newest + 1 >= decided:
            continue
        assert _near_plain_state(state, states[newest])
        assert not _near_plain_state(state, states[newest - 1])
        assert not _near_plain_state(state, states[newest + 1])


def test_prompt_lookup_and_a_prediction_give_plain_decoding(engine, plain):
    prompt, answer, _, _ = plain
    lookup_drafts = Speculation(draft_tokens=4, ngram=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=lookup_drafts)]
    # A random model's answer hardly ever repeats the prompt, so lookup rarely drafts here
    # (test_lookup_* cover what it drafts); whatever it drafts must not change the answer.
    _same_as_plain(tokens, plain)
    predicted = Speculation(draft_tokens=8, prediction=PredictedTokens(answer, prompt[-2:]))
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
    drafter = Speculation(draft_tokens=4, ngram=True, auto=True, pass_cost=_flat_cost)
    drafter._idle_lookups = AUTO_IDLE_LOOKUPS - 3  # about to give up
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.exhausted and len(switched) == 1
    position, count = switched[0]
    assert position + 1 - len(prompt) + count == ANSWER  # the rest of the answer, pipelined


def test_a_pass_is_charged_its_measured_time_once_the_engine_decoded_plainly(checkpoint, plain):
    """Until a generation has decoded plainly (pipelined) long enough to time a step, a verify
    pass is charged the model's estimate; then its own wall time, drafting included, in
    steps. Under a clock where every step takes 1 s and a verify pass 3 s, a pass costs 3."""
    prompt, answer, _, _ = plain
    engine = _engine(checkpoint)
    assert engine.pass_cost(4) == verify_cost_ratio(checkpoint.config, 4)
    clock = _FakeClock()
    engine.device = clock.timed(engine.device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lily.engine.engine.time, "perf_counter", clock.now)
        list(engine.generate(prompt, 12))  # plain: every step takes 1 s
        assert engine.pass_cost(4) == verify_cost_ratio(checkpoint.config, 4)  # no pass yet
        clock.seconds_per_graph = 3.0  # the drafted generation's passes are verify passes
        drafter = _Scripted(engine, prompt, answer, right=4)
        list(engine.generate(prompt, 6, drafter=drafter))
    assert drafter.outcomes
    assert engine.pass_cost(4) == pytest.approx(3.0)


class _FakeClock:
    """A clock that moves only when the host waits for the device: by `seconds_per_graph`
    (as it was at its submission) for each graph waited for."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.seconds_per_graph = 1.0

    def now(self) -> float:
        return self.seconds

    def timed(self, device):
        clock = self
        unwaited: dict[int, float] = {}  # ticket -> seconds its graph takes

        class Timed:
            def __getattr__(self, name):
                return getattr(device, name)

            def submit(self, graph):
                ticket = device.submit(graph)
                unwaited[ticket] = clock.seconds_per_graph
                return ticket

            def wait(self, ticket):
                for waited in [t for t in unwaited if t <= ticket]:
                    clock.seconds += unwaited.pop(waited)
                return device.wait(ticket)

            def run(self, graph):
                self.wait(self.submit(graph))

        return Timed()


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


class Recording(Speculation):
    """A drafter recording each verify pass's outcome (drafted, accepted)."""

    def verified(self, drafted, accepted):
        super().verified(drafted, accepted)
        self.outcomes = [*getattr(self, "outcomes", []), (len(drafted), accepted)]


def _wrong(token: int, checkpoint) -> int:
    return (token + 1) % checkpoint.config.vocab_size


def _predictions(checkpoint, answer: list[int]) -> dict[str, tuple[list[int], int]]:
    """Predictions of the answer whose first verify pass (drafting answer[1:5] after the first
    token) accepts all 4 drafts, none, or 2: (prediction, drafts the first pass accepts)."""
    wrong = [_wrong(t, checkpoint) for t in answer]
    return {
        "all accepted": (answer, 4),
        "all rejected": (answer[:1] + wrong[1:], 0),
        "partly": (answer[:3] + wrong[3:4] + answer[4:], 2),
    }


@pytest.mark.parametrize("outcome", ["all accepted", "all rejected", "partly"])
def test_a_prediction_drives_each_outcome_and_gives_plain_decoding(checkpoint, engine, plain,
                                                                  outcome):  # fmt: skip
    prompt, answer, _, decided = plain
    prediction, accepted = _predictions(checkpoint, answer)[outcome]
    drafter = Recording(draft_tokens=4, prediction=PredictedTokens(prediction, prompt[-2:]))
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.outcomes[0] == (4, accepted)


@pytest.mark.parametrize("source", ["scripted", "prediction"])
def test_a_rejection_right_after_a_prefix_cache_restore(checkpoint, plain, source):
    prompt, answer, _, _ = plain
    engine = _engine(checkpoint)
    list(engine.generate(prompt[:20], 2, snapshot_at=16))
    assert engine.cached_prefix_length(prompt) == 16
    if source == "scripted":
        drafter = _Scripted(engine, prompt, answer, right=0)
    else:
        prediction, _ = _predictions(checkpoint, answer)["all rejected"]
        drafter = Recording(draft_tokens=4, prediction=PredictedTokens(prediction, prompt[-2:]))
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.outcomes[0] == (4, 0)


# ---- prompt lookup on a bigram model -------------------------------------------------------------


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """(engine, base prompt, t, the answer after t) on the echo-head checkpoint
    (`tiny_models.echo_head_checkpoint`): its main model predicts the token after t from t alone,
    so an answer is the same after any prompt ending with t, and a prompt can hold the answer's
    continuation for prompt lookup to find without changing the answer. t is chosen so that the
    answer's first tokens and t are all different (no other occurrence to look up)."""
    checkpoint = load_checkpoint(echo_head_checkpoint(tmp_path_factory.mktemp("bigram") / "c"))
    engine = _engine(checkpoint)
    base = _prompt(checkpoint)
    for t in range(checkpoint.config.vocab_size):
        answer = [g.id for g in engine.generate([*base, t], 12)]
        if len({t, *answer[:10]}) == 11 and t not in base:
            return engine, base, t, answer
    raise AssertionError("no token starts a chain of 11 distinct tokens")


@pytest.mark.parametrize(
    ("outcome", "accepted"),
    [("all accepted", 4), ("all rejected", 0), ("partly", 1), ("restored", 0)],
)
def test_prompt_lookup_drives_each_outcome_and_gives_plain_decoding(bigram, outcome, accepted):
    """The prompt holds t and the answer's first tokens a1 .. a8 (a2 changed for all rejected,
    a3 for partly), then ends with t: after the first token a1, "t a1" is looked up and the 4
    tokens after it drafted. "restored": the prompt's first part comes from the prefix cache,
    then all are rejected."""
    engine, base, t, answer = bigram
    planted = answer[:8]
    changed = {"all rejected": 1, "restored": 1, "partly": 2}.get(outcome)
    if changed is not None:
        planted[changed] = (planted[changed] + 1) % engine._model.token_count
    prompt = [*base, t, *planted, t]
    if outcome == "restored":
        list(engine.generate(prompt[:20], 2, snapshot_at=16))
        assert engine.cached_prefix_length(prompt) >= 16
    drafter = Recording(draft_tokens=4, ngram=True)
    tokens = [g.id for g in engine.generate(prompt, 12, drafter=drafter)]
    assert tokens == answer
    assert drafter.outcomes[0] == (4, accepted)


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


def test_a_verify_pass_accepts_and_commits_the_state_on_the_device(checkpoint, engine, plain):
    """One verify pass run by hand after the prompt, the host doing nothing between: with a
    wrong first draft it yields the model's token, the state having consumed the waiting token
    alone; with two right drafts it yields them and the model's token, the state having
    consumed three tokens; with right drafts it yields them all and the model's next token. The
    pass leaves the step and its position at the model's token, which the next pass feeds."""
    prompt, answer, states, _ = plain
    model = engine._model
    recurrent = [b.numpy() for b in model.state.recurrent_buffers()]
    last = len(prompt)  # the first generated token's position: the state has not consumed it
    for drafts, expected in (
        ([_wrong(t, checkpoint) for t in answer[1:5]], answer[1:2]),
        ([*answer[1:3], *(_wrong(t, checkpoint) for t in answer[3:5])], answer[1:4]),
        (answer[1:5], answer[1:6]),
    ):
        assert [t.id for t in engine.generate(prompt, 1)] == answer[:1]
        history, step = model.history_view(), model.step_view()
        history[last + 1 : last + 5] = drafts
        step[POSITION], step[PROMPT_END], step[TOKEN] = last, last + 5, answer[0]
        graph = model.verify_graph(5, 5)
        model.verify_position_view()[0] = last
        engine.device.run(graph)
        outcome = model.pass_outcome(last, 4)
        assert outcome.drafts == drafts and outcome.tokens == expected
        assert history[last + len(expected)] == expected[-1]
        own = last + len(expected)
        assert list(step) == [own, own + 1, expected[-1]]
        assert model.verify_position_view()[0] == own
        assert _near_plain_state(recurrent, states[len(expected)])
        assert not _near_plain_state(recurrent, states[len(expected) - 1])


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


# ---- under a constraint --------------------------------------------------------------------------


class _Thirds:
    """A constraint whose mask depends on every token told before: it rules out the tokens t with
    (t + the sum of the tokens so far + shift) % 3 == 0, a different third of the vocabulary
    after each token, so that a row drawn under another row's mask, or a constraint left in a
    state plain decoding never reaches, changes the answer."""

    def __init__(self, vocab: int, shift: int) -> None:
        self.vocab, self.shift = vocab, shift
        self.consumed: list[int] = []

    def allows(self, token, before: list[int]):
        return (token + sum(before) + self.shift) % 3 != 0

    def allowed_tokens(self):
        ids = np.arange(self.vocab)
        return mask_from_tokens(ids[self.allows(ids, self.consumed)], self.vocab)

    def consume(self, token):
        assert self.allows(token, self.consumed), "told a token its mask rules out"
        self.consumed.append(token)

    def rollback(self, tokens):
        assert 0 <= tokens <= MAX_DRAFT_TOKENS
        del self.consumed[len(self.consumed) - tokens :]


@pytest.fixture(scope="module")
def constrained_plain(checkpoint, engine):
    """Plain greedy decoding under `_Thirds`: (prompt, answer, how far the masked answer is
    decided, the constraint's shift), as `plain_decoding`, with the first shift whose answer
    is decided for at least half its length."""
    prompt = _prompt(checkpoint)
    vocab = engine._model.token_count
    for shift in range(3):
        constraint = _Thirds(vocab, shift)
        answer = [t.id for t in engine.generate(prompt, ANSWER, constraint=constraint)]
        logits = engine.teacher_forced_logits(prompt + answer[:-1])[len(prompt) - 1 :]
        ids = np.arange(logits.shape[1])
        for i, row in enumerate(logits):
            row[~constraint.allows(ids, answer[:i])] = -np.inf
        top2 = np.sort(logits, axis=-1)[:, -2:]
        near = np.flatnonzero(top2[:, 1] - top2[:, 0] <= MARGIN)
        decided = int(near[0]) if near.size else ANSWER
        if decided >= ANSWER // 2:
            return prompt, answer, decided, shift
    raise AssertionError("no shift gives an answer decided for half its length")


@pytest.mark.parametrize("right", [4, 0, 2], ids=["all accepted", "all rejected", "partly"])
def test_greedy_output_under_a_constraint_is_plain_decoding_with_drafts(engine, constrained_plain,
                                                                        right):  # fmt: skip
    prompt, answer, decided, shift = constrained_plain
    constraint = _Thirds(engine._model.token_count, shift)
    drafter = _Scripted(engine, prompt, answer, right)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, constraint=constraint,
                                            drafter=drafter)]  # fmt: skip
    assert tokens[:decided] == answer[:decided] and len(tokens) == len(answer)
    # Told exactly the tokens generated, in order: the rejected drafts were taken back.
    assert constraint.consumed == tokens
    accepted = sum(a for _, a in drafter.outcomes)
    assert accepted > 0 if right else accepted == 0


def test_a_draft_the_constraint_rules_out_is_cut_before_the_verify_pass(engine, constrained_plain):
    """After the first token, drafts [a1, x, a3, a4] where the mask after a1 rules x out: the
    model can never draw x there, so the pass verifies a1 alone (and accepts it)."""
    prompt, answer, decided, shift = constrained_plain
    constraint = _Thirds(engine._model.token_count, shift)
    ruled_out = next(
        t for t in range(engine._model.token_count) if not constraint.allows(t, answer[:2])
    )

    class RuledOut(_Scripted):
        def draft(self, tokens, limit):
            drafts = super().draft(tokens, limit)
            if not self.outcomes:
                drafts[1] = ruled_out
            return drafts

    drafter = RuledOut(engine, prompt, answer, right=4)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, constraint=constraint,
                                            drafter=drafter)]  # fmt: skip
    assert drafter.outcomes[0] == (1, 1)
    assert tokens[:decided] == answer[:decided]


def test_tokens_the_caller_never_got_are_taken_back_from_the_constraint(engine, constrained_plain):
    prompt, answer, decided, shift = constrained_plain
    assert decided > 6
    constraint = _Thirds(engine._model.token_count, shift)
    drafter = _Scripted(engine, prompt, answer, right=4)
    generation = engine.generate(prompt, ANSWER, constraint=constraint, drafter=drafter)
    # The first token, then a pass yielding 4 drafts and the model's token: stop inside it.
    taken = [next(generation).id for _ in range(3)]
    generation.close()
    assert drafter.outcomes == [(4, 4)]
    assert constraint.consumed == taken == answer[:3]
    # A stop token among the accepted drafts ends the generation there, as plain decoding does.
    constraint = _Thirds(engine._model.token_count, shift)
    drafter = _Scripted(engine, prompt, answer, right=4)
    stop = answer[3]
    tokens = [
        t.id
        for t in engine.generate(prompt, ANSWER, {stop}, constraint=constraint, drafter=drafter)
    ]
    assert tokens == constraint.consumed == answer[: answer.index(stop) + 1]


def test_sampled_output_under_a_constraint_with_drafts_is_reproducible(engine, constrained_plain):
    prompt, _, _, shift = constrained_plain
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    constraint = _Thirds(engine._model.token_count, shift)
    sampled = [t.id for t in engine.generate(prompt, 16, sampling=params, constraint=constraint)]
    runs = []
    for _ in range(2):
        constraint = _Thirds(engine._model.token_count, shift)
        drafter = _Scripted(engine, prompt, sampled, right=4)
        tokens = [t.id for t in engine.generate(prompt, 16, sampling=params, constraint=constraint,
                                                drafter=drafter)]  # fmt: skip
        assert constraint.consumed == tokens
        assert all(constraint.allows(t, tokens[:i]) for i, t in enumerate(tokens))
        assert sum(a for _, a in drafter.outcomes) > 0
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_a_drafter_that_gave_up_leaves_constrained_decoding_one_pass_at_a_time(
    engine, constrained_plain
):
    """Without a constraint, decoding goes pipelined once nothing will be drafted (the test
    above); under one, every draw still waits for its mask."""
    prompt, answer, decided, shift = constrained_plain
    constraint = _Thirds(engine._model.token_count, shift)
    drafter = Speculation(draft_tokens=4, ngram=True, auto=True, pass_cost=_flat_cost)
    drafter._idle_lookups = AUTO_IDLE_LOOKUPS - 3  # about to give up
    tokens = [t.id for t in engine.generate(prompt, ANSWER, constraint=constraint,
                                            drafter=drafter)]  # fmt: skip
    assert drafter.exhausted
    assert tokens[:decided] == answer[:decided] and constraint.consumed == tokens
