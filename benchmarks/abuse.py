"""Abuse test for `lily serve`: hostile and careless clients on loopback must not wedge, crash or
fool the server.

It starts `lily serve --model demo` itself (twice: each run ends by a signal) and checks:

1. a fixed-seed request gets an answer, the reference for the end;
2. many connections at once (200 by default): well-behaved requests (streaming or not), slow
   senders, a slow reader, clients that disconnect mid-request (half a body sent), mid-prompt (a
   stream during its prefill), mid-stream and while queued, bodies declared or sent over the size
   limit, malformed JSON, invalid UTF-8, a lone surrogate, a message far over the context, bytes
   that are not HTTP, a forced tool call whose parameter has a 30,000-value enum (0.5 MB of
   grammar, under the bound on JSON values), too many messages, tool calls or tools, a client that
   sends nothing and one whose body stalls. Every answer must be the documented one: no 5xx but the
   documented 503s (`queue_full`, JSON with Retry-After), and the server still running; the queue
   holds every connection, so each case reaches the engine's checks (not only the 503 path), and
   `/health`, polled throughout, answers within `--health-within` seconds (a grammar compiled on
   the event loop once froze it for 25 s);
3. the engine is idle within `--idle-within` seconds of the last client leaving;
4. memory does not grow without bound: the clients of step 2 come back `--leak-rounds` more times,
   with the same checks, and the least any of those rounds adds to what the round before left is
   under `--max-rss-leak-mib` (at 200 connections, a leak of 320 KiB per request shows there: a
   leak adds in every round, while the allocator's high-water mark moves in steps, which once
   added 84 MiB in one round and 9-34 in others); the first round, whose clients send about
   100 MiB of bodies at once, may leave up to `--max-rss-growth-mib` resident (glibc and Python
   keep such a high-water mark for reuse; measured: 250-320 MiB at 200 connections);
5. the fixed-seed request is answered exactly as before;
6. SIGTERM while requests run and wait: each gets a complete answer, a stream ending with the
   `shutting_down` error event and `data: [DONE]`, or the JSON 503; the process exits 0
   without "terminate called" or a traceback; a second server answers the fixed-seed request
   the same, then gets SIGINT under load with the same checks;
7. the on-disk prefix cache (`--cache-dir`): a server saves conversations' prefixes and stops;
   their files are broken (a FIFO, a link to a 1 GiB file, a damaged file, a forged header, a
   state relabelled as another prompt's with a fresh unkeyed checksum, a directory under a
   file's name, a stale temporary file); a new server answers every conversation exactly as the
   first did, without a 5xx, a hang, a traceback or the memory of reading the 1 GiB; then its
   directory is deleted: still answered, and the directory is made again;
8. floods of the requests that once tokenized megabytes at leisure: `--flood-clients` bodies of
   7 MB at once to `/v1/messages/count_tokens`, as a chat `prediction` (n=4) and as a
   `/v1/completions` prompt, while one ordinary chat request waits its turn: each flood is
   refused (400 `context_length_exceeded`, Anthropic's `invalid_request_error` saying so for
   count_tokens, or a documented 503) within `--flood-within` seconds,
   the ordinary request is answered, and the resident memory stays within
   `--max-flood-rss-mib` of what it was (three 7 MB count_tokens bodies once took 158 MiB to
   3.5 GiB; a prediction held the engine 70 s, a completions prompt 18-29 s);
9. one `Lily` object (the Python API, in this process) shared by threads, as a web app's worker
   pool or `asyncio.to_thread` shares it: every thread's generation, streamed or not, and every
   chat completion equal what the same call answers alone; a thread that starts a second
   generation while its own stream is open gets `EngineBusyError`, and its stream goes on.

Everything is bounded: the number of connections, each client's time, and `--time-limit` for
the whole run. `--quick` is the reduced version the test suite runs (24 connections: every kind
of client at least once).

    python benchmarks/abuse.py            # the full run (200 connections; the sim is slow)
    python benchmarks/abuse.py --quick    # about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

# Shapes of the server run: 16-token prefill chunks keep every pass short on the sim, so that a
# cancelled request frees the engine soon; a small default completion bounds forgotten clients.
MAX_SEQ = 256
PREFILL_CHUNK = 16
MAX_TOKENS_DEFAULT = 8
SHUTDOWN_GRACE = 1.0
# Read timeouts short enough that the silent and stalled clients are cut off within the run,
# long enough that a megabyte-sized body sent among 200 connections on a loaded 2-core machine
# arrives in time (4 s was not: 5 of 200 bodies got 408).
HEADER_TIMEOUT = 5.0
BODY_TIMEOUT = 15.0
BODY_LIMIT = 8 * 1024 * 1024  # the server's default --max-body-bytes
FIXED_SEED = {"temperature": 0.8, "seed": 4242, "max_tokens": 3}
LONG_PROMPT = "Listen to all of this before you answer: " + "one two three four five six " * 10
# The 5xx a client may get: documented 503 codes, always JSON.
DOCUMENTED_503_CODES = {"queue_full", "shutting_down"}


class Failure(Exception):
    """A check of the abuse test failed."""


@dataclass
class Answer:
    """What one client saw: the status (None if the server never answered), the content type,
    the body (JSON or SSE text), and how the exchange ended."""

    kind: str
    status: int | None = None
    content_type: str = ""
    body: bytes = b""
    ended: str = "answered"  # answered, left (the client hung up on purpose), dropped, refused
    events: list[str] = field(default_factory=list)

    def error_code(self) -> str | None:
        try:
            return json.loads(self.body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None


# --- a minimal HTTP/1.1 client on asyncio streams (full control over when to hang up) ------------


def _request_head(
    length: int | None, *, chunked: bool = False, path: str = "/v1/chat/completions"
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        "Connection: close",
    ]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chat_body(content: str, **fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


async def _read_head(reader: asyncio.StreamReader, answer: Answer) -> dict[str, str]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("closed before answering")
    answer.status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    answer.content_type = headers.get("content-type", "")
    return headers


async def _read_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body, piece by piece (chunked transfer, a Content-Length, or up to EOF)."""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def exchange(
    port: int,
    kind: str,
    body: bytes,
    *,
    head: bytes | None = None,
    send: Callable[[asyncio.StreamWriter, bytes], Awaitable[None]] | None = None,
    leave_after_events: int | None = None,
    leave_after_seconds: float | None = None,
    read_delay: float = 0.0,
) -> Answer:
    """One request on its own connection. `leave_after_events`: hang up after that many SSE
    events (0: once the answer has started); `leave_after_seconds`: hang up after that long
    whatever has arrived."""
    answer = Answer(kind)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        answer.ended = "refused"
        return answer
    try:
        writer.write(head if head is not None else _request_head(len(body)))
        if send is None:
            writer.write(body)
        else:
            await send(writer, body)
        await writer.drain()
        if leave_after_seconds is not None:
            try:
                await asyncio.wait_for(_read_answer(reader, answer, None, 0), leave_after_seconds)
            except TimeoutError:
                answer.ended = "left"
        else:
            await _read_answer(reader, answer, leave_after_events, read_delay)
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        answer.ended = "dropped"
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return answer


