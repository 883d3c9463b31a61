"""One request cannot hold the event loop or the engine: a request too large to render or to
compile a grammar for is refused at once with a 400 naming the field (before it reaches the
engine's worker), and the grammar is compiled off the event loop, so `/health` and another
client's stream keep flowing meanwhile.

The demo model on the sim, served by uvicorn in a thread (`test_server.RunningServer`). On the
code before these bounds, the requests below reached the worker (200,000 messages rendered for
12 s, then a 500), and a forced call with a 60,000-value enum compiled its grammar on the event
loop for seconds, freezing `/health` and the stream running meanwhile.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import RunningServer, user

import lily
import lily.chat.completions
from lily.api import Lily
from lily.chat.request_limits import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_JSON_VALUES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_TOOL_CALLS,
    DEFAULT_MAX_TOOLS,
)
from lily.server.app import create_app

MAX_SEQ = 96
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def server(llm: Lily) -> Iterator[RunningServer]:
    # The default limits, and the default 8 MiB body bound.
    with RunningServer(create_app(llm, queue_limit=4)) as running:
        yield running


def chat(server: RunningServer, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": sorted(properties)}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def forced_enum_call(values: int) -> dict[str, Any]:
    """A forced call of a tool whose one string parameter has `values` allowed values."""
    enum = [f"choice-{i}" for i in range(values)]
    return {
        "messages": user("Pick one."),
        "tools": [tool("pick", {"choice": {"type": "string", "enum": enum}})],
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
        "max_tokens": 8,
        **GREEDY,
    }


def assistant_calls(count: int) -> dict[str, Any]:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(count)
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


SHAPES = {
    # The case: 500 chat_template_limit after 12 s of rendering.
    "messages": (
        {"messages": [{"role": "user", "content": "a"}] * 200_000},
        "messages",
        200_000,
        DEFAULT_MAX_MESSAGES,
    ),
    "tool calls": (
        {"messages": [*user("a"), assistant_calls(DEFAULT_MAX_TOOL_CALLS + 1), *user("b")]},
        "messages",
        DEFAULT_MAX_TOOL_CALLS + 1,
        DEFAULT_MAX_TOOL_CALLS,
    ),
    "tools": (
        {
            "messages": user("a"),
            "tools": [tool(f"t{i}", {}) for i in range(DEFAULT_MAX_TOOLS + 1)],
        },
        "tools",
        DEFAULT_MAX_TOOLS + 1,
        DEFAULT_MAX_TOOLS,
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_request_over_the_shape_bounds_is_refused_before_the_engine(
    server: RunningServer, shape: str
) -> None:
    body, param, count, limit = SHAPES[shape]
    completed = server.wait_idle()["completed"]
    response = chat(server, {**body, "max_tokens": 1})
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "array_above_max_length",
        param,
    )
    assert str(count) in error["message"] and str(limit) in error["message"]
    # Refused before its turn: the engine's worker never saw it (it renders the prompt).
    assert server.wait_idle()["completed"] == completed


def test_a_request_over_the_value_bound_is_refused_before_the_engine(
    server: RunningServer,
) -> None:
    # Within the other bounds (one message with one call), but its arguments hold 100,000
    # keys: the renderer took more than its 10 s deadline over them, a 500 chat_template_limit.
    arguments = json.dumps({f"k{i}": 0 for i in range(100_000)})
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [*user("a"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c", "content": "done"})
    completed = server.wait_idle()["completed"]
    started = time.monotonic()
    response = chat(server, {"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_values", "messages")
    assert str(DEFAULT_MAX_JSON_VALUES) in error["message"]
    assert time.monotonic() - started < 10
    assert server.wait_idle()["completed"] == completed


GRAMMARS = {
    "forced call": (
        forced_enum_call(20_000),
        "tools[0].function.parameters.properties.choice.enum",
    ),
    "response_format": (
        {
            "messages": user("Number?"),
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {
                        "type": "object",
                        # Strings: 40,000 integers would pass the grammar bound and meet the
                        # bound on JSON values first.
                        "properties": {
                            "n": {"type": "string", "enum": [f"choice-{i}" for i in range(30_000)]}
                        },
                    },
                },
            },
            "max_tokens": 8,
        },
        "response_format.json_schema.schema.properties.n.enum",
    ),
}


@pytest.mark.parametrize("case", sorted(GRAMMARS))
def test_a_grammar_over_the_size_bound_is_refused_naming_the_field(
    server: RunningServer, case: str
) -> None:
    body, param = GRAMMARS[case]
    completed = server.wait_idle()["completed"]
    response = chat(server, body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_schema", param)
    assert str(DEFAULT_MAX_GRAMMAR_BYTES) in error["message"]
    assert server.wait_idle()["completed"] == completed


def test_a_grammar_within_the_bound_is_compiled_off_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled_on: list[threading.Thread] = []
    compile_grammar = lily.chat.completions.output_grammar

    def recording(*args: Any, **kwargs: Any) -> Any:
        compiled_on.append(threading.current_thread())
        return compile_grammar(*args, **kwargs)

    monkeypatch.setattr(lily.chat.completions, "output_grammar", recording)
    response = chat(server, forced_enum_call(50))
    # The tool's description does not fit this small context: refused after the compile.
    assert response.json()["error"]["code"] == "context_length_exceeded", response.text[:500]
    # uvicorn runs the event loop on the server's thread; the grammar was compiled elsewhere.
    assert compiled_on and all(thread is not server.thread for thread in compiled_on)


def test_a_huge_grammar_stalls_neither_health_nor_another_stream(server: RunningServer) -> None:
    """A stream runs while another client sends a forced call with a 30,000-value enum (about
    0.5 MB, under the bound on JSON values; a 60,000-value one compiled on the event loop
    froze it for seconds) and /health is polled: the stream's
    chunks keep their pace, /health answers at once, the big request gets its 400 quickly."""
    server.wait_idle()
    arrivals: list[float] = []
    stream_body = {"messages": user("Tell me a story"), "max_tokens": 24, "stream": True, **GREEDY}

    def stream() -> None:
        url = f"{server.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=stream_body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic())

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 120
    while len(arrivals) < 3:  # the prompt is done: chunks flow at the decode pace
        assert streaming.is_alive() and time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)

    big: dict[str, Any] = {}

    def send_big() -> None:
        started = time.monotonic()
        big["response"] = chat(server, forced_enum_call(30_000))
        big["span"] = (started, time.monotonic())

    sending = threading.Thread(target=send_big)
    sending.start()
    health_latencies = []
    while sending.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=120).status_code == 200
        health_latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    sending.join()
    streaming.join(120)
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    start, end = big["span"]
    during = [
        later - earlier
        for earlier, later in zip(arrivals, arrivals[1:], strict=False)
        if later > start and earlier < end
    ]
    usual = statistics.median(gaps)
    # Generous margins for a loaded machine: the stall measured before the fix was seconds.
    assert max(health_latencies) < 1.5, health_latencies
    assert max(during, default=0) < 4 * usual + 1.0, (during, usual)
    assert end - start < 10, json.dumps(big["span"])
    response = big["response"]
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["code"] == "unsupported_schema"
