"""The HTTP side of Lily's other APIs: legacy completions (`lily.server.completions_api`), Anthropic
Messages (`lily.server.anthropic_messages`) and OpenAI Responses (`lily.server.responses_api`).

Each API only translates: its request becomes the chat path's `ChatRequest` (checked by
`lily.chat.completions.parse_request`, the one validation), the engine worker runs it as it runs a
chat
completion, and the ChatCompletion or the stream of chunks it produces is translated back into
the API's own objects and events. Queueing, cancellation when the client leaves, the request
log and the shutdown drain are the chat route's (`Server.run_job`); errors keep their status
and take the API's own shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lily.server import anthropic_messages, completions_api, responses_api
from lily.server.api_translation import API, Translation
from lily.server.routes import (
    KEEPALIVE,
    KEEPALIVE_COMMENT,
    ClientGone,
    PromptProgress,
    ShuttingDownError,
    _read_body,
    _shutting_down,
    as_api_error,
    parse_json_body,
)

if TYPE_CHECKING:
    from lily.api import Lily
    from lily.chat.completions import ChatRequest
    from lily.chat.request_limits import RequestLimits
    from lily.server.routes import Job, Server


def _error_response(api: API, exc: BaseException) -> Response:
    error = as_api_error(exc)
    return JSONResponse(api.error_body(error), status_code=error.status, headers=error.headers)


async def _body(server: Server, request: Request) -> bytes:
    server._check_api_key(request)
    return await _read_body(request, server.max_body_bytes, server.body_timeout)


def _parsed(server: Server, body: bytes) -> dict[str, Any]:
    return server.resolve_model(parse_json_body(body, server.limits))


def _generation_route(server: Server, api: API) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            body = await _body(server, request)
            # Off the event loop, as the chat route does it: parsing a large body and
            # compiling its output grammar take a while.
            translation = await server.prepare(
                lambda: api.translate(_parsed(server, body), server.llm, server.limits)
            )
            job, first = await server.run_job(request, translation.request)
            if not translation.request.stream:
                return JSONResponse(translation.complete(first))
            return StreamingResponse(
                _stream(server, job, first, translation),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it; what nginx logs for this
        except Exception as exc:
            return _error_response(api, exc)

    return endpoint


async def _stream(
    server: Server, job: Job, first: Any, translation: Translation
) -> AsyncIterator[bytes]:
    """The translated events; when the client leaves, Starlette cancels this generator and the
    `finally` stops the generation."""
    try:
        async for event in job.events_after(first, server.keepalive):
            if event is KEEPALIVE:
                yield KEEPALIVE_COMMENT
            elif isinstance(event, PromptProgress):
                yield event.comment
            elif isinstance(event, ShuttingDownError):
                for data in translation.failed(_shutting_down()):
                    yield data
                return
            elif isinstance(event, BaseException):
                for data in translation.failed(as_api_error(event)):
                    yield data
                return
            else:
                for data in translation.events(event):
                    yield data
        for data in translation.end():
            yield data
    finally:
        server.worker.withdraw(job)


def _count_tokens_route(
    server: Server,
    api: API,
    count_request: Callable[[dict[str, Any], Lily, RequestLimits], ChatRequest],
    answer: Callable[[int], dict[str, Any]],
) -> Callable[[Request], Awaitable[Response]]:
    """A route that measures the prompt an API's request would feed: `count_request` translates
    the body onto the chat path's request, `answer` shapes the count."""

    async def endpoint(request: Request) -> Response:
        try:
            body = await _body(server, request)

            def count() -> int:
                # Rendering and tokenizing touch no engine state: off the loop, not queued for
                # the engine, but bounded as the other routes' preparation is.
                checked = count_request(_parsed(server, body), server.llm, server.limits)
                return server.llm.chat.completions.count_prompt_tokens(checked)

            return JSONResponse(answer(await server.prepare(count)))
        except Exception as exc:
            return _error_response(api, exc)

    return endpoint


def api_routes(server: Server) -> list[Route]:
    return [
        Route(
            "/v1/completions",
            _generation_route(server, completions_api.API),
            methods=["POST"],
        ),
        Route(
            "/v1/messages",
            _generation_route(server, anthropic_messages.API),
            methods=["POST"],
        ),
        Route(
            "/v1/messages/count_tokens",
            _count_tokens_route(
                server,
                anthropic_messages.API,
                anthropic_messages.count_tokens_request,
                lambda count: {"input_tokens": count},
            ),
            methods=["POST"],
        ),
        Route(
            "/v1/responses/input_tokens",
            _count_tokens_route(
                server,
                responses_api.API,
                responses_api.input_tokens_request,
                lambda count: {"object": "response.input_tokens", "input_tokens": count},
            ),
            methods=["POST"],
        ),
        Route(
            "/v1/responses",
            _generation_route(server, responses_api.API),
            methods=["POST"],
        ),
    ]
