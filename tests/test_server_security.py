"""A server bound to this machine cannot be driven by web pages, and its API key works as given.

What a browser can do to `http://127.0.0.1:PORT` is replayed with httpx against a real uvicorn
server (on the demo model on the sim): requests whose Host header is a rebinding page's own name,
cross-origin POSTs with the content types a page may send without asking (`text/plain`, form
encodings, none), CORS preflights. The API key is taken from each of its sources and compared
as UTF-8 bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import RunningServer

import lily
from lily.api import Lily
from lily.cli import main
from lily.server.api_key import APIKeyError, resolve_api_key
from lily.server.app import create_app, serve
from lily.server.http_guard import GuardPolicy, HTTPGuard

MAX_SEQ = 48
CHAT = "/v1/chat/completions"
REQUEST = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
FRONT_END = "http://localhost:3000"


@pytest.fixture(scope="module")
def served_llm() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(served_llm: Lily) -> Iterator[RunningServer]:
    with RunningServer(create_app(served_llm)) as running:
        yield running


def port_of(server: RunningServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- Host: DNS rebinding -----------------------------------------------------------------------


def test_only_localhost_and_ip_addresses_are_answered(server: RunningServer) -> None:
    """A page of evil.example whose name was made to resolve to 127.0.0.1 sends its own name as
    Host: nothing is answered to it, not even /health."""
    port = port_of(server)
    for host in (f"localhost:{port}", f"LocalHost.:{port}", f"127.0.0.1:{port}",
                 f"[::1]:{port}", f"192.168.1.20:{port}", "127.0.0.1"):  # fmt: skip
        response = httpx.get(server.url + "/v1/models", headers={"host": host})
        assert response.status_code == 200, host
        assert response.json()["data"][0]["id"] == "demo"
    answer = httpx.post(server.url + CHAT, json=REQUEST, headers={"host": f"localhost:{port}"})
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
    for path in ("/v1/models", "/health", "/openapi.json"):
        response = httpx.get(server.url + path, headers={"host": f"evil.example:{port}"})
        assert response.status_code == 400, path
        error = error_of(response)
        assert error["code"] == "invalid_host" and "--allowed-host" in error["message"]
    refused = httpx.post(server.url + CHAT, json=REQUEST, headers={"host": "evil.example"})
    assert refused.status_code == 400 and error_of(refused)["code"] == "invalid_host"
    for malformed in ("", "a:b:c", "[::1", "localhost:port", "evil.example:80:80"):
        response = httpx.get(server.url + "/v1/models", headers={"host": malformed})
        assert response.status_code == 400, malformed
    # A name that merely contains an accepted one is not accepted.
    response = httpx.get(server.url + "/v1/models", headers={"host": "localhost.evil.example"})
    assert response.status_code == 400


def test_allowed_hosts_add_names(served_llm: Lily) -> None:
    with RunningServer(create_app(served_llm, allowed_hosts=["mybox.lan"])) as named:
        assert httpx.get(named.url + "/health", headers={"host": "mybox.lan:8000"}).is_success
        assert httpx.get(named.url + "/health", headers={"host": "MYBOX.lan"}).is_success
        assert httpx.get(named.url + "/health", headers={"host": "other.lan"}).status_code == 400
    with RunningServer(create_app(served_llm, allowed_hosts=["*"])) as behind_a_proxy:
        response = httpx.get(behind_a_proxy.url + "/health", headers={"host": "public.example"})
        assert response.is_success
    with pytest.raises(ValueError, match="not a host name"):
        create_app(served_llm, allowed_hosts=["a:b:c"])


# -- Content type: cross-origin "simple" POSTs -------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "text/plain; application/json",
        None,
    ],
)
def test_a_post_that_is_not_declared_json_is_refused_with_415(
    server: RunningServer, content_type: str | None
) -> None:
    """The bodies a page can POST cross-origin without a preflight, here with a valid request
    in them, never reach the engine; the same body declared as JSON does."""
    body = httpx.Request("POST", server.url + CHAT, json=REQUEST).content
    completed = server.health()["completed"]
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(server.url + CHAT, content=body, headers=headers)
    assert response.status_code == 415
    error = error_of(response)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert server.health()["completed"] == completed
    headers = {"content-type": "Application/JSON; charset=utf-8"}
    answer = httpx.post(server.url + CHAT, content=body, headers=headers)
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"


# -- CORS --------------------------------------------------------------------------------------


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(
        url + CHAT,
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, x-stainless-os",
        },
    )


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def test_cors_origins_may_call_the_api_from_a_browser(
    served_llm: Lily, server: RunningServer
) -> None:
    """Only the origins listed get CORS answers; with none listed no CORS header is sent."""
    refused = preflight(server.url, FRONT_END)
    assert refused.status_code == 405 and cors_headers(refused) == {}
    answer = httpx.post(server.url + CHAT, json=REQUEST, headers={"origin": FRONT_END})
    assert answer.status_code == 200 and cors_headers(answer) == {}
    app = create_app(served_llm, api_key="sesame", cors_origins=[FRONT_END + "/"])
    with RunningServer(app) as running:
        allowed = preflight(running.url, FRONT_END)
        assert allowed.status_code == 204
        headers = cors_headers(allowed)
        assert headers["access-control-allow-origin"] == FRONT_END
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"]
        assert "origin" in allowed.headers["vary"].lower()

        def post(origin: str, key: str) -> httpx.Response:
            headers = {"origin": origin, "authorization": f"Bearer {key}"}
            return httpx.post(running.url + CHAT, json=REQUEST, headers=headers)

        answer = post(FRONT_END, "sesame")
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == FRONT_END
        wrong_key = post(FRONT_END, "guess")  # the page can read why it failed
        assert wrong_key.status_code == 401
        assert wrong_key.headers["access-control-allow-origin"] == FRONT_END
        other = post("http://evil.example", "sesame")
        assert cors_headers(other) == {}
        other_preflight = preflight(running.url, "http://evil.example")
        assert other_preflight.status_code == 405 and cors_headers(other_preflight) == {}


@pytest.mark.parametrize("origin", ["*", "null", "localhost:3000", "http://a.example/path"])
def test_cors_origins_must_be_origins(served_llm: Lily, origin: str) -> None:
    with pytest.raises(ValueError, match="is not an origin"):
        create_app(served_llm, cors_origins=[origin])


# -- The API key -------------------------------------------------------------------------------


def test_a_utf8_api_key_is_compared_as_bytes(served_llm: Lily) -> None:
    key = "clé-🔑-ключ"
    with RunningServer(create_app(served_llm, api_key=key, open_model_list=False)) as locked:

        def status(authorization: bytes) -> int:
            headers = {"authorization": authorization}
            response = httpx.get(locked.url + "/v1/models", headers=headers)
            if response.status_code != 200:
                assert error_of(response)["code"] == "invalid_api_key"
            return response.status_code

        assert status(b"Bearer " + key.encode()) == 200
        assert status(b"bearer  " + key.encode()) == 200
        assert status(b"Bearer " + key.encode()[:-1]) == 401
        assert status(b"Bearer " + "clé".encode("latin-1")) == 401
        assert status(b"Bearer \xff\xfe\x80") == 401  # not UTF-8: refused, not a 500
        assert status(b"Basic " + key.encode()) == 401


def test_the_key_comes_from_the_argument_a_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file-ключ\n", encoding="utf-8")
    environ = {"LILY_API_KEY": "from-env"}
    assert resolve_api_key("given", None, environ) == "given"
    assert resolve_api_key(None, key_file, environ) == "from-file-ключ"
    assert resolve_api_key(None, None, environ) == "from-env"
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key(None, None, {"LILY_API_KEY": ""}) is None
    with pytest.raises(APIKeyError, match="not both"):
        resolve_api_key("given", key_file, environ)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(APIKeyError, match="one line"):
        resolve_api_key(None, tmp_path / "empty", {})
    (tmp_path / "two").write_text("a\nb\n")
    with pytest.raises(APIKeyError, match="one line"):
        resolve_api_key(None, tmp_path / "two", {})
    (tmp_path / "latin1").write_bytes(b"cl\xe9\n")
    with pytest.raises(APIKeyError, match="not UTF-8"):
        resolve_api_key(None, tmp_path / "latin1", {})
    with pytest.raises(APIKeyError, match="cannot read"):
        resolve_api_key(None, tmp_path / "missing", {})
    for unusable in ("", " padded", "tab\there"):
        with pytest.raises(APIKeyError):
            resolve_api_key(unusable, None, {})


def test_serve_wires_the_key_and_the_bound_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` itself: the key from a file wins over the environment's, and the host it is
    bound to is a name the Host header may carry."""
    apps: list[Any] = []
    monkeypatch.setattr(
        "lily.server.app._DrainingServer.run",
        lambda server, *a, **k: apps.append(server.config.app),
    )
    # Nothing listens: the host is a made-up name (the port check is tested in test_cli.py).
    monkeypatch.setattr("lily.server.app.check_port_free", lambda host, port: None)
    monkeypatch.setenv("LILY_API_KEY", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    common: dict[str, Any] = {"device": "sim", "max_seq": MAX_SEQ, "log_level": "warning"}
    serve("demo", host="mybox.lan", api_key_file=key_file, cors_origins=[FRONT_END], **common)
    serve("demo", allowed_hosts=["proxy.example"], **common)
    (from_file, from_env) = apps
    assert from_file.state.server.api_key == "from-file"
    assert from_env.state.server.api_key == "from-env"

    def policy(app: Any) -> GuardPolicy:
        (guard,) = [m for m in app.user_middleware if m.cls is HTTPGuard]
        return guard.kwargs["policy"]

    assert policy(from_file).host_allowed("mybox.lan:8000")
    assert policy(from_file).cors_origins == {FRONT_END}
    assert not policy(from_env).host_allowed("mybox.lan:8000")
    assert policy(from_env).host_allowed("proxy.example")


def test_serve_refuses_a_bad_key_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lily.api.load", no_load)
    with pytest.raises(APIKeyError, match="cannot read"):
        serve("demo", api_key_file=os.devnull + "-missing")
    with pytest.raises(ValueError, match="is not an origin"):
        serve("demo", cors_origins=["*"])


def test_cli_serve_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    key_file = tmp_path / "key"
    main(["serve", "--api-key-file", str(key_file), "--allowed-host", "mybox.lan", "--allowed-host",
          "other.lan:9000", "--cors-origin", "HTTP://LocalHost:3000/"])  # fmt: skip
    (options,) = calls
    assert options["api_key_file"] == key_file and options["api_key"] is None
    assert options["allowed_hosts"] == ["mybox.lan", "other.lan"]
    assert options["cors_origins"] == [FRONT_END]
    for bad in (["--cors-origin", "*"], ["--allowed-host", "a:b:c"],
                ["--api-key", "k", "--api-key-file", str(key_file)]):  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            main(["serve", *bad])
        assert refused.value.code == 2
    monkeypatch.undo()  # the real serve: an unreadable key file ends it before the model loads
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the API key file" in capsys.readouterr().err
