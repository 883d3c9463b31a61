"""Speculative decoding through the API: `lily.load(speculative=..., draft_tokens=...)`, OpenAI's
Predicted Outputs (`prediction`) in `chat.completions.create` and over HTTP, and the features a
request combines them with (stop strings, tool calls, json_schema, the reasoning budget,
streaming), on the demo model on the sim. Each answer with drafts is compared with the answer
of a model loaded with speculative="off"."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from test_server import RunningServer

import lily
from lily.api import Lily
from lily.chat.completions import parse_request
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import PredictedTokens, SourceCounts, Speculation
from lily.errors import RequestError, UnsupportedParameterError
from lily.server.app import create_app

MAX_SEQ = 256
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The demo's answer to it is text that tokenizes back into the same tokens (not every random
# answer does: one starting inside a UTF-8 character does not), so a prediction can match it.
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def plain():
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, speculative="off") as llm:
        yield llm


@pytest.fixture(scope="module")
def drafting():
    with lily.load(
        "demo", device="sim", max_seq=MAX_SEQ, speculative="ngram", draft_tokens=6
    ) as llm:
        yield llm


def _answer(llm, **params):
    params = {"messages": USER, "max_tokens": 16, "temperature": 0, **NO_THINKING, **params}
    return llm.chat.completions.create(**params)


@pytest.fixture(scope="module")
def expected(plain):
    return _answer(plain)


def test_a_prediction_equal_to_the_answer_is_accepted_almost_whole(plain, drafting, expected):
    content = expected.choices[0].message.content
    r = _answer(drafting, prediction={"type": "content", "content": content})
    assert r.choices[0].message == expected.choices[0].message
    details = r.usage.completion_tokens_details
    # OpenAI's counts: every token of the prediction appeared in the answer.
    assert details.accepted_prediction_tokens == len(drafting.tokenizer.encode(content))
    assert details.rejected_prediction_tokens == 0
    # Without a prediction none of its tokens were taken or left, as OpenAI reports it.
    unpredicted = expected.usage.model_dump()["completion_tokens_details"]
    assert (
        unpredicted["accepted_prediction_tokens"] == unpredicted["rejected_prediction_tokens"] == 0
    )


def test_a_wrong_prediction_changes_nothing(drafting, expected):
    r = _answer(drafting, prediction={"type": "content", "content": "Nothing like the answer."})
    assert r.choices[0].message == expected.choices[0].message
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0
    assert details.rejected_prediction_tokens > 0


def test_a_half_right_prediction_as_text_parts_while_streaming(plain, drafting, expected):
    content = expected.choices[0].message.content
    half = len(content) // 2
    parts = [
        {"type": "text", "text": content[:half]},
        {"type": "text", "text": "~~~" + content[half + 3 :]},
    ]
    chunks = list(
        _answer(
            drafting,
            prediction={"type": "content", "content": parts},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens > 0


def test_stop_strings_with_a_prediction(plain, drafting, expected):
    content = expected.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 3]
    want = _answer(plain, stop=stop)
    got = _answer(drafting, stop=stop, prediction={"type": "content", "content": content})
    assert got.choices[0].message == want.choices[0].message
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "stop"


# Mostly text the grammar forces (keys, separators, the rest of an enum value), which it writes
# in its canonical tokens: a prediction of the answer as text tokenizes into the same tokens.
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "order",
        "schema": {
            "type": "object",
            "properties": {
                "status": {"enum": ["shipped", "delivered", "pending"]},
                "size": {"enum": ["small", "large"]},
            },
            "required": ["status", "size"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
FORCED_CALL = {"type": "function", "function": {"name": "get_weather"}}


def _generated_text(llm, monkeypatch, **params):
    """(the response, the text of the tokens the model generated for it, stop token included):
    a tool call's as the model writes it, for a prediction of it."""
    generate, tokens = llm.engine.generate, []

    def recording(*args, **kwargs):
        for token in generate(*args, **kwargs):
            tokens.append(token.id)
            yield token

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine, "generate", recording)
        response = _answer(llm, **params)
    return response, llm.tokenizer.decode(tokens)


def _same_answer(got, want) -> None:
    """The same text and tool calls (a call's id is random)."""
    got, want = got.choices[0], want.choices[0]
    assert got.message.content == want.message.content
    assert got.finish_reason == want.finish_reason

    def calls(choice):
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]

    assert calls(got) == calls(want)


