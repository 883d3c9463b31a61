"""`lily serve` driven by the official `openai` client (sync, async, streaming) on the demo model
on the sim: answers equal the facade's, requests queue and never interleave, a full queue gives
503, a client that leaves frees the engine, bad input gets OpenAI error objects, and a bounded
schemathesis run over the OpenAPI description finds no 5xx.

The demo on the sim takes about 0.1 s per token (prompt tokens included), so answers are a few
tokens long. Requests sample (temperature 0.8) with a seed each: a server that lost or mixed up
seeds, or interleaved two requests on the engine, would give a different text than the facade.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

import lily
import lily.server.routes
from lily.api import Lily
from lily.errors import RequestError
from lily.server.app import create_app
from lily.server.openapi import CHAT_REQUEST_EXAMPLES, openapi_document
from lily.server.routes import ModelNames

MAX_SEQ = 96
MODEL = "demo"
GREEDY = {"temperature": 0}


def sampled(seed: int) -> dict[str, Any]:
    return {"temperature": 0.8, "seed": seed}


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The fuzzed server's context: a templated prompt of a few words leaves room for a few tokens.
FUZZ_MAX_SEQ = 32
FUZZ_EXAMPLES = 75


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


class RunningServer:
    """uvicorn serving `app` from a thread on a free loopback port."""

    def __init__(self, app: Any):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"),
                             **kwargs)  # fmt: skip

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health").json()

    def wait_idle(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (state := self.health())["busy"] or state["waiting"]:
            assert time.monotonic() < deadline, f"engine still busy: {state}"
            time.sleep(0.05)
        return state


class CountingEngine:
    """Wraps the engine's `generate` to count the tokens it really produced, and can be told to
    fail the next generation."""

    def __init__(self, llm: Lily):
        self.llm = llm
        self.inner = llm.engine.generate
        self.tokens = 0
        self.fail_next = False

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("planted engine failure /secret/path/engine.py line 42")
        for token in self.inner(*args, **kwargs):
            self.tokens += 1
            yield token


@pytest.fixture(scope="module")
def served_llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def counting(served_llm: Lily) -> Iterator[CountingEngine]:
    engine = served_llm.engine
    counter = CountingEngine(served_llm)
    engine.generate = counter.generate
    yield counter
    del engine.generate


@pytest.fixture(scope="module")
def server(served_llm: Lily, counting: CountingEngine) -> Iterator[RunningServer]:
    # Strict model ids, for the 404s checked here (test_server_clients.py checks the default).
    app = create_app(
        served_llm, queue_limit=16, max_body_bytes=64 * 1024, model_names=ModelNames(strict=True)
    )
    with RunningServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def facade() -> Iterator[Lily]:
    """A second copy of the demo model, called directly: the answers the server must give."""
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


_expected_cache: dict[str, Any] = {}


def expected(facade: Lily, text: str, max_tokens: int, seed: int) -> Any:
    """The facade's answer to `text` sampled with `seed`."""
    key = json.dumps([text, max_tokens, seed])
    if key not in _expected_cache:
        _expected_cache[key] = facade.chat.completions.create(
            model=MODEL, messages=user(text), max_tokens=max_tokens, **sampled(seed)
        )
    return _expected_cache[key]


def joined(chunks: list[Any]) -> tuple[str, str, str | None]:
    """(content, reasoning, finish_reason) of a stream of chunks."""
    content = reasoning = ""
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            finish = choice.finish_reason or finish
    return content, reasoning, finish


# -- models, health, OpenAPI -------------------------------------------------------------------


def test_models_health_and_openapi(server: RunningServer) -> None:
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    health = server.health()
    assert health["status"] == "ok" and health["device"] == "sim"
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/models", "/health"} <= set(document["paths"])


# -- answers equal the facade's ----------------------------------------------------------------


