"""Bounds on the shape of a chat request, checked before anything costly runs.

Rendering the chat template, checking tool schemas and compiling an output grammar all cost time
that grows with the request: 200,000 one-word messages took the renderer 12 s (and ended on the
template's own step bound, a server error for what is the client's doing), and a forced call
whose parameter has a 100,000-value `enum` took the grammar compiler 21 s. `RequestLimits` bounds
the request instead, so such a request is refused at once with a 400 naming the field:

- `max_messages`, `max_tools` and `max_tool_calls` (all the assistant messages' calls together)
  are counted on the parsed body, before it is validated further;
- `max_grammar_bytes` bounds the output grammar (`lily.chat.structured_output`): its Lark text, JSON
  Schemas inlined, is sized while it is built, before the grammar engine sees it.

The defaults are OpenAI's where it has one (2048 messages, 128 tools) and far above what fits a
32k context otherwise; `lily serve` takes each as a flag. The Python facade applies none: a
caller of `create` can only hold its own process.
"""

from __future__ import annotations

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


class ArrayTooLongError(RequestError):
    """An array of the request holds more items than the server's bound (OpenAI's code)."""

    def __init__(self, param: str, length: int, limit: int, what: str) -> None:
        super().__init__(
            f"{param} has {length} {what}, more than the {limit} this server accepts",
            param=param,
            code="array_above_max_length",
        )


@dataclass(frozen=True)
class RequestLimits:
    """The largest request a server accepts (see the module docstring); None: no bound."""

    max_messages: int | None = DEFAULT_MAX_MESSAGES
    max_tools: int | None = DEFAULT_MAX_TOOLS
    max_tool_calls: int | None = DEFAULT_MAX_TOOL_CALLS
    max_grammar_bytes: int | None = DEFAULT_MAX_GRAMMAR_BYTES

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


UNBOUNDED = RequestLimits(None, None, None, None)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _check_length(param: str, length: int, limit: int | None, what: str) -> None:
    if limit is not None and length > limit:
        raise ArrayTooLongError(param, length, limit, what)
