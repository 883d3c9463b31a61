"""qwen3_coder tool calls: XML -> OpenAI tool_calls, typed by the tool's schema, also streamed."""

from __future__ import annotations

import itertools
import json
import random
from importlib import resources

import pytest

from lily.chat.detokenize import IncrementalDecoder
from lily.chat.reasoning import ReasoningParser
from lily.chat.stop import StopStringMatcher
from lily.chat.tokenizer import Tokenizer
from lily.chat.tool_calls import ToolCallParser, convert_parameter, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "score": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "cursor": {"type": ["integer", "null"]},
                    "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    },
    {"name": "now", "parameters": {"type": "object", "properties": {}}},  # bare function form
]

TWO_CALLS = (
    "I will search twice.\n\n"
    "<tool_call>\n<function=search>\n"
    "<parameter=query>\nbest <b>pizza</b> in Napoli\nand Roma\n</parameter>\n"
    "<parameter=limit>\n10\n</parameter>\n"
    "<parameter=score>\n0.75\n</parameter>\n"
    "<parameter=exact>\nTrue\n</parameter>\n"
    '<parameter=filters>\n{"open": true, "stars": [4, 5]}\n</parameter>\n'
    '<parameter=tags>\n["food", "ça"]\n</parameter>\n'
    "<parameter=cursor>\nnull\n</parameter>\n"
    "<parameter=mode>\nfast\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=now>\n</function>\n</tool_call>"
)
FIRST_ARGUMENTS = {
    "query": "best <b>pizza</b> in Napoli\nand Roma",
    "limit": 10,
    "score": 0.75,
    "exact": True,
    "filters": {"open": True, "stars": [4, 5]},
    "tags": ["food", "ça"],
    "cursor": None,
    "mode": "fast",
}


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(pieces, tools=TOOLS):
    """Feed pieces; return (content, {index: [id, name, arguments]}) as an OpenAI client
    accumulates chunk deltas."""
    parser = ToolCallParser(tools, make_id=counting_ids())
    content, calls = "", {}
    for delta in [parser.feed(p) for p in pieces] + [parser.flush()]:
        content += delta.content
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, [None, None, ""])
            if piece.id is not None:
                assert call[0] is None, "id sent twice"
                call[0], call[1] = piece.id, piece.name
            call[2] += piece.arguments
    return content, calls