def test_sync_client_gets_the_facade_answer(server: RunningServer, facade: Lily) -> None:
    want = expected(facade, "Hi", 5, seed=1)
    got = server.client().chat.completions.create(
        model=MODEL, messages=user("Hi"), max_tokens=5, **sampled(1)
    )
    assert (got.choices[0].message.content or "") == (want.choices[0].message.content or "")
    assert got.choices[0].message.model_extra.get("reasoning_content") == (
        want.choices[0].message.reasoning_content
    )
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens == 5


def test_streaming_client_gets_the_facade_answer(server: RunningServer, facade: Lily) -> None:
    want = facade.chat.completions.create(
        model=MODEL, messages=user("Tell me"), max_tokens=4, **sampled(2), **NO_THINKING
    )
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=user("Tell me"),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        **sampled(2),
        extra_body=NO_THINKING,
    )
    chunks = list(stream)
    content, reasoning, finish = joined(chunks)
    assert content == (want.choices[0].message.content or "")
    assert reasoning == ""
    assert finish == want.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_is_server_sent_events_ending_in_done(server: RunningServer) -> None:
    body = {"messages": user("Hi"), "max_tokens": 2, "stream": True, **GREEDY}
    # A generous read timeout: the first token comes after the prefill, slow on a loaded machine.
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_async_clients_are_served_one_after_the_other(server: RunningServer, facade: Lily) -> None:
    prompts = ["One", "Two", "Three"]
    wants = [expected(facade, p, 3, seed=3) for p in prompts]

    async def ask_all() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
        async with client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL, messages=user(p), max_tokens=3, **sampled(3)
                    )
                    for p in prompts
                )
            )

    for got, want in zip(asyncio.run(ask_all()), wants, strict=True):
        message = want.choices[0].message
        assert got.choices[0].message.model_extra.get("reasoning_content") == (
            message.reasoning_content
        )
        assert (got.choices[0].message.content or "") == (message.content or "")


# -- under load --------------------------------------------------------------------------------


def test_concurrent_streaming_clients_each_get_their_sequential_answer(
    server: RunningServer, facade: Lily
) -> None:
    """Eight clients at once, half of them with the same prompt and their own seed: had two
    requests' tokens interleaved on the engine, or a seed gone to the wrong request, some
    client's text would differ from what the facade produces for its request alone."""
    prompts = ["Same question"] * 4 + [f"Client {i} says" for i in range(4)]
    seeds = [100 + i for i in range(len(prompts))]
    wants = [expected(facade, p, 3, seed) for p, seed in zip(prompts, seeds, strict=True)]
    same_prompt_answers = {w.choices[0].message.reasoning_content for w in wants[:4]}
    assert len(same_prompt_answers) > 1, "the seeds should matter for this check to mean much"
    results: dict[int, tuple[str, str, str | None]] = {}

    def run(i: int) -> None:
        stream = server.client().chat.completions.create(
            model=MODEL, messages=user(prompts[i]), max_tokens=3, stream=True, **sampled(seeds[i])
        )
        results[i] = joined(list(stream))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(len(prompts)))
    for i, want in enumerate(wants):
        message = want.choices[0].message
        assert results[i] == (
            message.content or "",
            message.reasoning_content or "",
            want.choices[0].finish_reason,
        ), (prompts[i], seeds[i])


