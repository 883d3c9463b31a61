"""A stream moved into a batch slot goes back to drafting alone once it is the only one left
(`lily.engine.scheduler`: `BatchedDecoder.leave_to_engine`, `DeviceEngine.resume`), and into a
slot again when another caller arrives: every stream's tokens are those it gets alone, through
every move. On the sim unless LILY_DEVICE names another device; fixtures from conftest.py."""

from __future__ import annotations

import numpy as np
import pytest
from drafting_streams import (
    BEFORE,
    LATE_STOP,
    Alternating,
    chat_joined_mid_stream,
    new_drafter,
    prompts,
    token_ids,
)
from test_batched_decode import assert_same_logprobs
from test_server import user
from test_server_batching import REQUESTS

from lily.engine import scheduler
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import Speculation

# The long answer: enough for a move into a slot, a way back and a second move.
LONG = 30
SHORT = 3
# Tokens the long stream's caller reads between its return to drafting and the third arrival.
READ_BETWEEN = 8


def _third_prompt(engine: DeviceEngine) -> list[int]:
    return np.random.default_rng(12).integers(0, engine.config.vocab_size, 9).tolist()


@pytest.mark.parametrize("source", ["mtp", "ngram"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)],
    ids=["greedy", "seeded"],
)
def test_a_stream_left_alone_in_a_slot_drafts_again_and_moves_back_when_another_arrives(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon, source, sampling
):
    """Alone (drafting) -> slot (a short request arrives) -> alone once it ended (drafting
    again) -> slot (a third arrives): the long answer is the one it gets alone, and so are
    the others'."""
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    third_prompt = _third_prompt(engine)
    other_sampling = SamplingParams(temperature=1.0, seed=4)
    alone = token_ids(engine.generate(first_prompt, LONG, sampling=sampling))
    second_alone = token_ids(engine.generate(second_prompt, SHORT, sampling=other_sampling))
    third_alone = token_ids(engine.generate(third_prompt, SHORT))
    drafter = new_drafter(source)
    lone = batching.generate(first_prompt, LONG, sampling=sampling, drafter=drafter)
    got = [next(lone).id for _ in range(BEFORE)]
    second = token_ids(batching.generate(second_prompt, SHORT, sampling=other_sampling))
    got += [next(lone).id for _ in range(READ_BETWEEN)]
    third = batching.generate(third_prompt, SHORT)
    got_third = [next(third).id]  # admitted once the long one moved into a slot again
    got += token_ids(lone)
    got_third += token_ids(third)
    assert got == alone
    assert (second, got_third) == (second_alone, third_alone)
    assert len(moves) == 2 and moves[0] < returns[0][0] < moves[1] < LONG
    _, passes_then, redrafting = returns[0]
    assert redrafting is drafter
    if source == "mtp":  # the head drafts at every pass but the first after a return
        assert drafter.total.passes > passes_then


def test_a_stream_that_joined_a_slot_directly_drafts_once_alone(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon
):
    """A stream admitted into a slot (another was drafting alone) never ran on the engine's
    state: it goes there once the other ends, and drafts, the head over a cache it never
    filled (its drafts are verified: the tokens are the same)."""
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, SHORT)
    short_alone = token_ids(engine.generate(first_prompt, SHORT + BEFORE))
    long_prompt = second_prompt[:12]
    long_alone = token_ids(engine.generate(long_prompt, LONG))
    drafter = new_drafter("mtp")
    short = batching.generate(first_prompt, SHORT + BEFORE, drafter=new_drafter("mtp"))
    got_short = [next(short).id]
    long = batching.generate(long_prompt, LONG, drafter=drafter)
    got_long = [next(long).id]
    got_short += token_ids(short)
    got_long += token_ids(long)
    assert (got_short, got_long) == (short_alone, long_alone)
    assert len(moves) == 1 and len(returns) == 1 and returns[0][2] is drafter
    assert drafter.total.passes > returns[0][1]


