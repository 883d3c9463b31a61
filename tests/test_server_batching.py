"""`lily serve` with several requests decoded at once (`lily.load(parallel=N)`, continuous
batching in `lily.engine.scheduler`): each concurrent request gets the answer the model gives it
alone, whatever runs beside it, and the load shows in /health and /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server import RunningServer, joined, user

import lily
from lily.api import Lily
from lily.server.app import create_app

MAX_SEQ = 256
MODEL = "demo"
PARALLEL = 3
NO_THINKING = {"reasoning_effort": "none"}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# Requests of every kind the chat layer handles differently, each sent alone to the facade and
# all at once to the server.
REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": dict(messages=user("Hello there"), max_tokens=14, temperature=0),
    "seeded": dict(messages=user("Hello there"), max_tokens=14, temperature=1.0, seed=7),
    "other seed": dict(messages=user("Hello there"), max_tokens=14, temperature=1.0, seed=8),
    "stop string": dict(messages=user("Count"), max_tokens=20, temperature=0, stop=["e"]),
    "json schema": dict(
        messages=user("Pick"),
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
        },
        **NO_THINKING,
    ),
    "tool call": dict(
        messages=user("Weather?"),
        max_tokens=40,
        temperature=0,
        tools=[TOOL],
        tool_choice="required",
        **NO_THINKING,
    ),
    "logprobs": dict(
        messages=user("Hi"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    ),
    "penalties": dict(
        messages=user("Hello there"), max_tokens=14, temperature=0, frequency_penalty=1.5
    ),
}


@pytest.fixture(scope="module")
def served() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, parallel=PARALLEL) as llm:
        yield llm


@pytest.fixture(scope="module")
def facade() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


def _answer(completion: Any) -> dict[str, Any]:
    choice = completion.choices[0]
    message = choice.message
    # The facade's own types carry reasoning_content; the openai SDK's keep it as an extra.
    extra = getattr(message, "model_extra", None) or {}
    logprobs = choice.logprobs
    return {
        "content": message.content,
        "reasoning": getattr(message, "reasoning_content", None) or extra.get("reasoning_content"),
        "tool_calls": [
            (call.function.name, call.function.arguments) for call in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
        "logprobs": None
        if logprobs is None
        else [
            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in logprobs.content
        ],
        "completion_tokens": completion.usage.completion_tokens,
    }


def test_concurrent_requests_each_get_their_answer_alone(served: Lily, facade: Lily) -> None:
    assert served.parallel == PARALLEL
    alone = {
        name: _answer(facade.chat.completions.create(model=MODEL, **request))
        for name, request in REQUESTS.items()
    }
    assert alone["json schema"]["content"].startswith("{")
    assert alone["tool call"]["tool_calls"] and alone["tool call"]["finish_reason"] == "tool_calls"
    assert alone["stop string"]["finish_reason"] == "stop"
    assert alone["seeded"] != alone["other seed"]
    got: dict[str, Any] = {}
    streamed: dict[str, Any] = {}
    with RunningServer(create_app(served, queue_limit=16)) as server:

        def ask(name: str) -> None:
            got[name] = _answer(
                server.client().chat.completions.create(model=MODEL, **REQUESTS[name])
            )

        def ask_streaming(name: str) -> None:
            chunks = server.client().chat.completions.create(
                model=MODEL, stream=True, **REQUESTS[name]
            )
            streamed[name] = joined(list(chunks))

        threads = [threading.Thread(target=ask, args=(name,)) for name in REQUESTS]
        threads += [
            threading.Thread(target=ask_streaming, args=(name,)) for name in ("greedy", "seeded")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    assert got == alone
    for name, (content, reasoning, finish) in streamed.items():
        assert (content, reasoning, finish) == (
            alone[name]["content"] or "",
            alone[name]["reasoning"] or "",
            alone[name]["finish_reason"],
        )


def _metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_requests_beyond_the_slots_wait_then_503(served: Lily) -> None:
    """PARALLEL requests run at once (each held after its first token), one more waits for a
    worker, the next is refused; once they go on, all are answered."""
    engine = served.engine
    inner, go_on = engine.generate, threading.Event()

    def held(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for i, token in enumerate(inner(*args, **kwargs)):
            yield token
            if i == 0:
                go_on.wait(60)

    request = {"messages": user("Go"), "max_tokens": 8, "temperature": 0}
    answers: list[Any] = []
    engine.generate = held  # type: ignore[method-assign]
    try:
        with RunningServer(create_app(served, queue_limit=1)) as server:

            def ask(text: str) -> None:
                answers.append(
                    server.client().chat.completions.create(
                        model=MODEL, **{**request, "messages": user(text)}
                    )
                )

            running = [threading.Thread(target=ask, args=(f"Go {i}",)) for i in range(PARALLEL)]
            for thread in running:
                thread.start()
            _wait_for(lambda: server.health()["running"] == PARALLEL)
            assert _metric(server, "lily_active_sequences") == PARALLEL
            assert server.health()["parallel"] == PARALLEL
            waiting = threading.Thread(target=ask, args=("Me next",))
            waiting.start()
            _wait_for(lambda: server.health()["waiting"] == 1)
            with pytest.raises(openai.APIStatusError) as refused:
                server.client(max_retries=0).chat.completions.create(model=MODEL, **request)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"].isdigit()
            assert httpx.get(f"{server.url}/ready").status_code == 503
            go_on.set()
            for thread in [*running, waiting]:
                thread.join(120)
            state = server.wait_idle()
    finally:
        go_on.set()
        del engine.generate
    assert len(answers) == PARALLEL + 1
    assert state["completed"] == PARALLEL + 1


def _wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)
