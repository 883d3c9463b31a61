"""Logit bias and the penalties through both engines on the demo model: the device counts the
generated tokens itself (the pipelined decode writes nothing between steps), so greedy runs
must agree with the reference's numpy definition token for token; a banned token never
appears, even where it would be the greedy choice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

import lily
from lily.api import Lily
from lily.engine.sampling import SamplingParams
from lily.errors import RequestError

MAX_SEQ = 64
STEPS = 16
PROMPT = "the the the the of of and"


@pytest.fixture(scope="module")
def sim() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference() -> Iterator[Lily]:
    with lily.load("demo", device="reference", max_seq=MAX_SEQ) as llm:
        yield llm


def generated(llm: Lily, sampling: SamplingParams, steps: int = STEPS) -> list[int]:
    prompt = llm.tokenizer.encode(PROMPT)
    return [t.id for t in llm.engine.generate(prompt, steps, sampling=sampling)]


def test_greedy_runs_under_penalties_and_bias_match_the_reference(sim, reference):
    """A negative frequency penalty makes the run repeat tokens, so what the device counted
    decides later steps (the presence penalty and a repetition penalty below 1 shift them)."""
    plain = generated(reference, SamplingParams(temperature=0))
    adjusted = SamplingParams(
        temperature=0,
        frequency_penalty=-2.0,
        presence_penalty=1.0,
        repetition_penalty=0.8,
        logit_bias=((plain[0], -1.0), (plain[3], 0.7)),
    )
    expected = generated(reference, adjusted)
    assert expected[0] != plain[0]  # the bias moved the argmax
    assert Counter(expected).most_common(2)[1][1] > 1  # two tokens repeat
    assert generated(sim, adjusted) == expected
    # The counts start from zero for every generation.
    assert generated(sim, adjusted) == expected


@pytest.mark.parametrize("engine", ["sim", "reference"])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_banned_token_never_appears_even_as_the_argmax(engine, temperature, request):
    llm = request.getfixturevalue(engine)
    # The greedy run's tokens: each is the argmax at some step unless banned.
    banned = set(generated(llm, SamplingParams(temperature=0)))
    sampling = SamplingParams(
        temperature=temperature, seed=5, logit_bias=tuple((t, -100.0) for t in sorted(banned))
    )
    tokens = generated(llm, sampling)
    assert len(tokens) == STEPS
    assert not set(tokens) & banned


@pytest.mark.parametrize("engine", ["sim", "reference"])
def test_a_bias_for_a_token_the_tokenizer_lacks_is_refused(engine, request):
    llm = request.getfixturevalue(engine)
    sampling = SamplingParams(logit_bias=((llm.tokenizer.vocab_size, 1.0),))
    with pytest.raises(RequestError, match="logit_bias") as refused:
        generated(llm, sampling)
    assert refused.value.param == "logit_bias"


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": ((3, 100.5),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((3, "1"),)},
    ],
)
def test_out_of_range_adjustments_are_refused(bad):
    with pytest.raises(RequestError) as refused:
        SamplingParams(**bad)
    assert refused.value.param == next(iter(bad))


RESUMING = SamplingParams(temperature=0, frequency_penalty=-2.0, presence_penalty=1.0)


@pytest.mark.parametrize("engine", ["sim", "reference"])
def test_a_resumed_reply_keeps_its_penalty_counts(engine, request):
    """A generation resumed from the reply so far (as Lily does after closing a think block
    whose budget ran out) continues exactly as the uninterrupted one when it says how much of
    its prompt is reply; counted from zero instead, the penalties steer it elsewhere."""
    llm = request.getfixturevalue(engine)
    prompt = llm.tokenizer.encode(PROMPT)
    whole = generated(llm, RESUMING)
    cut = STEPS // 2
    fed = prompt + whole[:cut]

    def resumed(reply_so_far: int) -> list[int]:
        tokens = llm.engine.generate(fed, STEPS - cut, sampling=RESUMING, reply_so_far=reply_so_far)
        return [t.id for t in tokens]

    assert resumed(cut) == whole[cut:]
    assert resumed(0) != whole[cut:]


@pytest.mark.parametrize("engine", ["sim", "reference"])
@pytest.mark.parametrize("reply_so_far", [-1, 8])
def test_a_reply_longer_than_the_prompt_is_refused(engine, reply_so_far, request):
    llm = request.getfixturevalue(engine)
    with pytest.raises(ValueError, match="reply_so_far"):
        next(llm.engine.generate([1, 2, 3], 2, reply_so_far=reply_so_far))