def test_full_queue_answers_503_and_a_leaving_client_frees_the_engine(
    served_llm: Lily, counting: CountingEngine
) -> None:
    with RunningServer(create_app(served_llm, queue_limit=1)) as small:
        long_request = {"messages": user("Go"), "max_tokens": 80, "stream": True, **GREEDY}
        started = counting.tokens
        with httpx.stream(
            "POST", f"{small.url}/v1/chat/completions", json=long_request, timeout=60
        ) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            waiting = threading.Thread(
                target=lambda: small.client().chat.completions.create(
                    model=MODEL, messages=user("Me next"), max_tokens=2, **GREEDY
                )
            )
            waiting.start()
            deadline = time.monotonic() + 30
            while small.health()["waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.APIStatusError) as refused:
                small.client(max_retries=0).chat.completions.create(
                    model=MODEL, messages=user("No room"), max_tokens=2
                )
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"].isdigit()
            assert refused.value.body["code"] == "queue_full"
            # A request the facade refuses is answered at once, even with the queue full.
            with pytest.raises(openai.BadRequestError):
                small.client(max_retries=0).chat.completions.create(
                    model=MODEL, messages=user("Hi"), temperature=-1
                )
        # The long stream's client has gone: its generation stops, the waiting one runs.
        waiting.join(60)
        assert not waiting.is_alive()
        state = small.wait_idle()
    assert state["completed"] == 2
    produced_by_long = counting.tokens - started - 2
    assert produced_by_long < 40, "the abandoned generation was not stopped"


def test_a_failing_request_leaves_the_engine_usable(
    server: RunningServer, counting: CountingEngine, facade: Lily
) -> None:
    client = server.client(max_retries=0)
    counting.fail_next = True
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2, **GREEDY)
    text = failed.value.response.text
    assert "secret" not in text and "Traceback" not in text
    assert failed.value.body["type"] == "server_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=user("x " * 200), max_tokens=2)
    got = client.chat.completions.create(
        model=MODEL, messages=user("Hi"), max_tokens=5, **sampled(1)
    )
    assert got.choices[0].message.model_extra.get("reasoning_content") == (
        expected(facade, "Hi", 5, seed=1).choices[0].message.reasoning_content
    )


def test_a_stream_that_fails_midway_ends_with_an_error_event(
    server: RunningServer, counting: CountingEngine
) -> None:
    """The status line is sent with the first chunk, so a later failure is reported in-band."""
    counting.fail_next = True
    body = {"model": MODEL, "messages": user("Hi"), "max_tokens": 2, "stream": True, **GREEDY}
    # A generous read timeout: the first token comes after the prefill, slow on a loaded machine.
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert "data: [DONE]" not in events
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "internal_error" and "secret" not in error["message"]
    counting.fail_next = True
    with pytest.raises(openai.APIError):
        list(server.client().chat.completions.create(**body))
    assert server.wait_idle()["status"] == "ok"


# -- errors ------------------------------------------------------------------------------------


