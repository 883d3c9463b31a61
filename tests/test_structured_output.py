"""Structured output: response_format and forced tool calls, through the chat facade.

The engine here draws every token from seeded random logits restricted to the constraint's mask
(the `TokenConstraint` protocol the device sampler applies), so the grammar alone decides
whether the answer parses: random logits know nothing of JSON or of the tool-call format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Sequence

import jsonschema
import numpy as np
import pytest

from lily.api import Lily
from lily.chat.structured_output import UnsupportedSchemaError
from lily.chat.tokenizer import Tokenizer
from lily.checkpoint.config import load_config
from lily.checkpoint.loader import resolve_model
from lily.engine.constraint import allowed_flags
from lily.engine.engine import GREEDY
from lily.engine.sampling import GeneratedToken, SamplingParams
from lily.errors import RequestError

# Nested objects, arrays, enums, required fields, numbers and strings (which random tokens fill
# with quotes, backslashes and control characters: escapes).
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 12},
        "status": {"enum": ["pending", "shipped", 'say "hi"']},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "vip": {"type": "boolean"},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number"},
                },
                "required": ["qty", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["id", "status", "customer", "items"],
    "additionalProperties": False,
}
ORDER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "order", "strict": True, "schema": ORDER_SCHEMA},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 20},
                "filters": {
                    "type": "object",
                    "properties": {"tags": {"type": "array", "items": {"type": "integer"}}},
                    "required": ["tags"],
                    "additionalProperties": False,
                },
            },
            "required": ["query"],
        },
    },
}
USER = [{"role": "user", "content": "answer"}]
NO_THINKING = {"reasoning_effort": "none"}


class MaskedRandomEngine:
    """Draws each token from seeded random logits where the constraint allows (all tokens the
    tokenizer has when there is none), and records the masks it was given."""

    def __init__(self, config, token_count: int, max_seq: int = 4096) -> None:
        self.config = config
        self.max_seq = max_seq
        self.token_count = token_count
        self.constraints: list[object] = []

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        snapshot_at: int | Sequence[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        constraint=None,
        cache_key: str | None = None,
        reply_so_far: int = 0,
    ) -> Iterator[GeneratedToken]:
        self.constraints.append(constraint)
        rng = np.random.default_rng([sampling.with_seed().seed, len(prompt)])
        for _ in range(max_new_tokens):
            logits = rng.normal(0.0, 2.0, self.config.vocab_size)
            logits[self.token_count :] = -np.inf
            mask = constraint.allowed_tokens() if constraint is not None else None
            if mask is not None:
                assert mask.dtype == np.uint32 and mask.size == (self.config.vocab_size + 31) // 32
                logits[~allowed_flags(mask, self.config.vocab_size)] = -np.inf
            token = int(np.argmax(logits))
            if constraint is not None:
                constraint.consume(token)
            yield GeneratedToken(token)
            if token in stop_token_ids:
                return

    def cached_prefix_length(self, prompt: Sequence[int], cache_key: str | None = None) -> int:
        return 0

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def demo_dir():
    return resolve_model("demo")


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture
def llm(demo_dir, tokenizer) -> Lily:
    engine = MaskedRandomEngine(load_config(demo_dir), tokenizer.vocab_size)
    return Lily("demo", demo_dir, tokenizer, engine, "masked-random")


def create(llm: Lily, **params):
    return llm.chat.completions.create(messages=USER, **{"max_tokens": 400, **params})


def test_fifty_schema_answers_all_validate(llm):
    answers = []
    for seed in range(50):
        completion = create(llm, response_format=ORDER_FORMAT, seed=seed, **NO_THINKING)
        assert completion.choices[0].finish_reason == "stop"
        answer = json.loads(completion.choices[0].message.content)
        jsonschema.validate(answer, ORDER_SCHEMA)
        answers.append(completion.choices[0].message.content)
    assert len(set(answers)) == 50  # 50 different answers, not one repeated
    assert any("\\" in a for a in answers)  # strings needed escapes, and got them right


def test_fifty_json_object_answers_are_objects(llm):
    for seed in range(50):
        completion = create(llm, response_format={"type": "json_object"}, seed=seed, **NO_THINKING)
        assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_the_closing_stretch_ends_long_answers_inside_max_tokens(llm):
    # Random tokens fill strings for hundreds of tokens; in the last tokens of the budget the
    # answer is steered shut, so it still parses.
    for seed in range(10):
        completion = create(
            llm, response_format={"type": "json_object"}, seed=seed, max_tokens=40, **NO_THINKING
        )
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage.completion_tokens <= 40
        assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_without_the_constraint_random_logits_do_not_make_json(llm):
    completion = create(llm, seed=0, max_tokens=40, **NO_THINKING)
    with pytest.raises(ValueError):
        json.loads(completion.choices[0].message.content or "")


def _validated_calls(message, tools) -> list[tuple[str, dict]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = []
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate(llm, stream):
    tools = [WEATHER, SEARCH]
    counts = set()
    for seed in range(10):
        params = dict(tools=tools, tool_choice="required", seed=seed, **NO_THINKING)
        message, finish = _answer(create(llm, stream=stream, **params), stream)
        assert finish == "tool_calls" and message.content is None
        counts.add(len(_validated_calls(message, tools)))
    assert 1 in counts and max(counts) > 1  # parallel calls are allowed by default


def test_no_further_call_starts_in_the_last_stretch_of_max_tokens(llm):
    """Parallel calls are allowed, but within CLOSING_LOOKAHEAD tokens of max_tokens a complete
    answer ends there: a call started then might not finish (finish_reason "length", a call
    missing its required arguments)."""
    tools = [WEATHER, SEARCH]
    for seed in range(12):
        params = dict(tools=tools, tool_choice="required", seed=seed, **NO_THINKING)
        completion = create(llm, max_tokens=60, **params)
        message, finish = completion.choices[0].message, completion.choices[0].finish_reason
        assert finish == "tool_calls", (seed, message)
        assert len(_validated_calls(message, tools)) == 1


def test_parallel_tool_calls_false_allows_one_call(llm):
    for seed in range(10):
        completion = create(
            llm,
            tools=[WEATHER, SEARCH],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            **NO_THINKING,
        )
        assert len(_validated_calls(completion.choices[0].message, [WEATHER, SEARCH])) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_is_the_one_called(llm, stream):
    choice = {"type": "function", "function": {"name": "search"}}
    for seed in range(10):
        params = dict(tools=[WEATHER, SEARCH], tool_choice=choice, seed=seed, **NO_THINKING)
        message, _ = _answer(create(llm, stream=stream, **params), stream)
        names = {name for name, _ in _validated_calls(message, [WEATHER, SEARCH])}
        assert names == {"search"}


def _answer(result, stream: bool):
    """(message, finish_reason) of a completion, or of a stream accumulated as a client does."""
    if not stream:
        return result.choices[0].message, result.choices[0].finish_reason
    from types import SimpleNamespace

    content, calls, finish = [], {}, None
    for chunk in result:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    message = SimpleNamespace(
        content="".join(content) or None,
        tool_calls=[SimpleNamespace(function=SimpleNamespace(**calls[i])) for i in sorted(calls)],
    )
    return message, finish


def test_auto_with_a_format_answers_or_calls(llm):
    kinds = set()
    for seed in range(20):
        completion = create(
            llm, tools=[WEATHER], response_format={"type": "json_object"}, seed=seed, **NO_THINKING
        )
        message = completion.choices[0].message
        if message.tool_calls:
            _validated_calls(message, [WEATHER])
            kinds.add("call")
        else:
            assert isinstance(json.loads(message.content), dict)
            kinds.add("json")
    assert kinds == {"call", "json"}


def test_thinking_stays_free_and_the_answer_follows_the_think_block(llm, tokenizer):
    completion = create(
        llm, response_format=ORDER_FORMAT, seed=3, extra_body={"reasoning_budget": 30}
    )
    message = completion.choices[0].message
    assert message.reasoning_content  # free text, up to the budget, then Lily closed the block
    assert completion.usage.completion_tokens_details.reasoning_tokens == 30
    jsonschema.validate(json.loads(message.content), ORDER_SCHEMA)


def test_the_end_of_turn_is_banned_while_thinking(llm, tokenizer):
    grammar_request = create(llm, response_format={"type": "json_object"}, seed=1, max_tokens=20)
    assert grammar_request.choices[0].finish_reason == "length"  # never ended while thinking
    constraint = llm.engine.constraints[-1]
    assert constraint.in_reasoning
    allowed = allowed_flags(constraint.allowed_tokens(), llm.engine.config.vocab_size)
    stop = tokenizer.token_to_id("<|im_end|>")
    assert not allowed[stop] and allowed[tokenizer.token_to_id("</think>")]


def test_text_and_no_tools_need_no_constraint(llm):
    create(llm, response_format={"type": "text"}, seed=0, max_tokens=5)
    create(llm, tools=[WEATHER], tool_choice="none", seed=0, max_tokens=5)
    assert llm.engine.constraints == [None, None]


@pytest.mark.parametrize(
    "params, param, words",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "array", "uniqueItems": True},
                    },
                }
            },
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "required"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
            "nope",
        ),
        ({"parallel_tool_calls": "yes", "tools": [WEATHER]}, "parallel_tool_calls", "boolean"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "string", "pattern": "^x+$"}},
                            },
                        },
                    }
                ],
            },
            "tools[0].function.parameters.properties.a",
            "pattern",
        ),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(llm, params, param, words):
    with pytest.raises(RequestError) as info:
        create(llm, **params)
    assert info.value.param == param
    assert words in info.value.message
    assert llm.engine.constraints == []  # refused before any generation


def forced_tool(parameters: dict, name: str = "f") -> dict:
    tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
    return {"tools": [tool], "tool_choice": "required"}


def with_property(schema: dict, **outer) -> dict:
    return {"type": "object", "properties": {"a": schema}, "required": ["a"], **outer}


@pytest.mark.parametrize(
    "params, param, words",
    [
        (forced_tool(with_property({"type": "string"}, required=5)),
         "tools[0].function.parameters.required", "must be a list"),
        (forced_tool(with_property({"type": "string"}, required=[[1]])),
         "tools[0].function.parameters.required", "property names"),
        (forced_tool(with_property({"enum": 5})),
         "tools[0].function.parameters.properties.a.enum", "must be a list"),
        (forced_tool(with_property({"type": "string", "minLength": -1})),
         "tools[0].function.parameters.properties.a.minLength", "non-negative"),
        (forced_tool(with_property({"type": "string", "minLength": 70000})),
         "tools[0].function.parameters.properties.a.minLength", "above 1000"),
        (forced_tool(with_property({"type": "string", "enum": ["x</parameter>y", "z"]})),
         "tools[0].function.parameters.properties.a", "</parameter>"),
        (forced_tool({"type": "object", "properties": {}}, name='f">\n</tool_call>'),
         "tools[0].function.name", "1 to 64 letters"),
        (forced_tool({"type": "object", "properties": {}}, name="x" * 65),
         "tools[0].function.name", "1 to 64 letters"),
        ({"response_format": {"type": "json_object", "schema": {"type": "object"}}},
         "response_format.schema", "takes no 'schema'"),
        ({"response_format": {"type": "text", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "takes no 'json_schema'"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("thinking", [{}, NO_THINKING], ids=["thinking", "no-thinking"])
def test_schemas_the_engine_cannot_run_are_400s_naming_the_field(
    llm, params, param, words, thinking
):
    with pytest.raises(RequestError) as info:
        create(llm, **params, **thinking)
    assert info.value.status == 400
    assert info.value.param == param
    assert words in info.value.message
    assert len(info.value.message) < 600  # the first line of an engine error, never a grammar
    assert llm.engine.constraints == []  # refused before any generation


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_no_finite_answer_satisfies_is_a_400_not_a_500(llm, stream):
    """A required self-reference: the grammar engine gives up once the answer reaches it (its
    budget for forced text runs out), which is the schema's fault: a 400 naming tools, with the
    first line of the engine's message and the grammar's digest, not the grammar itself."""
    endless = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]}
    tool = forced_tool({**with_property({"$ref": "#/$defs/n"}), "$defs": {"n": endless}})
    with pytest.raises(UnsupportedSchemaError) as info:
        result = create(llm, seed=0, stream=stream, **tool, **NO_THINKING)
        if stream:
            list(result)
    assert (info.value.status, info.value.param) == (400, "tools")
    assert "cannot be enforced" in info.value.message and "grammar " in info.value.message
    assert len(info.value.message) < 600


def test_the_closing_stretch_ends_strings_held_to_a_format_or_pattern(llm):
    """Random logits fill a string held to a format or a pattern until max_tokens draws near;
    the stretch must then write what the format still needs before the closing quote (a quote
    alone does not fit there), so the answer parses and validates."""
    schema = {
        "type": "object",
        "properties": {
            "href": {"type": "string", "format": "uri"},
            "mail": {"type": "string", "format": "email"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,}$"},
        },
        "required": ["href", "mail", "code"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "links", "schema": schema}}
    for seed in range(6):
        completion = create(llm, response_format=fmt, seed=seed, max_tokens=160, **NO_THINKING)
        answer = completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop", (seed, answer)
        value = json.loads(answer)
        checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        checker.validate(value)


def test_listed_values_are_written_and_read_back_as_listed(llm):
    """A parameter listing its values through anyOf/oneOf of consts is a choice among them
    (5,000 of them too: one lexeme, not 5,000 grammar alternatives in a row, which the engine
    refuses), written raw for strings and read back as the string, not as a quoted JSON text."""
    codes = [f"v{i}" for i in range(5000)]
    parameters = {
        "type": "object",
        "properties": {
            "code": {"anyOf": [{"const": c} for c in codes]},
            "level": {"oneOf": [{"const": 1}, {"const": 2.5}, {"enum": [True, None]}]},
        },
        "required": ["code", "level"],
    }
    llm.engine.max_seq = 200_000  # the template lists every value in the prompt
    for seed in range(4):
        completion = create(llm, seed=seed, max_tokens=64, **forced_tool(parameters), **NO_THINKING)
        [call] = completion.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert arguments["code"] in codes
        assert arguments["level"] in (1, 2.5, True, None)


def test_strict_schemas_use_every_keyword_the_engine_enforces(llm):
    """oneOf, minProperties and maxProperties are enforced under strict; only what the grammar
    engine cannot enforce (not, if/then/else, uniqueItems) is refused, by name."""
    enforced = {
        "type": "object",
        "properties": {
            "id": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
            "tags": {"type": "object", "additionalProperties": {"type": "boolean"},
                     "minProperties": 1, "maxProperties": 2},
        },
        "required": ["id", "tags"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": enforced, "strict": True}}
    for seed in range(4):
        answer = create(llm, response_format=fmt, seed=seed, max_tokens=120, **NO_THINKING)
        jsonschema.validate(json.loads(answer.choices[0].message.content), enforced)
    for keyword, schema in [
        ("not", {"type": "object", "not": {"required": ["a"]}}),
        ("if", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
    ]:
        refused = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        create(llm, response_format=refused, seed=0, max_tokens=20, **NO_THINKING)  # lenient
        refused["json_schema"]["strict"] = True
        with pytest.raises(UnsupportedSchemaError, match=keyword):
            create(llm, response_format=refused, seed=0, max_tokens=20, **NO_THINKING)


def test_a_huge_non_strict_max_length_is_left_unchecked_not_refused(llm):
    tool = forced_tool(with_property({"type": "string", "maxLength": 5_000_000}))
    call = create(llm, seed=0, **tool, **NO_THINKING).choices[0].message.tool_calls[0]
    assert call.function.name == "f"


def test_a_non_strict_schema_is_enforced_as_far_as_the_engine_goes(llm):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}
    for seed in range(5):
        answer = json.loads(
            create(llm, response_format=fmt, seed=seed, **NO_THINKING).choices[0].message.content
        )
        # uniqueItems is not enforced (llguidance does not implement it); the rest is.
        assert isinstance(answer, list) and len(answer) <= 3
        assert all(isinstance(x, int) for x in answer)
    with pytest.raises(UnsupportedSchemaError):
        strict = {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}
        create(llm, response_format=strict)


class LookaheadEngine(MaskedRandomEngine):
    """`MaskedRandomEngine`, but before every draw it walks the constraint up to 8 tokens ahead
    (as a verify pass's drafts: a mask asked before each, stopping at a stop token; `favoured`,
    when allowed, half the time) and takes them back with `rollback`; it records every mask the
    draws were given."""

    def __init__(self, config, token_count: int, favoured: int) -> None:
        super().__init__(config, token_count)
        self.favoured = favoured
        self.masks: list[np.ndarray] = []
        self._walk = np.random.default_rng(0)

    def generate(self, prompt, max_new_tokens, stop_token_ids=(), sampling=GREEDY, *args,
                 constraint=None, **kwargs):  # fmt: skip
        if constraint is not None:
            constraint = _Walking(constraint, self, stop_token_ids)
        yield from super().generate(prompt, max_new_tokens, stop_token_ids, sampling, *args,
                                    constraint=constraint, **kwargs)  # fmt: skip


class _Walking:
    def __init__(self, constraint, engine: LookaheadEngine, stop_token_ids) -> None:
        self.constraint, self.engine, self.stop_token_ids = constraint, engine, stop_token_ids

    def allowed_tokens(self):
        constraint, vocab = self.constraint, self.engine.config.vocab_size
        mask = constraint.allowed_tokens().copy()
        walked = 0
        for _ in range(int(self.engine._walk.integers(1, 9))):
            allowed = np.flatnonzero(allowed_flags(constraint.allowed_tokens(), vocab))
            token = int(self.engine._walk.choice(allowed))
            if self.engine.favoured in allowed and self.engine._walk.random() < 0.5:
                token = self.engine.favoured
            constraint.consume(token)
            walked += 1
            if token in self.stop_token_ids:
                break
        constraint.rollback(walked)
        np.testing.assert_array_equal(constraint.allowed_tokens(), mask)
        self.engine.masks.append(mask)
        return mask

    def consume(self, token: int) -> None:
        self.constraint.consume(token)


@pytest.mark.parametrize(
    "params",
    [
        dict(response_format=ORDER_FORMAT, max_tokens=90, extra_body={"reasoning_budget": 12}),
        dict(tools=[WEATHER, SEARCH], tool_choice="required", max_tokens=120, **NO_THINKING),
    ],
    ids=["json_schema after thinking", "tool calls"],
)
def test_a_grammar_taken_back_after_a_lookahead_is_as_before(demo_dir, tokenizer, llm, params):
    """A verify pass tells the grammar its drafts and takes back those rejected: after walking
    ahead (through forced text, the end of the think block, the closing stretch near
    max_tokens, the end of turn) and back, the mask is the one before the walk, and the answer
    (random logits under the masks) that of a grammar that never walked (a call's id is
    random)."""
    # The walk often ends the think block, and comes back into it.
    think_end = tokenizer.token_to_id("</think>")
    walking = LookaheadEngine(load_config(demo_dir), tokenizer.vocab_size, think_end)
    walked = Lily("demo", demo_dir, tokenizer, walking, "masked-random")
    for seed in range(3):
        want = create(llm, seed=seed, **params).choices[0]
        got = create(walked, seed=seed, **params).choices[0]
        assert got.message.content == want.message.content
        assert got.finish_reason == want.finish_reason
        calls = [[(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
                 for choice in (got, want)]  # fmt: skip
        assert calls[0] == calls[1]
    assert len(walking.masks) > 100


def test_a_format_json_schema_does_not_define_is_an_annotation(llm):
    schema = {
        "type": "object",
        "properties": {
            "phone": {"type": "string", "format": "phone-number", "maxLength": 12},
            "format": {"type": "integer", "format": "int32"},  # a property named "format" too
        },
        "required": ["phone", "format"],
        "additionalProperties": False,
    }
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "contact", "strict": True, "schema": schema},
    }
    completion = create(llm, response_format=response_format, seed=0, **NO_THINKING)
    answer = json.loads(completion.choices[0].message.content)
    jsonschema.validate(answer, schema)  # (jsonschema ignores such formats too)
    tool = {
        "type": "function",
        "function": {
            "name": "call",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "string", "format": "phone-number"}},
                "required": ["number"],
            },
        },
    }
    message, finish = _answer(
        create(llm, tools=[tool], tool_choice="required", **NO_THINKING), False
    )
    assert finish == "tool_calls" and message.tool_calls[0].function.name == "call"
    with pytest.raises(UnsupportedSchemaError):  # a defined format is still held to strict
        defined = {"type": "string", "format": "date-time"}
        tool["function"]["parameters"]["properties"]["number"] = defined
        create(llm, tools=[tool], tool_choice="required", **NO_THINKING)


def test_a_remote_ref_is_refused_up_front_naming_its_owner(llm):
    remote = "other.json#/$defs/id"
    schema = {"type": "object", "properties": {"id": {"items": {"$ref": remote}}}}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
    for choice in ("auto", "required", "none"):
        with pytest.raises(RequestError) as refused:
            create(llm, tools=[tool], tool_choice=choice, **NO_THINKING)
        assert refused.value.param == "tools[0].function.parameters.properties.id.items.$ref"
        assert str(refused.value).startswith(f"tool 'lookup': the $ref {remote!r} points outside")
    response_format = {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}
    with pytest.raises(RequestError) as refused:
        create(llm, response_format=response_format, **NO_THINKING)
    assert refused.value.param == "response_format.json_schema.schema.properties.id.items.$ref"
    assert str(refused.value).startswith("response format 'row': the $ref")
    # A property named "$ref" and a `const` holding one are no references.
    named = {"type": "object", "properties": {"$ref": {"const": {"$ref": remote}}}}
    tool["function"]["parameters"] = named
    create(llm, tools=[tool], tool_choice="auto", **NO_THINKING)
    # A reference inside the schema is followed.
    local = {
        "type": "object",
        "properties": {"id": {"$ref": "#/$defs/id"}},
        "required": ["id"],
        "$defs": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
    }
    tool["function"]["parameters"] = local
    message, finish = _answer(
        create(llm, tools=[tool], tool_choice="required", seed=0, **NO_THINKING), False
    )
    assert finish == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments)["id"] in range(1, 10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_that_ends_exactly_at_max_tokens_finishes_with_tool_calls(llm, stream):
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    forced = dict(
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "now"}},
        parallel_tool_calls=False,
        seed=0,
        **NO_THINKING,
    )
    whole = create(llm, **forced)
    assert whole.choices[0].finish_reason == "tool_calls"
    # Without the end-of-turn token the call is all there is to generate.
    exact = whole.usage.completion_tokens - 1
    message, finish = _answer(create(llm, stream=stream, max_tokens=exact, **forced), stream)
    assert finish == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["now"]