async def _read_answer(
    reader: asyncio.StreamReader, answer: Answer, leave_after_events: int | None, delay: float
) -> None:
    headers = await _read_head(reader, answer)
    if leave_after_events == 0 and answer.status == 200:
        answer.ended = "left"
        return
    pending = b""
    async for piece in _read_pieces(reader, headers):
        answer.body += piece
        if not answer.content_type.startswith("text/event-stream"):
            continue
        pending += piece
        *complete, pending = pending.split(b"\n\n")
        answer.events.extend(e.decode() for e in complete if e.strip())
        if leave_after_events is not None and len(answer.events) >= leave_after_events:
            answer.ended = "left"
            return
        if delay:
            await asyncio.sleep(delay)


async def trickle(writer: asyncio.StreamWriter, body: bytes, pieces: int, pause: float) -> None:
    step = max(1, len(body) // pieces)
    for start in range(0, len(body), step):
        writer.write(body[start : start + step])
        await writer.drain()
        await asyncio.sleep(pause)


async def stop_halfway(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(0.2)
    raise ConnectionResetError("the client hangs up mid-request")


async def oversized_chunked(writer: asyncio.StreamWriter, body: bytes) -> None:
    """A body over the limit with no Content-Length: the server must stop it while reading."""
    block = b"x" * (1024 * 1024)
    try:
        for _ in range(BODY_LIMIT // len(block) + 2):
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        pass  # the server answered 413 and closed; the answer is still to be read


# --- the server under test -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What answering the cache step's conversations may add to a server's resident memory: far
# below the 1 GiB file behind one of the broken links, which a careless reader would load.
CACHE_RSS_GROWTH_MIB = 256


class Server:
    """`lily serve --model demo` in a child process, its stderr kept in a file."""

    def __init__(self, args: argparse.Namespace, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed with the server)
        command = [
            sys.executable, "-m", "lily.cli", "serve", "--model", "demo", "--device", args.device,
            "--port", str(self.port), "--max-seq", str(MAX_SEQ),
            "--prefill-chunk", str(PREFILL_CHUNK), "--queue-limit", str(args.connections),
            "--max-tokens-default", str(MAX_TOKENS_DEFAULT),
            "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
            "--shutdown-grace", str(SHUTDOWN_GRACE), "--log-level", "warning", *extra,
        ]  # fmt: skip
        env = {name: value for name, value in os.environ.items() if name != "LILY_API_KEY"}
        self.process = subprocess.Popen(command, env=env, stderr=self.log)

    async def start(self) -> None:
        deadline = time.monotonic() + 120
        while await self.health() is None:
            if self.process.poll() is not None:
                raise Failure(f"lily serve exited with {self.process.returncode}: {self.stderr()}")
            if time.monotonic() > deadline:
                raise Failure("lily serve did not answer /health within 120 s")
            await asyncio.sleep(0.2)

    async def health(self) -> dict[str, Any] | None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return None
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = Answer("health")
            headers = await _read_head(reader, answer)
            body = b"".join([piece async for piece in _read_pieces(reader, headers)])
            return json.loads(body)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return None
        finally:
            writer.close()

    def rss_mib(self) -> float:
        """Resident memory, from `ps` (Linux and macOS alike)."""
        kib = subprocess.run(
            ["ps", "-o", "rss=", "-p", str(self.process.pid)], capture_output=True, text=True
        ).stdout
        return int(kib.strip()) / 1024

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


# --- the phases ------------------------------------------------------------------------------

FLOOD_BYTES = 7 * 1024 * 1024


def flood_requests() -> dict[str, tuple[str, bytes]]:
    """Each flood's route and body: 7 MB of text where a prompt or a prediction goes."""
    text = "lorem ipsum " * (FLOOD_BYTES // 12)
    messages = [{"role": "user", "content": text}]
    prediction = {"type": "content", "content": text}
    return {
        "count_tokens": (
            "/v1/messages/count_tokens",
            json.dumps({"model": "demo", "messages": messages}).encode(),
        ),
        "prediction": (
            "/v1/chat/completions",
            chat_body("Repeat it.", max_tokens=2, n=4, prediction=prediction),
        ),
        "completions": (
            "/v1/completions",
            json.dumps({"model": "demo", "prompt": text, "max_tokens": 2}).encode(),
        ),
    }


async def _watch_peak_memory(server: Server, peak: list[float]) -> None:
    """Keeps `peak[0]` the largest resident memory seen, every 0.1 s until cancelled."""
    while True:
        peak[0] = max(peak[0], server.rss_mib())
        await asyncio.sleep(0.1)


def _refused_as_too_long(answer: Answer) -> bool:
    """A 400 for a prompt the context cannot hold: OpenAI's `context_length_exceeded` code, or
    Anthropic's shape (`/v1/messages/count_tokens`), which has no code: an
    `invalid_request_error` whose message says the context cannot hold the prompt."""
    if answer.status != 400:
        return False
    if answer.error_code() == "context_length_exceeded":
        return True
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return error.get("type") == "invalid_request_error" and "context" in error.get("message", "")


async def floods(server: Server, args: argparse.Namespace) -> None:
    for name, (path, body) in flood_requests().items():
        before = server.rss_mib()
        peak = [before]

        watching = asyncio.ensure_future(_watch_peak_memory(server, peak))
        started = time.monotonic()
        try:
            flood = [
                exchange(
                    server.port, f"{name} flood", body, head=_request_head(len(body), path=path)
                )
                for _ in range(args.flood_clients)
            ]
            bystander = exchange(server.port, "bystander", chat_body("Hi", max_tokens=2))
            *answers, ordinary = await asyncio.gather(*flood, bystander)
        finally:
            watching.cancel()
        took = time.monotonic() - started
        growth = peak[0] - before
        outcomes = Counter(a.error_code() or a.status for a in answers)
        print(
            f"flood {name}: {len(answers)} x 7 MB answered in {took:.1f} s ({dict(outcomes)}), "
            f"resident memory +{growth:.0f} MiB at its peak, the waiting chat request "
            f"{ordinary.status}",
            flush=True,
        )
        problems = [
            f"{name} flood: {a.status} {a.body[:200]!r}"
            for a in answers
            if not _refused_as_too_long(a)
            and not (a.status == 503 and a.error_code() in DOCUMENTED_503_CODES)
            and not (a.status == 503 and b"overloaded_error" in a.body)
        ]
        if ordinary.status != 200:
            problems.append(f"{name} flood: the waiting chat request got {ordinary.status}")
        if took > args.flood_within:
            problems.append(f"{name} flood: took {took:.1f} s (> {args.flood_within})")
        if growth > args.max_flood_rss_mib:
            problems.append(f"{name} flood: +{growth:.0f} MiB (> {args.max_flood_rss_mib})")
        if problems:
            raise Failure("\n".join(problems))


async def fixed_seed_answer(server: Server) -> str:
    answer = await exchange(
        server.port, "fixed seed", chat_body("Name three colours.", **FIXED_SEED)
    )
    if answer.status != 200:
        raise Failure(f"the fixed-seed request got {answer.status}: {answer.body[:300]!r}")
    message = json.loads(answer.body)["choices"][0]["message"]
    return json.dumps([message.get("content"), message.get("reasoning_content")])


def forced_enum_call(values: int) -> bytes:
    """A forced call of a tool whose one string parameter has `values` allowed values."""
    parameters = {
        "type": "object",
        "properties": {"pick": {"type": "string", "enum": [f"v{i}" for i in range(values)]}},
        "required": ["pick"],
    }
    return chat_body(
        "Pick one",
        tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
        max_tokens=4,
    )


def many_tool_calls(count: int) -> bytes:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(count)
    ]
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "user", "content": "b"},
    ]
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


def many_tools(count: int) -> bytes:
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(count)]
    return chat_body("a", tools=tools, max_tokens=1)


