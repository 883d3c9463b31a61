"""What each of Lily's other APIs provides to the server (`lily.server.api_routes`): the translation
of one request onto the chat path's `ChatRequest`, and of its results back."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lily.chat.request_limits import UNBOUNDED, RequestLimits
from lily.errors import UnsupportedParameterError

if TYPE_CHECKING:
    from lily.api import Lily
    from lily.chat.completions import ChatRequest
    from lily.chat.types import ChatCompletion, ChatCompletionChunk
    from lily.server.routes import APIError


class Translation(Protocol):
    """One request of another API, translated: the chat request to run, and how its results
    become that API's answer."""

    request: ChatRequest

    def complete(self, result: ChatCompletion) -> dict[str, Any]:
        """The answer of a non-streaming request."""
        ...

    def events(self, chunk: ChatCompletionChunk) -> Iterable[bytes]:
        """The server-sent events one chat chunk becomes (the first chunk opens the stream)."""
        ...

    def end(self) -> Iterable[bytes]:
        """The events that close a stream that ran to its end."""
        ...

    def failed(self, error: APIError) -> Iterable[bytes]:
        """The events that end a stream that failed after it started."""
        ...


@dataclass(frozen=True)
class API:
    """What a route needs to know of an API."""

    # The request's JSON object, the model and the server's request bounds -> its translation
    # (raises RequestError / APIError).
    translate: Callable[[dict[str, Any], Lily, RequestLimits], Translation]
    # An error -> the API's error object.
    error_body: Callable[[APIError], dict[str, Any]]


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; `data` is serialized as compact JSON unless already a string."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def refuse_unknown(params: Mapping[str, Any], known: Iterable[str], prefix: str = "") -> None:
    """Refuses, by name, every field of `params` not in `known` (never silently ignored)."""
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise UnsupportedParameterError([f"{prefix}{name}" for name in unknown])


def chat_request(
    params: Mapping[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> ChatRequest:
    """The chat path's one validation (its bounds and grammar compile included), on a request
    in chat-completions fields (as sent, or translated from another API). Its image URLs may be
    data URLs, or http(s) URLs if the model fetches them: never the server's own files."""
    from lily.chat.completions import parse_request

    return parse_request(
        params,
        served_model=llm.model_id,
        default_sampling=llm.default_sampling,
        chat_template=llm.chat_template,
        limits=limits,
        image_access=llm.image_access.without_files(),
    )


def openai_error_body(error: APIError) -> dict[str, Any]:
    return error.body()
