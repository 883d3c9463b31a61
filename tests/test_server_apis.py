"""The APIs beside chat completions, driven through the official SDKs against a server on the
demo model on the sim: legacy completions with fill-in-the-middle (`openai`), Anthropic Messages
(`anthropic`) and OpenAI Responses (`openai`). Every answer is validated with the SDK's own
types, and compared with what the chat path or the raw-completion facade gives for the same
request (same seed): the APIs are translations onto one engine path, so they must agree.

The demo on the sim takes about 0.1 s per token, so answers are a few tokens long.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from test_api import ROOT, python_blocks, run_python
from test_server import RunningServer

import lily
from lily.api import Lily
from lily.server import create_app

MAX_SEQ = 128
MODEL = "demo"


class RecordingEngine:
    """Wraps the engine's `generate` to record the token ids each generation was fed."""

    def __init__(self, llm: Lily):
        self.inner = llm.engine.generate
        self.fed: list[list[int]] = []

    def generate(self, tokens: list[int], *args: Any, **kwargs: Any) -> Iterator[Any]:
        self.fed.append(list(tokens))
        yield from self.inner(tokens, *args, **kwargs)


@pytest.fixture(scope="module")
def served_llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def recording(served_llm: Lily) -> Iterator[RecordingEngine]:
    engine = served_llm.engine
    recorder = RecordingEngine(served_llm)
    engine.generate = recorder.generate
    yield recorder
    del engine.generate


@pytest.fixture(scope="module")
def server(served_llm: Lily, recording: RecordingEngine) -> Iterator[RunningServer]:
    with RunningServer(create_app(served_llm, queue_limit=8)) as s:
        yield s


@pytest.fixture(scope="module")
def facade() -> Iterator[Lily]:
    """A second copy of the demo model, called directly: the answers the server must give."""
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


def post(server: RunningServer, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


# --- /v1/completions ---------------------------------------------------------------------------


def validate_completion_chunk(chunk: dict[str, Any]) -> None:
    """A streamed piece is a Completion whose pieces before the last have no finish_reason yet
    (null, as OpenAI streams them; the SDK's type has no None, so those are checked apart)."""
    pieces = chunk["choices"]
    assert all(p["finish_reason"] in (None, "stop", "length") for p in pieces)
    Completion.model_validate(
        {**chunk, "choices": [{**p, "finish_reason": p["finish_reason"] or "stop"} for p in pieces]}
    )


def test_fim_completion_is_the_raw_completion_of_the_fim_prompt(
    server: RunningServer, facade: Lily, recording: RecordingEngine
) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n    return total\n"
    r = server.client().completions.create(
        model=MODEL, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0.8, seed=11
    )
    Completion.model_validate(r.model_dump())
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    ids = facade.tokenizer.encode(fim)
    # The model's own FIM tokens, fed as the control tokens, not as their spelling.
    tok = facade.tokenizer
    assert ids[0] == tok.token_to_id("<|fim_prefix|>") and ids[-1] == tok.token_to_id(
        "<|fim_middle|>"
    )
    assert recording.fed[-1] == ids
    assert r.choices[0].text == facade.generate(fim, 6, temperature=0.8, seed=11)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_token_id_prompt_with_echo_and_a_stop_string(server: RunningServer, facade: Lily) -> None:
    text = "Once upon a time"
    ids = facade.tokenizer.encode(text)
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0.8, seed=5, echo=True
    )
    Completion.model_validate(r.model_dump())
    answer = facade.generate(text, 6, temperature=0.8, seed=5)
    assert r.choices[0].text == text + answer
    # A stop string inside that answer cuts it there, with finish_reason "stop".
    stop = answer[len(answer) // 2 :][:3]
    assert stop.strip(), answer
    cut = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=6, temperature=0.8, seed=5, stop=[stop]
    )
    assert cut.choices[0].text == answer[: answer.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_completion_with_logprobs_matches_the_whole_one(server: RunningServer) -> None:
    client = server.client()
    args = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "seed": 3, "logprobs": 2}
    whole = client.completions.create(**args, temperature=0.7)
    chunks = list(
        client.completions.create(
            **args, temperature=0.7, stream=True, stream_options={"include_usage": True}
        )
    )
    for chunk in chunks:
        validate_completion_chunk(chunk.model_dump())
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason == "length"
    tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 5
    lp = whole.choices[0].logprobs
    # Offsets step through the text token by token; the top two are the likeliest tokens.
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob
        assert top.get(token, logprob) == pytest.approx(logprob)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "a", "best_of": 2}, "best_of", "unsupported_parameter"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
        ({"prompt": "a", "suffix": "b", "echo": True}, "echo", None),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
        ({"prompt": "a", "logprobs": 6}, "logprobs", None),
        ({"prompt": [1, 10**9]}, "prompt", None),
        ({"prompt": ""}, "prompt", None),
        ({"suffix": "b"}, "prompt", "missing_required"),
        ({"prompt": "a", "temperature": 9}, "temperature", None),
    ],
)
def test_completion_requests_refused_by_name(
    server: RunningServer, body: dict[str, Any], param: str, code: str | None
) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    if "prompt" in body:  # the SDK itself refuses a call without one
        with pytest.raises(openai.BadRequestError):
            server.client().completions.create(**{"model": MODEL, "max_tokens": 2, **body})


def test_completion_of_another_model_is_a_404(server: RunningServer) -> None:
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert json.loads(r.text)["error"]["param"] == "model"


# --- docs/server.md ----------------------------------------------------------------------------

DOCS_MARK = "# runs against: lily serve --model demo"


def test_the_server_page_examples_run_against_a_demo_server(server: RunningServer) -> None:
    """docs/server.md's client snippets, each run as written but for the server's address."""
    blocks = [b for b in python_blocks(ROOT / "docs" / "server.md") if b.startswith(DOCS_MARK)]
    assert len(blocks) >= 1
    for block in blocks:
        assert "http://127.0.0.1:8000" in block
        done = run_python(block.replace("http://127.0.0.1:8000", server.url))
        assert done.returncode == 0, f"{block}\n{done.stderr}"
        assert done.stdout.strip(), block