@pytest.mark.parametrize(
    ("raw", "schema", "expected"),
    [
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "number"}, -7),
        ("2.5e3", {"type": "number"}, 2500.0),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),  # does not fit: kept as text
        ("nan", {"type": "number"}, "nan"),
        ("FALSE", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": "null"}, None),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("42", {"type": "string"}, "42"),
        ("  padded ", {"type": "string"}, "  padded "),
        ("null", {"type": ["string", "null"]}, None),
        ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7),
        ("{}", {"properties": {}}, {}),
        ("42", None, "42"),  # a parameter the schema does not describe
    ],
)
def test_values_are_typed_by_the_schema(raw, schema, expected):
    value = convert_parameter(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_whole_text_parse():
    content, calls = parse_tool_calls(TWO_CALLS, TOOLS, make_id=counting_ids())
    assert content == "I will search twice."
    assert [(c.id, c.name) for c in calls] == [("call_0", "search"), ("call_1", "now")]
    assert json.loads(calls[0].arguments) == FIRST_ARGUMENTS
    assert calls[0].arguments == json.dumps(FIRST_ARGUMENTS, ensure_ascii=False)
    assert calls[1].arguments == "{}"


def test_every_two_piece_split_streams_the_same_calls():
    expected = (
        "I will search twice.",
        {
            0: ["call_0", "search", json.dumps(FIRST_ARGUMENTS, ensure_ascii=False)],
            1: ["call_1", "now", "{}"],
        },
    )
    for cut in range(len(TWO_CALLS) + 1):
        assert stream([TWO_CALLS[:cut], TWO_CALLS[cut:]]) == expected, cut
    assert stream(list(TWO_CALLS)) == expected


def test_arguments_stream_one_parameter_at_a_time():
    parser = ToolCallParser(TOOLS, make_id=counting_ids())
    head = "<tool_call>\n<function=search>\n<parameter=limit>\n5\n</parameter>\n"
    first = parser.feed(head)
    assert first.content == ""
    (delta,) = first.tool_calls
    assert (delta.index, delta.id, delta.name, delta.arguments) == (
        0,
        "call_0",
        "search",
        '{"limit": 5',
    )
    assert parser.feed("<parameter=query>\nx").tool_calls == ()  # value not finished yet
    assert parser.feed("\n</parameter>\n").tool_calls[0].arguments == ', "query": "x"'
    assert parser.feed("</function>\n</tool_call>").tool_calls[0].arguments == "}"
    assert parser.calls[0].arguments == '{"limit": 5, "query": "x"}'


def test_a_function_without_its_tool_call_wrapper():
    text = "Checking <function=search>\n<parameter=limit>\n3\n</parameter>\n</function>"
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Checking"
    assert calls[0].name == "search" and json.loads(calls[0].arguments) == {"limit": 3}


def test_a_missing_parameter_end_is_tolerated():
    text = "<tool_call>\n<function=search>\n<parameter=limit>\n3\n<parameter=query>\nq\n</function>"
    _, calls = parse_tool_calls(text, TOOLS)
    assert json.loads(calls[0].arguments) == {"limit": 3, "query": "q"}


def test_a_call_cut_short_streams_only_whole_parameters():
    """max_tokens ends the text inside a value ("0\n</" of an integer, the start of its closing
    tag): that value is not sent, nor a closing brace, so the streamed arguments stay the start
    of the JSON object the model was writing; the cut call is reported apart from `calls`."""
    text = (
        "<tool_call>\n<function=search>\n<parameter=query>\npar\n</parameter>\n"
        "<parameter=limit>\n0\n</"
    )
    for pieces in ([text], list(text)):
        parser = ToolCallParser(TOOLS, make_id=counting_ids())
        deltas = [parser.feed(p) for p in pieces] + [parser.flush(cut=True)]
        streamed = "".join(piece.arguments for d in deltas for piece in d.tool_calls)
        assert streamed == '{"query": "par"'
        assert parser.calls == []
        assert parser.cut is not None and parser.cut.name == "search"
        assert parser.cut.arguments == streamed and not parser.cut.complete
    cut_in_the_name = ToolCallParser(TOOLS)
    assert cut_in_the_name.feed("<tool_call>\n<function=sea").tool_calls == ()
    assert cut_in_the_name.flush(cut=True).tool_calls == ()  # nothing of it was streamed
    assert cut_in_the_name.cut is not None and cut_in_the_name.cut.id == ""


def test_a_call_the_model_ended_unfinished_is_closed_with_what_it_has():
    text = (
        "<tool_call>\n<function=search>\n<parameter=limit>\n8\n</parameter>\n<parameter=query>\npar"
    )
    content, calls = stream([text])
    assert content == "" and calls[0][1] == "search"
    assert json.loads(calls[0][2]) == {"limit": 8, "query": "par"}


def test_text_without_calls_is_untouched():
    text = "a < b, <tool and <function but no call; <tool_call is not closed> either?  "
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]]) == (text, {})


def test_a_non_xml_tool_call_body_is_returned_as_content():
    content, calls = stream(['<tool_call>\n{"name": "now"}\n</tool_call>'])
    assert calls == {} and '{"name": "now"}' in content


def test_text_after_the_calls_is_content():
    content, calls = stream(["<function=now>\n</function>\n\nDone."])
    assert content == "Done." and calls[0][2] == "{}"


def test_tool_calls_split_across_tokens_and_random_chunks():
    tokenizer = Tokenizer.from_dir(str(resources.files("lily").joinpath("data/demo")))
    ids = tokenizer.encode(TWO_CALLS)
    assert tokenizer.token_to_id("<tool_call>") in ids  # the marker is one added token
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
    expected = stream([TWO_CALLS])
    assert stream(pieces) == expected
    rng = random.Random(0)
    for _ in range(50):
        # Group tokens into random chunks, as a streaming client would receive them.
        cuts = sorted(rng.sample(range(1, len(pieces)), k=8))
        chunks = [
            "".join(pieces[a:b]) for a, b in zip([0, *cuts], [*cuts, len(pieces)], strict=True)
        ]
        assert stream(chunks) == expected


def test_a_missing_function_end_and_stray_text_are_tolerated():
    text = (
        "<tool_call>\n<function=search>\nnoise <parameter=limit>\n4\n</parameter>\n</tool_call>ok"
    )
    content, calls = stream([text])
    assert content == "ok" and json.loads(calls[0][2]) == {"limit": 4}


def test_malformed_and_truncated_calls_stream_like_a_whole_parse():
    variants = [
        TWO_CALLS,
        TWO_CALLS.replace("<tool_call>\n", ""),
        TWO_CALLS.replace("</parameter>\n", ""),
        TWO_CALLS.replace("</function>\n", ""),
        "text <function=now></function> more <function=search><parameter=limit>1</parameter>",
    ]
    rng = random.Random(1)
    for text in variants:
        for _ in range(40):
            truncated = text[: rng.randint(0, len(text))]
            cuts = sorted(rng.sample(range(len(truncated) + 1), k=min(6, len(truncated) + 1)))
            pieces = [
                truncated[a:b] for a, b in zip([0, *cuts], [*cuts, len(truncated)], strict=True)
            ]
            assert stream(pieces) == stream([truncated]), pieces