def abuse_clients(port: int, connections: int) -> list[Awaitable[Answer]]:
    """`connections` clients, cycling through the kinds of abuse."""
    short = {"max_tokens": 2, "temperature": 0}

    kinds: list[Callable[[int], Awaitable[Answer]]] = [
        lambda i: exchange(port, "normal", chat_body(f"Client {i} says hi", **short)),
        lambda i: exchange(
            port, "normal stream", chat_body(f"Client {i} streams", stream=True, **short)
        ),
        lambda i: exchange(
            port,
            "slow sender",
            chat_body(f"Slow {i}", **short),
            send=lambda w, b: trickle(w, b, pieces=8, pause=0.15),
        ),
        lambda i: exchange(
            port, "left mid-request", chat_body(f"Half {i}", **short), send=stop_halfway
        ),
        lambda i: exchange(
            port,
            "left mid-prompt",
            chat_body(LONG_PROMPT, stream=True, max_tokens=40),
            leave_after_events=0,
        ),
        lambda i: exchange(
            port,
            "left mid-stream",
            chat_body(f"Stream {i}", stream=True, max_tokens=60, temperature=0),
            leave_after_events=3,
        ),
        lambda i: exchange(
            port, "left while waiting", chat_body(f"Wait {i}", max_tokens=60), leave_after_seconds=1
        ),
        lambda i: exchange(port, "no max_tokens", chat_body(f"Client {i} rambles", temperature=0)),
        lambda i: exchange(port, "declared oversized", b"", head=_request_head(BODY_LIMIT + 1)),
        lambda i: exchange(
            port, "malformed JSON", b'{"messages": [{"role": "user", "content": "a"'
        ),
        lambda i: exchange(
            port, "invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'
        ),
        lambda i: exchange(
            port,
            "lone surrogate",
            b'{"messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 1}',
        ),
        lambda i: exchange(
            port, "far over the context", chat_body("word " * 400_000, max_tokens=1)
        ),
        lambda i: exchange(port, "not HTTP", b"", head=b"\x16\x03\x01\x02\x00hello\r\n\r\n"),
        lambda i: exchange(
            port,
            "slow reader",
            chat_body(f"Read me slowly {i}", stream=True, max_tokens=4, temperature=0),
            read_delay=0.3,
        ),
        lambda i: exchange(port, "huge enum", forced_enum_call(30_000)),
        lambda i: exchange(
            port,
            "many messages",
            json.dumps({"messages": [{"role": "user", "content": "a"}] * 5000}).encode(),
        ),
        lambda i: exchange(port, "many tool calls", many_tool_calls(2000)),
        lambda i: exchange(port, "many tools", many_tools(200)),
        lambda i: exchange(port, "silent client", b"", head=b""),
        lambda i: exchange(
            port, "stalled body", b'{"messages": ', head=_request_head(100), read_delay=0
        ),
        lambda i: exchange(
            port,
            "sent oversized",
            b"",
            head=_request_head(None, chunked=True),
            send=lambda w, b: oversized_chunked(w, b),
        ),
    ]
    return [kinds[i % len(kinds)](i) for i in range(connections)]


