"""Structured output as real clients ask for it, against `lily serve --model demo` on the sim.

The demo model has random weights: whatever parses here parses because the grammar made it, and
closes inside `max_tokens` because of the closing stretch (see lily.chat.structured_output).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

MAX_TOKENS = 48
# The tool-call format's tags take many tokens of the demo's small vocabulary (`<parameter=` is
# four): a call needs more room to close.
CALL_MAX_TOKENS = 80


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]


@tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city."""
    return "sunny"


@tool
def lookup(query: str) -> str:
    """Look something up."""
    return "found"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ)  # the lily under test: installed, or on the caller's PYTHONPATH
    env.pop("LILY_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "lily.cli", "serve", "--model", "demo", "--device", "sim",
         "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()
            try:
                httpx.get(f"{base}/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        yield f"{base}/v1"
    finally:
        process.terminate()
        process.communicate(timeout=60)


@pytest.fixture(scope="module")
def chat(url: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=url,
        api_key="none",
        model="demo",
        max_tokens=MAX_TOKENS,
        seed=7,
        reasoning_effort="none",
    )


def test_openai_parse_returns_the_parsed_object(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="none")
    completion = client.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "Describe someone."}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        seed=3,
        reasoning_effort="none",
    )
    assert isinstance(completion.choices[0].message.parsed, Person)


def test_langchain_structured_output_json_schema(chat: ChatOpenAI) -> None:
    structured = chat.with_structured_output(Person, method="json_schema")
    assert isinstance(structured.invoke("Hi"), Person)


def test_langchain_structured_output_function_calling(chat: ChatOpenAI) -> None:
    chat = chat.model_copy(update={"max_tokens": CALL_MAX_TOKENS})
    structured = chat.with_structured_output(Person, method="function_calling")
    assert isinstance(structured.invoke("Hi"), Person)


def test_langchain_structured_output_json_mode(chat: ChatOpenAI) -> None:
    # json_mode promises a JSON object, not a schema: LangChain hands back the parsed dict.
    schema = {"title": "anything", "type": "object"}
    answer = chat.with_structured_output(schema, method="json_mode").invoke("Reply in JSON.")
    assert isinstance(answer, dict)


@pytest.mark.parametrize("tool_choice", ["any", "get_weather"])
def test_langchain_bind_tools_forces_a_valid_call(chat: ChatOpenAI, tool_choice: str) -> None:
    chat = chat.model_copy(update={"max_tokens": CALL_MAX_TOKENS})
    message = chat.bind_tools([get_weather, lookup], tool_choice=tool_choice).invoke("Weather?")
    assert message.tool_calls
    schemas = {t.name: t.args_schema.model_json_schema() for t in (get_weather, lookup)}
    for call in message.tool_calls:
        jsonschema.validate(call["args"], schemas[call["name"]])
    if tool_choice == "get_weather":
        assert {call["name"] for call in message.tool_calls} == {"get_weather"}


def test_a_forced_call_streams_into_valid_arguments(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="none")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": get_weather.args_schema.model_json_schema(),
            },
        }
    ]
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=CALL_MAX_TOKENS,
        seed=5,
        reasoning_effort="none",
        stream=True,
    )
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                arguments[delta.index] = arguments.get(delta.index, "") + (
                    delta.function.arguments or ""
                )
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(arguments) == [0]
    jsonschema.validate(json.loads(arguments[0]), tools[0]["function"]["parameters"])


def test_the_structured_output_check_passes_in_its_reduced_form() -> None:
    """`benchmarks/structured_output_check.py` (the demo model through the Python API on the
    sim): every constrained answer of its three kinds validates."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "structured_output_check.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick"],
        env=dict(os.environ),  # the lily under test: installed, or on the caller's PYTHONPATH
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for kind in ("json_schema", "json_object", "tool_call"):
        assert f"{kind}: 3/3 valid" in result.stdout, result.stdout