def post(server: RunningServer, content: bytes | str, **headers: str) -> httpx.Response:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", **headers},
    )
    assert "Traceback" not in response.text
    return response


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ('{"messages": [', 400, None),
        ("[1, 2]", 400, None),
        ('"just a string"', 400, None),
        ('{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', 400, None),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
        ("{}", 400, "messages"),
        ('{"messages": []}', 400, "messages"),
        ('{"messages": "hello"}', 400, "messages"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', 400, "messages[0].role"),
        ('{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
        ('{"messages": [{"role": "user", "content": "a"}], "max_tokens": "5"}', 400, "max_tokens"),
        ('{"messages": [{"role": "user", "content": "a"}], "max_tokens": true}', 400, "max_tokens"),
        ('{"messages": [{"role": "user", "content": "a"}], "stream": "yes"}', 400, "stream"),
        ('{"messages": [{"role": "user", "content": "a"}], "seed": 1e400}', 400, "seed"),
        ('{"messages": [{"role": "user", "content": "a"}], "seed": 99999999999999999999}', 400,
         "seed"),
        ('{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 21}', 400,
         "top_logprobs"),
        ('{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
         "messages[0].content[0].image_url"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
         '{"url": "file:///etc/passwd"}}]}]}', 400, "messages[0].content[0]"),
        ('{"messages": [{"role": "user", "content": "a"}], "top_k": 4294967296}', 400, "top_k"),
        ('{"messages": [{"role": "user", "content": "a"}], "seed": -1}', 400, "seed"),
        ('{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tools": []}}',
         400, "chat_template_kwargs.tools"),
        ('{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": '
         '{"messages": []}}', 400, "chat_template_kwargs.messages"),
        ('{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": '
         '{"add_generation_prompt": false}}', 400, "chat_template_kwargs.add_generation_prompt"),
        ('{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": '
         '{"enable_thinkng": false}}', 400, "chat_template_kwargs.enable_thinkng"),
        ('{"messages": [{"role": "user", "content": "a", "nmae": "bob"}]}', 400,
         "messages[0].nmae"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": '
         '[{"function": {"name": "f", "arguments": "[1, 2]"}}]}, '
         '{"role": "user", "content": "b"}]}',
         400, "messages[1].tool_calls[0].function.arguments"),
        ('{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
         '"function": {"name": "f", "parameters": {"properties": [1]}}}]}', 400,
         "tools[0].function.parameters.properties"),
        ('{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
         '"function": {"name": "f", "parameters": {"properties": {"n": 5}}}}]}', 400,
         "tools[0].function.parameters.properties.n"),
    ],
)  # fmt: skip
def test_bad_requests_get_error_objects(
    server: RunningServer, body: str, status: int, param: str | None
) -> None:
    response = post(server, body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


AGREEMENT_CASES = {
    "negative seed": ({"seed": -1}, "seed"),
    "five stop strings": ({"stop": ["a", "b", "c", "d", "e"]}, None),
    "stream_options key": (
        {"stream": True, "stream_options": {"include_usag": True}},
        "stream_options.include_usag",
    ),
    "include_usage not a boolean": (
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    "top_k past uint32": ({"top_k": 2**32}, "top_k"),
    "developer message": ({"messages": [{"role": "developer", "content": "a"}, *user("b")]}, None),
    "bias and penalties": (
        {
            "logit_bias": {"17": -100, "200": 5},
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repetition_penalty": 1.1,
        },
        None,
    ),
    "penalty out of range": ({"presence_penalty": 2.5}, "presence_penalty"),
    "logit_bias key not an id": ({"logit_bias": {"x": 1}}, "logit_bias"),
    "logit_bias id past the vocabulary": ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    "fields not used": (
        {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        None,
    ),
    "user not a string": ({"user": 5}, "user"),
}


@pytest.mark.parametrize("case", sorted(AGREEMENT_CASES))
def test_the_python_api_and_http_agree(server: RunningServer, facade: Lily, case: str) -> None:
    """The same request is accepted by both or refused by both, naming the same field."""
    extra, param = AGREEMENT_CASES[case]
    body = {"messages": user("Hi"), "max_tokens": 1, **GREEDY, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    try:
        answer = facade.chat.completions.create(**body)
        if body.get("stream"):
            answer = list(answer)
    except RequestError as error:
        python_param = error.param
    else:
        python_param = None
    assert python_param == param
    if param is None:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400 and error_of(response)["param"] == param


def test_a_template_over_its_limits_is_a_named_server_error(
    server: RunningServer, served_llm: Lily
) -> None:
    from lily.chat.chat_template import ChatTemplate, TemplateLimits

    looping = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    original = served_llm.chat_template
    served_llm.chat_template = ChatTemplate(looping, limits=TemplateLimits(max_steps=10_000))
    try:
        body = {"messages": user("Hi"), "max_tokens": 1}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    finally:
        served_llm.chat_template = original
    assert response.status_code == 500
    error = error_of(response)
    assert (error["type"], error["code"]) == ("server_error", "chat_template_limit")
    assert "10000 loop steps" in error["message"]
    assert server.wait_idle()["status"] == "ok"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_deeply_nested_json_is_a_400(server: RunningServer) -> None:
    response = post(server, '{"messages": ' + "[" * 50_000)
    assert response.status_code == 400
    error_of(response)


def test_bodies_are_parsed_off_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed_on: list[threading.Thread] = []
    parse = lily.server.routes.parse_chat_request

    def recording_parse(body: bytes, **kwargs: Any) -> dict[str, Any]:
        parsed_on.append(threading.current_thread())
        return parse(body, **kwargs)

    monkeypatch.setattr(lily.server.routes, "parse_chat_request", recording_parse)
    response = post(server, "[1]")  # refused by the parser: no generation needed
    assert response.status_code == 400
    # uvicorn runs the event loop on the server's thread; the parse ran elsewhere.
    assert parsed_on and parsed_on[0] is not server.thread


def test_errors_through_the_openai_client(server: RunningServer) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.chat.completions.create(model="gpt-4o", messages=user("a"), max_tokens=1)
    assert unknown_model.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(
            model=MODEL,
            messages=user("a"),
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    assert unsupported.value.body["code"] == "unsupported_parameter"
    assert "audio, modalities" in unsupported.value.message
    with pytest.raises(openai.BadRequestError) as several_choices:
        client.chat.completions.create(model=MODEL, messages=user("a"), n=9)
    assert several_choices.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=user("a"), max_tokens=MAX_SEQ)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as oversized:
        client.chat.completions.create(model=MODEL, messages=user("word " * 5000), max_tokens=1)
    assert oversized.value.body["code"] == "context_length_exceeded"


def test_bodies_over_the_limit_get_413(server: RunningServer) -> None:
    big = json.dumps({"messages": user("a" * 100_000)})
    assert error_of(post(server, big))["code"] == "request_too_large"
    assert post(server, big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(100):
            yield b" " * 1024

    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413


def test_unknown_routes_and_methods(server: RunningServer) -> None:
    assert error_of(httpx.get(f"{server.url}/v1/nothing"))["code"] == "not_found"
    response = httpx.get(f"{server.url}/v1/chat/completions")
    assert response.status_code == 405 and error_of(response)["code"] == "method_not_allowed"


def test_api_key(served_llm: Lily) -> None:
    with RunningServer(create_app(served_llm, api_key="sesame", open_model_list=False)) as locked:
        with pytest.raises(openai.AuthenticationError):
            locked.client(api_key="wrong", max_retries=0).models.list()
        response = httpx.get(f"{locked.url}/v1/models")
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
        assert locked.client(api_key="sesame").models.list().data[0].id == "demo"
        assert locked.health()["status"] == "ok"  # liveness checks need no key


# -- fuzzing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHAT_REQUEST_EXAMPLES))
def test_documented_examples_are_answered(server: RunningServer, name: str) -> None:
    """Each request example of the OpenAPI description, sent whole, gets a 200 with a well-formed
    answer (sent here rather than through schemathesis, whose examples phase may not send
    documented bodies whole)."""
    body = CHAT_REQUEST_EXAMPLES[name]["value"]
    if not body.get("stream"):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= answer["usage"]["completion_tokens"] <= body["max_tokens"]
        return
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        # Comments (`: prompt 30/30 tokens` when the prompt took over a second) are not events.
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    usage = chunks[-1]["usage"]  # stream_options.include_usage: the last chunk carries it
    assert 1 <= usage["completion_tokens"] <= body["max_tokens"]
    assert chunks[-1]["choices"] == []


def test_schemathesis_finds_no_server_error() -> None:
    """Positive and negative cases generated from the OpenAPI description; every answer must be
    a documented status with a conforming body, never a 5xx. Bounded by the example count; the
    model's context is short so that valid requests generate few tokens."""
    statuses: dict[int, int] = {}
    conformance = [
        checks.not_a_server_error,
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_schema_conformance,
    ]
    schema = schemathesis.openapi.from_dict(openapi_document())
    with (
        lily.load("demo", device="sim", max_seq=FUZZ_MAX_SEQ) as fuzz_llm,
        RunningServer(create_app(fuzz_llm, queue_limit=4)) as fuzzed,
    ):
        for mode in schemathesis.GenerationMode:

            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=schema.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                response = case.call(base_url=fuzzed.url, timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=conformance)

            check()
    print(f"schemathesis: {sum(statuses.values())} cases, statuses {sorted(statuses.items())}")
    assert sum(statuses.values()) >= len(schemathesis.GenerationMode) * FUZZ_EXAMPLES
    assert not [status for status in statuses if status >= 500]