# What each kind may be answered (besides the documented 503s, allowed to every /v1 request).
EXPECTED: dict[str, set[int | str]] = {
    "normal": {200},
    "normal stream": {200},
    "slow sender": {200},
    "left mid-request": {"dropped"},
    "left mid-prompt": {200, "left"},
    "left mid-stream": {200, "left"},
    "left while waiting": {200, "left"},
    "no max_tokens": {200},
    "declared oversized": {413},
    "malformed JSON": {400},
    "invalid UTF-8": {400},
    "lone surrogate": {400},
    "far over the context": {400},
    "not HTTP": {400, "dropped"},
    "slow reader": {200},
    "sent oversized": {413, "dropped"},
    "huge enum": {400},
    "many messages": {400},
    "many tool calls": {400},
    "many tools": {400},
    "silent client": {408, "dropped"},
    "stalled body": {408},
}
# The error code of each kind's 4xx answer, where it is one.
EXPECTED_CODES = {
    "far over the context": "context_length_exceeded",
    "huge enum": "unsupported_schema",
    "many messages": "array_above_max_length",
    "many tool calls": "array_above_max_length",
    "many tools": "array_above_max_length",
    "silent client": "request_timeout",
    "stalled body": "request_timeout",
}


def check_answer(answer: Answer, problems: list[str]) -> None:
    outcome: int | str = answer.status if answer.status is not None else answer.ended
    if answer.status is not None and answer.ended == "left":
        outcome = "left"
    if answer.status == 503:
        if answer.error_code() not in DOCUMENTED_503_CODES:
            problems.append(f"{answer.kind}: an undocumented 503 {answer.body[:200]!r}")
        elif not answer.content_type.startswith("application/json"):
            problems.append(f"{answer.kind}: a 503 that is not JSON ({answer.content_type})")
        return
    if answer.status is not None and answer.status >= 500:
        problems.append(f"{answer.kind}: {answer.status} {answer.body[:200]!r}")
        return
    if outcome not in EXPECTED[answer.kind]:
        problems.append(f"{answer.kind}: got {outcome}, expected one of {EXPECTED[answer.kind]}")
    code = EXPECTED_CODES.get(answer.kind)
    if code is not None and answer.status is not None and answer.error_code() != code:
        problems.append(f"{answer.kind}: not {code}: {answer.body[:200]!r}")
    if answer.kind == "no max_tokens" and answer.status == 200:
        produced = json.loads(answer.body)["usage"]["completion_tokens"]
        if produced > MAX_TOKENS_DEFAULT:
            problems.append(f"no max_tokens: {produced} tokens, over --max-tokens-default")
    streamed = answer.status == 200 and answer.content_type.startswith("text/event-stream")
    if streamed and answer.ended == "answered" and answer.events[-1:] != ["data: [DONE]"]:
        problems.append(f"{answer.kind}: a stream that did not end with [DONE]")


