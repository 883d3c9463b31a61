"""`GET /metrics` and `GET /ready` on the demo model on the sim: the counters move by what the
answers report (`usage`), refusals count as 4xx, a follow-up turn counts as a prefix-cache hit,
the output parses with prometheus-client's own parser, each app counts alone; `/ready` answers
503 with its reason while the queue is full, before the worker starts and once the server
stops, while `/health` keeps its contract.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from test_server import RunningServer, user

import lily
from lily.api import Lily
from lily.server.app import create_app

MAX_SEQ = 96
NO_THINKING = {"temperature": 0, "reasoning_effort": "none"}
CHAT = "/v1/chat/completions"
HEALTH_FIELDS = {
    "status", "model", "device", "busy", "running", "parallel", "waiting", "queue_limit",
    "completed",
}  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def server(llm: Lily) -> Iterator[RunningServer]:
    with RunningServer(create_app(llm, queue_limit=4)) as running:
        yield running


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and labels, read with prometheus-client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Scrape:
    """The server's samples when made; `moved` gives a sample's change since."""

    def __init__(self, url: str, **kwargs: Any):
        self.url = url
        self.before = self.read(**kwargs)

    def read(self, **kwargs: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        response = httpx.get(f"{self.url}/metrics", **kwargs)
        assert response.status_code == 200, response.text
        return samples(response.text)

    def moved(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.read().get(key, 0.0) - self.before.get(key, 0.0)


def chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{CHAT}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


# -- /metrics --------------------------------------------------------------------------------


def test_a_request_moves_the_counters_by_its_usage(server: RunningServer) -> None:
    scrape = Scrape(server.url)
    answer = chat(server.url, {"messages": user("Count me"), "max_tokens": 4, **NO_THINKING})
    usage = answer["usage"]
    assert scrape.moved("lily_generation_tokens_total") == usage["completion_tokens"] > 0
    assert scrape.moved("lily_prompt_tokens_total") == usage["prompt_tokens"] > 0
    assert scrape.moved("lily_requests_total", route=CHAT, status="2xx") == 1
    assert scrape.moved("lily_prefix_cache_lookups_total") == 1
    assert scrape.moved("lily_time_to_first_token_seconds_count") == 1
    assert scrape.moved("lily_request_duration_seconds_count", route=CHAT) == 1
    # Time to first token lies within the request's whole duration.
    ttft = scrape.moved("lily_time_to_first_token_seconds_sum")
    assert 0 < ttft <= scrape.moved("lily_request_duration_seconds_sum", route=CHAT)


def test_a_stream_counts_its_tokens_too(server: RunningServer) -> None:
    scrape = Scrape(server.url)
    body = {"messages": user("Stream me"), "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, **NO_THINKING}  # fmt: skip
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=events[-1].removeprefix("data: ")).json()["usage"]
    assert scrape.moved("lily_generation_tokens_total") == usage["completion_tokens"] > 0
    assert scrape.moved("lily_prompt_tokens_total") == usage["prompt_tokens"] > 0


def test_refused_requests_count_as_4xx_and_reach_no_engine(server: RunningServer) -> None:
    scrape = Scrape(server.url)
    assert httpx.post(f"{server.url}{CHAT}", json={"messages": 3}).status_code == 400
    assert httpx.get(f"{server.url}/no/such/path").status_code == 404
    foreign = httpx.get(f"{server.url}/health", headers={"host": "rebound.example"})
    assert foreign.status_code == 400  # refused by the Host check, counted all the same
    assert scrape.moved("lily_requests_total", route=CHAT, status="4xx") == 1
    assert scrape.moved("lily_requests_total", route=CHAT, status="2xx") == 0
    # Any unknown path counts under one label: random paths cannot add series.
    assert scrape.moved("lily_requests_total", route="unmatched", status="4xx") == 1
    assert scrape.moved("lily_requests_total", route="/health", status="4xx") == 1
    assert scrape.moved("lily_generation_tokens_total") == 0
    assert scrape.moved("lily_request_duration_seconds_count", route=CHAT) == 0


def test_a_follow_up_turn_counts_as_a_prefix_cache_hit(server: RunningServer) -> None:
    first = chat(server.url, {"messages": user("Remember me"), "max_tokens": 2, **NO_THINKING})
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    scrape = Scrape(server.url)
    follow = chat(
        server.url,
        {"messages": [*user("Remember me"), reply, *user("And now?")], "max_tokens": 2,
         **NO_THINKING},
    )  # fmt: skip
    cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert scrape.moved("lily_prefix_cache_lookups_total") == 1
    assert scrape.moved("lily_prefix_cache_hits_total") == 1
    assert scrape.moved("lily_prefix_cache_reused_tokens_total") == cached


def test_speculative_drafts_are_counted_as_the_engine_verified_them(
    server: RunningServer, llm: Lily
) -> None:
    made = []  # each generation's drafting, read after the answer
    inner = llm.speculation

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append(inner(*args, **kwargs))
        return made[-1]

    body = {"messages": user("Draft"), "max_tokens": 4, **NO_THINKING}
    # The answer itself as the prediction: its passes draft (a prediction the answer leaves at
    # once drafts nothing, and under "auto" the head sits a request with one out).
    content = chat(server.url, body)["choices"][0]["message"]["content"]
    llm.speculation = recorded  # type: ignore[method-assign]
    try:
        scrape = Scrape(server.url)
        prediction = {"type": "content", "content": content}
        chat(server.url, {**body, "prediction": prediction})
    finally:
        del llm.speculation
    drafted = sum(s.total.drafted for s in made)
    assert drafted > 0
    assert scrape.moved("lily_speculative_draft_tokens_total") == drafted
    assert scrape.moved("lily_speculative_accepted_tokens_total") == (
        sum(s.total.accepted for s in made)
    )


def test_the_exposition_parses_and_names_every_series(server: RunningServer) -> None:
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    assert {
        "lily_requests": "counter",
        "lily_request_duration_seconds": "histogram",
        "lily_time_to_first_token_seconds": "histogram",
        "lily_requests_waiting": "gauge",
        "lily_queue_limit": "gauge",
        "lily_active_sequences": "gauge",
        "lily_prompt_tokens": "counter",
        "lily_generation_tokens": "counter",
        "lily_prefix_cache_lookups": "counter",
        "lily_prefix_cache_hits": "counter",
        "lily_prefix_cache_reused_tokens": "counter",
        "lily_speculative_draft_tokens": "counter",
        "lily_speculative_accepted_tokens": "counter",
    }.items() <= families.items()
    assert samples(response.text)[("lily_queue_limit", ())] == 4
    # OpenMetrics for a scraper that asks for it.
    open_metrics = httpx.get(
        f"{server.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/metrics", "/ready", "/health"} <= set(document["paths"])


def test_each_app_counts_alone(llm: Lily) -> None:
    first, second = create_app(llm), create_app(llm)  # the same names, registered twice
    with TestClient(first, base_url="http://localhost") as one:
        assert one.get("/v1/models").status_code == 200
        counted = samples(one.get("/metrics").text)
    with TestClient(second, base_url="http://localhost") as other:
        untouched = samples(other.get("/metrics").text)
    models = ("lily_requests_total", (("route", "/v1/models"), ("status", "2xx")))
    assert counted[models] == 1 and models not in untouched


def test_metrics_need_the_key_only_when_closed(llm: Lily) -> None:
    key = {"authorization": "Bearer sesame"}
    with TestClient(create_app(llm, api_key="sesame"), base_url="http://localhost") as open_:
        assert open_.get("/metrics").status_code == 200
        assert open_.get("/ready").status_code == 200
    closed_app = create_app(llm, api_key="sesame", open_metrics=False)
    with TestClient(closed_app, base_url="http://localhost") as closed:
        refused = closed.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert closed.get("/metrics", headers=key).status_code == 200
        assert closed.get("/ready").status_code == 200  # a probe never needs the key


# -- /ready and /health ----------------------------------------------------------------------


class Gate:
    """Holds every generation before its first token until opened."""

    def __init__(self, llm: Lily):
        self.engine = llm.engine
        self.inner = self.engine.generate
        self.open = threading.Event()
        self.entered = threading.Event()

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        self.entered.set()
        assert self.open.wait(60), "the gate was never opened"
        yield from self.inner(*args, **kwargs)

    def __enter__(self) -> Gate:
        self.engine.generate = self.generate
        return self

    def __exit__(self, *exc: object) -> None:
        self.open.set()
        del self.engine.generate


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_ready_is_503_while_the_queue_is_full(llm: Lily) -> None:
    with RunningServer(create_app(llm, queue_limit=1)) as small, Gate(llm) as gate:
        ready = httpx.get(f"{small.url}/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        body = {"messages": user("Wait"), "max_tokens": 2, **NO_THINKING}
        clients = [threading.Thread(target=chat, args=(small.url, body)) for _ in range(2)]
        clients[0].start()
        assert gate.entered.wait(30)  # the first holds the engine
        clients[1].start()
        wait_for(lambda: small.health()["waiting"] == 1, "the second request never queued")
        full = httpx.get(f"{small.url}/ready")
        assert full.status_code == 503 and full.headers["retry-after"].isdigit()
        assert full.json()["reason"] == "queue_full" and full.json()["waiting"] == 1
        load = samples(httpx.get(f"{small.url}/metrics").text)
        assert load[("lily_requests_waiting", ())] == 1
        assert load[("lily_active_sequences", ())] == 1
        # /health keeps answering 200: the process is alive, however busy.
        assert httpx.get(f"{small.url}/health").status_code == 200
        gate.open.set()
        for client in clients:
            client.join(60)
        small.wait_idle()
        assert httpx.get(f"{small.url}/ready").status_code == 200
        load = samples(httpx.get(f"{small.url}/metrics").text)
        assert load[("lily_requests_waiting", ())] == 0
        assert load[("lily_active_sequences", ())] == 0


def test_ready_is_503_before_the_worker_starts_and_once_stopping(llm: Lily) -> None:
    app = create_app(llm)
    # Without the lifespan (an ASGI server run with lifespan off) nothing would ever answer.
    starting = TestClient(app, base_url="http://localhost").get("/ready")
    assert starting.status_code == 503 and starting.json()["reason"] == "starting"
    with TestClient(app, base_url="http://localhost") as client:
        health = client.get("/health")
        assert health.status_code == 200 and set(health.json()) == HEALTH_FIELDS
        assert client.get("/ready").status_code == 200
        app.state.server.worker.stop()  # what SIGTERM's drain does first
        stopping = client.get("/ready")
        assert stopping.status_code == 503
        assert stopping.json()["reason"] == "shutting_down" and stopping.json()["message"]
        # Liveness is unchanged while draining: the process still answers.
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
