"""OpenAI's Responses API (`POST /v1/responses`), as a translation onto the chat path.

`input` (a string, or items: messages, `function_call`, `function_call_output`, `reasoning`),
`instructions`, function tools, `tool_choice`, `max_output_tokens`, `text.format`,
`reasoning.effort` and the sampling fields become chat-completions fields, checked by
`lily.chat.completions.parse_request` (the one validation, tool-call parser and grammar). The
ChatCompletion, or the stream of chunks, comes back as a `response` whose output items are a
`reasoning` item (the model's thinking), a `message` with `output_text`, and `function_call`
items; streamed as `response.created`, `response.in_progress`, the items' events
(`response.output_item.added`, `response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`, their `.done` events) and `response.completed`, or
`response.incomplete` when `max_output_tokens` ran out.

Nothing is stored: `store: true` and `previous_response_id` are refused by name (send the
conversation as items instead).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lily.chat.request_limits import UNBOUNDED, RequestLimits
from lily.errors import ImagesUnsupportedError, RequestError, require
from lily.server.api_translation import API as APIDescription
from lily.server.api_translation import chat_request, openai_error_body, refuse_unknown, sse

if TYPE_CHECKING:
    from lily.api import Lily
    from lily.chat.completions import ChatRequest
    from lily.chat.types import ChatCompletion, ChatCompletionChunk, CompletionUsage
    from lily.server.routes import APIError

# Fields passed on to the chat path unchanged.
CHAT_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "prompt_cache_key",
    "user",
    "safety_identifier",
    "metadata",
    "service_tier",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "chat_template_kwargs",
    "reasoning_budget",
)
FIELDS = (
    *CHAT_FIELDS,
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "text",
    "reasoning",
    "stream",
    "store",
    "truncation",
    "include",
)
# What `POST /v1/responses/input_tokens` takes: the fields that shape the prompt.
COUNT_FIELDS = (
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "truncation",
    "chat_template_kwargs",
)
ROLES = {"user": "user", "system": "system", "developer": "developer", "assistant": "assistant"}
# Content part type -> the roles that may send it.
TEXT_PARTS = {"input_text": ("user", "system", "developer"), "output_text": ("assistant",)}
REFUSED_PARTS = ("input_file", "input_audio")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content(content: Any, role: str, param: str, *, images: bool = False) -> Any:
    """A message's content in chat form: its text, or (where `images` allows them and there
    are some) a list of text and `image_url` parts."""
    if isinstance(content, str):
        return content
    require(isinstance(content, list), "content must be a string or a list of parts", param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        require(isinstance(part, Mapping), "a content part must be an object", where)
        kind = part.get("type")
        if kind == "input_image":
            parts.append(_image_part(part, role, where, images))
            continue
        if kind in REFUSED_PARTS:
            raise RequestError(
                f"content parts of type {kind!r} are not supported; Lily takes text and images",
                param=f"{where}.type",
                code="unsupported_content",
            )
        require(
            role in TEXT_PARTS.get(kind, ()),
            f"a {role} message's parts must be of type "
            + " or ".join(k for k, roles in TEXT_PARTS.items() if role in roles),
            f"{where}.type",
        )
        refuse_unknown(part, ("type", "text", "annotations", "logprobs"), f"{where}.")
        require(isinstance(part.get("text"), str), "a text part needs 'text'", where)
        parts.append({"type": "text", "text": part["text"]})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _image_part(part: Mapping[str, Any], role: str, param: str, allowed: bool) -> dict[str, Any]:
    """An `input_image` part as a chat `image_url` part."""
    if not allowed or role != "user":
        raise ImagesUnsupportedError("only a user message can hold images", param=param)
    refuse_unknown(part, ("type", "image_url", "file_id", "detail"), f"{param}.")
    require(
        part.get("file_id") is None,
        "input_image's file_id needs a files API, which Lily does not have: send image_url "
        "(a data URL)",
        f"{param}.file_id",
    )
    require(isinstance(part.get("image_url"), str), "input_image needs 'image_url'", param)
    image_url = {"url": part["image_url"]}
    if part.get("detail") is not None:
        image_url["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image_url}


class _Conversation:
    """Input items -> chat messages: consecutive function calls (and the reasoning before
    them) join one assistant message, as the chat format has them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []

    def _assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"] = "".join(self._reasoning)
            self._reasoning = []
        return last

    def add(self, item: Any, param: str) -> None:
        require(isinstance(item, Mapping), "an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            refuse_unknown(item, ("type", "role", "content", "id", "status", "phase"), f"{param}.")
            role = item.get("role")
            require(role in ROLES, f"role must be one of {', '.join(ROLES)}", f"{param}.role")
            text = _content(item.get("content"), role, f"{param}.content", images=True)
            if role == "assistant":
                message = self._assistant()
                message["content"] += text
            else:
                self.messages.append({"role": ROLES[role], "content": text})
        elif kind == "function_call":
            refuse_unknown(
                item, ("type", "call_id", "name", "arguments", "id", "status"), f"{param}."
            )
            for name in ("call_id", "name", "arguments"):
                require(isinstance(item.get(name), str), f"needs '{name}'", f"{param}.{name}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            self._assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            refuse_unknown(item, ("type", "call_id", "output", "id", "status"), f"{param}.")
            require(isinstance(item.get("call_id"), str), "needs 'call_id'", f"{param}.call_id")
            output = item.get("output")
            text = (
                output if isinstance(output, str) else _content(output, "user", f"{param}.output")
            )
            self.messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            refuse_unknown(
                item, ("type", "id", "summary", "content", "encrypted_content", "status"),
                f"{param}.",
            )  # fmt: skip
            require(
                item.get("encrypted_content") is None,
                "encrypted reasoning is not supported (Lily never encrypts)",
                f"{param}.encrypted_content",
            )
            parts = item.get("content") or item.get("summary") or []
            require(isinstance(parts, list), "must be a list of text parts", f"{param}.content")
            for j, part in enumerate(parts):
                require(
                    isinstance(part, Mapping) and isinstance(part.get("text"), str),
                    "a reasoning part needs 'text'",
                    f"{param}.content[{j}]",
                )
                self._reasoning.append(part["text"])
        else:
            raise RequestError(
                f"input items of type {kind!r} are not supported",
                param=f"{param}.type",
                code="unsupported_parameter",
            )


def _messages(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    conversation = _Conversation()
    instructions = params.get("instructions")
    if instructions is not None:
        require(isinstance(instructions, str), "instructions must be a string", "instructions")
        conversation.messages.append({"role": "system", "content": instructions})
    items = params.get("input")
    if isinstance(items, str):
        conversation.messages.append({"role": "user", "content": items})
    else:
        require(
            isinstance(items, list) and len(items) > 0,
            "input must be a string or a non-empty list of items",
            "input",
        )
        for i, item in enumerate(items):
            conversation.add(item, f"input[{i}]")
    return conversation.messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    require(isinstance(tools, list), "tools must be a list", "tools")
    translated = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        require(isinstance(tool, Mapping), "a tool must be an object", param)
        if tool.get("type") != "function":
            raise RequestError(
                f"tools of type {tool.get('type')!r} are not supported; give function tools",
                param=f"{param}.type",
                code="unsupported_parameter",
            )
        refuse_unknown(tool, ("type", "name", "description", "parameters", "strict"), f"{param}.")
        require(isinstance(tool.get("name"), str), "a tool needs 'name'", f"{param}.name")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        translated.append({"type": "function", "function": function})
    return translated


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # auto, none, required: the chat path checks it
    require(
        isinstance(choice, Mapping) and choice.get("type") == "function",
        "tool_choice must be auto, none, required or {'type': 'function', 'name': ...}",
        "tool_choice",
    )
    refuse_unknown(choice, ("type", "name"), "tool_choice.")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _text_format(text: Any) -> dict[str, Any] | None:
    require(isinstance(text, Mapping), "text must be an object", "text")
    refuse_unknown(text, ("format",), "text.")
    form = text.get("format")
    if form is None:
        return None
    require(isinstance(form, Mapping), "text.format must be an object", "text.format")
    kind = form.get("type")
    if kind == "json_schema":
        refuse_unknown(form, ("type", "name", "schema", "strict", "description"), "text.format.")
        spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": spec}
    refuse_unknown(form, ("type",), "text.format.")
    return {"type": kind}  # text, json_object; the chat path refuses the rest


def _reasoning(reasoning: Any, chat: dict[str, Any]) -> bool:
    """Sets the effort; returns whether a summary was asked for."""
    require(isinstance(reasoning, Mapping), "reasoning must be an object", "reasoning")
    refuse_unknown(reasoning, ("effort", "summary", "generate_summary"), "reasoning.")
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    require(
        summary in (None, "auto", "concise", "detailed"),
        "summary must be auto, concise or detailed",
        "reasoning.summary",
    )
    return summary is not None


def translate(
    params: dict[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> ResponsesTranslation:
    refuse_unknown(params, FIELDS)
    if params.get("store") is True:
        raise RequestError(
            "store=true is not supported: Lily keeps no responses (send store=false, and the "
            "conversation as input items)",
            param="store",
            code="unsupported_parameter",
        )
    require(params.get("store") in (None, False), "store must be a boolean", "store")
    _check_truncation(params)
    require(params.get("include") in (None, []), "include is not supported", "include")
    chat, summary = _chat_params(params)
    stream = params.get("stream", False)
    chat["stream"] = stream
    if stream is True:
        chat["stream_options"] = {"include_usage": True}  # the final response's usage
    request = dataclasses.replace(chat_request(chat, llm, limits), prompt_param="input")
    return ResponsesTranslation(request, params, llm.model_id, summary=summary)


def input_tokens_request(
    params: dict[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> ChatRequest:
    """The chat request whose prompt `POST /v1/responses/input_tokens` measures: the fields of
    a response that shape its prompt, translated as `translate` does."""
    refuse_unknown(params, COUNT_FIELDS)
    _check_truncation(params)
    chat, _ = _chat_params(params)
    return dataclasses.replace(chat_request(chat, llm, limits), prompt_param="input")


def _check_truncation(params: Mapping[str, Any]) -> None:
    require(
        params.get("truncation") in (None, "disabled"),
        "truncation must be disabled (Lily never drops input)",
        "truncation",
    )


def _chat_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The chat-completions fields of a response's prompt and limits, and whether a reasoning
    summary was asked for."""
    if "input" not in params:
        raise RequestError("input is required", param="input", code="missing_required")
    chat: dict[str, Any] = {name: params[name] for name in CHAT_FIELDS if name in params}
    chat["messages"] = _messages(params)
    if "tools" in params:
        chat["tools"] = _tools(params["tools"])
    if "tool_choice" in params:
        chat["tool_choice"] = _tool_choice(params["tool_choice"])
    if "max_output_tokens" in params:
        chat["max_tokens"] = params["max_output_tokens"]
    if "text" in params:
        form = _text_format(params["text"])
        if form is not None:
            chat["response_format"] = form
    summary = _reasoning(params["reasoning"], chat) if "reasoning" in params else False
    return chat, summary


def _usage(usage: CompletionUsage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    details = usage.completion_tokens_details
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
        "total_tokens": usage.total_tokens,
    }


class ResponsesTranslation:
    """A chat completion's results as a `response` object or its event stream. The output
    items are built piece by piece in both cases (`_reason`, `_say`, `_call`, ...), each piece
    also giving the events a stream sends."""

    def __init__(
        self, request: ChatRequest, params: Mapping[str, Any], model: str, *, summary: bool
    ) -> None:
        self.request = request
        self._params = params
        self._model = model
        self._summary = summary
        self._id = _new_id("resp")
        self._created = time.time()
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._status = "in_progress"
        self._usage: dict[str, Any] | None = None

    # --- the response object ---

    def _response(self) -> dict[str, Any]:
        params = self._params
        tools = [
            {"type": "function", "strict": None, "description": None, "parameters": None, **t}
            for t in params.get("tools", [])
        ]
        text = params.get("text") or {}
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "model": self._model,
            "status": self._status,
            "output": self.output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self._status == "incomplete"
            else None,
            "instructions": params.get("instructions"),
            "metadata": params.get("metadata"),
            "parallel_tool_calls": params.get("parallel_tool_calls", True),
            "tool_choice": params.get("tool_choice", "auto"),
            "tools": tools,
            "temperature": params.get("temperature"),
            "top_p": params.get("top_p"),
            "max_output_tokens": params.get("max_output_tokens"),
            "previous_response_id": None,
            "reasoning": params.get("reasoning"),
            "store": False,
            "text": {"format": text.get("format") or {"type": "text"}},
            "truncation": "disabled",
            "usage": self._usage,
        }

    # --- items, piece by piece ---

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._finish()
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        part = None
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", part))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        return self._event(kind, **self._where(), content_index=0, part=dict(part))

    def _finish(self) -> list[dict[str, Any]]:
        """Closes the item being written: its `.done` events."""
        item, events = self._open, []
        if item is None:
            return events
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=part["text"],
                    logprobs=[],
                )
            )  # fmt: skip
            events.append(self._part_event("response.content_part.done", part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=part["text"]
                )
            )
            events.append(self._part_event("response.content_part.done", part))
            if self._summary:
                item["summary"] = [{"type": "summary_text", "text": part["text"]}]
        elif item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where,
                    name=item["name"], arguments=item["arguments"],
                )
            )  # fmt: skip
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", **where, item=item))
        self._open = None
        return events

    def _reason(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            events += self._start({**item, "status": "in_progress"})
        self._open["content"][0]["text"] += text
        delta = self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                            delta=text)  # fmt: skip
        return [*events, delta]

    def _say(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}
            events += self._start({**item, "status": "in_progress"})
        self._open["content"][0]["text"] += text
        delta = self._event("response.output_text.delta", **self._where(), content_index=0,
                            delta=text, logprobs=[])  # fmt: skip
        return [*events, delta]

    def _call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        return self._start(item)

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        assert self._open is not None and self._open["type"] == "function_call"
        self._open["arguments"] += text
        delta = self._event("response.function_call_arguments.delta", **self._where(), delta=text)
        return [delta]

    def _end(self, finish_reason: str) -> list[dict[str, Any]]:
        events = self._finish()
        self._status = "incomplete" if finish_reason == "length" else "completed"
        if self._status == "incomplete":
            for item in self.output:
                if item["type"] == "message":
                    item["status"] = "incomplete"
        return events

    # --- Translation ---

    def complete(self, result: ChatCompletion) -> dict[str, Any]:
        choice = result.choices[0]
        message = choice.message
        if message.reasoning_content:
            self._reason(message.reasoning_content)
        if message.content:
            self._say(message.content)
        for call in message.tool_calls or []:
            self._call(call.id, call.function.name)
            self._arguments(call.function.arguments)
        self._end(choice.finish_reason)
        self._usage = _usage(result.usage)
        return self._response()

    def events(self, chunk: ChatCompletionChunk) -> Iterable[bytes]:
        events: list[dict[str, Any]] = []
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role is not None:
                events.append(self._event("response.created", response=self._response()))
                events.append(self._event("response.in_progress", response=self._response()))
            if delta.reasoning_content:
                events += self._reason(delta.reasoning_content)
            if delta.content:
                events += self._say(delta.content)
            for call in delta.tool_calls or []:
                function = call.function
                if call.id is not None:
                    events += self._call(call.id, function.name if function else "")
                if function is not None and function.arguments:
                    events += self._arguments(function.arguments)
            if choice.finish_reason is not None:
                events += self._end(choice.finish_reason)
        return [sse(e, e["type"]) for e in events]

    def end(self) -> Iterable[bytes]:
        kind = f"response.{self._status}"  # completed or incomplete
        event = self._event(kind, response=self._response())
        return [sse(event, kind)]

    def failed(self, error: APIError) -> Iterable[bytes]:
        body = error.body()["error"]
        event = self._event("error", code=body["code"], message=body["message"],
                            param=body["param"])  # fmt: skip
        return [sse(event, "error")]


API = APIDescription(translate=translate, error_body=openai_error_body)