async def poll_health(server: Server, latencies: list[float]) -> None:
    """Asks /health every 0.1 s until cancelled, noting how long each answer took."""
    while True:
        started = time.monotonic()
        if await server.health() is not None:
            latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.1)


async def wait_idle(server: Server, within: float) -> float:
    """Seconds until /health shows the engine idle with nothing waiting; fails past `within`."""
    started = time.monotonic()
    while True:
        state = await server.health()
        if state is None:
            raise Failure("the server stopped answering /health")
        elapsed = time.monotonic() - started
        if not state["busy"] and not state["waiting"]:
            return elapsed
        if elapsed > within:
            raise Failure(
                f"the engine is still busy {elapsed:.1f} s after the last client: {state}"
            )
        await asyncio.sleep(0.05)


async def abuse(server: Server, args: argparse.Namespace) -> None:
    before = server.rss_mib()
    await abuse_round(server, args)
    after_first = server.rss_mib()
    growth = after_first - before
    print(f"abuse: resident memory grew by {growth:.0f} MiB (the high-water mark)")
    if growth > args.max_rss_growth_mib:
        raise Failure(f"resident memory grew by {growth:.0f} MiB (> {args.max_rss_growth_mib})")
    added, last = [], after_first
    for _ in range(args.leak_rounds):
        await abuse_round(server, args)
        now = server.rss_mib()
        added.append(now - last)
        last = now
    listed = ", ".join(f"{a:+.0f}" for a in added)
    print(f"abuse: the next {len(added)} rounds added {listed} MiB")
    if min(added) > args.max_rss_leak_mib:
        raise Failure(f"every round added more than {args.max_rss_leak_mib} MiB ({listed})")


