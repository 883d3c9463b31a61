"""The ASGI app and the HTTP server: `create_app` binds the routes of `lily.server.routes` (and
the other APIs', `lily.server.api_routes`) to one loaded model; `serve` loads the model and runs
the app on uvicorn with the header timeout and the draining shutdown described in
`lily.server.routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from lily.chat.completions import AUTO_REASONING_BUDGET
from lily.chat.request_limits import RequestLimits
from lily.engine.prefix_cache import CacheOptions
from lily.engine.speculative import DEFAULT_DRAFT_TOKENS
from lily.server.api_key import resolve_api_key
from lily.server.api_routes import api_routes
from lily.server.http_guard import GuardPolicy, HTTPGuard, bound_host_names
from lily.server.metrics import RequestMetrics
from lily.server.request_log import RequestLog
from lily.server.routes import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_HOST,
    DEFAULT_KEEPALIVE_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PARALLEL,
    DEFAULT_PORT,
    DEFAULT_QUEUE_LIMIT,
    DEFAULT_SHUTDOWN_GRACE,
    SHUTDOWN_MARGIN_SECONDS,
    APIError,
    ClientGone,
    EngineWorker,
    ModelNames,
    Server,
    as_api_error,
)

if TYPE_CHECKING:
    from lily.api import Lily

logger = logging.getLogger("lily.server")


def _guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable:
    """Turns every exception of an endpoint into an OpenAI error response."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except (ClientGone, ClientDisconnect):
            # Nobody reads this answer; 499 is what nginx logs for a client that left.
            return Response(status_code=499)
        except Exception as exc:
            return as_api_error(exc).response()

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
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    default_reasoning_budget: int | str | None = None,
    limits: RequestLimits | None = None,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
    keepalive: float | None = DEFAULT_KEEPALIVE_SECONDS,
    model_names: ModelNames | None = None,
    open_model_list: bool = True,
    open_metrics: bool = True,
) -> Starlette:
    """The ASGI app serving `llm`. The worker thread starts and stops with the app's lifespan;
    the caller keeps ownership of `llm` (and closes it). `default_max_tokens` bounds the
    completions of requests that set no `max_tokens` (None: the rest of the context);
    `default_reasoning_budget` the thinking of requests that set no `reasoning_budget`
    (`ChatCompletions.run`'s; None here, as the Python API, `"auto"` in `lily serve`).
    `limits` bounds the requests' size (default: `RequestLimits()`), `body_timeout` the
    seconds a body may take to arrive (408 after; None: no bound). The headers' timeout is the
    HTTP server's (`serve` sets uvicorn's protocol, `http_protocol`). A stream silent for
    `keepalive` seconds (a long prompt) gets a `: keep-alive` SSE comment (None: never).
    `model_names` says which `model` names requests may send (default: any, answered by the
    served model); `open_model_list` serves `GET /v1/models` without the API key,
    `open_metrics` `GET /metrics` (the app's own registry: `app.state.server.metrics`).

    Requests must name localhost, an IP address or one of `allowed_hosts` in their Host header,
    and POST JSON; pages of `cors_origins` may call it from a browser (see
    `lily.server.http_guard`)."""
    guard = GuardPolicy(allowed_hosts=allowed_hosts, cors_origins=cors_origins)
    server = Server(
        llm,
        api_key=api_key,
        queue_limit=queue_limit,
        max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens,
        default_reasoning_budget=default_reasoning_budget,
        limits=RequestLimits() if limits is None else limits,
        body_timeout=body_timeout,
        keepalive=keepalive,
        model_names=model_names,
        open_model_list=open_model_list,
        open_metrics=open_metrics,
    )

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
        Route("/ready", _guarded(server.ready), methods=["GET"]),
        Route("/metrics", _guarded(server.prometheus_metrics), methods=["GET"]),
        Route("/openapi.json", _guarded(server.openapi), methods=["GET"]),
    ]
    # The other APIs (Anthropic Messages, OpenAI Responses, legacy completions), each
    # translated onto the chat path's request model.
    routes += api_routes(server)
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
        # The request log and the metrics outside the guard: refused requests are logged,
        # carry an id and are counted too.
        middleware=[
            Middleware(RequestLog),
            Middleware(RequestMetrics, metrics=server.metrics, routes=routes),
            Middleware(HTTPGuard, policy=guard),
        ],
    )
    app.state.server = server
    return app


_HEADER_TIMEOUT_BODY = json.dumps(
    APIError(408, "the request headers did not arrive in time", code="request_timeout").body()
).encode()


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers take longer than
    `header_timeout` seconds to arrive: from the connection, or from the first byte of the next
    request on a kept-alive one (an idle kept-alive connection is uvicorn's own
    `timeout_keep_alive`). uvicorn bounds neither, so a silent client held its socket for ever."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._arm_header_timer()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            # Nothing of a response went out on this request yet: say why before closing.
            head = (
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_HEADER_TIMEOUT_BODY)
            )
            self.transport.write(head + _HEADER_TIMEOUT_BODY)
        self.transport.close()