def test_the_text_side_of_a_tool_calling_turn():
    """Token ids -> detokenizer -> stop strings -> reasoning -> tool calls, as the engine chains
    them, on what the model writes after a thinking-on generation prompt."""
    tokenizer = Tokenizer.from_dir(str(resources.files("lily").joinpath("data/demo")))
    output = (
        "The user wants the weather.\n</think>\n\nLet me look that up.\n\n"
        "<tool_call>\n<function=search>\n<parameter=query>\nweather in Paris\n</parameter>\n"
        "<parameter=limit>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>"
    )
    decoder = IncrementalDecoder(tokenizer)
    stop = StopStringMatcher(["Observation:"])
    thinking = ReasoningParser(thinking=True)
    tools = ToolCallParser(TOOLS, make_id=counting_ids())
    reasoning, content, deltas = "", "", []

    def push(text: str) -> None:
        nonlocal reasoning, content
        split = thinking.feed(stop.feed(text))
        reasoning += split.reasoning
        parsed = tools.feed(split.content)
        content += parsed.content
        deltas.extend(parsed.tool_calls)

    for token_id in tokenizer.encode(output):
        if token_id in tokenizer.stop_token_ids:
            break
        push(decoder.add(token_id))
    # End of stream: flush each stage into the next, in order.
    push(decoder.flush())
    push(stop.flush())
    tail = thinking.flush()
    reasoning += tail.reasoning
    parsed = tools.feed(tail.content)
    last = tools.flush()
    content += parsed.content + last.content
    deltas.extend(parsed.tool_calls + last.tool_calls)

    assert reasoning == "The user wants the weather."
    assert content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in tools.calls] == [
        ("search", {"query": "weather in Paris", "limit": 1})
    ]
    assert "".join(d.arguments for d in deltas) == tools.calls[0].arguments


def test_numbers_too_long_for_python_stay_text():
    """The model may write any digits: past Python's 4300-digit conversion limit a value is not
    typed (and nothing crashes), it stays the text the model wrote."""
    huge = "9" * 5000
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {
                        "n": {"type": "integer"},
                        "x": {"type": "number"},
                        "o": {"type": "object"},
                        "a": {"type": "array"},
                    }
                },
            },
        }
    ]
    values = {"n": huge, "x": f"-{huge}", "o": f'{{"k": {huge}}}', "a": "[" * 100_000}
    text = "<tool_call>\n<function=f>\n" + "".join(
        f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in values.items()
    )
    _, calls = parse_tool_calls(text + "</function>\n</tool_call>", tools)
    assert json.loads(calls[0].arguments) == values
    assert convert_parameter("12", {"type": "integer"}) == 12


@pytest.mark.parametrize(
    "parameters",
    [[1], {"properties": [1]}, {"properties": {"n": "integer"}}, {"properties": None}, "x"],
)
def test_a_malformed_tool_schema_types_nothing(parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    text = "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_tool_calls(text, tools)
    assert json.loads(calls[0].arguments) == {"n": "2"}


# A JSON-typed value whose strings hold every tag that ends a value; escaped quotes and
# backslashes must not end its strings early either.
TAGS_IN_JSON = {"note": 'see </parameter> and <parameter=x> "</function>" \\ </tool_call>'}


def test_tags_inside_the_strings_of_a_json_value_do_not_end_it():
    text = (
        "<tool_call>\n<function=search>\n"
        f"<parameter=filters>\n{json.dumps(TAGS_IN_JSON)}\n</parameter>\n"
        "<parameter=limit>\n2\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    expected = {"filters": TAGS_IN_JSON, "limit": 2}
    _, calls = parse_tool_calls(text, TOOLS)
    assert json.loads(calls[0].arguments) == expected
    streamed = stream(list(text))
    assert json.loads(streamed[1][0][2]) == expected


def test_a_string_value_still_ends_at_the_first_tag():
    text = '<function=search>\n<parameter=query>\na "</parameter>" b\n</parameter>\n</function>'
    _, calls = parse_tool_calls(text, TOOLS)
    assert json.loads(calls[0].arguments) == {"query": 'a "'}


def test_an_unclosed_quote_in_a_json_value_ends_at_its_line():
    text = '<function=search>\n<parameter=filters>\n{"a": "open\n</parameter>\n</function>'
    _, calls = parse_tool_calls(text, TOOLS)
    # Not JSON, so it stays text, and the call still closes where it should.
    assert json.loads(calls[0].arguments) == {"filters": '{"a": "open'}
