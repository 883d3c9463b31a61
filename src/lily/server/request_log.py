"""One log line per HTTP request, and the `x-request-id` header that ties a response to it.

An ASGI middleware around the whole app. A request's id is the client's `x-request-id` when it
sends a usable one (visible ASCII, at most 128 characters), else a fresh random one; either way
the response carries it back. When the response has been sent, the `lily.requests` logger
writes one line, e.g. (wrapped here)

    POST /v1/chat/completions 200 0.84 s id=3f2a9c... prompt=14 cached=7 cache=hit
    generated=20 first_token=0.210 s 30.2 tok/s

where `cache` says whether the prefix cache spared any prompt token (hit) or not (miss), and
the rate is the generated tokens after the first over the time after the first. The
token fields appear for chat completions whose generation has ended:
the route puts an object with a `stats` attribute (a `GenerationStats`, or None while unknown)
in the request state as `generation`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from lily.chat.completions import GenerationStats

logger = logging.getLogger("lily.requests")

REQUEST_ID_HEADER = "x-request-id"
# What a client-sent id may look like: no spaces or control characters (it goes into the log
# and back into a header), and short.
_USABLE_ID = re.compile(r"[!-~]{1,128}")


def request_id_of(headers: Headers) -> str:
    """The client's request id when usable, else a new one."""
    sent = headers.get(REQUEST_ID_HEADER, "")
    return sent if _USABLE_ID.fullmatch(sent) else uuid.uuid4().hex


def describe(
    method: str,
    path: str,
    status: int | None,
    seconds: float,
    request_id: str,
    stats: GenerationStats | None = None,
) -> str:
    """The log line of one request."""
    shown_status = "-" if status is None else status
    line = f"{method} {path} {shown_status} {seconds:.2f} s id={request_id}"
    if stats is None:
        return line
    line += (
        f" prompt={stats.prompt_tokens} cached={stats.cached_tokens}"
        f" cache={'hit' if stats.cached_tokens else 'miss'} generated={stats.generated_tokens}"
    )
    if stats.first_token_s is not None:
        line += f" first_token={stats.first_token_s:.3f} s"
    rate = stats.decode_tokens_per_second
    if rate is not None:
        line += f" {rate:.1f} tok/s"
    return line


class RequestLog:
    """The middleware: sets the id header on the response, logs the line when it is done."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status: int | None = None
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            generation = state.get("generation")
            logger.info(
                describe(
                    scope["method"],
                    scope["path"],
                    status,
                    time.perf_counter() - started,
                    request_id,
                    generation.stats if generation is not None else None,
                )
            )