def http_protocol(header_timeout: float | None) -> type[asyncio.Protocol]:
    """The uvicorn HTTP protocol class (`uvicorn.Config(http=...)`) with this header timeout
    (None: uvicorn's own, unbounded)."""
    if header_timeout is None:
        return H11Protocol
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be positive, got {header_timeout}")
    return type(
        "HeaderTimeoutProtocol", (_HeaderTimeoutProtocol,), {"header_timeout": header_timeout}
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn, draining the engine worker as soon as the shutdown starts: uvicorn alone would
    wait for the connections and then cancel them, answering plain-text 500s."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, grace: float):
        super().__init__(config)
        self.worker = worker
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stopping = asyncio.ensure_future(asyncio.to_thread(self.worker.stop, self.grace))
        await super().shutdown(sockets)
        await stopping


class PortInUseError(OSError):
    """`lily serve` cannot listen where it was asked to."""


def check_port_free(host: str, port: int) -> None:
    """Raises PortInUseError when nothing could listen on `host`:`port` now (bound as uvicorn
    binds, with SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            raise PortInUseError(f"cannot listen on {host}:{port}: {why}") from None


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
    prefill_chunk: int | None = None,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    default_reasoning_budget: int | str | None = AUTO_REASONING_BUDGET,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    log_level: str = "info",
    escape_special_tokens: bool = False,
    speculative: str = "auto",
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    cache: CacheOptions | None = None,
    limits: RequestLimits | None = None,
    kv_cache: str = "bf16",
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
    model_names: ModelNames | None = None,
    open_model_list: bool = True,
    open_metrics: bool = True,
    fetch_images: bool = False,
    parallel: int = DEFAULT_PARALLEL,
) -> None:
    """Loads the model and serves it until SIGINT (Ctrl-C) or SIGTERM. Either drains: no new
    connections, waiting requests get 503 `shutting_down`, the running one gets
    `shutdown_grace` seconds, then stops (a stream ends with an error event and `[DONE]`), and
    the function returns. Call it from the main thread (signals are only delivered there).

    The API key is `api_key`, else the content of `api_key_file`, else `$LILY_API_KEY`. The Host
    header may name `host` itself besides localhost, IP addresses and `allowed_hosts`.
    `cache` sizes the prefix cache, in memory and on disk (`lily.load`'s cache arguments);
    `speculative`, `draft_tokens`, `kv_cache`, `fetch_images` and `parallel` are `lily.load`'s
    (with `fetch_images`, the server fetches any http(s) address a client's image part names;
    `parallel` requests decode at once, `Lily.parallel` as memory allows).
    `limits` bounds the requests' size (`lily.chat.request_limits`); a client gets `header_timeout`
    seconds to send a request's headers and `body_timeout` more for its body (408 after).
    `model_names`, `open_model_list` and `open_metrics` are `create_app`'s."""
    from lily.api import load

    check_port_free(host, port)  # before the load, which can take minutes
    api_key = resolve_api_key(api_key, api_key_file)
    allowed_hosts = [*allowed_hosts, *bound_host_names(host)]
    cors_origins = list(cors_origins)
    GuardPolicy(allowed_hosts=allowed_hosts, cors_origins=cors_origins)  # fails before the load
    protocol = http_protocol(header_timeout)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", host)
    with load(
        model,
        revision=revision,
        device=device,
        max_seq=max_seq,
        prefill_chunk=prefill_chunk,
        escape_special_tokens=escape_special_tokens,
        speculative=speculative,
        draft_tokens=draft_tokens,
        kv_cache=kv_cache,
        fetch_images=fetch_images,
        parallel=parallel,
        **vars(cache or CacheOptions()),
    ) as llm:
        app = create_app(
            llm,
            api_key=api_key,
            queue_limit=queue_limit,
            max_body_bytes=max_body_bytes,
            allowed_hosts=allowed_hosts,
            cors_origins=cors_origins,
            default_max_tokens=default_max_tokens,
            default_reasoning_budget=default_reasoning_budget,
            limits=limits,
            body_timeout=body_timeout,
            model_names=model_names,
            open_model_list=open_model_list,
            open_metrics=open_metrics,
        )
        worker = app.state.server.worker
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,  # the request log (lily.server.request_log) replaces uvicorn's
            http=protocol,
            timeout_graceful_shutdown=shutdown_grace + SHUTDOWN_MARGIN_SECONDS,
        )
        logger.info("serving %s on %s at http://%s:%d/v1", llm.model_id, llm.device, host, port)
        # uvicorn re-raises the signal that stopped it once it has shut down: SIGTERM then
        # raises KeyboardInterrupt as SIGINT does, so both end here and the process exits 0.
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            _DrainingServer(config, worker, shutdown_grace).run()
        except KeyboardInterrupt:
            logger.info("stopped")
        finally:
            signal.signal(signal.SIGTERM, previous)
            # Also after a forced exit (a second Ctrl-C skips the drain): the engine thread
            # must stop at a boundary before the engine is freed, not die inside native code.
            worker.stop()
