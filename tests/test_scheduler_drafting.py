"""A lone generation drafts on a batching engine (`lily.engine.scheduler`): it runs alone on the
engine's state with its drafter while nothing else runs, and moves into a batch slot between two
of its passes when another caller arrives (`BatchedDecoder.join_from_engine`). Every stream's
tokens are those it gets alone, across the move. On the sim unless LILY_DEVICE names another
device."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from drafting_streams import (
    BEFORE,
    LATE_STOP,
    NEW_TOKENS,
    Alternating,
    chat_joined_mid_stream,
    new_drafter,
    prompts,
    token_ids,
)
from test_batched_decode import assert_same_logprobs
from test_server_batching import REQUESTS

from lily.engine.sampling import SamplingParams
from lily.engine.scheduler import BatchScheduler


def _joined_mid_answer(
    scheduler: BatchScheduler, first: dict[str, Any], second: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """The first request's tokens and the second's, the second arriving once the first's
    caller has taken BEFORE tokens."""
    lone = scheduler.generate(**first)
    got = [next(lone).id for _ in range(BEFORE)]
    other = scheduler.generate(**second)
    got_other = [next(other).id]  # admitted once the first moved into a slot
    got += token_ids(lone)
    return got, got_other + token_ids(other)


# The head drafts at every pass; prompt lookup finds nothing in this random model's answer, so
# its passes are decode steps run one at a time; a drafter that gave up leaves two in flight.
@pytest.mark.parametrize("source", ["mtp", "ngram", "gave up"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)],
    ids=["greedy", "seeded"],
)
def test_a_lone_drafting_stream_joined_mid_answer_keeps_its_tokens(
    drafting_engine, drafting_scheduler, moves, source, sampling
):
    first_prompt, second_prompt = prompts(drafting_engine)
    other_sampling = SamplingParams(temperature=1.0, seed=4)
    alone = token_ids(drafting_engine.generate(first_prompt, NEW_TOKENS, sampling=sampling))
    other_alone = token_ids(
        drafting_engine.generate(second_prompt, NEW_TOKENS, sampling=other_sampling)
    )
    drafter = new_drafter(source)
    got, got_other = _joined_mid_answer(
        drafting_scheduler,
        dict(prompt=first_prompt, max_new_tokens=NEW_TOKENS, sampling=sampling, drafter=drafter),
        dict(prompt=second_prompt, max_new_tokens=NEW_TOKENS, sampling=other_sampling),
    )
    assert got == alone
    assert got_other == other_alone
    # It moved mid-answer: after the tokens its caller took, before its last.
    assert len(moves) == 1 and BEFORE <= moves[0] < NEW_TOKENS
    if source == "mtp":
        assert drafter.total.passes > 0  # it drafted while alone


def test_a_moved_stream_ends_at_its_stop_token_and_keeps_its_constraint(
    drafting_engine, drafting_scheduler, moves
):
    first_prompt, second_prompt = prompts(drafting_engine)
    vocab = drafting_engine._model.token_count
    constrained = token_ids(
        drafting_engine.generate(first_prompt, NEW_TOKENS, constraint=Alternating(vocab))
    )
    stop = constrained[NEW_TOKENS - 3]
    alone = constrained[: constrained.index(stop) + 1]
    other_alone = token_ids(drafting_engine.generate(second_prompt, NEW_TOKENS))
    constraint = Alternating(vocab)
    got, got_other = _joined_mid_answer(
        drafting_scheduler,
        dict(
            prompt=first_prompt,
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=[stop],
            constraint=constraint,
            drafter=new_drafter("mtp"),
        ),
        dict(prompt=second_prompt, max_new_tokens=NEW_TOKENS),
    )
    assert got == alone
    assert constraint.consumed == got  # told each token once, drafts taken back
    assert got_other == other_alone
    if len(alone) > BEFORE + 1:  # else the first pass after the arrival ended it
        assert len(moves) == 1


def test_a_moved_stream_keeps_reporting_its_log_probabilities(
    drafting_engine, drafting_scheduler, moves
):
    """Log-probabilities come from the verify passes while the stream drafts alone and from its
    slot's ring once it is batched: both as the stream alone reports them."""
    first_prompt, second_prompt = prompts(drafting_engine)
    sampling = SamplingParams(temperature=0.0, top_logprobs=2)
    alone = list(drafting_engine.generate(first_prompt, NEW_TOKENS, sampling=sampling))
    lone = drafting_scheduler.generate(
        first_prompt, NEW_TOKENS, sampling=sampling, drafter=new_drafter("mtp")
    )
    got = [next(lone) for _ in range(BEFORE)]
    other = drafting_scheduler.generate(second_prompt, NEW_TOKENS)
    next(other)
    got += list(lone)
    list(other)
    assert [t.id for t in got] == [t.id for t in alone]
    assert_same_logprobs(got, alone)
    assert len(moves) == 1 and moves[0] < NEW_TOKENS - 1  # some tokens came from the slot


