"""`RequestLimits.check_values`: the bound on a body's JSON values, counted as documented (every
object, array, string, number, boolean and null, the body's own object included; keys are not
values), with the error naming the field that holds most of them."""

from __future__ import annotations

import pytest

from lily.chat.request_limits import RequestLimits, TooManyValuesError
from lily.errors import RequestError

# 1 (the body) + 1 (the list) + 1 (the message) + 2 (its two strings) = 5 values.
ONE_MESSAGE = {"messages": [{"role": "user", "content": "a"}]}


def test_a_body_of_exactly_the_bound_passes_and_one_value_more_is_refused() -> None:
    RequestLimits(max_json_values=5).check_values(ONE_MESSAGE)
    with pytest.raises(TooManyValuesError) as refused:
        RequestLimits(max_json_values=4).check_values(ONE_MESSAGE)
    assert isinstance(refused.value, RequestError)
    assert (refused.value.status, refused.value.code) == (400, "too_many_values")
    assert "more than 4 JSON values" in refused.value.message


def test_the_error_names_the_field_holding_most_values() -> None:
    arguments = {f"k{i}": i for i in range(1000)}
    body = {
        "messages": [{"role": "user", "content": "a"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": arguments}}],
        "max_tokens": 3,
    }
    with pytest.raises(TooManyValuesError) as refused:
        RequestLimits(max_json_values=500).check_values(body)
    assert refused.value.param == "tools"


def test_deep_nesting_is_counted_without_recursion() -> None:
    deep: object = "leaf"
    for _ in range(100_000):
        deep = [deep]
    body = {"messages": deep}
    with pytest.raises(TooManyValuesError):
        RequestLimits(max_json_values=50_000).check_values(body)
    RequestLimits(max_json_values=100_002).check_values(body)


def test_no_bound_counts_nothing() -> None:
    huge = {"metadata": {str(i): i for i in range(10**5)}}
    with pytest.raises(TooManyValuesError):
        RequestLimits().check_values(huge)
    RequestLimits(max_json_values=None).check_values(huge)


def test_tool_call_arguments_count_as_the_values_their_json_text_holds() -> None:
    # The template renders the arguments parsed: 2 values (the object and its 1) where the text
    # would be 1, so 12 values in all (body, list, message, "assistant", list, call, "c",
    # "function", function, "f", and the arguments' 2).
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    body = {"messages": [{"role": "assistant", "tool_calls": [call]}]}
    RequestLimits(max_json_values=12).check_values(body)
    with pytest.raises(TooManyValuesError):
        RequestLimits(max_json_values=11).check_values(body)
    broken = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}]}
    RequestLimits(max_json_values=8).check_values(broken)  # left to the request's validation
