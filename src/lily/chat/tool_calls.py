"""Tool calls: the model's qwen3_coder XML, parsed into OpenAI `tool_calls`, also while streaming.

The model writes

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, so they are typed with the tool's JSON schema (`"2"` becomes the
integer 2 when the schema says integer, stays the string "2" when it says string). The OpenAI
`arguments` field is a JSON object text; when streaming it is sent in fragments, one per
completed parameter, that concatenate to `json.dumps(arguments, ensure_ascii=False)`.

The parser tolerates a `<function=...>` the model wrote without its `<tool_call>` wrapper and a
missing `</parameter>` (the next `<parameter=`, `</function>` or `</tool_call>` ends the value).
A value whose schema says it is JSON (an object, array, number, ...) ends only at a tag outside
its JSON strings, so a string inside it may hold any of those tags.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from lily.chat.stop import partial_marker_length

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# Any of these ends a parameter value; only the first is the well-formed one.
_VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_INTEGER = re.compile(r"[-+]?\d+")
# Python refuses to convert longer digit strings (sys.get_int_max_str_digits, 4300 by default);
# a longer "integer" stays text.
MAX_INTEGER_DIGITS = 4300


@dataclass(frozen=True)
class ToolCall:
    """One call; `arguments` is the JSON object text of OpenAI's `function.arguments`. A call
    the text ended before its closing tag is not `complete`: closed at a stop, its arguments
    are what was written; cut by max_tokens (`ToolCallParser.cut`), the parameters written
    in full, without the closing brace."""

    id: str
    name: str
    arguments: str
    complete: bool = True


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call number `index`: its first piece has `id` and `name`, later pieces
    add `arguments` text. The pieces of one call concatenate to its full `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolParseDelta:
    """What one piece of generated text added: answer text and/or tool-call pieces."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_JSON_TYPE_OF = {bool: "boolean", type(None): "null", dict: "object", list: "array", str: "string"}


def _schema_types(schema: Mapping[str, Any]) -> list[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    listed = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        listed = [schema["const"]]
    if listed is not None:
        # The types of the values a schema lists, as the output grammar reads them.
        return sorted({_JSON_TYPE_OF.get(type(v), "string" if isinstance(v, str) else "number")
                       for v in listed})  # fmt: skip
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key, []):
            if isinstance(member, Mapping):
                types += _schema_types(member)
    if not types and "properties" in schema:
        types.append("object")
    if not types and "items" in schema:
        types.append("array")
    return types


def _as_type(text: str, json_type: str) -> tuple[bool, Any]:
    """(True, value) if `text` reads as a value of that JSON type."""
    stripped = text.strip()
    if json_type == "string":
        return True, text
    if json_type == "null":
        return stripped.lower() in ("null", "none"), None
    if json_type == "boolean":
        lowered = stripped.lower()
        return lowered in ("true", "false"), lowered == "true"
    if json_type in ("integer", "number") and _INTEGER.fullmatch(stripped):
        if len(stripped.lstrip("+-")) > MAX_INTEGER_DIGITS:
            return False, None  # past what Python converts (and what any tool takes)
        return True, int(stripped)
    if json_type == "integer":
        try:
            number = float(stripped)
        except ValueError:
            return False, None
        return number.is_integer(), int(number) if number.is_integer() else None
    if json_type == "number":
        try:
            number = float(stripped)
        except ValueError:
            return False, None
        return math.isfinite(number), number
    if json_type in ("object", "array"):
        try:
            value = json.loads(stripped)
        except (ValueError, RecursionError):  # also integers past Python's digit limit
            return False, None
        return isinstance(value, dict if json_type == "object" else list), value
    return False, None


# When a schema allows several types, the most specific reading wins; string is the fallback.
_TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array", "string")


