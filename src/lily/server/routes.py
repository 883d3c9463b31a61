"""`lily serve`: the OpenAI chat-completions API over HTTP, on one engine.

Routes: `POST /v1/chat/completions` (JSON, or server-sent events ending in `data: [DONE]`),
`GET /v1/models`, `GET /v1/models/{model}`, `GET /health` (liveness), `GET /ready` (readiness:
503 when a request would not be taken now), `GET /metrics` (Prometheus, `lily.server.metrics`),
and `GET /openapi.json` describing them.
The legacy completions, Anthropic Messages and OpenAI Responses APIs are translations onto the
same request model, served by `lily.server.api_routes` through `Server.run_job`.

Requests are taken from a bounded first-in first-out queue by `Lily.parallel` worker threads:
one, on an engine that runs one generation at a time, or one per batched slot, whose
generations `lily.engine.scheduler` decodes together (continuous batching). A full queue
answers 503 with `Retry-After`, a client that goes away (streaming or not) has its request
dropped from the queue or its generation stopped at the next prefill chunk or token, and the
worker moves on to the next request. On SIGINT/SIGTERM `serve` drains: waiting requests get a
503, the running ones a grace, then a final error event. The HTTP side is Starlette on uvicorn;
it only parses, checks and relays.

Every failure a client can cause is an OpenAI error object,
`{"error": {"message", "type", "param", "code"}}`, with the status the `openai` SDK expects:
400 bad request (a field of the wrong type or range, and a request over the server's size
bounds, `lily.chat.request_limits`, too), 401 missing or wrong API key, 404 unknown model or route,
408 request headers or body not received in time, 413 body over the limit, 415 a POST that is
not JSON, 503 queue full or shutting down. Anything else is a 500 whose body
says nothing about the server's internals (the log has the traceback).

Nothing whose cost grows with the request runs on the event loop: the body is parsed, checked
and its output grammar compiled in a thread (llguidance releases the GIL while it compiles), so
`/health` and the streams being served keep flowing; the grammar's size is bounded before it is
compiled (`RequestLimits.max_grammar_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lily.chat.completions import ChatCompletions, ChatRequest, GenerationStats, parse_request
from lily.chat.request_limits import RequestLimits
from lily.errors import ChatTemplateLimitError, GenerationCancelled, RequestError
from lily.server.api_key import bearer_key_matches
from lily.server.metrics import ServerMetrics
from lily.server.openapi import CHAT_REQUEST_SCHEMA, json_type_name, openapi_document, validate

if TYPE_CHECKING:
    from lily.api import Lily

logger = logging.getLogger("lily.server")
T = TypeVar("T")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Requests allowed to wait while others run. A full queue answers 503 instead of growing unbounded.
DEFAULT_QUEUE_LIMIT = 64
# Requests `lily serve` decodes at once (continuous batching), as memory allows.
DEFAULT_PARALLEL = 4
# Largest request body accepted (413 above): far more text than any context holds, small enough
# that a hostile client cannot make the server buffer gigabytes.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# What a 503 tells clients to wait before retrying (the openai SDK honours it).
RETRY_AFTER_SECONDS = 1
# The longest completion of a request that sets no `max_tokens` (LangChain and litellm send
# none): room for a long reasoned answer, while a forgotten client cannot hold the engine for
# a whole 32k context.
DEFAULT_MAX_TOKENS = 8192
# A stream that has sent nothing for this long (a long prompt being prefilled) gets an SSE
# comment, `: keep-alive`, so that proxies and clients with idle timeouts keep the connection.
DEFAULT_KEEPALIVE_SECONDS = 15.0
# On SIGINT/SIGTERM, how long the running request may go on before it is interrupted.
DEFAULT_SHUTDOWN_GRACE = 5.0
# After the grace: time for the last answers to be written, before uvicorn cancels whatever is
# left (the running request is answered when the grace ends; the engine stops at its next chunk
# or token boundary, however long its pass takes).
SHUTDOWN_MARGIN_SECONDS = 10.0
# The most seconds a client may take to send a request's headers (from the connection, or from
# the first byte of a later request on a kept-alive connection), and then its body: a slow or
# silent client must not hold a connection (and its memory) for ever.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
# Requests whose body is parsed, rendered and tokenized at once, off the event loop (the engine's
# worker tokenizes nothing costly): tokenizing a 7 MB body takes about 1 GiB for a while, so
# without a bound a few concurrent ones took the server from 158 MiB to 3.5 GiB. More wait their
# turn (up to the queue limit; beyond, 503 queue_full).
PREPARE_CONCURRENCY = 2


# --- Errors ---------------------------------------------------------------------------------


class APIError(Exception):
    """An error the server answers with an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def from_request_error(cls, error: RequestError) -> APIError:
        return cls(
            error.status,
            error.message,
            error_type=error.error_type,
            param=error.param,
            code=error.code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _internal_error() -> APIError:
    return APIError(
        500,
        "the server failed while handling this request; it is still serving, see its log",
        error_type="server_error",
        code="internal_error",
    )


def as_api_error(exc: BaseException) -> APIError:
    """The answer for an exception raised while serving a request: request errors keep their
    status and names; anything else is logged and becomes an opaque 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError.from_request_error(exc)
    if isinstance(exc, ChatTemplateLimitError):
        # The checkpoint's template, not the request, is at fault: a server error, named.
        logger.error("chat template over its limits: %s", exc)
        return APIError(500, str(exc), error_type="server_error", code="chat_template_limit")
    logger.error("request failed", exc_info=exc)
    return _internal_error()


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _check_text_is_unicode(document: Any) -> None:
    """JSON allows lone surrogates (\\ud800) that no tokenizer can encode; refuse them here.
    Iterative so that a deeply nested body cannot exhaust the stack."""
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "the body contains text that is not valid Unicode") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_chat_request(body: bytes, limits: RequestLimits | None = None) -> dict[str, Any]:
    """The request's fields, checked for JSON shape and types; null fields are dropped (they
    mean "the default" in the OpenAI API). With `limits`, too many messages, tools or tool
    calls are refused before the fields are checked."""
    request = parse_json_body(body, limits)
    for name, schema in CHAT_REQUEST_SCHEMA["properties"].items():
        if name not in request:
            continue
        value = request[name]
        # JSON has one number type: 2.0 is as much an integer as 2 (JSON Schema agrees).
        if "integer" in schema.get("type", ()) and isinstance(value, float) and value.is_integer():
            value = request[name] = int(value)
        validate(value, schema, name)
    if "messages" not in request:
        raise APIError(400, "messages is required", param="messages", code="missing_required")
    return request


def parse_json_body(body: bytes, limits: RequestLimits | None = None) -> dict[str, Any]:
    """A request body's JSON object, its text checked to be valid Unicode; null fields are
    dropped (they mean "the default"). With `limits`, too many messages, tools, tool calls or
    JSON values are refused."""
    try:
        document = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise APIError(400, f"the body is not valid JSON: {message}", code="invalid_json") from None
    if not isinstance(document, dict):
        raise APIError(
            400,
            f"the body must be a JSON object, got {json_type_name(document)}",
            code="invalid_json",
        )
    if limits is not None:
        limits.check_shape(document)
        limits.check_values(document)
    _check_text_is_unicode(document)
    return {name: value for name, value in document.items() if value is not None}


@dataclass(frozen=True)
class ModelNames:
    """Which `model` names a request may send. Clients and SDK examples send fixed ids
    (`gpt-4o`, `claude-...`), so by default any name is answered by the served model, as
    llama-server does; `strict` answers 404 to names that are neither the served id nor one of
    `aliases` (which `GET /v1/models` lists beside it)."""

    aliases: tuple[str, ...] = ()
    strict: bool = False

    def accepts(self, name: str) -> bool:
        """Whether a request naming `name` is answered by the served model (its own id is
        checked by the request's validation)."""
        return not self.strict or name in self.aliases


# --- The engine worker ------------------------------------------------------------------------

_DONE = object()
# Stands for a keep-alive in a job's events (`Job.events_after`).
KEEPALIVE = object()
# What a stream sends for one: an SSE comment, which clients ignore.
KEEPALIVE_COMMENT = b": keep-alive\n\n"
# The least time between two progress reports of one prompt (in the log and the stream): the
# engine reports after every command buffer, dozens a second on a fast GPU.
PROGRESS_INTERVAL_SECONDS = 1.0


@dataclass(frozen=True)
class PromptProgress:
    """How far the engine has fed a stream's prompt: sent as an SSE comment, which clients
    ignore and a person or a proxy watching the stream can read."""

    fed: int
    total: int

    @property
    def comment(self) -> bytes:
        return f": prompt {self.fed}/{self.total} tokens\n\n".encode()


class _ProgressReport:
    """The `progress` callback of a job: once its prompt has taken PROGRESS_INTERVAL_SECONDS,
    logs how far it is fed and, for a stream, sends it to the client, at most every
    PROGRESS_INTERVAL_SECONDS, and when it is done. A prompt fed faster reports nothing."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.last = time.monotonic()
        self.reported = False

    def __call__(self, fed: int, total: int) -> None:
        now = time.monotonic()
        due = now - self.last >= PROGRESS_INTERVAL_SECONDS
        if not (due or (fed >= total and self.reported)):
            return
        self.last, self.reported = now, True
        logger.info("id=%s prompt: %d/%d tokens fed", self.job.request_id, fed, total)
        if self.job.request.stream:
            self.job.emit(PromptProgress(fed, total))


@dataclass(eq=False)  # a job is itself: the worker keeps the running ones in a set
class Job:
    """One request for the worker. Its results go back to the event loop through `events`:
    a ChatCompletion, ChatCompletionChunks then `_DONE`, or an exception."""

    request: ChatRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set when the client has gone: the generation stops at its next prefill chunk or token.
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set by the worker once the generation has ended, before its last event (the request log).
    stats: GenerationStats | None = None
    # The request log's id for the request, which the progress lines in the log name.
    request_id: str = ""
    # When it was made, just before joining the queue: the start of its time to first token.
    queued_at: float = field(default_factory=time.perf_counter)

    def emit(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has shut down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> Any:
        return await self.events.get()

    async def events_after(self, first: Any, keepalive: float | None) -> AsyncIterator[Any]:
        """`first`, then the job's events up to `_DONE` (not included) or an exception; after
        every `keepalive` seconds without an event, `KEEPALIVE` instead."""
        yield first
        if isinstance(first, BaseException):
            return
        pending = asyncio.ensure_future(self.next_event())
        try:
            while True:
                # asyncio.wait, unlike wait_for, never cancels the get: no event is lost.
                done, _ = await asyncio.wait({pending}, timeout=keepalive)
                if not done:
                    yield KEEPALIVE
                    continue
                event = pending.result()
                if event is _DONE:
                    return
                yield event
                if isinstance(event, BaseException):
                    return
                pending = asyncio.ensure_future(self.next_event())
        finally:
            pending.cancel()


class QueueFullError(Exception):
    pass


class ShuttingDownError(Exception):
    """The server is stopping: the request was refused, or interrupted after the grace."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry against its next run")


