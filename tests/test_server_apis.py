"""The APIs beside chat completions, driven through the official SDKs against a server on the
demo model on the sim: legacy completions with fill-in-the-middle (`openai`), Anthropic Messages
(`anthropic`) and OpenAI Responses (`openai`). Every answer is validated with the SDK's own
types, and compared with what the chat path or the raw-completion facade gives for the same
request (same seed): the APIs are translations onto one engine path, so they must agree.

The demo on the sim takes about 0.1 s per token, so answers are a few tokens long.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types import Completion
from openai.types.responses import Response, ResponseStreamEvent
from PIL import Image
from pydantic import TypeAdapter
from test_api import ROOT, python_blocks, run_python
from test_server import RunningServer

import lily
import lily.server.routes
from lily.api import Lily
from lily.chat.completions import AUTO_REASONING_BUDGET
from lily.server.app import create_app
from lily.server.routes import ModelNames

MAX_SEQ = 384  # a prompt with tools is about 200 tokens
MODEL = "demo"


class RecordingEngine:
    """Wraps the engine's `generate` to record the token ids each generation was fed."""

    def __init__(self, llm: Lily):
        self.inner = llm.engine.generate
        self.fed: list[list[int]] = []

    def generate(self, tokens: list[int], *args: Any, **kwargs: Any) -> Iterator[Any]:
        self.fed.append(list(tokens))
        yield from self.inner(tokens, *args, **kwargs)


@pytest.fixture(scope="module")
def served_llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def recording(served_llm: Lily) -> Iterator[RecordingEngine]:
    engine = served_llm.engine
    recorder = RecordingEngine(served_llm)
    engine.generate = recorder.generate
    yield recorder
    del engine.generate


@pytest.fixture(scope="module")
def server(served_llm: Lily, recording: RecordingEngine) -> Iterator[RunningServer]:
    # Strict model ids, for the 404s checked here (test_server_clients.py checks the default).
    with RunningServer(
        create_app(served_llm, queue_limit=8, model_names=ModelNames(strict=True))
    ) as s:
        yield s


@pytest.fixture(scope="module")
def facade() -> Iterator[Lily]:
    """A second copy of the demo model, called directly: the answers the server must give."""
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


def post(server: RunningServer, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


# --- /v1/completions ---------------------------------------------------------------------------


def validate_completion_chunk(chunk: dict[str, Any]) -> None:
    """A streamed piece is a Completion whose pieces before the last have no finish_reason yet
    (null, as OpenAI streams them; the SDK's type has no None, so those are checked apart)."""
    pieces = chunk["choices"]
    assert all(p["finish_reason"] in (None, "stop", "length") for p in pieces)
    Completion.model_validate(
        {**chunk, "choices": [{**p, "finish_reason": p["finish_reason"] or "stop"} for p in pieces]}
    )


def test_fim_completion_is_the_raw_completion_of_the_fim_prompt(
    server: RunningServer, facade: Lily, recording: RecordingEngine
) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n    return total\n"
    r = server.client().completions.create(
        model=MODEL, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0.8, seed=11
    )
    Completion.model_validate(r.model_dump())
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    ids = facade.tokenizer.encode(fim)
    # The model's own FIM tokens, fed as the control tokens, not as their spelling.
    tok = facade.tokenizer
    assert ids[0] == tok.token_to_id("<|fim_prefix|>") and ids[-1] == tok.token_to_id(
        "<|fim_middle|>"
    )
    assert recording.fed[-1] == ids
    assert r.choices[0].text == facade.generate(fim, 6, temperature=0.8, seed=11)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_token_id_prompt_with_echo_and_a_stop_string(server: RunningServer, facade: Lily) -> None:
    text = "Once upon a time"
    ids = facade.tokenizer.encode(text)
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0.8, seed=5, echo=True
    )
    Completion.model_validate(r.model_dump())
    answer = facade.generate(text, 6, temperature=0.8, seed=5)
    assert r.choices[0].text == text + answer
    # A stop string inside that answer cuts it there, with finish_reason "stop".
    stop = answer[len(answer) // 2 :][:3]
    assert stop.strip(), answer
    cut = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=6, temperature=0.8, seed=5, stop=[stop]
    )
    assert cut.choices[0].text == answer[: answer.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_completion_with_logprobs_matches_the_whole_one(server: RunningServer) -> None:
    client = server.client()
    args = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "seed": 3, "logprobs": 2}
    whole = client.completions.create(**args, temperature=0.7)
    chunks = list(
        client.completions.create(
            **args, temperature=0.7, stream=True, stream_options={"include_usage": True}
        )
    )
    for chunk in chunks:
        validate_completion_chunk(chunk.model_dump())
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason == "length"
    tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 5
    lp = whole.choices[0].logprobs
    # Offsets step through the text token by token; the top two are the likeliest tokens.
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob
        assert top.get(token, logprob) == pytest.approx(logprob)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "a", "best_of": 2}, "best_of", "unsupported_parameter"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
        ({"prompt": "a", "suffix": "b", "echo": True}, "echo", None),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
        ({"prompt": "a", "logprobs": 6}, "logprobs", None),
        ({"prompt": [1, 10**9]}, "prompt", None),
        ({"prompt": ""}, "prompt", None),
        ({"suffix": "b"}, "prompt", "missing_required"),
        ({"prompt": "a", "temperature": 9}, "temperature", None),
    ],
)
def test_completion_requests_refused_by_name(
    server: RunningServer, body: dict[str, Any], param: str, code: str | None
) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    if "prompt" in body:  # the SDK itself refuses a call without one
        with pytest.raises(openai.BadRequestError):
            server.client().completions.create(**{"model": MODEL, "max_tokens": 2, **body})


