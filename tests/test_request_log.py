"""The server's request log and `x-request-id`: one line per request with its status and, for
chat completions, the token counts and timing; the id header on every response, the client's
echoed when it sends a usable one."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

import lily
from lily.api import Lily
from lily.chat.completions import GenerationStats
from lily.server.app import create_app
from lily.server.request_log import describe

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def demo() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=64) as llm:
        yield llm


@pytest.fixture
def client(demo: Lily) -> Iterator[TestClient]:
    with TestClient(create_app(demo), base_url="http://localhost") as client:
        yield client


def log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lily.requests"]


def test_every_response_carries_a_request_id_and_echoes_the_clients(client: TestClient) -> None:
    first = client.get("/health").headers["x-request-id"]
    second = client.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second
    assert client.get("/health", headers={"x-request-id": "job-42"}).headers["x-request-id"] == (
        "job-42"
    )
    # Errors carry it too; an id that would break the log line or the header is replaced.
    missing = client.get("/nowhere", headers={"x-request-id": "two words"})
    assert missing.status_code == 404
    assert re.fullmatch(r"[0-9a-f]{32}", missing.headers["x-request-id"])
    too_long = client.get("/health", headers={"x-request-id": "x" * 129})
    assert too_long.headers["x-request-id"] != "x" * 129
    # Also when the security guard refuses the request before any route sees it.
    foreign = client.get("/health", headers={"host": "rebound.example", "x-request-id": "r-7"})
    assert foreign.status_code == 400 and foreign.headers["x-request-id"] == "r-7"


def test_one_log_line_per_chat_completion(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lily.requests")
    response = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 3, "temperature": 0},
        headers={"x-request-id": "abc"},
    )
    assert response.status_code == 200
    usage = response.json()["usage"]
    (line,) = log_lines(caplog)
    assert line.startswith("POST /v1/chat/completions 200 ")
    assert " id=abc " in line
    assert f" prompt={usage['prompt_tokens']} " in line
    assert f" cached={usage['prompt_tokens_details']['cached_tokens']} " in line
    assert " generated=3 " in line
    assert re.search(r" first_token=\d+\.\d{3} s \d+\.\d tok/s$", line), line


def test_a_stream_without_usage_is_logged_with_its_counts(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lily.requests")
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "temperature": 0, "stream": True},
    ) as response:
        body = "".join(response.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    (line,) = log_lines(caplog)
    assert line.startswith("POST /v1/chat/completions 200 ") and " generated=2 " in line


def test_refused_requests_are_logged_without_token_counts(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lily.requests")
    client.post("/v1/chat/completions", json={"messages": USER, "prediction": {}})
    client.get("/v1/models")
    refused, models = log_lines(caplog)
    assert refused.startswith("POST /v1/chat/completions 400 ") and "prompt=" not in refused
    assert models.startswith("GET /v1/models 200 ")


def test_the_log_line_format() -> None:
    stats = GenerationStats(
        prompt_tokens=14, cached_tokens=7, generated_tokens=21, first_token_s=0.25, total_s=2.25
    )
    assert describe("POST", "/v1/chat/completions", 200, 2.3, "r1", stats) == (
        "POST /v1/chat/completions 200 2.30 s id=r1 prompt=14 cached=7 cache=hit generated=21 "
        "first_token=0.250 s 10.0 tok/s"
    )
    assert describe("GET", "/health", None, 0.001, "r2") == "GET /health - 0.00 s id=r2"
