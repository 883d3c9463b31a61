"""What other projects' clients send `lily serve`, and what they get: any model id (SDK examples
and agents send fixed ones), a model list they may read without the key, system messages after
the first turn, Responses' token count, and the defaults of clients that set no limit or a small
one. On the demo model on the sim (about 0.1 s a token), so answers are a few tokens long.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server import RunningServer

import lily
from lily.api import Lily
from lily.chat.completions import AUTO_REASONING_BUDGET
from lily.server.app import create_app
from lily.server.routes import ModelNames

MAX_SEQ = 160
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served_llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(served_llm: Lily) -> Iterator[RunningServer]:
    app = create_app(served_llm, api_key="sesame", default_reasoning_budget=AUTO_REASONING_BUDGET)
    with RunningServer(app) as s:
        yield s


def post(server: RunningServer, path: str, body: dict, key: str = "sesame") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def test_any_model_id_is_answered_by_the_served_model(server: RunningServer) -> None:
    client = server.client(api_key="sesame", max_retries=0)
    answer = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body=NO_THINKING,
    )
    assert answer.model == "demo"
    message = post(
        server,
        "/v1/messages",
        {
            "model": "claude-sonnet-4-5",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}],
        },
    )
    assert message.status_code == 200 and message.json()["model"] == "demo"


def test_strict_model_ids_and_aliases(served_llm: Lily) -> None:
    names = ModelNames(aliases=("qwen3.6",), strict=True)
    with RunningServer(create_app(served_llm, model_names=names)) as strict:
        client = strict.client(max_retries=0)
        assert [m.id for m in client.models.list().data] == ["demo", "qwen3.6"]
        assert client.models.retrieve("qwen3.6").id == "qwen3.6"
        with pytest.raises(openai.NotFoundError) as unknown:
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        assert unknown.value.body["code"] == "model_not_found"
        aliased = client.chat.completions.create(
            model="qwen3.6",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body=NO_THINKING,
        )
        assert aliased.model == "demo"


def test_the_model_list_is_open_unless_closed(server: RunningServer, served_llm: Lily) -> None:
    listed = httpx.get(f"{server.url}/v1/models")  # no key sent
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "demo"
    assert httpx.get(f"{server.url}/v1/models/demo").status_code == 200
    assert post(server, "/v1/chat/completions", {"messages": []}, key="wrong").status_code == 401
    with RunningServer(create_app(served_llm, api_key="k", open_model_list=False)) as closed:
        assert httpx.get(f"{closed.url}/v1/models").status_code == 401
        assert httpx.get(f"{closed.url}/v1/models/demo").status_code == 401


def test_a_system_message_after_the_first_turn_is_answered(server: RunningServer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Bye"},
    ]
    body = {"messages": messages, "max_tokens": 1, **NO_THINKING}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_responses_input_tokens_counts_the_prompt_a_response_feeds(server: RunningServer) -> None:
    request = {
        "model": "gpt-4.1",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": "What is two plus two?"}],
        "reasoning": {"effort": "none"},
    }
    counted = post(server, "/v1/responses/input_tokens", request)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    answered = post(server, "/v1/responses", {**request, "max_output_tokens": 1})
    assert counted.json()["input_tokens"] == answered.json()["usage"]["input_tokens"] > 5
    refused = post(server, "/v1/responses/input_tokens", {**request, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_a_small_output_limit_leaves_room_for_an_answer(server: RunningServer) -> None:
    """With thinking on, a limit of 24 tokens is not all spent thinking: half of it at most
    (`lily serve`'s default reasoning budget), then the answer."""
    response = post(
        server,
        "/v1/responses",
        {"input": "Name a prime.", "max_output_tokens": 24, "temperature": 0},
    ).json()
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] <= 12
    kinds = [item["type"] for item in response["output"]]
    assert "message" in kinds, response
    if response["status"] == "incomplete":
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}


REMOTE_REF = "https://example.com/schemas/city.json"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_remote_ref_in_a_tool_schema_is_refused_by_every_api_naming_the_tool(
    server: RunningServer, choice: str
) -> None:
    """Lily fetches no schema: a `$ref` outside the schema is refused before the engine, in the
    same words whether the model may call the tool (`auto`, whose arguments the schema types)
    or must (whose grammar needs it), by chat, Messages and Responses alike."""
    schema = {
        "type": "object",
        "properties": {"city": {"anyOf": [{"type": "null"}, {"$ref": REMOTE_REF}]}},
    }
    user = [{"role": "user", "content": "Weather?"}]
    requests = {
        "/v1/chat/completions": {
            "messages": user,
            "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": schema}}],
            "tool_choice": choice,
        },
        "/v1/messages": {
            "model": "demo",
            "max_tokens": 1,
            "messages": user,
            "tools": [{"name": "weather", "input_schema": schema}],
            "tool_choice": {"type": "auto" if choice == "auto" else "any"},
        },
        "/v1/responses": {
            "input": "Weather?",
            "max_output_tokens": 16,
            "tools": [{"type": "function", "name": "weather", "parameters": schema}],
            "tool_choice": choice,
        },
    }
    for path, body in requests.items():
        refused = post(server, path, body)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert "tool 'weather'" in error["message"] and REMOTE_REF in error["message"], path
        assert "$defs" in error["message"] and "registry" not in error["message"], path
        if path != "/v1/messages":  # (Anthropic's errors carry no param; it leads the message)
            assert error["param"] == "tools[0].function.parameters.properties.city.anyOf[1].$ref"