class BoundedWork:
    """Costly work for requests, run in threads at most `concurrency` at a time with at most
    `waiting` more waiting their turn; beyond, QueueFullError. A slot is freed when its work
    ends, even when the request that asked for it is gone."""

    def __init__(self, concurrency: int, waiting: int) -> None:
        self.concurrency = concurrency
        self.waiting = waiting
        self._slots = asyncio.Semaphore(concurrency)
        self._admitted = 0  # running or waiting

    @property
    def full(self) -> bool:
        """Whether `run` would refuse work now."""
        return self._admitted >= self.concurrency + self.waiting

    async def run(self, work: Callable[[], T]) -> T:
        if self.full:
            raise QueueFullError(
                f"the server is busy: {self.waiting} request(s) already waiting to be prepared"
            )
        self._admitted += 1
        try:
            await self._slots.acquire()
        except BaseException:
            self._admitted -= 1
            raise
        loop = asyncio.get_running_loop()

        def in_thread() -> T:
            try:
                return work()
            finally:
                loop.call_soon_threadsafe(self._release)

        return await asyncio.to_thread(in_thread)

    def _release(self) -> None:
        self._admitted -= 1
        self._slots.release()


class EngineWorker:
    """The threads that run jobs on the engine, in arrival order: one, or as many as the model
    decodes at once (`Lily.parallel`, continuous batching in `lily.engine.scheduler`).
    `generation_ended(stats, seconds)` is told of each generation when it ends (finished,
    stopped or cancelled), `seconds` after its job was queued; it runs on the job's thread."""

    def __init__(
        self,
        llm: Lily,
        queue_limit: int,
        *,
        default_max_tokens: int | None = None,
        default_reasoning_budget: int | str | None = None,
        generation_ended: Callable[[GenerationStats, float], None] | None = None,
    ):
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be at least 1, got {queue_limit}")
        self.llm = llm
        self.queue_limit = queue_limit
        self.default_max_tokens = default_max_tokens
        self.default_reasoning_budget = default_reasoning_budget
        self.generation_ended = generation_ended
        self._waiting: deque[Job] = deque()
        self._changed = threading.Condition()
        self._running: set[Job] = set()
        self._stopping = False
        # Set once the shutdown grace is over: the running generations stop at their next chunk
        # or token (never inside native code, which would abort the process).
        self._interrupted = False
        self.completed = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"lily-engine-{i}", daemon=True)
            for i in range(llm.parallel)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs being answered now."""
        return len(self._running)

    @property
    def started(self) -> bool:
        """Whether the threads have been started (the app's lifespan starts them)."""
        return self._threads[0].ident is not None

    @property
    def stopping(self) -> bool:
        """Whether `stop` has been called: no job is accepted any more."""
        return self._stopping

    @property
    def full(self) -> bool:
        """Whether `submit` would refuse a job for want of room in the queue."""
        return len(self._waiting) >= self.queue_limit

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def submit(self, job: Job) -> None:
        with self._changed:
            if self._stopping:
                raise ShuttingDownError
            if self.full:
                raise QueueFullError(
                    f"the server is busy: {self.queue_limit} request(s) already waiting"
                )
            self._waiting.append(job)
            self._changed.notify()

    def withdraw(self, job: Job) -> None:
        """The job's client has gone: a waiting job leaves the queue (its slot is free at
        once), a running one stops at its next prefill chunk or token."""
        with self._changed:
            job.cancelled.set()
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)

    def stop(self, grace: float = 0.0) -> None:
        """Refuses new jobs, answers the waiting ones ShuttingDownError, lets the running ones
        go on for `grace` seconds, then interrupts them and waits for the threads to end (at
        their next chunk or token boundary). Safe to call more than once, from any thread."""
        with self._changed:
            self._stopping = True
            refused = list(self._waiting)
            self._waiting.clear()
            self._changed.notify_all()
        for job in refused:
            job.emit(ShuttingDownError())
        alive = [thread for thread in self._threads if thread.is_alive()]
        if not alive:
            return
        deadline = time.monotonic() + grace
        for thread in alive:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._interrupted = True
        with self._changed:
            running = list(self._running)
        for job in running:
            # Answered now, with the JSON 503 (or a stream's error event): the engine may be
            # inside a long prefill pass, longer than the server waits before cancelling the
            # connections. The worker stops at its next boundary; what it still emits is
            # read by nobody.
            job.emit(ShuttingDownError())
        for thread in alive:
            thread.join()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return  # `stop` answers the jobs still waiting
                job = self._waiting.popleft()
                self._running.add(job)
            try:
                self._run(job)
            finally:
                with self._changed:
                    self._running.discard(job)
                    self.completed += 1

    def _run(self, job: Job) -> None:
        def should_stop() -> bool:
            return job.cancelled.is_set() or self._interrupted

        # Its own, for the stats of its own generation.
        completions = ChatCompletions(self.llm)
        try:
            request = dataclasses.replace(job.request, progress=_ProgressReport(job))
            result = completions.run(
                request,
                default_max_tokens=self.default_max_tokens,
                default_reasoning_budget=self.default_reasoning_budget,
                should_stop=should_stop,
            )
            if not job.request.stream:
                job.stats = self._report_generation(job, completions)
                job.emit(result)
                return
            try:
                for chunk in result:
                    job.emit(chunk)
            finally:
                result.close()
            job.stats = self._report_generation(job, completions)
            job.emit(_DONE)
        except GenerationCancelled:
            self._report_generation(job, completions)
            if not job.cancelled.is_set():  # the shutdown, not the client, stopped it
                job.emit(ShuttingDownError())
        except Exception as exc:  # the request fails; the worker and the engine go on
            self._report_generation(job, completions)
            job.emit(exc)

    def _report_generation(self, job: Job, completions: ChatCompletions) -> GenerationStats | None:
        """The stats of the job's generation, if one ran, told to `generation_ended`: before
        the job's last event, so that a client reading the metrics after its answer sees it
        counted; also for a cancelled or failed generation, whose tokens the engine did make."""
        stats = completions.last_stats
        if stats is not None and self.generation_ended is not None:
            self.generation_ended(stats, time.perf_counter() - job.queued_at)
        return stats