def test_the_way_back_keeps_the_constraint_and_the_stop_token(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon
):
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    vocab = engine.model_graph.token_count
    constrained = token_ids(engine.generate(first_prompt, LONG, constraint=Alternating(vocab)))
    stop = constrained[LONG - 4]
    alone = constrained[: constrained.index(stop) + 1]
    constraint = Alternating(vocab)
    drafter = new_drafter("mtp")
    lone = batching.generate(first_prompt, LONG, [stop], constraint=constraint, drafter=drafter)
    got = [next(lone).id for _ in range(BEFORE)]
    token_ids(batching.generate(second_prompt, SHORT))
    got += token_ids(lone)
    assert got == alone
    assert constraint.consumed == got  # told each token once, drafts taken back
    assert len(moves) == 1 and len(returns) == 1
    assert drafter.total.passes > returns[0][1]  # the head's drafts the grammar allows


def test_the_way_back_keeps_reporting_log_probabilities(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon
):
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    sampling = SamplingParams(temperature=0.0, top_logprobs=2)
    alone = list(engine.generate(first_prompt, LONG, sampling=sampling))
    lone = batching.generate(first_prompt, LONG, sampling=sampling, drafter=new_drafter("mtp"))
    got = [next(lone) for _ in range(BEFORE)]
    token_ids(batching.generate(second_prompt, SHORT))
    got += list(lone)
    assert [t.id for t in got] == [t.id for t in alone]
    assert_same_logprobs(got, alone)
    assert len(moves) == 1 and len(returns) == 1


def test_a_short_rest_of_an_answer_stays_in_its_slot(
    drafting_engine, drafting_scheduler, moves, returns
):
    """Under REDRAFT_MIN_TOKENS tokens left to generate, the move back would not pay."""
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    assert LONG < scheduler.REDRAFT_MIN_TOKENS
    alone = token_ids(engine.generate(first_prompt, LONG))
    lone = batching.generate(first_prompt, LONG, drafter=new_drafter("mtp"))
    got = [next(lone).id for _ in range(BEFORE)]
    token_ids(batching.generate(second_prompt, SHORT))
    got += token_ids(lone)
    assert got == alone
    assert len(moves) == 1 and returns == []


def test_a_stream_whose_head_auto_dropped_stays_in_its_slot(
    drafting_engine, drafting_scheduler, moves, returns, redraft_soon
):
    """A head that "auto" dropped while the stream drafted alone would not draft again: the
    stream stays batched (each pass charged 10 decode steps, the random head's first pass
    loses more than AUTO_MAX_LOSS)."""
    engine, batching = drafting_engine, drafting_scheduler
    first_prompt, second_prompt = prompts(engine, LONG)
    alone = token_ids(engine.generate(first_prompt, LONG))
    drafter = Speculation(draft_tokens=3, mtp=True, auto=True, pass_cost=lambda drafts: 10.0)
    lone = batching.generate(first_prompt, LONG, drafter=drafter)
    got = [next(lone).id for _ in range(BEFORE)]
    token_ids(batching.generate(second_prompt, SHORT))
    got += token_ids(lone)
    assert got == alone
    assert drafter.verdict("mtp") is False
    assert len(moves) == 1 and returns == []


SHORT_REQUEST = {"messages": user("Hi"), "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("lone", ["late stop", "json schema"])
def test_a_chat_request_back_to_drafting_answers_as_alone(lone, moves, returns, redraft_soon):
    """Through the chat layer (a stop string, a json_schema grammar), on the demo loaded with
    `parallel=2` and the MTP head: the first request drafts alone, a short one arrives while
    it streams, and once that one ended the first drafts again; each answer is the one a
    model without drafting or batching gives."""
    kinds = {**REQUESTS, "late stop": LATE_STOP}
    expected, short_alone, streamed, answers = chat_joined_mid_stream(
        kinds[lone], SHORT_REQUEST, other_ends_first=True
    )
    assert expected["finish_reason"] == "stop"  # at the stop string, or the grammar's end
    assert streamed == (
        expected["content"] or "",
        expected["reasoning"] or "",
        expected["finish_reason"],
    )
    assert answers == [short_alone]
    assert len(moves) == 1 and len(returns) == 1
    _, passes_then, drafter = returns[0]
    if lone != "json schema":  # the demo's random head drafts nothing its grammar allows
        assert drafter.total.passes > passes_then  # it drafted again