def convert_parameter(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A raw parameter value typed by its JSON schema; text that fits no declared type (or a
    parameter the schema does not describe) stays a string."""
    types = _schema_types(schema) if schema else []
    for json_type in sorted(
        set(types), key=lambda t: _TYPE_ORDER.index(t) if t in _TYPE_ORDER else 99
    ):
        ok, value = _as_type(text, json_type)
        if ok:
            return value
    return text


def _parameter_schemas(tools: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> {parameter name: schema}, from OpenAI tools (or bare function dicts),
    local `$ref`s followed (`follow_local_refs`)."""
    schemas = {}
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if not isinstance(properties, Mapping):
            properties = {}  # a malformed schema types nothing: every value stays text
        schemas[function.get("name")] = {
            name: follow_local_refs(schema, parameters)
            for name, schema in properties.items()
            if isinstance(schema, Mapping)
        }
    return schemas


# How many `$ref`s in a row `follow_local_refs` follows (a loop stops there).
_REF_HOPS = 8


def follow_local_refs(schema: Mapping[str, Any], root: Any, hops: int = _REF_HOPS) -> Mapping:
    """`schema` with its `$ref` into `root` (a JSON pointer such as `#/$defs/NAME`) replaced
    by the schema it points to, the other keywords beside the `$ref` kept over it, and the
    same for the members of its `anyOf`/`oneOf`: what a parameter's type is read from, by the
    output grammar and by this parser alike. A reference that points nowhere is left as it
    is (requests refuse any other kind up front)."""
    while hops > 0 and isinstance(schema.get("$ref"), str):
        target = _json_pointer(root, schema["$ref"])
        if not isinstance(target, Mapping):
            break
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        hops -= 1
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if hops > 0 and isinstance(members, list):
            followed = [
                follow_local_refs(m, root, hops - 1) if isinstance(m, Mapping) else m
                for m in members
            ]
            schema = {**schema, key: followed}
    return schema


def _json_pointer(root: Any, ref: str) -> Any:
    """What `ref` (`#`, `#/a/b`) points to in `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _State(Enum):
    CONTENT = auto()
    CALL_OPENED = auto()  # after <tool_call>, before <function=
    FUNCTION_NAME = auto()  # after <function=, before >
    IN_FUNCTION = auto()  # between parameters
    PARAMETER_NAME = auto()  # after <parameter=, before >
    PARAMETER_VALUE = auto()
    CALL_CLOSING = auto()  # after </function>, maybe before </tool_call>


class ToolCallParser:
    """Streaming parser for qwen3_coder tool calls in the answer text.

    Feed it the content (not the reasoning) piece by piece; each `feed` returns the answer text
    that is certain not to be part of a call, and the tool-call pieces completed by this text.
    `flush` at the end closes a call the generation cut short. `calls` lists the calls parsed
    so far. Whitespace around and between calls is not content.
    """

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        make_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._schemas = _parameter_schemas(tools or [])
        self._make_id = make_id
        self._state = _State.CONTENT
        self._buffer = ""
        self._after_call = False
        self.calls: list[ToolCall] = []
        # The call the text ended inside, once flushed (its `id` empty when even its name was
        # unfinished, so that nothing of it was streamed).
        self.cut: ToolCall | None = None
        # The call being parsed.
        self._id = ""
        self._name = ""
        self._arguments = ""
        self._parameter = ""

    def feed(self, text: str) -> ToolParseDelta:
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas, final=False):
            pass
        return ToolParseDelta("".join(content), _merge(deltas))

    def flush(self, *, cut: bool = False) -> ToolParseDelta:
        """End of stream: held-back content is released. An unfinished call the model ended
        (a stop) is closed with the parameters it has (an unterminated value runs to the end
        of the text). One the generation `cut` short (max_tokens) streams nothing more: a
        value or a name that may be unfinished is not sent, nor the closing brace, so what was
        streamed stays a prefix of the arguments the model was writing; the call is kept in
        `cut` (its arguments so far), not in `calls`."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas, final=True):
            pass
        rest, self._buffer = self._buffer, ""
        if self._state is _State.CONTENT:
            content.append(rest.strip() if self._after_call else rest)
        elif cut and self._state is _State.FUNCTION_NAME:
            self.cut = ToolCall("", rest.strip(), "", complete=False)
        elif cut and self._state is not _State.CALL_OPENED:
            self.cut = ToolCall(self._id, self._name, self._arguments, complete=False)
        elif self._state is not _State.CALL_OPENED:
            if self._state is _State.FUNCTION_NAME:
                self._open_function(rest.strip(), deltas)
            elif self._state is _State.PARAMETER_VALUE:
                self._add_parameter(rest, deltas)
            self._close_function(deltas, complete=False)
        self._state = _State.CONTENT
        return ToolParseDelta("".join(content), _merge(deltas))

    def _step(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        """Consume what the buffer allows in the current state; False when more text is needed."""
        handler = {
            _State.CONTENT: self._content,
            _State.CALL_OPENED: self._call_opened,
            _State.FUNCTION_NAME: self._function_name,
            _State.IN_FUNCTION: self._in_function,
            _State.PARAMETER_NAME: self._parameter_name,
            _State.PARAMETER_VALUE: self._parameter_value,
            _State.CALL_CLOSING: self._call_closing,
        }[self._state]
        return handler(content, deltas, final)

    def _content(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        buffer = self._buffer
        if self._after_call:
            buffer = self._buffer = buffer.lstrip()
        starts = [(buffer.find(m), m) for m in (TOOL_CALL_START, FUNCTION_START)]
        found = [(at, m) for at, m in starts if at >= 0]
        if found:
            at, marker = min(found)
            content.append(buffer[:at].rstrip())
            self._buffer = buffer[at + len(marker) :]
            wrapped = marker == TOOL_CALL_START
            self._state = _State.CALL_OPENED if wrapped else _State.FUNCTION_NAME
            return True
        if final:
            return False
        # Hold back a possible marker start, and trailing whitespace that would not be content
        # if a call follows.
        hold = partial_marker_length(buffer, (TOOL_CALL_START, FUNCTION_START))
        emit = buffer[: len(buffer) - hold].rstrip()
        content.append(emit)
        self._buffer = buffer[len(emit) :]
        if emit:
            self._after_call = False
        return False

    def _call_opened(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        buffer = self._buffer = self._buffer.lstrip()
        if buffer.startswith(FUNCTION_START):
            self._buffer = buffer[len(FUNCTION_START) :]
            self._state = _State.FUNCTION_NAME
            return True
        if buffer.startswith(TOOL_CALL_END):  # an empty call
            self._buffer = buffer[len(TOOL_CALL_END) :]
            self._state, self._after_call = _State.CONTENT, True
            return True
        if _could_become(buffer, (FUNCTION_START, TOOL_CALL_END)):
            return False
        # Not the XML format: give the text back as content rather than lose it.
        content.append(TOOL_CALL_START + buffer)
        self._buffer, self._state = "", _State.CONTENT
        return False

    def _function_name(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        end = _first_of(self._buffer, (">", "\n"))
        if end < 0:
            return False
        name = self._buffer[:end].strip()
        self._buffer = self._buffer[end + 1 :]
        self._open_function(name, deltas)
        return True

    def _in_function(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        buffer = self._buffer = self._buffer.lstrip()
        if buffer.startswith(PARAMETER_START):
            self._buffer = buffer[len(PARAMETER_START) :]
            self._state = _State.PARAMETER_NAME
            return True
        if buffer.startswith(FUNCTION_END):
            self._buffer = buffer[len(FUNCTION_END) :]
            self._close_function(deltas)
            self._state = _State.CALL_CLOSING
            return True
        if buffer.startswith(TOOL_CALL_END):  # </function> forgotten
            self._buffer = buffer[len(TOOL_CALL_END) :]
            self._close_function(deltas)
            self._state, self._after_call = _State.CONTENT, True
            return True
        if _could_become(buffer, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)):
            return False
        # Text between parameters is not part of the format: skip to the next tag.
        next_tag = buffer.find("<", 1)
        self._buffer = buffer[next_tag:] if next_tag > 0 else ""
        return next_tag > 0

    def _parameter_name(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        end = _first_of(self._buffer, (">", "\n"))
        if end < 0:
            return False
        self._parameter = self._buffer[:end].strip()
        self._buffer = self._buffer[end + 1 :]
        self._state = _State.PARAMETER_VALUE
        return True

    def _parameter_value(
        self, content: list[str], deltas: list[ToolCallDelta], final: bool
    ) -> bool:
        schema = self._schemas.get(self._name, {}).get(self._parameter)
        json_typed = schema is not None and "string" not in _schema_types(schema)
        found = _value_end(self._buffer, json_typed)
        if found is None:
            return False
        at, marker = found
        self._add_parameter(self._buffer[:at], deltas)
        # A well-formed value ends with </parameter>; any other end tag is left to be read.
        consumed = at + len(marker) if marker == PARAMETER_END else at
        self._buffer = self._buffer[consumed:]
        self._state = _State.IN_FUNCTION
        return True

    def _call_closing(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        buffer = self._buffer = self._buffer.lstrip()
        if buffer.startswith(TOOL_CALL_END):
            self._buffer = buffer[len(TOOL_CALL_END) :]
        elif TOOL_CALL_END.startswith(buffer) and not final:
            return False  # wait: the optional </tool_call> may be arriving
        self._state, self._after_call = _State.CONTENT, True
        return True

    def _open_function(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._id, self._name, self._arguments = self._make_id(), name, ""
        deltas.append(ToolCallDelta(len(self.calls), id=self._id, name=name))
        self._state = _State.IN_FUNCTION

    def _add_parameter(self, raw: str, deltas: list[ToolCallDelta]) -> None:
        # The format puts the value on its own lines: drop exactly those two newlines.
        raw = raw.removeprefix("\n").removesuffix("\n")
        schema = self._schemas.get(self._name, {}).get(self._parameter)
        value = convert_parameter(raw, schema)
        separator = "{" if not self._arguments else ", "
        piece = f"{separator}{json.dumps(self._parameter)}: {json.dumps(value, ensure_ascii=False)}"
        self._arguments += piece
        deltas.append(ToolCallDelta(len(self.calls), arguments=piece))

    def _close_function(self, deltas: list[ToolCallDelta], *, complete: bool = True) -> None:
        piece = "}" if self._arguments else "{}"
        self._arguments += piece
        deltas.append(ToolCallDelta(len(self.calls), arguments=piece))
        self.calls.append(ToolCall(self._id, self._name, self._arguments, complete))


def _value_end(text: str, json_typed: bool) -> tuple[int, str] | None:
    """Where a parameter value ends: the first of `_VALUE_ENDS`, and its marker. A value typed as
    JSON (no string in its schema) ends only at a marker outside its string literals, so
    `{"note": "</parameter>"}` stays whole. JSON strings cannot hold a raw newline, so a
    newline also ends a string literal: an unclosed quote cannot swallow the value's end."""
    found = [(at, m) for at, m in ((text.find(m), m) for m in _VALUE_ENDS) if at >= 0]
    if not json_typed or not found:
        return min(found) if found else None
    in_string = escaped = False
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char in '"\n':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "<":
            for marker in _VALUE_ENDS:
                if text.startswith(marker, at):
                    return at, marker
    return None


def _could_become(text: str, markers: Iterable[str]) -> bool:
    """Whether `text` is the start of one of the markers (so more text is needed to decide)."""
    return any(marker.startswith(text) for marker in markers)


def _first_of(text: str, markers: Iterable[str]) -> int:
    hits = [at for at in (text.find(m) for m in markers) if at >= 0]
    return min(hits, default=-1)


def _merge(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """One delta per call index and feed: OpenAI clients accumulate by index either way, but
    fewer, larger pieces make tidier chunks."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(
                last.index,
                last.id or delta.id,
                last.name or delta.name,
                last.arguments + delta.arguments,
            )
        else:
            merged.append(delta)
    return tuple(merged)


def parse_tool_calls(
    text: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    make_id: Callable[[], str] = new_call_id,
) -> tuple[str, list[ToolCall]]:
    """Whole-text parse: (answer text without the calls, the calls). Same rules as streaming."""
    parser = ToolCallParser(tools, make_id=make_id)
    first, last = parser.feed(text), parser.flush()
    return first.content + last.content, parser.calls
