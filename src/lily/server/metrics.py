"""What `GET /metrics` serves: the server's load and work, in Prometheus's exposition format.

The series and what they mean are listed in docs/server.md. Each app has its own registry
(`prometheus_client.CollectorRegistry`), not the library's global one: several apps in one
process (the tests', an embedding application's) must not add to each other's counters, nor
fail registering the same names twice. Three things feed it:

- `RequestMetrics`, an ASGI middleware, counts every HTTP request by route and status class
  and times those that reached the engine's queue;
- the engine worker reports each generation when it ends (`generation_ended`): tokens, the
  prefix cache's part, speculative drafts, time to first token;
- the gauges (queue depth, active sequences) are read from the worker at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from lily.chat.completions import GenerationStats

# The `route` label of a request no route matches: one value for any path, so that a client
# sending random paths cannot grow the number of series.
UNMATCHED_ROUTE = "unmatched"
# Time to first token on a Mac runs from well under a second (a cached prefix) to minutes (a
# long prompt on the simulator); a request's whole run, up to the default 8,192 tokens, longer.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560)


class ServerMetrics:
    """One server's series, in its own registry. `waiting` and `active` are read at each
    scrape: the requests waiting for the engine, and the sequences it is generating now."""

    def __init__(self, *, waiting: Callable[[], int], active: Callable[[], int], queue_limit: int):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "lily_requests",
            "HTTP requests answered, by route and status class (2xx, 4xx, 5xx)",
            ["route", "status"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "lily_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, for requests that "
            "reached the engine's queue",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "lily_time_to_first_token_seconds",
            "Time from a request joining the engine's queue to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        Gauge(
            "lily_requests_waiting", "Requests waiting for the engine", registry=registry
        ).set_function(waiting)
        Gauge(
            "lily_queue_limit",
            "Requests that may wait for the engine; more are answered 503 queue_full",
            registry=registry,
        ).set(queue_limit)
        Gauge(
            "lily_active_sequences", "Sequences the engine is generating now", registry=registry
        ).set_function(active)
        self.prompt_tokens = Counter(
            "lily_prompt_tokens", "Prompt tokens of the generations run", registry=registry
        )
        self.generation_tokens = Counter(
            "lily_generation_tokens", "Tokens generated", registry=registry
        )
        self.prefix_cache_lookups = Counter(
            "lily_prefix_cache_lookups",
            "Generations whose prompt was looked up in the prefix cache",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "lily_prefix_cache_hits",
            "Generations whose prompt resumed from a cached prefix",
            registry=registry,
        )
        self.prefix_cache_reused_tokens = Counter(
            "lily_prefix_cache_reused_tokens",
            "Prompt tokens not fed again because the prefix cache held their state",
            registry=registry,
        )
        self.draft_tokens = Counter(
            "lily_speculative_draft_tokens",
            "Tokens drafted for speculative decoding and checked by a verify pass",
            registry=registry,
        )
        self.accepted_draft_tokens = Counter(
            "lily_speculative_accepted_tokens",
            "Drafted tokens the verify passes accepted",
            registry=registry,
        )

    def generation_ended(self, stats: GenerationStats, since_queued_s: float) -> None:
        """Counts a generation that has ended (finished, stopped or cancelled), reported
        `since_queued_s` seconds after its request joined the engine's queue."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.prefix_cache_lookups.inc()
        if stats.cached_tokens:
            self.prefix_cache_hits.inc()
            self.prefix_cache_reused_tokens.inc(stats.cached_tokens)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted_draft_tokens.inc(stats.accepted_drafts)
        if stats.first_token_s is not None:
            # The queue wait, rendering and tokenizing come before the generation's own clock
            # starts: the first token came as long before the end as the tokens after it took.
            after_first = stats.total_s - stats.first_token_s
            self.time_to_first_token.observe(max(0.0, since_queued_s - after_first))

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The series in the format `accept` asks for (Prometheus text by default, OpenMetrics
        when asked), and its content type."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


def route_label(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route serving this request (`/v1/models/{model:path}`), also
    when only its method is wrong; UNMATCHED_ROUTE when no route's path matches."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", UNMATCHED_ROUTE)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path", UNMATCHED_ROUTE)
    return partial or UNMATCHED_ROUTE


class RequestMetrics:
    """The middleware: counts each request by route and status class when its answer is done,
    and times it when it reached the engine's queue (the route put its job in the request's
    state as `generation`). A request that raised before answering counts as a 5xx."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Sequence[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            route = route_label(self.routes, scope)
            self.metrics.requests.labels(route=route, status=f"{status // 100}xx").inc()
            if scope.get("state", {}).get("generation") is not None:
                elapsed = time.perf_counter() - started
                self.metrics.request_duration.labels(route=route).observe(elapsed)
