"""Response objects validate as the openai SDK's own types and dump like them."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatCompletionChunk

from lily.chat.tool_calls import ToolCall, ToolCallDelta
from lily.chat.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionTokenLogprob,
    Choice,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionUsage,
    TopLogprob,
)


def logprobs() -> ChoiceLogprobs:
    token = ChatCompletionTokenLogprob(
        token="é",
        logprob=-0.25,
        bytes=list("é".encode()),
        top_logprobs=[TopLogprob("é", -0.25, [195, 169]), TopLogprob("e", -1.5, [101])],
    )
    return ChoiceLogprobs(content=[token])


def completion() -> ChatCompletion:
    call = ChatCompletionMessageToolCall.from_call(ToolCall("call_1", "f", '{"x": 1}'))
    message = ChatCompletionMessage(content="Hi", reasoning_content="think", tool_calls=[call])
    return ChatCompletion(
        choices=[Choice(message=message, finish_reason="tool_calls", logprobs=logprobs())],
        model="mlx-community/Qwen3.6-35B-A3B-4bit",
        usage=CompletionUsage.count(12, 5, cached_tokens=8, reasoning_tokens=2),
    )


def test_completion_validates_as_the_sdk_type():
    ours = completion()
    sdk = SDKChatCompletion.model_validate(ours.model_dump())
    assert sdk.object == "chat.completion" and sdk.id.startswith("chatcmpl-")
    assert sdk.choices[0].message.tool_calls[0].function.arguments == '{"x": 1}'
    assert sdk.choices[0].message.tool_calls[0].type == "function"
    assert sdk.choices[0].logprobs.content[0].top_logprobs[1].token == "e"
    assert sdk.usage.total_tokens == 17 and sdk.usage.prompt_tokens_details.cached_tokens == 8
    assert sdk.usage.completion_tokens_details.reasoning_tokens == 2
    # reasoning_content is an extra field the SDK keeps.
    assert sdk.choices[0].message.reasoning_content == "think"
    # The SDK's own dump of the same data is what we dump.
    assert sdk.model_dump(exclude_none=True) == ours.model_dump(exclude_none=True)


def test_attribute_access_and_json():
    ours = completion()
    assert ours.choices[0].message.content == "Hi"
    assert ours.usage.prompt_tokens_details.cached_tokens == 8
    assert json.loads(ours.model_dump_json()) == ours.model_dump()
    assert json.loads(ours.to_json()) == ours.to_dict()
    assert "\n" not in ours.model_dump_json() and "é" in ours.model_dump_json()
    plain = ChatCompletion(choices=[Choice(ChatCompletionMessage(content="x"), "stop")], model="m")
    dumped = plain.model_dump()
    assert dumped["usage"] is None and dumped["choices"][0]["message"]["tool_calls"] is None
    assert "usage" not in plain.model_dump(exclude_none=True)
    SDKChatCompletion.model_validate(dumped)


@pytest.mark.parametrize("finish_reason", ["stop", "length", "tool_calls"])
def test_finish_reasons_validate(finish_reason):
    done = ChatCompletion(
        choices=[Choice(ChatCompletionMessage(content=""), finish_reason)], model="m"
    )
    assert (
        SDKChatCompletion.model_validate(done.model_dump()).choices[0].finish_reason
        == finish_reason
    )


def test_stream_chunks_validate_as_the_sdk_type():
    common = {"model": "m", "id": "chatcmpl-1", "created": 1_700_000_000}
    chunks = [
        ChatCompletionChunk([ChunkChoice(ChoiceDelta(role="assistant", content=""))], **common),
        ChatCompletionChunk([ChunkChoice(ChoiceDelta(reasoning_content="hmm"))], **common),
        ChatCompletionChunk([ChunkChoice(ChoiceDelta(content="é"), logprobs=logprobs())], **common),
        ChatCompletionChunk(
            [
                ChunkChoice(
                    ChoiceDelta(
                        tool_calls=[
                            ChoiceDeltaToolCall.from_delta(ToolCallDelta(0, "call_1", "f", "")),
                            ChoiceDeltaToolCall.from_delta(ToolCallDelta(0, arguments="{}")),
                        ]
                    )
                )
            ],
            **common,
        ),
        ChatCompletionChunk([ChunkChoice(ChoiceDelta(), finish_reason="tool_calls")], **common),
        ChatCompletionChunk([], usage=CompletionUsage.count(3, 4), **common),
    ]
    sdk = [SDKChatCompletionChunk.model_validate(c.model_dump()) for c in chunks]
    assert all(c.object == "chat.completion.chunk" for c in sdk)
    assert sdk[0].choices[0].delta.role == "assistant"
    assert sdk[1].choices[0].delta.reasoning_content == "hmm"
    first, rest = sdk[3].choices[0].delta.tool_calls
    assert (first.id, first.type, first.function.name) == ("call_1", "function", "f")
    assert (rest.id, rest.type, rest.function.arguments) == (None, None, "{}")
    assert sdk[4].choices[0].finish_reason == "tool_calls"
    assert sdk[5].choices == [] and sdk[5].usage.total_tokens == 7
    for ours, theirs in zip(chunks, sdk, strict=True):
        assert theirs.model_dump(exclude_none=True) == ours.model_dump(exclude_none=True)


def test_stream_deltas_carry_only_their_fields_as_openai_sends_them():
    common = {"model": "m", "id": "chatcmpl-1", "created": 1_700_000_000}
    first = ChatCompletionChunk([ChunkChoice(ChoiceDelta(role="assistant", content=""))], **common)
    text = ChatCompletionChunk([ChunkChoice(ChoiceDelta(content="Hi"))], **common)
    call = ChatCompletionChunk(
        [
            ChunkChoice(
                ChoiceDelta(
                    tool_calls=[ChoiceDeltaToolCall.from_delta(ToolCallDelta(0, arguments="{"))]
                )
            )
        ],
        **common,
    )
    last = ChatCompletionChunk([ChunkChoice(ChoiceDelta(), finish_reason="stop")], **common)
    chunks = (first, text, call, last)
    wire = [json.loads(chunk.model_dump_json())["choices"][0] for chunk in chunks]
    assert [choice["delta"] for choice in wire] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {},
    ]
    # The choice keeps its explicit nulls, as OpenAI's do.
    assert wire[1]["finish_reason"] is None and "logprobs" in wire[1]
    assert wire[3]["finish_reason"] == "stop"
