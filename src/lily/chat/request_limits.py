"""Bounds on the shape of a chat request, checked before anything costly runs.

Rendering the chat template, checking tool schemas and compiling an output grammar all cost time
that grows with the request: 200,000 one-word messages took the renderer 12 s (and ended on the
template's own step bound, a server error for what is the client's doing), and a forced call
whose parameter has a 100,000-value `enum` took the grammar compiler 21 s. `RequestLimits` bounds
the request instead, so such a request is refused at once with a 400 naming the field:

- `max_messages`, `max_tools` and `max_tool_calls` (all the assistant messages' calls together)
  are counted on the parsed body, before it is validated further;
- `max_grammar_bytes` bounds the output grammar (`lily.chat.structured_output`): its Lark text, JSON
  Schemas inlined, is sized while it is built, before the grammar engine sees it;
- `max_json_values` bounds every value of the body (objects, arrays, strings, numbers, ...)
  added up: within the other bounds, one tool call's `arguments` with 100,000 keys still took the
  renderer past its 10 s deadline. The template renders each value the prompt holds as one token
  or more, so the default (32,768) is no less than what the default context holds.

The defaults are OpenAI's where it has one (2048 messages, 128 tools) and far above what fits a
32k context otherwise; `lily serve` takes each as a flag. The Python facade applies none: a
caller of `create` can only hold its own process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lily.errors import RequestError

DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_TOOLS = 128
DEFAULT_MAX_TOOL_CALLS = 1024
# A 256 KiB grammar (about 8,000 values of a string enum) compiles in well under a second; the
# compile time grows faster than linearly beyond (a 1 MB enum: 21 s).
DEFAULT_MAX_GRAMMAR_BYTES = 256 * 1024
DEFAULT_MAX_JSON_VALUES = 32_768


class ArrayTooLongError(RequestError):
    """An array of the request holds more items than the server's bound (OpenAI's code)."""

    def __init__(self, param: str, length: int, limit: int, what: str) -> None:
        super().__init__(
            f"{param} has {length} {what}, more than the {limit} this server accepts",
            param=param,
            code="array_above_max_length",
        )


class TooManyValuesError(RequestError):
    """The body holds more JSON values, all added up, than the server's bound."""

    def __init__(self, param: str, limit: int) -> None:
        super().__init__(
            f"the request holds more than {limit} JSON values (objects, arrays, strings, "
            f"numbers, ...) in all, the most this server accepts; most of them are in {param}",
            param=param,
            code="too_many_values",
        )


@dataclass(frozen=True)
class RequestLimits:
    """The largest request a server accepts (see the module docstring); None: no bound."""

    max_messages: int | None = DEFAULT_MAX_MESSAGES
    max_tools: int | None = DEFAULT_MAX_TOOLS
    max_tool_calls: int | None = DEFAULT_MAX_TOOL_CALLS
    max_grammar_bytes: int | None = DEFAULT_MAX_GRAMMAR_BYTES
    max_json_values: int | None = DEFAULT_MAX_JSON_VALUES

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def check_shape(self, request: Mapping[str, Any]) -> None:
        """Refuses a request with too many messages, tools or tool calls (400). Fields of the
        wrong type are left to the request's validation."""
        messages = request.get("messages")
        if _is_list(messages):
            _check_length("messages", len(messages), self.max_messages, "messages")
            calls = sum(
                len(m["tool_calls"])
                for m in messages
                if isinstance(m, Mapping) and _is_list(m.get("tool_calls"))
            )
            _check_length("messages", calls, self.max_tool_calls, "tool calls")
        tools = request.get("tools")
        if _is_list(tools):
            _check_length("tools", len(tools), self.max_tools, "tools")

    def check_values(self, body: Mapping[str, Any]) -> None:
        """Refuses a request body holding more JSON values than `max_json_values` (400). Counted
        once, on the body as it arrived: a translated request holds the same values again."""
        if self.max_json_values is not None:
            _check_value_count(body, self.max_json_values)


UNBOUNDED = RequestLimits(None, None, None, None, None)


def _check_value_count(request: Mapping[str, Any], limit: int) -> None:
    """Counts the values of every field (iteratively: a deep body cannot exhaust the stack),
    stopping once the whole request is over `limit`; the error names the largest field.
    Tool-call `arguments`, a JSON text in OpenAI's shape, count as the values they hold: the
    template renders them parsed."""
    total = 1
    counts: dict[str, int] = {}
    for name, value in request.items():
        stack = [value]
        count = 0
        while stack and total + count <= limit:
            item = stack.pop()
            count += 1
            if isinstance(item, Mapping):
                for key, inner in item.items():
                    if key == "arguments" and isinstance(inner, str):
                        inner = _json_or_text(inner)
                    stack.append(inner)
            elif _is_list(item):
                stack.extend(item)
        counts[name] = count
        total += count
        if total > limit:
            largest = max(counts, key=counts.__getitem__)
            raise TooManyValuesError(largest, limit)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _check_length(param: str, length: int, limit: int | None, what: str) -> None:
    if limit is not None and length > limit:
        raise ArrayTooLongError(param, length, limit, what)


def _json_or_text(text: str) -> Any:
    """`text` parsed as JSON, or `text` itself when it is not JSON (its validation comes later)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
