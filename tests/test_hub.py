"""The Hub probe that lets `lily.load` fail fast without a network: any HTTP answer counts as
reachable, a closed port or an unresolvable host does not (quickly), and proxies are honoured."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from lily.checkpoint import hub


class _AnswersEverything(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(404)  # an answer all the same
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnswersEverything)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
                 "all_proxy", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def test_an_endpoint_that_answers_is_reachable(
    local_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub, "hub_endpoint", lambda: local_endpoint)
    assert hub.hub_reachable()


def test_a_closed_port_is_unreachable_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "hub_endpoint", lambda: f"http://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    assert not hub.hub_reachable()
    assert time.monotonic() - started < hub.PROBE_TIMEOUT_SECONDS


def test_the_probe_goes_through_the_proxy(
    local_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_directly = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(hub, "hub_endpoint", lambda: unreachable_directly)
    monkeypatch.setenv("HTTP_PROXY", local_endpoint)  # the proxy answers for it
    assert hub.hub_reachable()
    monkeypatch.setattr(hub, "hub_endpoint", lambda: local_endpoint)
    monkeypatch.setenv("HTTP_PROXY", unreachable_directly)
    assert not hub.hub_reachable()


def test_the_download_hint_names_the_command_and_the_alternatives() -> None:
    hint = hub.download_hint("owner/name", "abc123")
    assert "`hf download owner/name --revision abc123`" in hint
    assert "--model DIR" in hint and "--model demo" in hint