async def abuse_round(server: Server, args: argparse.Namespace) -> None:
    started = time.monotonic()
    latencies: list[float] = []
    polling = asyncio.ensure_future(poll_health(server, latencies))
    try:
        answers = await asyncio.gather(*abuse_clients(server.port, args.connections))
    finally:
        polling.cancel()
    last_client_left = time.monotonic()
    print(f"abuse: {len(answers)} connections in {last_client_left - started:.1f} s", flush=True)
    slowest = max(latencies, default=0.0)
    print(f"abuse: /health answered {len(latencies)} times, the slowest in {slowest:.2f} s")
    tally = Counter(
        (a.kind, a.status if a.status is not None and a.ended != "left" else a.ended)
        for a in answers
    )
    for (kind, outcome), count in sorted(tally.items(), key=str):
        print(f"  {kind:22} {outcome!s:9} x{count}")
    problems: list[str] = []
    for answer in answers:
        check_answer(answer, problems)
    if slowest > args.health_within:
        problems.append(f"/health took {slowest:.1f} s to answer (> {args.health_within})")
    refused = sum(a.error_code() == "queue_full" for a in answers)
    if refused:
        problems.append(f"{refused} request(s) got queue_full: the queue should hold them all")
    if server.process.poll() is not None:
        problems.append(f"the server exited with {server.process.returncode}")
    if "Traceback" in server.stderr():
        problems.append(f"a traceback in the server's log:\n{server.stderr()}")
    if problems:
        raise Failure("\n".join(problems))
    idle = await wait_idle(server, args.idle_within)
    print(f"abuse: the engine was idle {idle:.2f} s after the last client left")


async def signal_under_load(server: Server, sig: signal.Signals) -> None:
    """Sends `sig` while a stream runs its prompt and other requests wait."""
    port = server.port
    clients = [
        asyncio.ensure_future(
            exchange(port, "running", chat_body(LONG_PROMPT, stream=True, max_tokens=40))
        )
    ]
    deadline = time.monotonic() + 60
    while not ((await server.health()) or {}).get("busy"):
        if time.monotonic() > deadline:
            raise Failure("the request before the signal never started")
        await asyncio.sleep(0.05)
    for i in range(3):
        clients.append(
            asyncio.ensure_future(
                exchange(port, "waiting", chat_body(f"Waiting {i}", max_tokens=2))
            )
        )
        clients.append(
            asyncio.ensure_future(
                exchange(port, "waiting stream", chat_body(f"W{i}", stream=True, max_tokens=2))
            )
        )
    while ((await server.health()) or {}).get("waiting", 0) < 1:
        if time.monotonic() > deadline:
            raise Failure("no request waited before the signal")
        await asyncio.sleep(0.05)
    server.process.send_signal(sig)
    answers = await asyncio.gather(*clients)
    problems = []
    for answer in answers:
        if answer.ended == "refused":
            continue  # connected after the listener closed
        if answer.status == 200 and answer.content_type.startswith("text/event-stream"):
            ok_end = answer.events[-1:] == ["data: [DONE]"]
            stopped = len(answer.events) >= 2 and '"shutting_down"' in answer.events[-2]
            finished = any('"finish_reason":"' in e for e in answer.events)
            if not ok_end or not (stopped or finished):
                problems.append(f"{sig.name}: {answer.kind} stream ended {answer.events[-2:]}")
        elif answer.status == 200:
            continue
        elif answer.status == 503 and answer.error_code() in DOCUMENTED_503_CODES:
            if not answer.content_type.startswith("application/json"):
                problems.append(f"{sig.name}: a 503 that is not JSON")
        else:
            problems.append(f"{sig.name}: {answer.kind} got {answer.status} {answer.ended} "
                            f"{answer.body[:200]!r}")  # fmt: skip
    try:
        code = await asyncio.to_thread(server.process.wait, 60)
    except subprocess.TimeoutExpired:
        raise Failure(f"{sig.name}: the server did not exit within 60 s") from None
    stderr = server.stderr()
    if code != 0:
        problems.append(f"{sig.name}: exit code {code}")
    for sign in ("terminate called", "Traceback"):
        if sign in stderr:
            problems.append(f"{sig.name}: {sign!r} in the server's log")
    if problems:
        raise Failure("\n".join(problems) + "\n--- server log ---\n" + stderr)
    print(f"{sig.name}: {Counter((a.kind, a.status, a.ended) for a in answers)}; exit 0")


# --- the on-disk prefix cache ------------------------------------------------------------------

CACHE_MIN_TOKENS = 16
# Conversations of one message each, of equal length: each saves one prefix file.
CACHE_CONVERSATIONS = [f"Cache case {i}: tell me about the number {i}." for i in range(1, 8)]
CACHE_FAULTS = ["fifo", "link", "damaged", "deep header", "relabelled", "directory", "intact"]


async def _cached_answer(server: Server, content: str, within: float = 120.0) -> str:
    """The fixed-seed answer to one message; fails on anything but a 200 within `within` s."""
    try:
        answer = await asyncio.wait_for(
            exchange(server.port, "cache", chat_body(content, **FIXED_SEED)), within
        )
    except TimeoutError:
        raise Failure(f"cache: no answer to {content!r} within {within:.0f} s") from None
    if answer.status != 200:
        raise Failure(f"cache: {content!r} got {answer.status} {answer.body[:300]!r}")
    return json.loads(answer.body)["choices"][0]["message"]["content"] or ""


