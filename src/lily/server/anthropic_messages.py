"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as a
translation onto the chat path.

A request's system prompt, messages (text, `tool_use`, `tool_result` and `thinking` blocks),
tools, `tool_choice`, `stop_sequences`, sampling fields and `thinking` become chat-completions
fields, checked by `lily.chat.completions.parse_request` (the one validation, tool-call parser and
grammar);
the ChatCompletion, or the stream of chunks, comes back as a `message` (content blocks,
`stop_reason`, usage with the prefix cache's tokens as `cache_read_input_tokens`) or as
Anthropic's event sequence: `message_start`, then per block `content_block_start`,
`content_block_delta`..., `content_block_stop`, then `message_delta` (stop reason and usage)
and `message_stop`. Errors are `{"type": "error", "error": {"type", "message"}}`.

Thinking follows Anthropic's semantics: off unless the request sets `thinking` (`enabled`, whose
`budget_tokens` becomes the reasoning budget, or `adaptive`, without a budget); the model's
reasoning comes back as `thinking` blocks (with an empty `signature`: nothing is signed here),
and `thinking` blocks sent back in assistant turns are rendered as the turn's reasoning.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lily.chat.request_limits import UNBOUNDED, RequestLimits
from lily.errors import ImagesUnsupportedError, RequestError, UnsupportedParameterError, require
from lily.server.api_translation import API as APIDescription
from lily.server.api_translation import chat_request, refuse_unknown, sse

if TYPE_CHECKING:
    from lily.api import Lily
    from lily.chat.completions import ChatRequest
    from lily.chat.types import ChatCompletion, ChatCompletionChunk, CompletionUsage
    from lily.server.routes import APIError

# Message fields Lily reads, and those it accepts without using them.
FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "output_config",
)
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
# Accepted on any block or tool: the prefix cache reuses prompts by itself.
CACHE_CONTROL = "cache_control"
# The media types the Messages API documents for base64 image sources.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": message},
    }


def _block_fields(block: Mapping[str, Any], known: Iterable[str], param: str) -> None:
    refuse_unknown(block, {"type", CACHE_CONTROL, *known}, prefix=f"{param}.")


