"""`lily serve`: the OpenAI chat-completions API over HTTP, on one engine.

Routes: `POST /v1/chat/completions` (JSON, or server-sent events ending in `data: [DONE]`),
`GET /v1/models`, `GET /v1/models/{model}`, `GET /health`, and `GET /openapi.json` describing them.

The engine runs one generation at a time and is not thread-safe, so one worker thread owns it and
takes requests from a bounded first-in first-out queue: requests never interleave, a full queue
answers 503 with `Retry-After`, a streaming client that goes away has its generation closed
(the facade stops within one token) and the worker moves on to the next request. The HTTP side is
Starlette on uvicorn; it only parses, checks and relays.

Every failure a client can cause is an OpenAI error object,
`{"error": {"message", "type", "param", "code"}}`, with the status the `openai` SDK expects:
400 bad request, 401 missing or wrong API key, 404 unknown model or route, 413 body over the limit,
415 a POST that is not JSON, 422 well-formed JSON whose fields have the wrong type or range,
503 queue full. Anything else is a 500 whose body says nothing about the server's internals (the
log has the traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lily.api_key import bearer_key_matches, resolve_api_key
from lily.chat import parse_request
from lily.errors import ChatTemplateLimitError, RequestError
from lily.http_guard import GuardPolicy, HTTPGuard, bound_host_names
from lily.openapi import CHAT_REQUEST_SCHEMA, json_type_name, openapi_document, validate

if TYPE_CHECKING:
    from lily.api import Lily

logger = logging.getLogger("lily.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Requests allowed to wait while one runs. A full queue answers 503 instead of growing unbounded.
DEFAULT_QUEUE_LIMIT = 64
# Largest request body accepted (413 above): far more text than any context holds, small enough
# that a hostile client cannot make the server buffer gigabytes.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# What a 503 tells clients to wait before retrying (the openai SDK honours it).
RETRY_AFTER_SECONDS = 1


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


def _as_api_error(exc: BaseException) -> APIError:
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


def parse_chat_request(body: bytes) -> dict[str, Any]:
    """The request's fields, checked for JSON shape and types; null fields are dropped (they
    mean "the default" in the OpenAI API)."""
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
    _check_text_is_unicode(document)
    request = {name: value for name, value in document.items() if value is not None}
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


# --- The engine worker ------------------------------------------------------------------------

_DONE = object()


@dataclass
class Job:
    """One request for the worker. Its results go back to the event loop through `events`:
    a ChatCompletion, ChatCompletionChunks then `_DONE`, or an exception."""

    params: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set when the client has gone: a queued job is skipped, a running stream is closed.
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has shut down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> Any:
        return await self.events.get()


class QueueFullError(Exception):
    pass


class EngineWorker:
    """The one thread that touches the engine: runs jobs one at a time, in arrival order."""

    def __init__(self, llm: Lily, queue_limit: int):
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be at least 1, got {queue_limit}")
        self.llm = llm
        self.queue_limit = queue_limit
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_limit)
        self._running: Job | None = None
        self._stopping = False
        self.completed = 0
        self._thread = threading.Thread(target=self._serve, name="lily-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise QueueFullError("the server is shutting down")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError(
                f"the server is busy: {self.queue_limit} request(s) already waiting"
            ) from None

    def stop(self, timeout: float = 10.0) -> None:
        """Refuses new jobs, fails the waiting ones, stops the running one, joins the thread."""
        self._stopping = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(QueueFullError("the server is shutting down"))
        if self._running is not None:
            self._running.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            self._running = job
            try:
                self._run(job)
            finally:
                self._running = None
                self.completed += 1

    def _run(self, job: Job) -> None:
        try:
            result = self.llm.chat.completions.create(**job.params)
            if not job.params.get("stream"):
                job.emit(result)
                return
            try:
                for chunk in result:
                    if job.cancelled.is_set():
                        break
                    job.emit(chunk)
            finally:
                # Stops the generation within one token and releases the engine.
                result.close()
            job.emit(_DONE)
        except Exception as exc:  # the request fails; the worker and the engine go on
            job.emit(exc)


# --- HTTP -------------------------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def _first_event_or_disconnect(request: Request, job: Job) -> Any:
    """The job's first event; if the client disconnects first, cancels the job and raises
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
            job.cancelled.set()
    if gone or not event.done() or event.cancelled():
        raise ClientGone
    return event.result()


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class Server:
    """The routes, bound to one loaded model and its worker."""

    def __init__(self, llm: Lily, *, api_key: str | None, queue_limit: int, max_body_bytes: int):
        self.llm = llm
        self.model_id: str = llm.model_id
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.worker = EngineWorker(llm, queue_limit)
        self.started = int(time.time())

    def _check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        # Starlette decodes header values as Latin-1: encoding back gives the bytes sent.
        authorization = request.headers.get("authorization", "").encode("latin-1")
        if not bearer_key_matches(authorization, self.api_key):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    async def chat_completions(self, request: Request) -> Response:
        self._check_api_key(request)
        params = parse_chat_request(await _read_body(request, self.max_body_bytes))
        # The facade's own checks, run here too so that a bad request is refused at once
        # instead of after waiting its turn (the prompt's length is checked on the worker).
        parse_request(
            params,
            served_model=self.model_id,
            default_sampling=self.llm.default_sampling,
            chat_template=self.llm.chat_template,
        )
        job = Job(params, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFullError as exc:
            raise APIError(
                503,
                str(exc),
                error_type="server_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        try:
            first = await _first_event_or_disconnect(request, job)
        except ClientGone:
            # Nobody reads this answer; 499 is what nginx logs for a client that left.
            return Response(status_code=499)
        if isinstance(first, QueueFullError):
            raise APIError(503, str(first), error_type="server_error", code="shutting_down")
        if isinstance(first, BaseException):
            raise first
        if not params.get("stream"):
            return Response(first.model_dump_json(), media_type="application/json")
        return StreamingResponse(
            self._event_stream(job, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _event_stream(self, job: Job, first: Any) -> AsyncIterator[bytes]:
        """SSE lines for the chunks; when the client disconnects Starlette cancels this
        generator, and the `finally` tells the worker to close the generation."""
        try:
            event = first
            while event is not _DONE:
                if isinstance(event, BaseException):
                    # Headers are gone already: report in-band, as OpenAI does.
                    yield _sse(json.dumps(_as_api_error(event).body()))
                    return
                yield _sse(event.model_dump_json())
                event = await job.next_event()
            yield _sse("[DONE]")
        finally:
            job.cancelled.set()

    async def list_models(self, request: Request) -> Response:
        self._check_api_key(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        self._check_api_key(request)
        requested = request.path_params["model"]
        if requested != self.model_id:
            raise APIError(
                404,
                f"model {requested!r} is not served here; this server runs {self.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
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
                "waiting": self.worker.waiting,
                "queue_limit": self.worker.queue_limit,
                "completed": self.worker.completed,
            }
        )

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())


def _guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable:
    """Turns every exception of an endpoint into an OpenAI error response."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:
            return _as_api_error(exc).response()

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


def create_app(
    llm: Lily,
    *,
    api_key: str | None = None,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: Iterable[str] = (),
    cors_origins: Iterable[str] = (),
) -> Starlette:
    """The ASGI app serving `llm`. The worker thread starts and stops with the app's lifespan;
    the caller keeps ownership of `llm` (and closes it).

    Requests must name localhost, an IP address or one of `allowed_hosts` in their Host header,
    and POST JSON; pages of `cors_origins` may call it from a browser (see `lily.http_guard`)."""
    guard = GuardPolicy(allowed_hosts=allowed_hosts, cors_origins=cors_origins)
    server = Server(llm, api_key=api_key, queue_limit=queue_limit, max_body_bytes=max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.worker.stop)

    routes = [
        Route("/v1/chat/completions", _guarded(server.chat_completions), methods=["POST"]),
        Route("/v1/models", _guarded(server.list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guarded(server.get_model), methods=["GET"]),
        Route("/health", _guarded(server.health), methods=["GET"]),
        Route("/openapi.json", _guarded(server.openapi), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
        middleware=[Middleware(HTTPGuard, policy=guard)],
    )
    app.state.server = server
    return app


def serve(
    model: str | None = None,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    api_key_file: str | os.PathLike[str] | None = None,
    allowed_hosts: Iterable[str] = (),
    cors_origins: Iterable[str] = (),
    device: str = "auto",
    revision: str | None = None,
    max_seq: int | None = None,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    escape_special_tokens: bool = False,
) -> None:
    """Loads the model and serves it until interrupted (Ctrl-C).

    The API key is `api_key`, else the content of `api_key_file`, else `$LILY_API_KEY`. The Host
    header may name `host` itself besides localhost, IP addresses and `allowed_hosts`."""
    import uvicorn

    from lily.api import load

    api_key = resolve_api_key(api_key, api_key_file)
    allowed_hosts = [*allowed_hosts, *bound_host_names(host)]
    cors_origins = list(cors_origins)
    GuardPolicy(allowed_hosts=allowed_hosts, cors_origins=cors_origins)  # fails before the load
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", host)
    with load(
        model,
        revision=revision,
        device=device,
        max_seq=max_seq,
        escape_special_tokens=escape_special_tokens,
    ) as llm:
        app = create_app(
            llm,
            api_key=api_key,
            queue_limit=queue_limit,
            max_body_bytes=max_body_bytes,
            allowed_hosts=allowed_hosts,
            cors_origins=cors_origins,
        )
        logger.info("serving %s on %s at http://%s:%d/v1", llm.model_id, llm.device, host, port)
        # On Ctrl-C, streams still running get a few seconds, then are cancelled (which stops
        # their generation) instead of holding the shutdown until they finish.
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
