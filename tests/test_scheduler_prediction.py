"""A generation with a client's prediction on a batching engine (`lily.engine.scheduler`): it
drafts alone while nothing else runs, moves into a batch slot when another caller arrives
(which is admitted, not kept waiting), and drafts alone again once it is the only stream left.
Every stream's tokens are those it gets alone, and OpenAI's prediction counts those of a model
without batching. On the sim unless LILY_DEVICE names another device; fixtures from
conftest.py."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
from drafting_streams import BEFORE, prompts, token_ids
from test_server import joined, user

import lily
from lily.engine import scheduler
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import PredictedTokens, Speculation

# The predicted answer: enough for a move into a slot, a way back and drafts after it.
LONG = 30
SHORT = 3
SAMPLINGS = pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)],
    ids=["greedy", "seeded"],
)


def _predicting(prompt: list[int], answer: list[int]) -> Speculation:
    """A drafter of the client's prediction `answer`, lined up after the prompt's last tokens."""
    return Speculation(draft_tokens=3, prediction=PredictedTokens(answer, anchor=prompt[-3:]))


@SAMPLINGS
def test_a_prediction_alone_drafts_it(drafting_engine, drafting_scheduler, moves, sampling):
    prompt, _ = prompts(drafting_engine, LONG)
    alone = token_ids(drafting_engine.generate(prompt, LONG, sampling=sampling))
    drafter = _predicting(prompt, alone)
    got = token_ids(drafting_scheduler.generate(prompt, LONG, sampling=sampling, drafter=drafter))
    assert got == alone
    counts = drafter.counts["prediction"]
    assert counts.drafted > 0 and counts.accepted > 0
    assert counts.passes < LONG - 1  # passes kept several tokens each
    assert moves == []


@SAMPLINGS
def test_a_prediction_joined_mid_answer_admits_the_newcomer_and_drafts_again_once_alone(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon, deliveries, sampling
):
    """Alone (drafting the prediction) -> slot (a short request arrives and is admitted while it
    decodes) -> alone once the short one ended (drafting it again): both answers are those
    they get alone."""
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    other_sampling = SamplingParams(temperature=1.0, seed=4)
    alone = token_ids(engine.generate(first_prompt, LONG, sampling=sampling))
    other_alone = token_ids(engine.generate(second_prompt, SHORT, sampling=other_sampling))
    drafter = _predicting(first_prompt, alone)
    lone = batching.generate(first_prompt, LONG, sampling=sampling, drafter=drafter)
    got = [next(lone).id for _ in range(BEFORE)]
    other = batching.generate(second_prompt, SHORT, sampling=other_sampling)
    got_other = [next(other).id]
    got_other += token_ids(other)
    got += token_ids(lone)
    assert got == alone
    assert got_other == other_alone
    # The newcomer's first token came while the prediction's stream still had tokens to give.
    order = [length for length, _ in deliveries]
    assert order.index(len(second_prompt)) < len(order) - 1 - order[::-1].index(len(first_prompt))
    assert len(moves) == 1 and BEFORE <= moves[0] < LONG
    assert len(returns) == 1 and returns[0][2] is drafter and moves[0] < returns[0][0] < LONG
    assert drafter.counts["prediction"].passes > returns[0][1]  # it drafted after its return


def test_redrafts_a_prediction_that_auto_would_judge_unpaid(drafting_engine, redraft_soon):
    """The "auto" policy never drops a prediction: a stream with one goes back to drafting
    however its other sources did, while one whose head did not pay stays in its slot."""
    prompt, _ = prompts(drafting_engine, LONG)

    def generation(speculation: Speculation) -> scheduler._Generation:
        return scheduler._Generation(prompt, LONG, (), SamplingParams(), {"drafter": speculation})

    never_pays = {"auto": True, "pass_cost": lambda drafts: 10.0, "mtp": True}
    predicted = Speculation(prediction=PredictedTokens([1, 2, 3]), **never_pays)
    head = Speculation(**never_pays)
    for speculation in (predicted, head):
        for _ in range(4):  # head passes that kept nothing, at ten decode steps each
            speculation._last_source = "mtp"
            speculation.verified([5], 0)
        assert speculation.verdict("mtp") is False
    assert scheduler.BatchScheduler._redrafts(generation(predicted))
    assert not scheduler.BatchScheduler._redrafts(generation(head))


# -- through the chat layer: OpenAI's prediction counts --------------------------------------

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PREDICTED = dict(messages=user("Hi"), max_tokens=40, **NO_THINKING)
OTHER = dict(messages=user("Hello there"), max_tokens=14, temperature=0)


def _usage(completion: Any) -> tuple[int, int]:
    details = completion.usage.completion_tokens_details
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_a_joined_prediction_request_answers_and_counts_as_alone(moves, sampling):
    """The prediction (the answer, edited in its middle) streams on `parallel=2`, another
    request arriving after 3 chunks: its text, finish reason and accepted and rejected
    prediction tokens are those of `parallel=1`, which drafts it throughout (prompt lookup too:
    with speculative="off" nothing drafts)."""
    request = {"model": "demo", **PREDICTED, **sampling}
    with lily.load("demo", device="sim", max_seq=256, speculative="ngram") as plain:
        answer = plain.chat.completions.create(**request).choices[0].message.content
        assert answer and len(answer) > 24
        middle = len(answer) // 2
        edited = answer[:middle] + "~~~" + answer[middle + 3 :]
        request["prediction"] = {"type": "content", "content": edited}
        expected = plain.chat.completions.create(**request)
        other_alone = plain.chat.completions.create(model="demo", **OTHER).choices[0].message
    accepted, rejected = _usage(expected)
    assert accepted > 0 and rejected > 0
    with lily.load("demo", device="sim", max_seq=256, parallel=2, speculative="ngram") as llm:
        chunks = llm.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **request
        )
        streamed = list(itertools.islice(chunks, 3))
        others: list[Any] = []
        second = threading.Thread(
            target=lambda: others.append(llm.chat.completions.create(model="demo", **OTHER))
        )
        second.start()
        second.join(120)  # admitted while the prediction's stream waits for its reader
        streamed += list(chunks)
    message = expected.choices[0].message
    assert joined(streamed) == (message.content, "", expected.choices[0].finish_reason)
    assert _usage(streamed[-1]) == (accepted, rejected)
    assert [o.choices[0].message.content for o in others] == [other_alone.content]
    assert len(moves) == 1