def _text_of(blocks: Any, param: str) -> str:
    """A string, or a list of text blocks, as text (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    require(isinstance(blocks, list), "must be a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        require(isinstance(block, Mapping), "a content block must be an object", where)
        _refuse_non_text(block.get("type"), where)
        _block_fields(block, ("text", "citations"), where)
        require(isinstance(block.get("text"), str), "a text block needs 'text'", where)
        texts.append(block["text"])
    return "".join(texts)


def _refuse_non_text(kind: Any, param: str) -> None:
    if kind == "image":
        raise ImagesUnsupportedError("images are taken in a user turn's own blocks", param=param)
    if kind in ("document", "search_result", "container_upload"):
        raise RequestError(
            f"content blocks of type {kind!r} are not supported; Lily takes text and images",
            param=f"{param}.type",
            code="unsupported_content",
        )
    require(kind == "text", f"unknown content block type {kind!r}", f"{param}.type")


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn: its tool results (as tool messages, first, as the chat format needs them
    right after the assistant's calls), then its text and images (chat `image_url` parts)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    require(isinstance(content, list), "content must be a string or a list of blocks", param)
    results, parts = [], []
    for i, block in enumerate(content):
        where = f"{param}[{i}]"
        require(isinstance(block, Mapping), "a content block must be an object", where)
        if block.get("type") == "tool_result":
            _block_fields(block, ("tool_use_id", "content", "is_error"), where)
            require(isinstance(block.get("tool_use_id"), str), "needs 'tool_use_id'", where)
            text = _text_of(block.get("content", ""), f"{where}.content")
            is_error = block.get("is_error", False)
            require(isinstance(is_error, bool), "is_error must be a boolean", f"{where}.is_error")
            if is_error:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif block.get("type") == "image":
            parts.append(_image_part(block, where))
        else:
            _refuse_non_text(block.get("type"), where)
            _block_fields(block, ("text", "citations"), where)
            require(isinstance(block.get("text"), str), "a text block needs 'text'", where)
            parts.append({"type": "text", "text": block["text"]})
    if any(part["type"] == "image_url" for part in parts):
        results.append({"role": "user", "content": parts})
    elif parts or not results:
        results.append({"role": "user", "content": "".join(part["text"] for part in parts)})
    return results


def _image_part(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """An `image` block as a chat `image_url` part: base64 data becomes a data URL."""
    _block_fields(block, ("source",), param)
    source = block.get("source")
    require(isinstance(source, Mapping), "an image block needs 'source'", param)
    kind = source.get("type")
    where = f"{param}.source"
    if kind == "base64":
        refuse_unknown(source, ("type", "media_type", "data"), prefix=f"{where}.")
        media_type, data = source.get("media_type"), source.get("data")
        require(
            media_type in IMAGE_MEDIA_TYPES,
            f"media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}",
            f"{where}.media_type",
        )
        require(isinstance(data, str), "a base64 source needs 'data'", where)
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        refuse_unknown(source, ("type", "url"), prefix=f"{where}.")
        require(isinstance(source.get("url"), str), "a url source needs 'url'", where)
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise RequestError(
        f"image sources of type {kind!r} are not supported; send 'base64' (or 'url')",
        param=f"{where}.type",
        code="unsupported_content",
    )


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    require(isinstance(content, list), "content must be a string or a list of blocks", param)
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(content):
        where = f"{param}[{i}]"
        require(isinstance(block, Mapping), "a content block must be an object", where)
        kind = block.get("type")
        if kind == "tool_use":
            _block_fields(block, ("id", "name", "input"), where)
            require(isinstance(block.get("id"), str), "a tool_use block needs 'id'", where)
            require(isinstance(block.get("name"), str), "a tool_use block needs 'name'", where)
            require(isinstance(block.get("input"), Mapping), "input must be an object", where)
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "thinking":
            _block_fields(block, ("thinking", "signature"), where)
            require(isinstance(block.get("thinking"), str), "needs 'thinking'", where)
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            raise RequestError(
                "redacted_thinking blocks are not supported (Lily never redacts)",
                param=f"{where}.type",
                code="unsupported_content",
            )
        else:
            _refuse_non_text(kind, where)
            _block_fields(block, ("text", "citations"), where)
            require(isinstance(block.get("text"), str), "a text block needs 'text'", where)
            texts.append(block["text"])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = []
    system = params.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    turns = params.get("messages")
    require(
        isinstance(turns, list) and len(turns) > 0, "messages must be a non-empty list", "messages"
    )
    for i, turn in enumerate(turns):
        param = f"messages[{i}]"
        require(isinstance(turn, Mapping), "a message must be an object", param)
        refuse_unknown(turn, ("role", "content"), prefix=f"{param}.")
        role = turn.get("role")
        content = turn.get("content")
        if role == "user":
            messages.extend(_user_messages(content, f"{param}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(content, f"{param}.content"))
        else:
            raise RequestError("role must be user or assistant", param=f"{param}.role")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    require(isinstance(tools, list), "tools must be a list", "tools")
    translated = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        require(isinstance(tool, Mapping), "a tool must be an object", param)
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise RequestError(
                f"tools of type {kind!r} (Anthropic's server tools) are not supported; "
                "give client tools with an input_schema",
                param=f"{param}.type",
                code="unsupported_parameter",
            )
        refuse_unknown(
            tool, ("type", "name", "description", "input_schema", CACHE_CONTROL), f"{param}."
        )
        require(isinstance(tool.get("name"), str), "a tool needs 'name'", f"{param}.name")
        require(
            isinstance(tool.get("input_schema"), Mapping),
            "a tool needs 'input_schema' (an object)",
            f"{param}.input_schema",
        )
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        translated.append({"type": "function", "function": function})
    return translated


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    require(
        isinstance(choice, Mapping) and choice.get("type") in ("auto", "any", "tool", "none"),
        "tool_choice must be an object whose type is auto, any, tool or none",
        "tool_choice",
    )
    kind = choice["type"]
    refuse_unknown(
        choice,
        ("type", "disable_parallel_tool_use", *(("name",) if kind == "tool" else ())),
        "tool_choice.",
    )
    if kind == "tool":
        require(isinstance(choice.get("name"), str), "needs 'name'", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    single = choice.get("disable_parallel_tool_use")
    if single is not None:
        require(
            isinstance(single, bool), "must be a boolean", "tool_choice.disable_parallel_tool_use"
        )
        chat["parallel_tool_calls"] = not single


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    """Anthropic's `thinking`: off unless enabled (the chat template's `enable_thinking`)."""
    if thinking is None:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        return
    require(
        isinstance(thinking, Mapping)
        and thinking.get("type") in ("enabled", "disabled", "adaptive"),
        "thinking must be an object whose type is enabled, disabled or adaptive",
        "thinking",
    )
    kind = thinking["type"]
    refuse_unknown(
        thinking,
        ("type", *(("budget_tokens", "display") if kind != "disabled" else ())),
        "thinking.",
    )
    require(
        thinking.get("display", "summarized") in ("summarized", "omitted"),
        "display must be summarized or omitted",
        "thinking.display",
    )
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    if kind == "enabled" or "budget_tokens" in thinking:
        budget = thinking.get("budget_tokens")
        require(
            type(budget) is int and budget >= 0,
            "budget_tokens must be an integer >= 0",
            "thinking.budget_tokens",
        )
        chat["reasoning_budget"] = budget


def _metadata(metadata: Any) -> None:
    require(isinstance(metadata, Mapping), "metadata must be an object", "metadata")
    refuse_unknown(metadata, ("user_id",), "metadata.")
    user = metadata.get("user_id")
    require(user is None or isinstance(user, str), "must be a string", "metadata.user_id")


def _chat_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The request as chat-completions fields (unknown fields refused by the caller)."""
    chat: dict[str, Any] = {"messages": _messages(params)}
    if "model" in params:
        chat["model"] = params["model"]
    if "tools" in params:
        chat["tools"] = _tools(params["tools"])
    if "tool_choice" in params:
        _tool_choice(params["tool_choice"], chat)
    _thinking(params.get("thinking"), chat)
    if "output_config" in params:
        _output_config(params["output_config"], chat)
    return chat


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """Structured output: `format` is the chat path's `response_format` json_schema (enforced
    by the same grammar)."""
    require(isinstance(config, Mapping), "output_config must be an object", "output_config")
    refuse_unknown(config, ("format",), "output_config.")
    form = config.get("format")
    if form is None:
        return
    require(
        isinstance(form, Mapping) and form.get("type") == "json_schema",
        "format must be an object whose type is json_schema",
        "output_config.format",
    )
    refuse_unknown(form, ("type", "schema"), "output_config.format.")
    require(
        isinstance(form.get("schema"), Mapping),
        "format needs 'schema' (an object)",
        "output_config.format.schema",
    )
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": form["schema"], "strict": True},
    }


