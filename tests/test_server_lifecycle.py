"""The engine always comes free: a request whose client leaves stops at its next prefill chunk or
token (streaming or not, during the prompt or the answer) and frees its queue slot; requests
without `max_tokens` are bounded; a huge prompt is refused by its size, untokenized, and a prompt
is tokenized once; SIGINT and SIGTERM drain `lily serve` and exit 0; `benchmarks/abuse.py` runs
in its reduced form.

The demo model on the sim, loaded with 8-token prefill chunks so that a prompt of a few dozen
tokens takes several passes (about a second each on this machine): work is counted in engine
passes (`Device.submit` calls) and generated tokens, never in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import CountingEngine, RunningServer, user

import lily
from lily.api import Lily
from lily.server.app import create_app

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 8
MAX_SEQ = 160
GREEDY = {"temperature": 0}
# A prompt of about 70 templated tokens: nine or more prefill passes of CHUNK tokens.
LONG_PROMPT = "Please read all of this carefully: " + "one two three four five six " * 8


@pytest.fixture(scope="module")
def llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, prefill_chunk=CHUNK) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def counting(llm: Lily) -> Iterator[CountingEngine]:
    engine = llm.engine
    counter = CountingEngine(llm)
    engine.generate = counter.generate
    yield counter
    del engine.generate


class PassCounter:
    """Counts the passes (prefill chunks and decode steps) the engine submits to its device."""

    def __init__(self, llm: Lily):
        self.device = llm.engine.device
        self.inner = self.device.submit
        self.passes = 0

    def submit(self, graph: Any) -> int:
        self.passes += 1
        return self.inner(graph)


@pytest.fixture
def passes(llm: Lily) -> Iterator[PassCounter]:
    counter = PassCounter(llm)
    counter.device.submit = counter.submit
    yield counter
    del counter.device.submit


@pytest.fixture(scope="module")
def server(llm: Lily, counting: CountingEngine) -> Iterator[RunningServer]:
    with RunningServer(create_app(llm, queue_limit=4)) as running:
        yield running


def prompt_passes(llm: Lily, text: str) -> int:
    rendered = llm.chat_template.render(user(text), add_generation_prompt=True)
    return -(-len(llm.tokenizer.encode(rendered)) // CHUNK)


def raw_request(server: RunningServer, body: dict[str, Any]) -> socket.socket:
    """Sends a chat request on a bare socket, so that the test decides when the client leaves."""
    payload = json.dumps(body).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    return sock


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- cancellation --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_stops_during_its_prompt_when_its_client_leaves(
    server: RunningServer, llm: Lily, passes: PassCounter, counting: CountingEngine, stream: bool
) -> None:
    chunks = prompt_passes(llm, LONG_PROMPT)
    assert chunks >= 8
    produced = counting.tokens
    body = {"messages": user(LONG_PROMPT), "max_tokens": 40, "stream": stream, **GREEDY}
    with raw_request(server, body):
        wait_for(lambda: passes.passes >= 1, "the prompt's first pass")
    server.wait_idle()
    # The pass running when the client left and the one queued behind it may finish; no more.
    assert passes.passes <= 3 < chunks
    assert counting.tokens == produced


def test_a_non_streaming_request_stops_generating_when_its_client_leaves(
    server: RunningServer, counting: CountingEngine
) -> None:
    start = counting.tokens
    body = {"messages": user("Hi"), "max_tokens": 100, **GREEDY}
    with raw_request(server, body):
        wait_for(lambda: counting.tokens > start, "the first generated token")
    server.wait_idle()
    assert counting.tokens - start < 10, "the abandoned generation ran on"


def test_a_queued_request_whose_client_left_frees_its_slot_at_once(
    llm: Lily, counting: CountingEngine
) -> None:
    with RunningServer(create_app(llm, queue_limit=1)) as small:
        running = {"messages": user("Go"), "max_tokens": 120, "stream": True, **GREEDY}
        with raw_request(small, running):
            wait_for(lambda: small.health()["busy"], "the long stream to run")
            with raw_request(small, {"messages": user("Me next"), "max_tokens": 2}):
                wait_for(lambda: small.health()["waiting"] == 1, "the second request to queue")
            # Its client has gone: the slot is free while the long stream still runs.
            wait_for(lambda: small.health()["waiting"] == 0, "the slot to be freed", timeout=5)
            assert small.health()["busy"]
            answer: dict[str, httpx.Response] = {}
            third = threading.Thread(
                target=lambda: answer.update(
                    response=httpx.post(
                        f"{small.url}/v1/chat/completions",
                        json={"messages": user("Third"), "max_tokens": 2, **GREEDY},
                        timeout=120,
                    )
                )
            )
            third.start()
            wait_for(lambda: small.health()["waiting"] == 1, "the third request to queue")
        third.join(120)
        assert answer["response"].status_code == 200
        assert answer["response"].json()["usage"]["completion_tokens"] == 2
        small.wait_idle()


def test_requests_without_max_tokens_get_the_default_limit(llm: Lily) -> None:
    want = llm.chat.completions.create(messages=user("Hi"), max_tokens=3, **GREEDY)
    unbounded = llm.chat.completions.create(messages=user("Hi"), **GREEDY)
    assert unbounded.usage.completion_tokens > 3, "the demo should talk on for this to mean much"
    with RunningServer(create_app(llm, default_max_tokens=3)) as limited:
        answer = httpx.post(
            f"{limited.url}/v1/chat/completions",
            json={"messages": user("Hi"), **GREEDY},
            timeout=120,
        ).json()
        # A client may still ask for more than the default (within the context).
        longer = httpx.post(
            f"{limited.url}/v1/chat/completions",
            json={"messages": user("Hi"), "max_tokens": 5, **GREEDY},
            timeout=120,
        ).json()
    assert answer["usage"]["completion_tokens"] == want.usage.completion_tokens == 3
    assert answer["choices"][0]["message"]["content"] == want.choices[0].message.content
    assert answer["choices"][0]["finish_reason"] == "length"
    assert longer["usage"]["completion_tokens"] == min(5, unbounded.usage.completion_tokens)


# -- huge inputs ---------------------------------------------------------------------------------


class CountingBackend:
    """Delegates to a `tokenizers.Tokenizer`, counting the texts it is asked to encode."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.encoded = 0

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.encoded += 1
        return self.inner.encode(text, **kwargs)

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.encoded += len(texts)
        return self.inner.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def backend(llm: Lily) -> Iterator[CountingBackend]:
    tokenizer = llm.tokenizer
    counter = CountingBackend(tokenizer._backend)
    tokenizer._backend = counter
    yield counter
    tokenizer._backend = counter.inner