def test_completion_of_another_model_is_a_404(server: RunningServer) -> None:
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert json.loads(r.text)["error"]["param"] == "model"


# --- /v1/messages ------------------------------------------------------------------------------

GREEDY = {"temperature": 0}  # the anthropic SDK sends sampling fields through extra_body
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)


def claude(server: RunningServer, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "none"), **kwargs)


def raw_events(server: RunningServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed /v1/messages answer, each data validated as the SDK's
    stream event type."""
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                STREAM_EVENT.validate_python(data)
                events.append((name, data))
    return events


def event_grammar(events: list[tuple[str, dict[str, Any]]]) -> str:
    """The event names as one letter each: s(tart) b(lock start) d(elta) e(nd of block)
    m(essage delta) x (message stop)."""
    letters = {
        "message_start": "s",
        "content_block_start": "b",
        "content_block_delta": "d",
        "content_block_stop": "e",
        "message_delta": "m",
        "message_stop": "x",
    }
    return "".join(letters[name] for name, _ in events)


def test_message_is_the_chat_answer(server: RunningServer, facade: Lily) -> None:
    r = claude(server).messages.create(
        model=MODEL,
        max_tokens=5,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi there"}],
        metadata={"user_id": "user-1"},
        extra_body=GREEDY,
    )
    Message.model_validate(r.model_dump())
    chat = facade.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ],
        max_tokens=5,
        **GREEDY,
        **NO_THINKING,
    )
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.role == "assistant"
    usage = r.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == 5 and usage.cache_creation_input_tokens == 0


def test_streamed_message_follows_anthropics_event_sequence(server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}],
        **GREEDY,
    }
    whole = claude(server).messages.create(**{k: v for k, v in body.items() if k != "temperature"},
                                           extra_body=GREEDY)  # fmt: skip
    events = raw_events(server, body)
    assert re.fullmatch(r"sbd+emx", event_grammar(events)), event_grammar(events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # message_start already counts the prompt, as message_delta does.
    start = events[0][1]["message"]["usage"]
    assert start["output_tokens"] == 0
    assert start["input_tokens"] + start["cache_read_input_tokens"] == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    assert delta["usage"]["output_tokens"] == 5
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    # The SDK's own stream helper assembles the same message.
    with claude(server).messages.stream(
        model=MODEL, max_tokens=5, messages=body["messages"], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"


def test_stop_sequence_is_named(server: RunningServer) -> None:
    client = claude(server)
    args = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "Count"}]}
    text = client.messages.create(**args, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), text
    r = client.messages.create(**args, stop_sequences=[stop], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_thinking_budget_is_the_reasoning_budget(server: RunningServer, facade: Lily) -> None:
    r = claude(server).messages.create(
        model=MODEL,
        max_tokens=7,
        messages=[{"role": "user", "content": "Why?"}],
        thinking={"type": "enabled", "budget_tokens": 3},
        extra_body=GREEDY,
    )
    Message.model_validate(r.model_dump())
    chat = facade.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Why?"}], max_tokens=7,
        reasoning_budget=3, **GREEDY,
    )  # fmt: skip
    message = chat.choices[0].message
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == message.reasoning_content and r.content[0].signature == ""
    assert r.content[1].text == message.content


def test_forced_tool_call_then_its_result(server: RunningServer) -> None:
    client = claude(server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    Message.model_validate(r.model_dump())
    assert r.stop_reason == "tool_use"
    [call] = r.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)
    # count_tokens measures the prompt the request was fed.
    counted = client.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER])
    MessageTokensCount.model_validate(counted.model_dump())
    assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    # The call and its result go back as Anthropic blocks; the next turn answers.
    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
            {"type": "text", "text": "Thanks"},
        ]},
    ]  # fmt: skip
    follow = client.messages.create(
        model=MODEL, max_tokens=2, messages=turns, tools=[WEATHER], extra_body=GREEDY
    )
    assert follow.stop_reason == "max_tokens"
    # The first turn's conversation (up to its generation prompt) is reused from the cache.
    assert counted.input_tokens - 10 < follow.usage.cache_read_input_tokens < counted.input_tokens
    counted_follow = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert counted_follow.input_tokens == (
        follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    )


def test_streamed_forced_tool_call(server: RunningServer) -> None:
    events = raw_events(
        server,
        {
            "model": MODEL,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            **GREEDY,
        },
    )
    assert re.fullmatch(r"sbd+emx", event_grammar(events)), event_grammar(events)
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert set(json.loads(partial)) == {"city"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         400, "invalid_request_error", "image sources of type None"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         400, "invalid_request_error", "'document'"),
        ({"mcp_servers": []}, 400, "invalid_request_error", "mcp_servers"),
        ({"output_config": {"effort": "high"}},
         400, "invalid_request_error", "output_config.effort"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "invalid_request_error", "tools[0].type"),
        ({"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "budget_tokens"),
        ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ],
)  # fmt: skip
def test_message_errors_are_anthropic_shaped(
    server: RunningServer, body: dict[str, Any], status: int, kind: str, words: str
) -> None:
    request = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = post(server, "/v1/messages", {**request, **body})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert words in r.json()["error"]["message"]
    assert set(r.json()["error"]) == {"type", "message"}


def test_message_errors_through_the_sdk(server: RunningServer) -> None:
    client = claude(server, max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )


def test_x_api_key_and_bearer_are_both_accepted(served_llm: Lily) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    with RunningServer(create_app(served_llm, api_key="sesame")) as locked:
        assert claude(locked, api_key="sesame").messages.count_tokens(**ask).input_tokens > 0
        bearer = claude(locked, api_key=None, auth_token="sesame")
        assert bearer.messages.count_tokens(**ask).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as refused:
            claude(locked, api_key="wrong", max_retries=0).messages.count_tokens(**ask)
        assert refused.value.body["error"]["type"] == "authentication_error"
        r = post(locked, "/v1/completions", {"prompt": "a", "max_tokens": 1}, **{"x-api-key": "no"})
        assert r.status_code == 401


# --- /v1/responses -----------------------------------------------------------------------------

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER_FUNCTION = {
    "type": "function",
    "name": WEATHER["name"],
    "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"],
    "strict": True,
}


def validated_response(r: Any) -> Response:
    """The SDK builds its objects without validating them: validate the dump (by alias: the
    SDK's field for `schema` is `schema_`)."""
    return Response.model_validate(r.model_dump(by_alias=True))


def test_response_is_the_chat_answer(server: RunningServer, facade: Lily) -> None:
    r = server.client().responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Hi there",
        max_output_tokens=5,
        temperature=0,
        reasoning={"effort": "none"},
        store=False,
    )
    validated_response(r)
    chat = facade.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi there"}],
        max_tokens=5, reasoning_effort="none", **GREEDY,
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 5
    assert r.usage.total_tokens == r.usage.input_tokens + 5


def test_reasoning_comes_back_as_a_reasoning_item(server: RunningServer, facade: Lily) -> None:
    r = server.client().responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Why?"}]}],
        max_output_tokens=7,
        temperature=0,
        reasoning={"effort": "low", "summary": "auto"},
        extra_body={"reasoning_budget": 3},
    )
    validated_response(r)
    chat = facade.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Why?"}], max_tokens=7,
        reasoning_budget=3, **GREEDY,
    )  # fmt: skip
    message = chat.choices[0].message
    reasoning, answer = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == message.reasoning_content
    assert reasoning.summary[0].text == message.reasoning_content  # the thinking itself
    assert answer.type == "message" and r.output_text == message.content
    assert r.usage.output_tokens_details.reasoning_tokens == 3