# --- HTTP -------------------------------------------------------------------------------------


async def _read_body(request: Request, limit: int, timeout: float | None) -> bytes:
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def _first_event_or_disconnect(request: Request, job: Job, worker: EngineWorker) -> Any:
    """The job's first event; if the client disconnects first, withdraws the job and raises
    ClientGone."""
    event = asyncio.ensure_future(job.next_event())
    disconnect = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({event, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = disconnect.done()
        disconnect.cancel()
        if gone or not event.done():
            # Also when both finished at once: the disconnect message is consumed, so nobody
            # else would notice that the client has left.
            event.cancel()
            worker.withdraw(job)
    if gone or not event.done() or event.cancelled():
        raise ClientGone
    return event.result()


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def _queue_full(exc: QueueFullError) -> APIError:
    return APIError(
        503,
        str(exc),
        error_type="server_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def _shutting_down() -> APIError:
    return APIError(
        503,
        str(ShuttingDownError()),
        error_type="server_error",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


class Server:
    """The routes, bound to one loaded model and its worker."""

    def __init__(
        self,
        llm: Lily,
        *,
        api_key: str | None,
        queue_limit: int,
        max_body_bytes: int,
        default_max_tokens: int | None,
        limits: RequestLimits,
        default_reasoning_budget: int | str | None = None,
        body_timeout: float | None,
        keepalive: float | None = DEFAULT_KEEPALIVE_SECONDS,
        model_names: ModelNames | None = None,
        open_model_list: bool = True,
        open_metrics: bool = True,
    ):
        self.llm = llm
        self.model_id: str = llm.model_id
        self.model_names = model_names or ModelNames()
        self.open_model_list = open_model_list
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.body_timeout = body_timeout
        self.keepalive = keepalive
        self.open_metrics = open_metrics
        self.metrics = ServerMetrics(
            waiting=lambda: self.worker.waiting,
            active=lambda: self.worker.running,
            queue_limit=queue_limit,
        )
        self.worker = EngineWorker(
            llm,
            queue_limit,
            default_max_tokens=default_max_tokens,
            default_reasoning_budget=default_reasoning_budget,
            generation_ended=self.metrics.generation_ended,
        )
        self.preparing = BoundedWork(PREPARE_CONCURRENCY, queue_limit)
        self.started = int(time.time())

    def _check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        # Starlette decodes header values as Latin-1: encoding back gives the bytes sent.
        authorization = request.headers.get("authorization", "").encode("latin-1")
        # The anthropic SDK sends the key as `x-api-key: KEY` instead.
        x_api_key = request.headers.get("x-api-key")
        if x_api_key is not None and not authorization:
            authorization = b"Bearer " + x_api_key.encode("latin-1")
        if not bearer_key_matches(authorization, self.api_key):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'",
                code="invalid_api_key",
            )

    async def prepare(self, work: Callable[[], T]) -> T:
        """`work` (parsing, rendering, tokenizing a request) in a thread, within the bound on
        such work running at once (`PREPARE_CONCURRENCY`): 503 queue_full beyond it."""
        try:
            return await self.preparing.run(work)
        except QueueFullError as exc:
            raise _queue_full(exc) from None

    async def run_job(self, request: Request, checked: ChatRequest) -> tuple[Job, Any]:
        """Queues a checked request for the engine and waits for its first event (a
        ChatCompletion, or a stream's first chunk): what the other APIs
        (`lily.server.api_routes`) translate. Raises APIError when the queue is full or the server
        is stopping, the request's own failure, or ClientGone."""
        job = Job(
            checked,
            asyncio.get_running_loop(),
            request_id=getattr(request.state, "request_id", ""),
        )
        request.state.generation = job  # its stats go into the request's log line
        try:
            self.worker.submit(job)
        except ShuttingDownError:
            raise _shutting_down() from None
        except QueueFullError as exc:
            raise _queue_full(exc) from None
        first = await _first_event_or_disconnect(request, job, self.worker)
        if isinstance(first, ShuttingDownError):
            raise _shutting_down()
        if isinstance(first, BaseException):
            raise first
        return job, first

    async def chat_completions(self, request: Request) -> Response:
        self._check_api_key(request)
        body = await _read_body(request, self.max_body_bytes, self.body_timeout)
        # Off the event loop, so that /health and the streams being served meanwhile do not
        # stall: parsing a body of megabytes takes tens of ms, compiling its output grammar up
        # to the bound on its size (`RequestLimits`) a good part of a second.
        checked = await self.prepare(lambda: self._checked_request(body))
        job, first = await self.run_job(request, checked)
        if not checked.stream:
            return Response(first.model_dump_json(), media_type="application/json")
        return StreamingResponse(
            self._event_stream(job, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _checked_request(self, body: bytes) -> ChatRequest:
        """The body parsed, then the facade's checks (the output grammar compiled), run here so
        that a bad request is refused at once instead of after waiting its turn (the prompt is
        rendered, sized and tokenized on the worker)."""
        params = self.resolve_model(parse_chat_request(body, limits=self.limits))
        checked = parse_request(
            params,
            served_model=self.model_id,
            default_sampling=self.llm.default_sampling,
            chat_template=self.llm.chat_template,
            limits=self.limits,
            image_access=self.llm.image_access.without_files(),
        )
        return self.llm.chat.completions.prepare(checked)

    async def _event_stream(self, job: Job, first: Any) -> AsyncIterator[bytes]:
        """SSE lines for the chunks; when the client disconnects Starlette cancels this
        generator, and the `finally` tells the worker to stop the generation."""
        try:
            async for event in job.events_after(first, self.keepalive):
                if event is KEEPALIVE:
                    yield KEEPALIVE_COMMENT
                    continue
                if isinstance(event, PromptProgress):
                    yield event.comment
                    continue
                if isinstance(event, ShuttingDownError):
                    # An orderly end the client can tell from a failure: the error, then the
                    # stream's usual last event.
                    yield _sse(json.dumps(_shutting_down().body()))
                    break
                if isinstance(event, BaseException):
                    # Headers are gone already: report in-band, as OpenAI does.
                    yield _sse(json.dumps(as_api_error(event).body()))
                    return
                yield _sse(event.model_dump_json())
            yield _sse("[DONE]")
        finally:
            self.worker.withdraw(job)

    def resolve_model(self, params: dict[str, Any]) -> dict[str, Any]:
        """The request's fields with its `model` naming the served model when the server
        accepts the name it sent (`ModelNames.accepts`); a name it refuses is left for the
        request's validation to answer 404."""
        model = params.get("model")
        if isinstance(model, str) and self.model_names.accepts(model):
            return {**params, "model": self.model_id}
        return params

    def listed_model_ids(self) -> list[str]:
        return [self.model_id, *(a for a in self.model_names.aliases if a != self.model_id)]

    async def list_models(self, request: Request) -> Response:
        if not self.open_model_list:
            self._check_api_key(request)
        cards = [self._model_card(name) for name in self.listed_model_ids()]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        if not self.open_model_list:
            self._check_api_key(request)
        requested = request.path_params["model"]
        # A lookup answers for the listed names only, even when requests may name any model.
        if requested not in self.listed_model_ids():
            raise APIError(
                404,
                f"model {requested!r} is not served here; this server runs {self.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card(requested))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "lily",
            "max_model_len": self.llm.max_seq,
        }

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_id,
                "device": self.llm.device,
                "busy": self.worker.busy,
                "running": self.worker.running,
                "parallel": self.llm.parallel,
                "waiting": self.worker.waiting,
                "queue_limit": self.worker.queue_limit,
                "completed": self.worker.completed,
            }
        )

    def unready_reason(self) -> tuple[str, str] | None:
        """Why a request sent now would not be taken (a code and a sentence), or None."""
        if self.worker.stopping:
            return "shutting_down", str(ShuttingDownError())
        if not self.worker.started:
            return "starting", "the engine's worker has not started (the app's lifespan runs it)"
        if self.worker.full:
            waiting = self.worker.queue_limit
            return "queue_full", f"{waiting} request(s) already wait for the engine"
        if self.preparing.full:
            return "queue_full", "the requests being prepared for the engine fill their queue"
        return None

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 when a request sent now would be queued for the engine, else 503
        saying why. `/health` is liveness: 200 whenever the process answers."""
        state = {"waiting": self.worker.waiting, "queue_limit": self.worker.queue_limit}
        unready = self.unready_reason()
        if unready is None:
            return JSONResponse({"status": "ready", **state})
        reason, message = unready
        return JSONResponse(
            {"status": "unavailable", "reason": reason, "message": message, **state},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    async def prometheus_metrics(self, request: Request) -> Response:
        if not self.open_metrics:
            self._check_api_key(request)
        body, content_type = self.metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())