def test_a_lone_stream_that_ends_before_anyone_arrives_never_moves(
    drafting_engine, drafting_scheduler, moves
):
    first_prompt, _ = prompts(drafting_engine)
    alone = token_ids(drafting_engine.generate(first_prompt, NEW_TOKENS))
    drafter = new_drafter("mtp")
    got = token_ids(drafting_scheduler.generate(first_prompt, NEW_TOKENS, drafter=drafter))
    assert got == alone
    assert moves == [] and drafter.total.passes > 0


def test_a_call_moves_the_lone_stream_and_runs(drafting_engine, drafting_scheduler, moves):
    """A call that would touch the engine's state (here `prompt_logits`) does not wait for the
    lone stream's answer: the stream moves into a slot, with the same tokens."""
    first_prompt, second_prompt = prompts(drafting_engine)
    alone = token_ids(drafting_engine.generate(first_prompt, NEW_TOKENS))
    expected_logits = drafting_engine.prompt_logits(second_prompt)
    lone = drafting_scheduler.generate(first_prompt, NEW_TOKENS, drafter=new_drafter("mtp"))
    got = [next(lone).id for _ in range(BEFORE)]
    np.testing.assert_array_equal(drafting_scheduler.prompt_logits(second_prompt), expected_logits)
    got += token_ids(lone)
    assert got == alone
    assert len(moves) == 1


def test_a_stream_the_pause_ends_while_its_caller_reads_moves_too(
    drafting_engine, drafting_scheduler, moves, monkeypatch
):
    """A caller may arrive after the scheduler looked for one and before the lone stream's next
    pass, whose `pause` then ends it: it moves all the same, as its caller reads on."""
    monkeypatch.setattr(BatchScheduler, "_others_wait", lambda self: False)
    first_prompt, second_prompt = prompts(drafting_engine)
    alone = token_ids(drafting_engine.generate(first_prompt, NEW_TOKENS))
    other_alone = token_ids(drafting_engine.generate(second_prompt, NEW_TOKENS))
    lone = drafting_scheduler.generate(first_prompt, NEW_TOKENS, drafter=new_drafter("mtp"))
    got = [next(lone).id for _ in range(BEFORE)]
    other: list[int] = []
    reader = threading.Thread(
        target=lambda: other.extend(
            token_ids(drafting_scheduler.generate(second_prompt, NEW_TOKENS))
        )
    )
    reader.start()
    while not drafting_scheduler.waiting:  # the second caller has arrived
        time.sleep(0.01)
    got += token_ids(lone)
    reader.join(120)
    assert got == alone and other == other_alone
    assert len(moves) == 1


@pytest.mark.parametrize("lone, other", [("late stop", "json schema"), ("json schema", "greedy")])
def test_a_chat_request_drafting_alone_then_joined_answers_as_alone(lone, other, moves):
    """Through the chat layer (a stop string, a json_schema grammar), on a model loaded with
    `parallel=2` and the MTP head: the first request drafts alone, the second arrives while it
    streams, and each answer is the one a model without drafting or batching gives."""
    kinds = {**REQUESTS, "late stop": LATE_STOP}
    expected, other_alone, streamed, answers = chat_joined_mid_stream(
        kinds[lone], kinds[other], other_ends_first=False
    )
    assert expected["finish_reason"] == "stop"  # at the stop string, or the grammar's end
    assert streamed == (
        expected["content"] or "",
        expected["reasoning"] or "",
        expected["finish_reason"],
    )
    assert answers == [other_alone]
    assert len(moves) == 1