async def _new_prefix_file(directory: str, before: set[str]) -> str:
    """The name of the file a background write adds to `directory` (waits for it)."""
    deadline = time.monotonic() + 60
    while True:
        names = os.listdir(directory) if os.path.isdir(directory) else []
        added = {n for n in names if n.endswith(".prefix")} - before
        if added:
            return max(added, key=lambda n: int(n.split("-")[0]))
        if time.monotonic() > deadline:
            raise Failure("cache: no prefix file was written within 60 s")
        await asyncio.sleep(0.1)


def _forge_prefix_file(path: str, tokens_from: str | None = None, deep_header: bool = False):
    """Rewrites a prefix file as someone who can write the directory (but not read Lily's key)
    could: its tokens replaced by `tokens_from`'s, or its header by a deeply nested one, then
    sealed with a fresh unkeyed SHA-256."""
    import hashlib
    import struct

    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack_from("<Q", data, 40)
    header, payload = data[48 : 48 + length], bytearray(data[48 + length :])
    if deep_header:
        header = b"[" * 100_000 + b"]" * 100_000
    if tokens_from is not None:
        with open(tokens_from, "rb") as f:
            other = f.read()
        (other_length,) = struct.unpack_from("<Q", other, 40)
        count = json.loads(header)["tokens"]
        payload[: 4 * count] = other[48 + other_length : 48 + other_length + 4 * count]
    body = struct.pack("<Q", len(header)) + header + bytes(payload)
    with open(tokens_from or path, "wb") as f:
        f.write(data[:8] + hashlib.sha256(body).digest() + body)