def test_a_prompt_is_tokenized_once(server: RunningServer, backend: CountingBackend) -> None:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": user("Hi"), "max_tokens": 1, **GREEDY},
        timeout=120,
    )
    assert response.status_code == 200
    assert backend.encoded == 1


def test_a_huge_message_is_refused_by_size_without_tokenizing(
    server: RunningServer, backend: CountingBackend
) -> None:
    huge = "many words here " * 64 * 1024  # 1 MiB: far more than MAX_SEQ tokens can spell
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": user(huge), "max_tokens": 1},
        timeout=120,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert backend.encoded == 0
    server.wait_idle()


# -- signals -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_drains_the_server_and_exits_cleanly(sig: signal.Signals) -> None:
    """The signal comes while a stream is in its long prompt and another request waits: the
    waiting one gets the JSON 503, the stream its error event and [DONE], the process rc 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)  # the lily under test: installed, or on the caller's PYTHONPATH
    env.pop("LILY_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "lily.cli", "serve", "--model", "demo", "--device", "sim",
         "--port", str(port), "--max-seq", str(MAX_SEQ), "--prefill-chunk", str(CHUNK),
         "--shutdown-grace", "1", "--log-level", "warning",
         # One request at a time, so that the second waits (abuse.py drains a batching one).
         "--parallel", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: _answers(f"{url}/health") or process.poll() is not None, "the server")
        assert process.poll() is None, process.communicate()
        stream_body = {"messages": user(LONG_PROMPT), "max_tokens": 40, "stream": True, **GREEDY}
        events: list[str] = []
        waiting: dict[str, httpx.Response] = {}

        def stream() -> None:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=stream_body, timeout=120
            ) as response:
                events.extend(line for line in response.iter_lines() if line)

        def queued() -> None:
            waiting["response"] = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": user("Hi"), "max_tokens": 2},
                timeout=120,
            )

        streaming = threading.Thread(target=stream)
        streaming.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["busy"], "the stream to run")
        queueing = threading.Thread(target=queued)
        queueing.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 1, "a waiting request")
        process.send_signal(sig)
        queueing.join(60)
        streaming.join(60)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr
    response = waiting["response"]
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert not _answers(f"{url}/health")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


# -- the abuse script ----------------------------------------------------------------------------


def test_the_abuse_script_passes_in_its_reduced_form() -> None:
    env = dict(os.environ)  # the lily under test: installed, or on the caller's PYTHONPATH
    env.pop("LILY_API_KEY", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "abuse.py"), "--quick"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "abuse: all checks passed" in result.stdout


def test_a_signal_during_a_long_prefill_pass_answers_the_running_request_in_json() -> None:
    """One prefill pass (hundreds of tokens in one chunk) lasts longer than the shutdown waits
    for connections before cancelling them (the grace plus a margin, cut to 1 s here): the
    running request still gets the JSON 503 `shutting_down` when the grace ends, not uvicorn's
    plain-text 500, and the process still waits for the engine's boundary and exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.pop("LILY_API_KEY", None)
    launcher = (
        "import sys, lily.server.routes; lily.server.routes.SHUTDOWN_MARGIN_SECONDS = 1.0; "
        "from lily.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", launcher, "serve", "--model", "demo", "--device", "sim",
         "--port", str(port), "--max-seq", "512", "--prefill-chunk", "512",
         "--shutdown-grace", "0.5", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    answer: dict[str, Any] = {}
    try:
        wait_for(lambda: _answers(f"{url}/health") or process.poll() is not None, "the server")
        assert process.poll() is None, process.communicate()
        # About 370 prompt tokens: one pass of several seconds on the sim.
        body = {"messages": user("one two three four five six " * 45), "max_tokens": 4}

        def running() -> None:
            answer["response"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

        client = threading.Thread(target=running)
        client.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["busy"], "the request to run")
        time.sleep(0.5)  # inside the pass
        process.send_signal(signal.SIGINT)
        client.join(120)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    response = answer["response"]
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"
    assert process.returncode == 0, stderr
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr


# -- slow clients --------------------------------------------------------------------------------


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_clients_are_cut_off_by_the_header_and_body_timeouts() -> None:
    """A client that sends nothing, or only part of its headers, is disconnected after
    --header-timeout (with a 408); one whose body does not come gets the JSON 408
    `request_timeout` after --body-timeout; others are served as usual."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.pop("LILY_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "lily.cli", "serve", "--model", "demo", "--device", "sim",
         "--port", str(port), "--max-seq", "96", "--header-timeout", "1", "--body-timeout", "1",
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: _answers(f"{url}/health") or process.poll() is not None, "the server")
        assert process.poll() is None, process.communicate()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        full_head = head + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        cases = {"silent": b"", "partial headers": head, "partial body": full_head + b'{"mes'}
        for name, sent in cases.items():
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(sent)
                answer = _read_all(sock)  # until the server closes the connection
            elapsed = time.monotonic() - started
            assert 0.8 < elapsed < 15, (name, elapsed)
            assert answer.startswith(b"HTTP/1.1 408 "), (name, answer)
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_timeout", (name, body)
        assert _answers(f"{url}/health")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