def translate(
    params: dict[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> MessagesTranslation:
    refuse_unknown(params, FIELDS)
    for name in ("model", "max_tokens"):
        if name not in params:
            raise RequestError(f"{name} is required", param=name, code="missing_required")
    chat = _chat_params(params)
    chat["max_tokens"] = params["max_tokens"]
    if "stop_sequences" in params:
        stops = params["stop_sequences"]
        require(isinstance(stops, list), "stop_sequences must be a list", "stop_sequences")
        if stops:
            chat["stop"] = stops
    for name in ("temperature", "top_p", "top_k"):
        if name in params:
            chat[name] = params[name]
    if "metadata" in params:
        _metadata(params["metadata"])
    tier = params.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise RequestError("service_tier must be auto or standard_only", param="service_tier")
    stream = params.get("stream", False)
    chat["stream"] = stream
    if stream is True:
        chat["stream_options"] = {"include_usage": True}  # message_delta's usage
    thinking = params.get("thinking")
    omit = isinstance(thinking, Mapping) and thinking.get("display") == "omitted"
    return MessagesTranslation(chat_request(chat, llm, limits), llm.model_id, omit_thinking=omit)


def count_tokens_request(
    params: dict[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> ChatRequest:
    """The chat request whose prompt `count_tokens` measures."""
    refuse_unknown(params, COUNT_FIELDS)
    if "model" not in params:
        raise RequestError("model is required", param="model", code="missing_required")
    return chat_request(_chat_params(params), llm, limits)


def _usage(usage: CompletionUsage | None) -> dict[str, int]:
    """Anthropic's counts: `input_tokens` are the prompt tokens prefilled, the prefix cache's
    are `cache_read_input_tokens` (the three input counts add up to the prompt)."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


class MessagesTranslation:
    """A chat completion's results as an Anthropic message or event stream."""

    def __init__(self, request: ChatRequest, model: str, *, omit_thinking: bool = False) -> None:
        if request.n != 1:  # pragma: no cover (the translation never asks for more)
            raise UnsupportedParameterError(["n"])
        self.request = request
        self._model = model
        # thinking.display "omitted": thinking blocks come back empty.
        self._omit_thinking = omit_thinking
        self._id = f"msg_{uuid.uuid4().hex}"
        self._block: str | None = None  # the open block's type
        self._index = -1
        self._stop_reason = "end_turn"
        self._stop_sequence: str | None = None
        self._usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}

    def _message(self, content: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            **fields,
        }

    def complete(self, result: ChatCompletion) -> dict[str, Any]:
        choice = result.choices[0]
        message = choice.message
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            thinking = "" if self._omit_thinking else message.reasoning_content
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls or []:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": json.loads(call.function.arguments or "{}"),
                }
            )
        return self._message(
            content,
            stop_reason=_stop_reason(choice.finish_reason, choice.stop_sequence),
            stop_sequence=choice.stop_sequence,
            usage=_usage(result.usage),
        )

    def _open(self, block: dict[str, Any]) -> Iterable[bytes]:
        yield from self._close()
        self._index += 1
        self._block = block["type"]
        event = {"type": "content_block_start", "index": self._index, "content_block": block}
        yield sse(event, "content_block_start")

    def _close(self) -> Iterable[bytes]:
        if self._block is None:
            return
        if self._block == "thinking":
            yield self._delta({"type": "signature_delta", "signature": ""})
        yield sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")
        self._block = None

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return sse(event, "content_block_delta")

    def events(self, chunk: ChatCompletionChunk) -> Iterable[bytes]:
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role is not None:
                # The prompt's counts are known before the answer starts.
                start = self._message(
                    [],
                    stop_reason=None,
                    stop_sequence=None,
                    usage=_usage(chunk.prompt_usage),
                )
                yield sse({"type": "message_start", "message": start}, "message_start")
            if delta.reasoning_content:
                if self._block != "thinking":
                    yield from self._open({"type": "thinking", "thinking": "", "signature": ""})
                if not self._omit_thinking:
                    thinking = {"type": "thinking_delta", "thinking": delta.reasoning_content}
                    yield self._delta(thinking)
            if delta.content:
                if self._block != "text":
                    yield from self._open({"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": delta.content})
            for call in delta.tool_calls or []:
                function = call.function
                if call.id is not None:
                    name = function.name if function else None
                    block = {"type": "tool_use", "id": call.id, "name": name, "input": {}}
                    yield from self._open(block)
                if function is not None and function.arguments:
                    part = {"type": "input_json_delta", "partial_json": function.arguments}
                    yield self._delta(part)
            if choice.finish_reason is not None:
                self._stop_reason = _stop_reason(choice.finish_reason, choice.stop_sequence)
                self._stop_sequence = choice.stop_sequence

    def end(self) -> Iterable[bytes]:
        yield from self._close()
        delta = {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence}
        event = {"type": "message_delta", "delta": delta, "usage": self._usage}
        yield sse(event, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    def failed(self, error: APIError) -> Iterable[bytes]:
        yield sse(error_body(error), "error")


API = APIDescription(translate=translate, error_body=error_body)
