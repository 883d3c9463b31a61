"""Response objects shaped like the `openai` SDK's chat types, without depending on it.

Users switch between Lily and an OpenAI-compatible server without changing their code, so the
objects have the SDK's field names and nesting, attribute access, and `model_dump()` /
`to_dict()` / `model_dump_json()` / `to_json()`. A dump validates as the SDK's own type
(`openai.types.chat.ChatCompletion.model_validate(obj.model_dump())`). They are plain
dataclasses: pydantic is not a runtime dependency. Like the SDK (and vLLM, SGLang), messages and
deltas carry the non-standard `reasoning_content` for the model's thinking.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from lily.chat.tool_calls import ToolCall, ToolCallDelta

FinishReason = Literal["stop", "length", "tool_calls"]


# Marks a field that other APIs' translations read and no dump shows (`field(metadata=...)`).
INTERNAL = {"internal": True}
# Marks a Lily extension that dumps show only when it is set.
EXTENSION = {"omit_none": True}


def _dump(value: Any, exclude_none: bool) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        omit_none = exclude_none or getattr(value, "omits_none", False)
        for f in dataclasses.fields(value):
            if f.metadata.get("internal"):
                continue  # for Lily's other APIs (`INTERNAL`), not part of OpenAI's shape
            item = getattr(value, f.name)
            if item is None and (omit_none or f.metadata.get("omit_none")):
                continue
            out[f.name] = _dump(item, exclude_none)
        return out
    if isinstance(value, (list, tuple)):
        return [_dump(item, exclude_none) for item in value]
    return value


class OpenAIObject:
    """Serialization shared by every response object (the SDK's method names)."""

    def model_dump(self, *, exclude_none: bool = False) -> dict[str, Any]:
        """Plain nested dicts and lists; `None` fields are kept unless `exclude_none`."""
        return _dump(self, exclude_none)

    def to_dict(self, *, exclude_none: bool = False) -> dict[str, Any]:
        return self.model_dump(exclude_none=exclude_none)

    def model_dump_json(self, *, exclude_none: bool = False, indent: int | None = None) -> str:
        """Compact JSON by default (what an SSE `data:` line carries); non-ASCII kept."""
        separators = (",", ":") if indent is None else None
        return json.dumps(
            self.model_dump(exclude_none=exclude_none),
            ensure_ascii=False,
            indent=indent,
            separators=separators,
        )

    def to_json(self, *, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


@dataclass
class PromptTokensDetails(OpenAIObject):
    # Prompt tokens whose state came from the prefix cache instead of being prefilled.
    cached_tokens: int = 0


@dataclass
class CompletionTokensDetails(OpenAIObject):
    reasoning_tokens: int = 0
    # The tokens of the request's `prediction` (OpenAI's Predicted Outputs) that the answer
    # took, and those it did not: 0 without a prediction, as OpenAI reports them.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass
class CompletionUsage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def count(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        reasoning_tokens: int | None = None,
        prediction_tokens: tuple[int, int] | None = None,
    ) -> CompletionUsage:
        """Usage with the total filled in; reasoning tokens are reported when counted, and the
        (accepted, rejected) tokens of a prediction when one was given (else 0 and 0)."""
        details = None
        if reasoning_tokens is not None or prediction_tokens is not None:
            details = CompletionTokensDetails(reasoning_tokens or 0)
            if prediction_tokens is not None:
                accepted, rejected = prediction_tokens
                details.accepted_prediction_tokens = accepted
                details.rejected_prediction_tokens = rejected
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=details,
        )


@dataclass
class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    # The token's raw bytes (a token may be part of a multi-byte character).
    bytes: list[int] | None = None


@dataclass
class ChatCompletionTokenLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class ChoiceLogprobs(OpenAIObject):
    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


@dataclass
class Function(OpenAIObject):
    name: str
    # A JSON object as text, exactly as OpenAI sends it.
    arguments: str


@dataclass
class ChatCompletionMessageToolCall(OpenAIObject):
    id: str
    function: Function
    type: Literal["function"] = "function"

    @classmethod
    def from_call(cls, call: ToolCall) -> ChatCompletionMessageToolCall:
        return cls(id=call.id, function=Function(name=call.name, arguments=call.arguments))


@dataclass
class ChatCompletionMessage(OpenAIObject):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    refusal: str | None = None
    role: Literal["assistant"] = "assistant"


@dataclass
class IncompleteToolCall(OpenAIObject):
    """A tool call that max_tokens cut short (Lily's extension, on a choice and on a stream's
    last chunk): it is not in `tool_calls`, since it cannot be run. `index` is the one its
    streamed pieces had, `arguments` what was streamed of them: the parameters written in full,
    without the closing brace. `id` is None when even the name was unfinished (nothing of the
    call was streamed)."""

    index: int
    id: str | None
    name: str
    arguments: str

    @classmethod
    def from_call(cls, index: int, call: ToolCall) -> IncompleteToolCall:
        return cls(index=index, id=call.id or None, name=call.name, arguments=call.arguments)


@dataclass
class Choice(OpenAIObject):
    message: ChatCompletionMessage
    finish_reason: FinishReason
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    # The stop string that ended the answer (Anthropic's `stop_sequence`); never dumped.
    stop_sequence: str | None = field(default=None, metadata=INTERNAL, repr=False)
    incomplete_tool_call: IncompleteToolCall | None = field(default=None, metadata=EXTENSION)


@dataclass
class ChatCompletion(OpenAIObject):
    """The result of a non-streaming `chat.completions.create`."""

    choices: list[Choice]
    model: str
    usage: CompletionUsage | None = None
    id: str = field(default_factory=new_completion_id)
    created: int = field(default_factory=_now)
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


# A stream's deltas carry only what they say, as OpenAI sends them: `{"content": "Hi"}`, not
# `{"role": null, "content": "Hi", "tool_calls": null, ...}`. Clients read them with
# `delta.get("tool_calls", [])`, which an explicit null breaks. (Attribute access, and the
# SDK's parsing, see None either way.)
class _OmitsNone:
    omits_none = True


@dataclass
class ChoiceDeltaToolCallFunction(_OmitsNone, OpenAIObject):
    name: str | None = None
    arguments: str | None = None


@dataclass
class ChoiceDeltaToolCall(_OmitsNone, OpenAIObject):
    index: int
    id: str | None = None
    function: ChoiceDeltaToolCallFunction | None = None
    type: Literal["function"] | None = None

    @classmethod
    def from_delta(cls, delta: ToolCallDelta) -> ChoiceDeltaToolCall:
        """A streamed tool-call piece; the first piece of a call carries its id and type."""
        return cls(
            index=delta.index,
            id=delta.id,
            function=ChoiceDeltaToolCallFunction(name=delta.name, arguments=delta.arguments),
            type="function" if delta.id is not None else None,
        )


@dataclass
class ChoiceDelta(_OmitsNone, OpenAIObject):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None
    refusal: str | None = None


@dataclass
class ChunkChoice(OpenAIObject):
    delta: ChoiceDelta
    index: int = 0
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None
    # On the last chunk of a choice: the stop string that ended it; never dumped.
    stop_sequence: str | None = field(default=None, metadata=INTERNAL, repr=False)
    # On the last chunk of a choice that max_tokens cut inside a tool call.
    incomplete_tool_call: IncompleteToolCall | None = field(default=None, metadata=EXTENSION)


@dataclass
class ChatCompletionChunk(OpenAIObject):
    """One streamed event. With `stream_options={"include_usage": True}` the last chunk has
    `choices=[]` and `usage` set; every chunk of one stream shares `id` and `created`."""

    choices: list[ChunkChoice]
    model: str
    id: str
    created: int
    usage: CompletionUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    # On a stream's first chunk: the prompt's tokens and the cached ones, known before the
    # answer starts (Anthropic's `message_start` reports them); never dumped.
    prompt_usage: CompletionUsage | None = field(default=None, metadata=INTERNAL, repr=False)
