"""Reasoning controls on the demo model: `reasoning_effort` ("none" turns thinking off) and
`reasoning_budget` (after N thinking tokens Lily closes the think block and the answer follows),
through the Python API and over HTTP.

The demo's random weights never close the think block on their own within a few tokens, so
every budget below runs out and is enforced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

import lily
from lily.api import Lily
from lily.chat.completions import THINK_CLOSE
from lily.errors import RequestError
from lily.server.app import create_app

USER = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def demo() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=128) as llm:
        yield llm


@pytest.fixture
def generate_calls(demo: Lily) -> Iterator[list[dict[str, Any]]]:
    """Each engine.generate call: the prompt it was fed, how much of it was reply, and the
    tokens it produced."""
    calls: list[dict[str, Any]] = []
    inner = demo.engine.generate

    def recording(prompt: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        call: dict[str, Any] = {
            "prompt": list(prompt),
            "reply_so_far": kwargs.get("reply_so_far", 0),
            "produced": [],
        }
        calls.append(call)
        for token in inner(prompt, *args, **kwargs):
            call["produced"].append(token.id)
            yield token

    demo.engine.generate = recording
    yield calls
    del demo.engine.generate


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_budget_of_n_thinks_n_tokens_then_answers(
    demo: Lily, generate_calls: list[dict[str, Any]], budget: int
) -> None:
    close = demo.tokenizer.encode(THINK_CLOSE)
    max_tokens = budget + len(close) + 5
    r = demo.chat.completions.create(
        messages=USER, max_tokens=max_tokens, reasoning_budget=budget, **GREEDY
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == budget
    assert r.usage.completion_tokens == max_tokens
    assert r.choices[0].message.content  # an answer, not only thinking
    assert (r.choices[0].message.reasoning_content is None) == (budget == 0)
    # The first generation thought `budget` tokens (none at all for 0: it never ran); the
    # closing tokens were appended, and the answer was generated after them.
    assert len(generate_calls) == (1 if budget == 0 else 2)
    *first, resumed = generate_calls
    thought = first[0]["produced"][:budget] if first else []
    assert len(thought) == budget
    assert resumed["prompt"] == first_prompt(demo) + thought + close
    # The resumed generation's penalties count the reply so far, not only what it generates.
    assert resumed["reply_so_far"] == len(thought + close)
    assert demo.tokenizer.decode(resumed["produced"]) == r.choices[0].message.content


def first_prompt(llm: Lily) -> list[int]:
    return llm.tokenizer.encode(llm.chat_template.render(USER, add_generation_prompt=True))


def test_a_streamed_budget_gives_the_same_answer(demo: Lily) -> None:
    params = {"messages": USER, "max_tokens": 10, "extra_body": {"reasoning_budget": 2}, **GREEDY}
    whole = demo.chat.completions.create(**params)
    reasoning = content = ""
    for chunk in demo.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            reasoning += choice.delta.reasoning_content or ""
            content += choice.delta.content or ""
    assert content == whole.choices[0].message.content != ""
    assert reasoning == whole.choices[0].message.reasoning_content != ""


def test_a_budget_the_reply_never_reaches_changes_nothing(
    demo: Lily, generate_calls: list[dict[str, Any]]
) -> None:
    unbounded = demo.chat.completions.create(messages=USER, max_tokens=4, **GREEDY)
    bounded = demo.chat.completions.create(
        messages=USER, max_tokens=4, reasoning_budget=10, **GREEDY
    )
    assert bounded.choices[0].message == unbounded.choices[0].message
    assert len(generate_calls) == 2  # one generation each: nothing was closed or resumed


def test_reasoning_effort_none_turns_thinking_off(demo: Lily) -> None:
    off = demo.chat.completions.create(
        messages=USER, max_tokens=4, reasoning_effort="none", **GREEDY
    )
    template_off = demo.chat.completions.create(
        messages=USER, max_tokens=4, chat_template_kwargs={"enable_thinking": False}, **GREEDY
    )
    assert off.choices[0].message == template_off.choices[0].message
    assert off.choices[0].message.reasoning_content is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high", "xhigh"])
def test_other_reasoning_efforts_keep_thinking_on(demo: Lily, effort: str) -> None:
    r = demo.chat.completions.create(messages=USER, max_tokens=2, reasoning_effort=effort)
    assert r.usage.completion_tokens_details.reasoning_tokens == 2
    assert r.choices[0].message.reasoning_content


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
         "reasoning_effort"),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
         "reasoning_effort"),
        ({"reasoning_budget": -1}, "reasoning_budget"),
        ({"reasoning_budget": "8"}, "reasoning_budget"),
        ({"reasoning_budget": True}, "reasoning_budget"),
        ({"reasoning_budget": 2.5}, "reasoning_budget"),
    ],
)  # fmt: skip
def test_bad_reasoning_controls_are_refused_by_name(
    demo: Lily, params: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as raised:
        demo.chat.completions.create(messages=USER, max_tokens=2, **params)
    assert raised.value.param == param


def test_the_server_takes_both_controls(demo: Lily) -> None:
    with TestClient(create_app(demo), base_url="http://localhost") as client:
        budgeted = client.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 9, "reasoning_budget": 3, **GREEDY},
        )
        off = client.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 2, "reasoning_effort": "none", **GREEDY},
        )
        refused = client.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 2, "reasoning_budget": -3},
        )
    assert budgeted.status_code == 200, budgeted.text
    body = budgeted.json()
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    assert body["choices"][0]["message"]["content"]
    assert off.status_code == 200
    assert off.json()["choices"][0]["message"].get("reasoning_content") is None
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "reasoning_budget"