def test_streamed_response_events(server: RunningServer) -> None:
    client = server.client()
    args = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 5, "temperature": 0,
            "reasoning": {"effort": "none"}}  # fmt: skip
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    for event in events:
        RESPONSE_EVENT.validate_python(event.model_dump(by_alias=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 5


def test_forced_function_call_streamed_then_its_output(server: RunningServer) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    events = list(
        client.responses.create(
            model=MODEL,
            input=ask,
            tools=[WEATHER_FUNCTION],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
            temperature=0,
            reasoning={"effort": "none"},
            stream=True,
        )
    )
    for event in events:
        RESPONSE_EVENT.validate_python(event.model_dump(by_alias=True))
    final = validated_response(events[-1].response)
    assert events[-1].type == "response.completed" and final.status == "completed"
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert streamed == call.arguments and set(json.loads(call.arguments)) == {"city"}
    # The call and its output go back as items; the first exchange is reused from the cache.
    follow = client.responses.create(
        model=MODEL,
        input=[
            *ask,
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
        tools=[WEATHER_FUNCTION],
        max_output_tokens=2,
        temperature=0,
        reasoning={"effort": "none"},
    )  # fmt: skip
    validated_response(follow)
    assert follow.usage.input_tokens_details.cached_tokens > final.usage.input_tokens // 2


def test_json_schema_text_format_is_enforced(server: RunningServer) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = server.client().responses.create(
        model=MODEL,
        input="Pick a number",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=20,
        temperature=0,
        reasoning={"effort": "none"},
    )
    validated_response(r)
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 99


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"store": True}, 400, "store"),
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "messages[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
         400, "input[0].content[0].type"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"background": True}, 400, "background"),
        ({"model": "gpt-5"}, 404, "model"),
        ({"max_output_tokens": 0}, 400, "max_tokens"),
    ],
)  # fmt: skip
def test_response_requests_refused_by_name(
    server: RunningServer, body: dict[str, Any], status: int, param: str
) -> None:
    r = post(server, "/v1/responses", {"model": MODEL, "input": "Hi", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# --- keep-alives during a long prompt ------------------------------------------------------------


def test_a_silent_stream_gets_keep_alive_comments(
    served_llm: Lily, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt that takes long to prefill (here: an engine that waits before its first token)
    sends `: keep-alive` SSE comments meanwhile, on every API's stream, and the SDKs read the
    streams as usual."""
    engine = served_llm.engine
    inner = engine.generate

    def slow(*args: Any, **kwargs: Any) -> Iterator[Any]:
        tokens = inner(*args, **kwargs)
        first = next(tokens, None)
        time.sleep(0.6)  # the "prefill"
        if first is not None:
            yield first
            yield from tokens

    monkeypatch.setattr(engine, "generate", slow)
    with RunningServer(create_app(served_llm, keepalive=0.1)) as s:
        bodies = {
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
            "/v1/completions": {"prompt": "Hi"},
            "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}]},
            "/v1/responses": {"input": "Hi"},
        }
        for path, body in bodies.items():
            request = {"model": MODEL, "stream": True, "max_tokens": 2, **body}
            if path == "/v1/responses":
                request["max_output_tokens"] = request.pop("max_tokens")
            with httpx.stream("POST", f"{s.url}{path}", json=request, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
            comments = [i for i, line in enumerate(lines) if line.startswith(":")]
            assert comments and all(lines[i] == ": keep-alive" for i in comments), (path, lines)
            # Sent while the prompt was being fed, before the answer's events.
            assert comments[-1] < len(lines) - 2, (path, lines)
        text = claude(s).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
            stream=True,
        )  # fmt: skip
        assert [e.type for e in text][-1] == "message_stop"
        chunks = list(s.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                    stream=True))  # fmt: skip
        assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_and_the_log_show_how_far_the_prompt_is_fed(
    served_llm: Lily, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Progress reports (here every one, without the usual second between two) go to the log,
    naming the request's id, and into every API's stream as `: prompt FED/TOTAL tokens`
    comments before the answer's events; the SDKs read such streams as usual."""
    monkeypatch.setattr(lily.server.routes, "PROGRESS_INTERVAL_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="lily.server")
    text = "Tell me about the river and its bridges. " * 4
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": text}]},
        "/v1/completions": {"prompt": text},
        "/v1/messages": {"messages": [{"role": "user", "content": text}]},
        "/v1/responses": {"input": text},
    }
    with RunningServer(create_app(served_llm)) as s:
        for path, body in bodies.items():
            request = {"model": MODEL, "stream": True, "max_tokens": 2, **body}
            if path == "/v1/responses":
                request["max_output_tokens"] = request.pop("max_tokens")
            request_id = "progress" + path.replace("/", "-")
            headers = {"x-request-id": request_id}
            with httpx.stream(
                "POST", f"{s.url}{path}", json=request, headers=headers, timeout=60
            ) as r:
                lines = [line for line in r.iter_lines() if line]
            reports = [
                (i, int(m[1]), int(m[2]))
                for i, line in enumerate(lines)
                if (m := re.fullmatch(r": prompt (\d+)/(\d+) tokens", line))
            ]
            assert reports, (path, lines)
            # All together, after the stream's opening events at most (the role chunk,
            # message_start, response.created, ...), before any of the answer's text.
            at = [i for i, _, _ in reports]
            assert at == list(range(at[0], at[-1] + 1)), (path, lines)
            opening = [line for line in lines[: at[0]] if line.startswith("data:")]
            assert len(opening) <= 2, (path, lines)
            assert not any("_delta" in line or "[DONE]" in line for line in opening), path
            assert reports[-1][1] == reports[-1][2] > 40, (path, lines)
            logged = [
                m.groups()
                for record in caplog.records
                if (m := re.fullmatch(rf"id={request_id} prompt: (\d+)/(\d+) tokens fed",
                                      record.getMessage()))
            ]  # fmt: skip
            assert logged == [(str(f), str(t)) for _, f, t in reports], path
        chunks = list(
            s.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
                stream=True,
            )
        )  # fmt: skip
        assert chunks[-1].choices[0].finish_reason == "length"


# --- images -----------------------------------------------------------------------------------


def test_an_image_reaches_the_model_through_every_api(
    server: RunningServer, facade: Lily, tmp_path: Path
) -> None:
    """One picture, sent as each API sends images (an OpenAI data URL, an Anthropic base64
    block, a Responses input_image), gets the answer the Python API gives for it read from a
    file, with the image's tokens counted in the prompt."""
    picture = io.BytesIO()
    Image.new("RGB", (100, 60), (200, 120, 30)).save(picture, format="PNG")
    data = picture.getvalue()
    encoded = base64.b64encode(data).decode()
    url = f"data:image/png;base64,{encoded}"
    (tmp_path / "picture.png").write_bytes(data)
    question = "What is it?"
    expected = facade.chat.completions.create(
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (tmp_path / "picture.png").as_uri()}},
            {"type": "text", "text": question},
        ]}],
        max_tokens=4, reasoning_effort="none", **GREEDY,
    )  # fmt: skip
    assert expected.usage.prompt_tokens > 70  # 100 x 60 is scaled up to 320 x 224: 70 tokens
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "text", "text": question},
        ]}],
        max_tokens=4, reasoning_effort="none", **GREEDY,
    )  # fmt: skip
    assert chat.choices[0].message.content == expected.choices[0].message.content
    assert chat.usage.prompt_tokens == expected.usage.prompt_tokens
    message = claude(server).messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": encoded}},
            {"type": "text", "text": question},
        ]}],
        thinking={"type": "disabled"},
        extra_body=GREEDY,
    )  # fmt: skip
    assert message.content[0].text == expected.choices[0].message.content
    # Anthropic counts the cached part apart: the image, reused from the request before.
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert usage.cache_read_input_tokens >= 70
    response = server.client().responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"},
            {"type": "input_text", "text": question},
        ]}],
        max_output_tokens=4, temperature=0, reasoning={"effort": "none"}, store=False,
    )  # fmt: skip
    assert response.output_text == expected.choices[0].message.content
    # A server never reads its own files.
    r = post(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (tmp_path / "picture.png").as_uri()}},
        ]}],
    })  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image_url"


# --- docs/server.md ----------------------------------------------------------------------------

DOCS_MARK = "# runs against: lily serve --model demo"


def test_the_server_page_examples_run_against_a_demo_server(served_llm: Lily) -> None:
    """docs/server.md's client snippets, each run as written but for the server's address,
    against a server set up as `lily serve --model demo` sets it up (its reasoning budget of
    half the limit leaves the answer room: without it the 16 tokens are all thinking)."""
    blocks = [b for b in python_blocks(ROOT / "docs" / "server.md") if b.startswith(DOCS_MARK)]
    assert len(blocks) >= 1
    app = create_app(served_llm, default_reasoning_budget=AUTO_REASONING_BUDGET)
    with RunningServer(app) as server:
        for block in blocks:
            assert "http://127.0.0.1:8000" in block
            done = run_python(block.replace("http://127.0.0.1:8000", server.url))
            assert done.returncode == 0, f"{block}\n{done.stderr}"
            assert done.stdout.strip(), block