def _break_cache(directory: str, files: dict[str, str], scratch: str) -> None:
    """Applies each fault of CACHE_FAULTS to the file of the conversation of the same index."""
    path = {fault: os.path.join(directory, files[fault]) for fault in CACHE_FAULTS}
    os.unlink(path["fifo"])
    os.mkfifo(path["fifo"])
    large = os.path.join(scratch, "large")
    with open(large, "wb") as f:
        f.truncate(1 << 30)  # sparse
    os.unlink(path["link"])
    os.symlink(large, path["link"])
    with open(path["damaged"], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    _forge_prefix_file(path["deep header"], deep_header=True)
    # The "intact" conversation's state, planted as the "relabelled" one's.
    _forge_prefix_file(path["intact"], tokens_from=path["relabelled"])
    os.unlink(path["directory"])
    os.mkdir(path["directory"])
    with open(os.path.join(path["directory"], "inside"), "wb"):
        pass
    stale = os.path.join(directory, ".lily-deadwrite.prefix.tmp")
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    os.utime(stale, (1, 1))


async def cache_faults(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = os.path.join(scratch, "cache")
        extra = ("--cache-dir", directory, "--cache-disk-min-tokens", str(CACHE_MIN_TOKENS))
        first = Server(args, extra)
        answers, files = {}, {}
        try:
            await first.start()
            for fault, content in zip(CACHE_FAULTS, CACHE_CONVERSATIONS, strict=False):
                before = set(os.listdir(directory))
                answers[fault] = await _cached_answer(first, content)
                files[fault] = await _new_prefix_file(directory, before)
        finally:
            first.kill()
        if len({name.split("-")[0] for name in files.values()}) != 1:
            raise Failure(f"cache: the conversations' prefixes differ in length: {files}")
        _break_cache(directory, files, scratch)
        second = Server(args, extra)
        try:
            await second.start()
            before = second.rss_mib()
            for fault, content in zip(CACHE_FAULTS, CACHE_CONVERSATIONS, strict=False):
                if await _cached_answer(second, content) != answers[fault]:
                    raise Failure(f"cache: the {fault} conversation was answered differently")
            growth = second.rss_mib() - before
            if growth > CACHE_RSS_GROWTH_MIB:
                raise Failure(f"cache: resident memory grew by {growth:.0f} MiB")
            print(f"cache: every broken file cost a recompute only (+{growth:.0f} MiB)")
            if os.path.exists(os.path.join(directory, ".lily-deadwrite.prefix.tmp")):
                raise Failure("cache: a stale temporary file was kept")
            shutil.rmtree(directory)
            await _cached_answer(second, "Cache case 0: and after the directory went?")
            await _new_prefix_file(directory, set())
            print("cache: a deleted directory cost a recompute and was made again")
            if second.process.poll() is not None or "Traceback" in second.stderr():
                raise Failure(f"cache: the server failed:\n{second.stderr()}")
        finally:
            second.kill()


def threads_sharing_one_model(args: argparse.Namespace) -> None:
    """Step 8, run in a worker thread of its own."""
    from concurrent.futures import ThreadPoolExecutor

    import lily
    from lily.errors import EngineBusyError

    prompts = [f"Thread {i} says" for i in range(max(4, args.connections // 8))]

    def chat(llm: Any, prompt: str) -> str:
        reply = llm.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0
        )
        return reply.choices[0].message.content or reply.choices[0].message.reasoning_content

    def streamed(llm: Any, prompt: str) -> str:
        pieces = []
        for piece in llm.stream(prompt, 6):
            pieces.append(piece)
            time.sleep(0.002)  # let the other threads in between tokens
        return "".join(pieces)

    with lily.load("demo", device=args.device, max_seq=MAX_SEQ) as llm:
        alone = {p: (llm.generate(p, 6), chat(llm, p)) for p in prompts}
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: streamed(llm, p), prompts))
            chats = list(pool.map(lambda p: chat(llm, p), prompts))
        for prompt, text, answer in zip(prompts, texts, chats, strict=True):
            if (text, answer) != alone[prompt]:
                raise Failure(f"threads: {prompt!r} was answered differently while shared")
        stream = llm.stream(prompts[0], 6)
        first = next(stream)
        try:
            llm.generate(prompts[1], 2)
        except EngineBusyError:
            pass
        else:
            raise Failure("threads: a nested generation in the same thread was not refused")
        if first + "".join(stream) != alone[prompts[0]][0]:
            raise Failure("threads: the open stream was disturbed by the refused generation")
    print(f"threads: {len(prompts)} threads on one model, each answered as alone", flush=True)


async def run(args: argparse.Namespace) -> None:
    if args.cache_only:
        await cache_faults(args)
        return
    if args.floods_only:
        server = Server(args)
        try:
            await server.start()
            await floods(server, args)
        finally:
            server.kill()
        return
    await asyncio.to_thread(threads_sharing_one_model, args)
    first = Server(args)
    try:
        await first.start()
        reference = await fixed_seed_answer(first)
        print(f"fixed seed: {reference}", flush=True)
        await abuse(first, args)
        if await fixed_seed_answer(first) != reference:
            raise Failure("the fixed-seed request was answered differently after the abuse")
        print("fixed seed: the same answer after the abuse", flush=True)
        await floods(first, args)
        await signal_under_load(first, signal.SIGTERM)
    finally:
        first.kill()
    second = Server(args)
    try:
        await second.start()
        if await fixed_seed_answer(second) != reference:
            raise Failure("the restarted server answered the fixed-seed request differently")
        print("fixed seed: the same answer from a restarted server", flush=True)
        await signal_under_load(second, signal.SIGINT)
    finally:
        second.kill()
    await cache_faults(args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200, help="concurrent connections")
    parser.add_argument("--device", default="sim")
    parser.add_argument(
        "--idle-within", type=float, default=1.0, help="seconds after the last client leaves"
    )
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=512.0,
        help="resident memory the first round may leave (its high-water mark)",
    )
    parser.add_argument(
        "--max-rss-leak-mib",
        type=float,
        default=64.0,
        help="resident memory the least growing of the rounds after the first may add",
    )
    parser.add_argument(
        "--leak-rounds",
        type=int,
        default=2,
        help="rounds after the first, for the leak check (at least 1)",
    )
    parser.add_argument(
        "--health-within", type=float, default=5.0, help="slowest /health answer under abuse"
    )
    parser.add_argument("--time-limit", type=float, default=900.0, help="for the whole run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the test suite's reduced run: 24 connections, a 10 s idle bound (a loaded "
        "machine's sim pass can take seconds), a 300 s time limit",
    )
    parser.add_argument(
        "--cache-only", action="store_true", help="only the on-disk prefix cache's cases (7)"
    )
    parser.add_argument("--floods-only", action="store_true", help="only the floods (8)")
    parser.add_argument(
        "--flood-clients", type=int, default=8, help="concurrent 7 MB bodies in each flood"
    )
    parser.add_argument(
        "--flood-within", type=float, default=60.0, help="seconds for each flood's answers"
    )
    parser.add_argument(
        "--max-flood-rss-mib",
        type=float,
        default=512.0,
        help="resident memory a flood may add at its peak",
    )
    args = parser.parse_args()
    if args.quick:
        args.connections, args.idle_within, args.time_limit = 24, 10.0, 300.0
        args.flood_clients = 3
    try:
        asyncio.run(asyncio.wait_for(run(args), args.time_limit))
    except Failure as failure:
        print(f"abuse: FAILED\n{failure}")
        return 1
    except TimeoutError:
        print(f"abuse: FAILED: the run took more than {args.time_limit:.0f} s")
        return 1
    print("abuse: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
