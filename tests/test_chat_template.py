"""Chat template rendering: the documented Qwen3.6 format, and the same prompt transformers'
`apply_chat_template` renders from the same template (transformers is the oracle)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import transformers  # installed with mlx-lm; the reference renderer

from lily.chat.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits
from lily.errors import ChatTemplateLimitError, ChatTemplateRefusedError, RequestError

TEMPLATE_PATH = Path(__file__).resolve().parent / "chat_template_qwen.jinja"
DEMO_DIR = resources.files("lily").joinpath("data/demo")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather & forecast <for a city>",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Ville, e.g. Zürich"},
                "days": {"type": "integer"},
                "units": {"type": "object"},
            },
            "required": ["city"],
        },
    },
}

# One tool round trip: the assistant thinks, calls the tool (arguments as the JSON string
# OpenAI clients send), gets two results back, and the user asks a follow-up.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "\nI should call the tool.\n",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "Zürich", "days": 2, "units": {"t": "C"}}),
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_1", "content": "tomorrow: rain"},
]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(TEMPLATE_PATH.read_text(), special_tokens={"eos_token": "<|im_end|>"})


def test_single_turn_opens_a_think_block_by_default(template):
    prompt = template.render([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_thinking_off_writes_an_empty_think_block(template):
    prompt = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Explicitly on is the same as the default.
    on = template.render([{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert on == template.render([{"role": "user", "content": "Hi"}])


def test_no_generation_prompt(template):
    prompt = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_are_listed_in_the_system_turn(template):
    prompt = template.render(TOOL_CONVERSATION[:2], tools=[WEATHER_TOOL])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n")
    # tojson as transformers does it: no HTML escaping, non-ASCII kept.
    schema = json.dumps(WEATHER_TOOL["function"], ensure_ascii=False)
    assert f"<tools>\n{schema}\n</tools>" in system
    assert "<function=" in system and "<parameter=" in system


def test_tool_calls_and_results_use_the_documented_format(template):
    prompt = template.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    call = (
        "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n"
        '<parameter=units>\n{"t": "C"}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
    )
    results = (
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\ntomorrow: rain\n</tool_response><|im_end|>\n"
    )
    assert prompt.endswith(call + results + "<|im_start|>assistant\n<think>\n")
    # The caller's messages are not modified (arguments stay a JSON string).
    assert isinstance(TOOL_CONVERSATION[2]["tool_calls"][0]["function"]["arguments"], str)


def test_earlier_turns_drop_their_think_blocks(template):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    prompt = template.render(messages)
    assert "add them" not in prompt
    assert "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?" in prompt
    kept = template.render(messages, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>" in kept


def test_think_blocks_after_the_last_query_are_kept(template):
    # Tool results come back as a user turn; they do not count as a new query.
    prompt = template.render(TOOL_CONVERSATION + [{"role": "assistant", "content": "Sunny."}])
    assert prompt.count("<think>") == 3  # both assistant turns plus the generation prompt
    follow_up = TOOL_CONVERSATION + [
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    assert "I should call the tool" not in template.render(follow_up)


def test_template_refusals_become_chat_template_errors(template):
    with pytest.raises(ChatTemplateError, match="Unknown message role"):
        template.render([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="user message is required"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="Only text and image content"):
        template.render([{"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(ChatTemplateError, match="System message cannot contain images"):
        template.render(
            [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}]
        )
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
        template.render(
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [bad]}]
        )


def test_environment_matches_transformers_semantics():
    source = (
        "{{ messages[0].content | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}|"
        "{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ custom }}\n"
        "  {% if true %}\n"
        "kept\n"
        "  {% endif %}\n"
    )
    rendered = ChatTemplate(source, special_tokens={"eos_token": "<E>"}).render(
        [{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "x"}],
        custom="extra kwarg",
    )
    # trim_blocks and lstrip_blocks swallow the block lines; no HTML escaping in tojson.
    assert rendered == '"<é>"|{\n  "a": [\n    1,\n    2\n  ]\n}|user|<E>|4|extra kwarg\nkept\n'


def test_the_sandbox_is_immutable():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_template_is_found_next_to_the_checkpoint(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A{{ 1 }}"}))
    assert ChatTemplate.from_dir(tmp_path).render([]) == "A1"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.from_dir(tmp_path).render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_dir(tmp_path).render([]) == "J"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path / "missing")


def test_the_demo_template_is_the_test_template():
    assert DEMO_DIR.joinpath("chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()


CONVERSATIONS = {
    "single": ([{"role": "user", "content": "Hello there"}], None),
    "multi_turn": (
        [
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "r1"},
            {"role": "user", "content": "c"},
        ],
        None,
    ),
    "tools": (TOOL_CONVERSATION, [WEATHER_TOOL]),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, False])
def test_renders_like_transformers(template, name, thinking):
    messages, tools = CONVERSATIONS[name]
    hf = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    # transformers wants tool-call arguments as mappings already.
    hf_messages = json.loads(json.dumps(messages))
    for message in hf_messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = hf.apply_chat_template(
        hf_messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert template.render(messages, tools=tools, enable_thinking=thinking) == expected


# -- bounds and named failures -----------------------------------------------------------------

USER_HI = [{"role": "user", "content": "hi"}]
# Small bounds keep the checks fast; the defaults are only larger.
SMALL = TemplateLimits(max_steps=20_000, max_seconds=60, max_chars=1 << 20, max_built_chars=8 << 20)


def limit_hit(source: str, limits: TemplateLimits = SMALL) -> str:
    with pytest.raises(ChatTemplateLimitError) as info:
        ChatTemplate(source, limits=limits).render(USER_HI)
    return info.value.limit


def test_a_template_that_loops_for_years_stops_at_its_step_budget():
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    assert limit_hit(nested) == "max_steps"
    recursive_loop = (
        "{% for m in [[1, [2]]] recursive %}{{ loop(m if m is iterable else []) }}{% endfor %}"
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
    )
    assert limit_hit(recursive_loop) == "max_steps"
    filtered = (
        "{% for a in range(100000) %}{% for b in range(100000) if b < 0 %}{% endfor %}{% endfor %}"
    )
    assert limit_hit(filtered) == "max_steps"


def test_a_template_that_loops_stops_at_its_deadline():
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    deadline = TemplateLimits(max_steps=10**12, max_seconds=0.5)
    assert limit_hit(nested, deadline) == "max_seconds"


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**12 }}",
        "{{ ([1] * 100000) * 100000 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{{ 'x' | center(10**11) }}",
        "{{ 'x'.ljust(10**11) }}",
        "{{ '%099999999999d' % 1 }}",
        "{{ '{:>99999999999}'.format(1) }}",
        "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}",
        "{% set s = 'x' * 100000 %}{{ ([s] * 1000) | join }}",
        "{% set s = 'x' * 100000 %}{{ ''.join([s] * 1000) }}",
        "{% set s = 'y\n' * 100000 %}{{ s | indent('x' * 100) }}",
        # Output buffered inside a {% set %} block, never reaching the prompt.
        "{% set s = 'y' * 500000 %}{% set b %}{% for i in range(1000) %}{{ s }}{% endfor %}"
        "{% endset %}",
        "{% macro m(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
        "{% for i in range(40) %}{% set ns.s = m(ns.s) %}{% endfor %}",
    ],
)
def test_a_growing_template_is_stopped_by_size_before_it_allocates(source):
    # Each of these would allocate gigabytes or more; "memory" would mean the check came late.
    assert limit_hit(source) in ("max_chars", "max_built_chars")


def test_integer_arithmetic_is_bounded():
    squaring = (
        "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}"
    )
    assert limit_hit(squaring) == "integer_bits"
    assert limit_hit("{{ 10 ** 100000 }}") == "integer_bits"
    assert ChatTemplate("{{ 2 ** 64 }}").render(USER_HI) == str(2**64)


def test_the_prompt_itself_is_bounded():
    template = ChatTemplate("{{ messages[0].content }}", limits=SMALL)
    big = [{"role": "user", "content": "x" * (SMALL.max_chars + 1)}]
    with pytest.raises(ChatTemplateLimitError) as info:
        template.render(big)
    assert info.value.limit == "max_chars"


def test_the_default_limits_leave_room_for_long_conversations(template):
    """The Qwen-format template on 2001 messages with tools stays within the defaults, and
    within a budget far smaller than them (so the defaults are not tight)."""
    long = [{"role": "user", "content": "first question"}]
    for i in range(1000):
        long += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": "q"}]
    assert template.render(long, tools=[WEATHER_TOOL]).count("<|im_start|>") == 1 + 2001 + 1
    frugal = ChatTemplate(template.source, limits=TemplateLimits(max_steps=20_000))
    assert frugal.render(long, tools=[WEATHER_TOOL]) == template.render(long, tools=[WEATHER_TOOL])


def test_failures_inside_the_template_are_named_refusals():
    recursion = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    with pytest.raises(ChatTemplateRefusedError, match="recursed too deeply"):
        ChatTemplate(recursion).render(USER_HI)
    with pytest.raises(ChatTemplateRefusedError, match="TypeError") as info:
        ChatTemplate("{% for k, v in messages[0].content | items %}{% endfor %}").render(USER_HI)
    # A refusal is the request's to fix: a 400 naming the messages.
    assert isinstance(info.value, RequestError)
    assert (info.value.status, info.value.param) == (400, "messages")


@pytest.mark.parametrize(
    "source", ["{% include 'other.jinja' %}", "{% import 'm.jinja' as m %}", "{% extends 'b' %}"]
)
def test_templates_that_load_other_templates_are_refused_at_load(source):
    with pytest.raises(ChatTemplateError, match="self-contained"):
        ChatTemplate(source)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_steps"):
        TemplateLimits(max_steps=0)


def test_what_the_template_reads(template):
    assert {"enable_thinking", "preserve_thinking"} <= template.keyword_variables
    assert not {"messages", "tools", "add_generation_prompt", "eos_token", "raise_exception"} & (
        template.keyword_variables
    )
    assert {"role", "content", "reasoning_content", "tool_calls"} <= template.message_fields
    assert not template.knows_developer_role


def test_reserved_variables_cannot_be_set_by_keywords(template):
    # (messages, tools and add_generation_prompt are render's own parameters.)
    for name in ("documents", "eos_token"):
        with pytest.raises(ChatTemplateRefusedError, match=name):
            template.render(USER_HI, **{name: "x"})


def test_developer_messages_are_system_messages_where_the_template_lacks_the_role(template):
    as_developer = [{"role": "developer", "content": "Be brief."}, *USER_HI]
    as_system = [{"role": "system", "content": "Be brief."}, *USER_HI]
    assert template.render(as_developer) == template.render(as_system)
    knows = ChatTemplate("{% for m in messages %}{{ m.role }};{% endfor %}{# developer #}")
    assert knows.render(as_developer) == "system;user;"  # a comment is not a comparison
    knows = ChatTemplate("{% for m in messages %}{{ m.role == 'developer' }};{% endfor %}")
    assert knows.knows_developer_role
    assert knows.render(as_developer) == "True;False;"


@pytest.mark.parametrize(
    ("arguments", "match"),
    [("[1, 2]", "JSON object, not list"), ("5", "JSON object, not int"), ("{oops", "not valid")],
)
def test_tool_call_arguments_must_be_a_json_object(template, arguments, match):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(ChatTemplateRefusedError, match=match):
        template.render([*USER_HI, {"role": "assistant", "content": None, "tool_calls": [call]}])