def _speculations(llm, monkeypatch) -> list:
    """The `Speculation` of each generation `llm` runs from now on (their counts per source)."""
    made, speculation = [], llm.speculation

    def recording(*args, **kwargs):
        made.append(speculation(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(llm, "speculation", recording)
    return made


@pytest.mark.parametrize(
    "params",
    [
        {"response_format": SCHEMA_FORMAT},
        {"tools": [WEATHER_TOOL], "tool_choice": FORCED_CALL},
    ],
    ids=["json_schema", "tool call"],
)
def test_under_a_grammar_a_prediction_is_accepted(plain, drafting, monkeypatch, params):
    """Each verify row draws under the grammar's mask after the drafts before it: the answer is
    plain decoding's, and the prediction of it is accepted."""
    want, generated = _generated_text(plain, monkeypatch, **params)
    got = _answer(drafting, prediction={"type": "content", "content": generated}, **params)
    _same_answer(got, want)
    assert got.usage.completion_tokens_details.accepted_prediction_tokens >= 6


def test_under_a_grammar_prompt_lookup_gives_plain_decoding(plain, drafting, monkeypatch):
    """The tool's name and parameters are in the prompt (the tool list) and the grammar forces
    them: prompt lookup drafts them, and the drafts the grammar rules out are cut."""
    speculations = _speculations(drafting, monkeypatch)
    params = {"tools": [WEATHER_TOOL], "tool_choice": FORCED_CALL}
    got = _answer(drafting, **params)
    _same_answer(got, _answer(plain, **params))
    (lookup,) = [s.counts["ngram"] for s in speculations]
    assert lookup.accepted > 0
    _same_answer(_answer(drafting, response_format=SCHEMA_FORMAT),
                 _answer(plain, response_format=SCHEMA_FORMAT))  # fmt: skip
    _same_answer(_answer(drafting, tools=[WEATHER_TOOL]), _answer(plain, tools=[WEATHER_TOOL]))


def test_a_grammar_after_a_think_block_closed_by_the_reasoning_budget(plain, drafting):
    """The budget closes the generation, the chat layer tells the grammar the block's end and
    resumes: the grammar must have been told exactly the tokens the chat layer got (a closed
    generation takes back the rest: test_speculative's test_tokens_the_caller_never_got_*), and
    the answer after the block is plain decoding's, its prediction accepted."""
    params = dict(messages=USER, max_tokens=30, temperature=0, reasoning_budget=4,
                  response_format=SCHEMA_FORMAT)  # fmt: skip
    want = plain.chat.completions.create(**params)
    content = want.choices[0].message.content
    assert content
    got = drafting.chat.completions.create(
        **params, prediction={"type": "content", "content": content}
    )
    _same_answer(got, want)
    assert got.choices[0].message.reasoning_content == want.choices[0].message.reasoning_content
    assert got.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_seeded_sampled_answer_under_a_grammar_is_reproducible(drafting, monkeypatch):
    format_params = dict(response_format=SCHEMA_FORMAT, max_tokens=40)
    _, generated = _generated_text(drafting, monkeypatch, **format_params)
    params = dict(temperature=0.9, seed=3, prediction={"type": "content", "content": generated},
                  **format_params)  # fmt: skip
    first = _answer(drafting, **params)
    assert _answer(drafting, **params).choices[0].message == first.choices[0].message
    json.loads(first.choices[0].message.content)
    assert first.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_the_prediction_follows_a_think_block_closed_by_the_reasoning_budget(plain, drafting):
    params = dict(messages=USER, max_tokens=20, temperature=0, reasoning_budget=4)
    want = plain.chat.completions.create(**params)
    content = want.choices[0].message.content
    assert content
    got = drafting.chat.completions.create(
        **params, prediction={"type": "content", "content": content}
    )
    assert got.choices[0].message == want.choices[0].message
    assert got.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_speculative_off_counts_the_prediction_as_drafting_does(plain, drafting, expected):
    content = expected.choices[0].message.content
    edited = content[: len(content) // 2] + "~~~" + content[len(content) // 2 + 3 :]
    for prediction in (content, edited):
        params = {"prediction": {"type": "content", "content": prediction}}
        off, on = _answer(plain, **params), _answer(drafting, **params)
        assert off.choices[0].message == expected.choices[0].message
        counts = off.usage.completion_tokens_details
        assert counts == on.usage.completion_tokens_details
        total = counts.accepted_prediction_tokens + counts.rejected_prediction_tokens
        assert total == len(plain.tokenizer.encode(prediction))
        assert (counts.rejected_prediction_tokens == 0) == (prediction == content)


# An answer of the demo that the tokenizer spells in other tokens than the model did (it
# starts inside a UTF-8 character and writes tokens the tokenizer would merge).
RESPELLED = [{"role": "user", "content": "Write a poem about the sea."}]


def test_a_prediction_spelled_in_other_tokens_is_drafted_from_its_text(
    plain, drafting, monkeypatch
):
    want = _answer(plain, messages=RESPELLED, max_tokens=48)
    content = want.choices[0].message.content
    # The model wrote bytes that are not UTF-8, which the answer shows as U+FFFD.
    assert "\ufffd" in content
    by_ids = drafting.tokenizer.encode(content)
    passes: Counter = Counter()  # the generation's passes, verify passes or not
    kept: dict[str, SourceCounts] = {}
    original = Lily.speculation

    def counted(name: str, prediction_of: Any) -> None:
        def speculation(self: Lily, prediction: Any = None) -> Speculation:
            made = original(self, prediction_of(prediction))
            draft = made.draft

            def counting(tokens: list[int], limit: int) -> Any:
                passes[name] += 1  # each pass after the prompt's asks for drafts once
                return draft(tokens, limit)

            monkeypatch.setattr(made, "draft", counting)
            kept[name] = made.counts["prediction"]
            return made

        monkeypatch.setattr(Lily, "speculation", speculation)
        got = _answer(
            drafting,
            messages=RESPELLED,
            max_tokens=48,
            prediction={"type": "content", "content": content},
        )
        assert got.choices[0].message == want.choices[0].message

    counted("text", lambda prediction: prediction)
    counted("token ids", lambda _: PredictedTokens(by_ids, drafting.tokenizer.encode("</think>")))
    # Lined up on text, the 47 tokens after the prompt's take fewer passes than lined up on
    # token ids, and every pass drafts: after a stray byte, past its U+FFFD.
    assert passes["text"] < passes["token ids"]
    assert kept["text"].accepted > kept["token ids"].accepted
    assert kept["text"].passes == passes["text"]


def test_sampled_answers_with_a_prediction_are_reproducible(drafting, expected):
    content = expected.choices[0].message.content
    params = dict(temperature=0.7, seed=5, prediction={"type": "content", "content": content})
    first = _answer(drafting, **params).choices[0].message
    assert _answer(drafting, **params).choices[0].message == first


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ("text", "prediction"),
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content"),
    ],
)
def test_a_malformed_prediction_is_refused_naming_the_field(prediction, param):
    with pytest.raises(RequestError) as error:
        parse_request(
            {"messages": USER, "prediction": prediction},
            served_model="demo",
            default_sampling=SamplingParams(),
        )
    assert error.value.param == param


def test_an_unknown_prediction_field_is_refused():
    with pytest.raises(UnsupportedParameterError, match="prediction.extra"):
        parse_request(
            {"messages": USER, "prediction": {"type": "content", "content": "", "extra": 1}},
            served_model="demo",
            default_sampling=SamplingParams(),
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative": "mtp", "device": "reference"}, "reference engine"),
        ({"speculative": "fast"}, "speculative must be one of"),
        ({"draft_tokens": 12}, "draft_tokens must be 1 to 8"),
        ({"speculative": "ngram", "device": "reference"}, "reference engine"),
        ({"speculative": "ngram", "prefill_chunk": 1}, "prefill_chunk of 1"),
    ],
)
def test_load_refuses_speculative_settings_it_cannot_honour(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lily.load("demo", **{"device": "sim", **kwargs})


def test_auto_is_off_where_drafts_cannot_be_verified():
    with lily.load("demo", device="reference", max_seq=64) as llm:
        assert llm.speculative == "off"


def test_predicted_outputs_over_http(drafting, expected):
    content = expected.choices[0].message.content
    with RunningServer(create_app(drafting)) as server:
        r = server.client().chat.completions.create(
            model="demo",
            messages=USER,
            max_tokens=16,
            temperature=0,
            extra_body=NO_THINKING,
            prediction={"type": "content", "content": content},
        )
        assert r.choices[0].message.content == content
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens is not None
        bad = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": USER, "prediction": {"type": "content", "content": 7}},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"].startswith("prediction")
