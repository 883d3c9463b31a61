"""The `lily` command line: help, argument wiring, and each command run for real on the demo
model on the sim (in-process where possible, as a subprocess for `serve` and `chat`'s stdin loop).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

import lily
import lily.cli
import lily.engine.engine
from lily.api import Lily
from lily.checkpoint.loader import DEFAULT_REPO, DEFAULT_REVISION
from lily.cli import BENCH_DECODE_STEPS, ChatSession, main, synthetic_prompt
from lily.engine.speculative import PredictedTokens

GREEDY = {"temperature": 0, "max_tokens": 3}


@pytest.fixture(scope="module")
def demo() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=256) as llm:
        yield llm


def run_lily(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lily.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


# -- help and argument wiring ------------------------------------------------------------------


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("chat", "generate", "serve", "bench", "info"):
        assert f"\n    {command} " in out


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("serve", ["--host", "--port", "--api-key", "--queue-limit", "--max-seq", "--model",
                   "--device", "--cache-memory", "--cache-dir"]),
        ("chat", ["--system", "--max-tokens", "--temperature", "--seed", "--no-thinking"]),
        ("bench", ["--context", "--json", "--model", "--device", "--speculative",
                   "--draft-tokens"]),
        ("generate", ["--max-tokens", "--model"]),
    ],
)  # fmt: skip
def test_command_help_names_its_options(
    command: str, options: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for option in options:
        assert option in out


def test_every_option_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("chat", "generate", "serve", "bench", "doctor"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # unwrapped
        for shown in {
            "chat": ["(default: 1024)", "(default: auto)", "(default: 32768",
                     "(default: the longest of 4096, 2048, 1024, 512 that the memory allows)",
                     "(default: no limit)", "(default: random)"],
            "generate": ["(default: 32)"],
            "serve": ["(default: 8000)", "(default: 64)", "(default: info)"],
            "bench": ["(default: [256])"],
            "doctor": ["(default: 10)", "(default: auto)"],
        }[command]:  # fmt: skip
            assert shown in out, (command, shown)


def test_version() -> None:
    done = run_lily("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"lily {lily.__version__}"


def _without_network(home: Path) -> dict[str, str]:
    """The environment of a machine with no network and an empty Hugging Face cache: every
    proxy variable points at a closed local port."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.pop("HF_HUB_OFFLINE", None)
    closed = f"http://127.0.0.1:{_free_port()}"
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy"):
        env[name] = closed
    env["HF_HOME"] = str(home)
    return env


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["generate", "hi", "--max-tokens", "-3"], 2, "--max-tokens: must be at least 1, got -3"),
        (["chat", "--max-seq", "0"], 2, "--max-seq: must be at least 1, got 0"),
        (["chat", "--temperature", "5"], 2, "--temperature: must be between 0 and 2"),
        (["chat", "--reasoning-budget", "-1"], 2, "--reasoning-budget: must be at least 0"),
        (["bench", "--context", "0"], 2, "--context: must be at least 1"),
        (["bench", "--speculative", "eagle"], 2,
         "speculative must be one of auto, mtp, ngram, dflash, off"),
        (["bench", "--draft-tokens", "0"], 2, "--draft-tokens: invalid choice: 0"),
        (["bench", "--draft-tokens", "9"], 2, "--draft-tokens: invalid choice: 9"),
        (["bench", "--draft-tokens", "two"], 2, "--draft-tokens: invalid int value: 'two'"),
        (["serve", "--port", "70000"], 2, "--port: must be a TCP port"),
        (["serve", "--kv-cache", "fp8"], 2, "--kv-cache: invalid choice: 'fp8'"),
        (["generate", "hi", "--model", "demo", "--device", "reference", "--kv-cache", "int8"], 1,
         "the reference engine keeps its KV cache in float32"),
        (["generate", "hi", "--model", "demo", "--max-seq", "10000000"], 1,
         "max_seq must be between 1 and"),
        (["generate", "hi", "--model", "no/such-dir/"], 1, "neither an existing directory"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_a_status(argv: list[str], status: int, message: str) -> None:
    done = run_lily(*argv, input="Hello\n")
    assert done.returncode == status
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""  # nothing ran: e.g. chat's temperature is refused before a message


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac build may have a metal device")
def test_metal_off_a_mac_is_one_clear_line() -> None:
    done = run_lily("generate", "hi", "--model", "demo", "--device", "metal")
    assert done.returncode == 1
    assert "metal device is not available here" in done.stderr and "sim" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_default_model_without_network_fails_fast_saying_how_to_get_it(tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_lily("generate", "hi", env=_without_network(tmp_path))
    elapsed = time.monotonic() - started
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "cannot be reached" in line
    assert f"hf download {DEFAULT_REPO} --revision {DEFAULT_REVISION}" in line
    assert "--model DIR" in line and "--model demo" in line
    # The Hub client alone retries for ~25 s; the probe fails at once on a closed port (the
    # bound is loose for a loaded machine).
    assert elapsed < 20


def test_default_model_with_hf_hub_offline_says_how_to_get_it(tmp_path: Path) -> None:
    env = {**_without_network(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = run_lily("chat", env=env)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "HF_HUB_OFFLINE is set" in line and "hf download" in line


def test_serve_arguments_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append((a, k)))
    monkeypatch.delenv("LILY_API_KEY", raising=False)
    main(["serve", "--model", "demo", "--device", "sim", "--port", "9123", "--queue-limit", "3"])
    main(["serve", "--host", "0.0.0.0", "--api-key", "k", "--max-seq", "64"])
    (first_args, first), (second_args, second) = calls
    assert first_args == ("demo",) and second_args == (None,)
    assert first["host"] == "127.0.0.1" and first["port"] == 9123 and first["queue_limit"] == 3
    assert first["device"] == "sim" and first["api_key"] is None
    assert second["host"] == "0.0.0.0" and second["api_key"] == "k" and second["max_seq"] == 64


def test_serve_limits_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from lily.server.routes import DEFAULT_MAX_TOKENS, DEFAULT_SHUTDOWN_GRACE

    calls: list[dict] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    main(["serve"])
    main(
        ["serve", "--max-tokens-default", "100", "--shutdown-grace", "2.5", "--prefill-chunk", "8"]
    )
    defaults, chosen = calls
    assert defaults["default_max_tokens"] == DEFAULT_MAX_TOKENS == 8192
    assert defaults["shutdown_grace"] == DEFAULT_SHUTDOWN_GRACE
    assert chosen["default_max_tokens"] == 100 and chosen["shutdown_grace"] == 2.5
    assert chosen["prefill_chunk"] == 8
    with pytest.raises(SystemExit):
        main(["serve", "--max-tokens-default", "0"])


def test_serve_model_names_and_thinking_defaults_reach_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lily.server.routes import ModelNames

    calls: list[dict] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    main(["serve"])
    names = ["--strict-model-id", "--served-model-name", "a", "--served-model-name", "b"]
    limits = ["--default-max-tokens", "64", "--reasoning-budget", "16"]
    main(["serve", *names, "--no-open-model-list", *limits])
    main(["serve", "--reasoning-budget", "none"])
    defaults, chosen, unbounded = calls
    assert defaults["model_names"] == ModelNames() and defaults["open_model_list"] is True
    assert defaults["default_reasoning_budget"] == "auto"
    assert chosen["model_names"] == ModelNames(("a", "b"), strict=True)
    assert chosen["open_model_list"] is False
    assert chosen["default_max_tokens"] == 64 and chosen["default_reasoning_budget"] == 16
    assert unbounded["default_reasoning_budget"] is None
    with pytest.raises(SystemExit):
        main(["serve", "--reasoning-budget", "-1"])


def test_serve_request_bounds_and_timeouts_reach_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lily.chat.request_limits import RequestLimits
    from lily.server.routes import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT

    calls: list[dict] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    main(["serve"])
    main(["serve", "--max-messages", "10", "--max-tools", "2", "--max-tool-calls", "3",
          "--max-grammar-bytes", "64KiB", "--max-json-values", "1000", "--header-timeout", "2.5",
          "--body-timeout", "7"])  # fmt: skip
    defaults, chosen = calls
    assert defaults["limits"] == RequestLimits()
    assert (defaults["header_timeout"], defaults["body_timeout"]) == (
        DEFAULT_HEADER_TIMEOUT,
        DEFAULT_BODY_TIMEOUT,
    )
    assert chosen["limits"] == RequestLimits(10, 2, 3, 64 * 1024, 1000)
    assert (chosen["header_timeout"], chosen["body_timeout"]) == (2.5, 7.0)
    refused = [("--max-messages", "0"), ("--header-timeout", "0"), ("--body-timeout", "x"),
               ("--max-grammar-bytes", "0"), ("--max-grammar-bytes", "0.5"),
               ("--max-json-values", "0")]  # fmt: skip
    for flag, bad in refused:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", flag, bad])
        assert exit_.value.code == 2  # argparse's refusal, not an error once the server starts


def test_serve_cache_options_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from lily.engine.prefix_cache import CacheOptions

    calls: list[dict] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    main(["serve"])
    main(["serve", "--cache-memory", "4GiB", "--cache-dir", "prefixes", "--cache-disk-size",
          "500MB", "--cache-disk-min-tokens", "256"])  # fmt: skip
    main(["serve", "--cache-memory", "0"])
    defaults, chosen, off = (call["cache"] for call in calls)
    assert defaults == CacheOptions()
    assert chosen == CacheOptions(4 << 30, Path("prefixes"), 500_000_000, 256)
    assert off.cache_memory == 0
    for bad in ("-1", "4 lots", "GiB"):
        with pytest.raises(SystemExit):
            main(["serve", "--cache-memory", bad])


# -- the commands, for real --------------------------------------------------------------------


def test_generate_prints_the_prompt_and_its_greedy_continuation(
    demo: Lily, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "Once upon a time"
    assert (
        main(["generate", "--model", "demo", "--device", "sim", "--max-tokens", "4", prompt]) == 0
    )
    captured = capsys.readouterr()
    assert captured.out == prompt + demo.generate(prompt, max_tokens=4) + "\n"
    assert "random weights" in captured.err and "tokens/s" in captured.err


def test_synthetic_prompt_follows_the_benchmark_contract() -> None:
    i = np.arange(5000, dtype=np.uint64)
    expected = ((i * np.uint64(2654435761)) % np.uint64(2**32)) % np.uint64(248320)
    assert synthetic_prompt(5000, 248320) == expected.tolist()
    assert max(synthetic_prompt(300, 4096)) < 4096


def test_bench_measures_one_prefill_and_64_decode_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--model", "demo", "--device", "sim", "--context", "3", "--json"]) == 0
    captured = capsys.readouterr()
    arm = json.loads(captured.out)
    # Progress on stderr, each stage before it runs; stdout is the result alone.
    stages = [line for line in captured.err.splitlines() if line.startswith("[bench")]
    assert [s.split(": ")[1].split()[0] for s in stages] == ["loading", "warm-up", "measuring"]
    assert arm["device"] == "sim" and arm["context"] == 3
    assert arm["decode_steps"] == BENCH_DECODE_STEPS == 64
    assert arm["prefill_tok_s"] == pytest.approx(3 / arm["prefill_s"])
    assert arm["decode_tok_s"] == pytest.approx(64 / arm["decode_s"])


def test_bench_without_speculative_options_keeps_the_contract_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--model", "demo", "--device", "sim", "--context", "3"]
    assert main([*argv, "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == sorted(
        ["device", "context", "prefill_s", "prefill_tok_s", "decode_steps", "decode_s",
         "decode_tok_s"]
    )  # fmt: skip


def _recording_generations(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token ids of every `DeviceEngine.generate` from now on, one list per call."""
    runs: list[list[int]] = []
    original = lily.engine.engine.DeviceEngine.generate

    def recording(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        runs.append([])
        for token in original(self, *args, **kwargs):
            runs[-1].append(token.id)
            yield token

    monkeypatch.setattr(lily.engine.engine.DeviceEngine, "generate", recording)
    return runs


def test_bench_speculative_ngram_says_so_on_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "demo", "--device", "sim", "--context", "3"]
    assert main([*argv, "--speculative", "ngram", "--draft-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "decode" in lines[0] and "(64 steps in" in lines[0]
    # The demo's random output rarely repeats a 2-gram, so prompt lookup may draft nothing;
    # whatever it drafted, the line states the mode and counts that add up.
    found = re.fullmatch(
        r"  speculative ngram \(draft tokens 3\): [0-9.]+ delivered tok/s, (\d+) of (\d+) "
        r"drafted tokens accepted \((n/a|[0-9.]+%)\), (n/a|[0-9.]+) tokens per verify pass "
        r"\((\d+) passes\)",
        lines[1],
    )
    assert found, lines[1]
    accepted, drafted, passes = int(found[1]), int(found[2]), int(found[5])
    assert accepted <= drafted <= 3 * passes
    assert (found[3] == "n/a") == (drafted == 0)


def test_bench_speculative_counts_add_up_and_leave_the_tokens_unchanged(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", "demo", "--device", "sim", "--context", "3", "--json"]
    runs = _recording_generations(monkeypatch)
    assert main([*argv, "--speculative", "off"]) == 0
    plain_arm = json.loads(capsys.readouterr().out)
    assert "speculative" not in plain_arm
    plain = runs[-1]  # the measured run (the one before it is the warm-up)
    assert len(plain) == BENCH_DECODE_STEPS + 1

    # The synthetic prompt and the demo's output give prompt lookup little to find, so the
    # drafter also gets the plain answer as a prediction with every fifth token wrong: verify
    # passes then both accept and reject, through the same `Lily.speculation` the bench uses.
    prompt = synthetic_prompt(3, 4096)
    wrong = [(t + 1) % 4096 if i % 5 == 4 else t for i, t in enumerate(plain)]
    original = Lily.speculation

    def with_prediction(self: Lily, prediction: Any = None) -> Any:
        return original(self, prediction=PredictedTokens(wrong, prompt))

    monkeypatch.setattr(Lily, "speculation", with_prediction)
    runs.clear()
    assert main([*argv, "--speculative", "ngram", "--draft-tokens", "4"]) == 0
    arm = json.loads(capsys.readouterr().out)
    drafted = runs[-1]
    assert arm["speculative"] == "ngram" and arm["draft_tokens"] == 4
    assert arm["decode_steps"] == BENCH_DECODE_STEPS and len(drafted) == BENCH_DECODE_STEPS + 1
    assert arm["decode_tok_s"] == pytest.approx(BENCH_DECODE_STEPS / arm["decode_s"])
    assert 0 < arm["accepted"] < arm["drafted"] <= 4 * arm["verify_passes"]
    assert arm["acceptance_rate"] == pytest.approx(arm["accepted"] / arm["drafted"])
    assert arm["tokens_per_verify_pass"] == pytest.approx(
        (arm["accepted"] + arm["verify_passes"]) / arm["verify_passes"]
    )
    # Equal to plain decoding up to its first near-tie (tests/test_speculative.py: verify
    # passes agree with decode steps to rounding, not bit for bit).
    with lily.load("demo", device="sim", max_seq=128) as llm:
        logits = llm.engine.teacher_forced_logits(prompt + plain[:-1])[len(prompt) - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near = np.flatnonzero(top2[:, 1] - top2[:, 0] <= 1e-2)
    decided = int(near[0]) if near.size else len(plain)
    assert decided >= len(plain) // 2, "the demo's answer is undecided too early to test"
    assert drafted[:decided] == plain[:decided]


def test_bench_passes_the_speculative_options_to_each_arm_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[str]] = []

    def run(argv: list[str], check: bool) -> subprocess.CompletedProcess:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(lily.cli.subprocess, "run", run)
    argv = ["bench", "--model", "demo", "--context", "3", "4", "--speculative", "auto"]
    assert main([*argv, "--draft-tokens", "2"]) == 0
    assert len(calls) == 2
    for call in calls:
        options = call[call.index("bench") :]
        at = options.index("--speculative")
        assert options[at : at + 4] == ["--speculative", "auto", "--draft-tokens", "2"]


def test_bench_prefills_in_the_chunks_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chunks: list[int] = []
    original = lily.engine.engine.DeviceEngine._passes

    def recording(self: Any, *args: Any) -> Iterator[tuple[int, int, bool]]:
        for start, tokens, predicts in original(self, *args):
            if start < args[1]:  # a prompt chunk, not a decode step
                chunks.append(tokens)
            yield start, tokens, predicts

    monkeypatch.setattr(lily.engine.engine.DeviceEngine, "_passes", recording)
    argv = ["bench", "--model", "demo", "--device", "sim", "--context", "20", "--json"]
    assert main([*argv, "--prefill-chunk", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 20
    assert chunks == [8, 8, 4] * 2  # the warm-up, then the measured prefill


def test_a_prefill_chunk_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "hi", "--model", "demo", "--prefill-chunk", "0"])
    assert done.value.code == 2
    assert "--prefill-chunk: must be at least 1" in capsys.readouterr().err


def info_output(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["info"]) == 0
    return capsys.readouterr().out


def test_info_reports_device_memory_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "lily"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    out = info_output(capsys)
    assert "device (auto):   sim" in out or "device (auto):   metal" in out
    assert "memory:" in out and "GiB" in out
    assert f"{DEFAULT_REPO}@{DEFAULT_REVISION[:10]}: not downloaded" in out
    assert "demo: not generated yet" in out
    # The real model's KV cache per context token: 10 layers x K,V x 2 heads x a row of 512 B
    # (bf16) or 272 B (int8: 256 codes and 8 fp16 scales).
    assert "kv cache:        bf16 20,480 B per token" in out and "int8 10,880 B per token" in out

    (tmp_path / "lily" / "demo-0123").mkdir(parents=True)
    assert "demo: generated at" in info_output(capsys)

    # The Hugging Face cache layout: models--owner--name/snapshots/<revision>/...
    owner, name = DEFAULT_REPO.split("/")
    snapshot = tmp_path / "hf" / f"models--{owner}--{name}" / "snapshots" / DEFAULT_REVISION
    snapshot.mkdir(parents=True)
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    weight_map = {"a": shards[0], "b": shards[1]}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (snapshot / shards[0]).write_bytes(b"x" * 2**20)
    assert "partly downloaded" in info_output(capsys)
    (snapshot / shards[1]).write_bytes(b"x" * 2**20)
    assert "cached at" in info_output(capsys)


class InterruptingOutput(io.StringIO):
    """Raises KeyboardInterrupt on the n-th write, as Ctrl-C would in the middle of a reply."""

    def __init__(self, interrupt_at: int):
        super().__init__()
        self.interrupt_at = interrupt_at
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes == self.interrupt_at:
            raise KeyboardInterrupt
        return super().write(text)


def test_chat_keeps_history_and_resets(demo: Lily) -> None:
    out = io.StringIO()
    # One token of thinking, the think block's 3 closing tokens, then 2 of answer.
    request = {"temperature": 0, "max_tokens": 6, "reasoning_budget": 1}
    session = ChatSession(demo, out, system="Be brief.", request=request)
    assert session.handle("Hi")
    assert [m["role"] for m in session.history] == ["system", "user", "assistant"]
    want = demo.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        **request,
    )
    assert session.history[-1]["content"] == want.choices[0].message.content != ""
    assert "[thinking]" in out.getvalue()  # the demo's template thinks by default
    assert session.handle("And then?")
    assert len(session.history) == 5
    assert session.handle("/reset")
    assert session.history == [{"role": "system", "content": "Be brief."}]
    assert "forgotten" in out.getvalue()
    assert session.handle("   ") and len(session.history) == 1
    assert not session.handle("/exit")


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(demo: Lily) -> None:
    produced = []
    inner = demo.engine.generate

    def counting_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for token in inner(*args, **kwargs):
            produced.append(token)
            yield token

    demo.engine.generate = counting_generate
    try:
        out = InterruptingOutput(interrupt_at=3)
        session = ChatSession(demo, out, request={"temperature": 0, "max_tokens": 60})
        session.handle("Tell me a long story")
        assert "[stopped]" in out.getvalue()
        assert len(produced) < 10, "the generation went on after Ctrl-C"
        # Stopped while thinking: no empty assistant turn, and the unanswered message is gone.
        assert session.history == []
        produced.clear()
        session.request = {**GREEDY, "reasoning_effort": "none"}
        session.handle("Shorter")
        assert len(produced) == 3
        assert [m["role"] for m in session.history] == ["user", "assistant"]
        assert session.history[-1]["content"]
    finally:
        del demo.engine.generate


def test_a_reply_that_ends_while_thinking_is_not_kept(demo: Lily) -> None:
    out = io.StringIO()
    session = ChatSession(demo, out, request={"temperature": 0, "max_tokens": 2})
    session.handle("Hi")
    assert "[thinking]" in out.getvalue() and "[answer]" not in out.getvalue()
    assert session.history == []
    assert "not kept" in out.getvalue()


def test_chat_slash_words_are_commands_not_messages(demo: Lily) -> None:
    out = io.StringIO()
    session = ChatSession(demo, out, request={**GREEDY, "reasoning_effort": "none"})
    assert session.handle("/foo")
    assert session.history == []
    assert "unknown command /foo" in out.getvalue() and "/reset" in out.getvalue()
    session.handle("/usr/bin is a directory?")  # a path, not a command: sent as a message
    assert session.history[0] == {"role": "user", "content": "/usr/bin is a directory?"}


def test_chat_shows_generated_tokens_over_the_reply_time(demo: Lily) -> None:
    out = io.StringIO()
    session = ChatSession(
        demo, out, request={**GREEDY, "max_tokens": 4, "reasoning_effort": "none"}
    )
    session.handle("Hi")
    stats = re.search(
        r"\+ (\d+) generated tokens in ([\d.]+) s: ([\d.]+) generated tokens/s", out.getvalue()
    )
    assert stats, out.getvalue()
    generated, seconds, rate = int(stats[1]), float(stats[2]), float(stats[3])
    assert generated == 4
    # Not (prompt + generated) / time: the prompt is longer than the 4 generated tokens.
    assert rate == pytest.approx(generated / seconds, rel=0.05)


def test_chat_reads_stdin_until_its_end() -> None:
    done = run_lily(
        "chat", "--model", "demo", "--device", "sim", "--temperature", "0", "--max-tokens", "2",
        input="Hello\n/reset\nHi\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[conversation forgotten]" in done.stdout
    assert "Traceback" not in done.stderr


def test_chat_takes_an_image_file(tmp_path: Path) -> None:
    picture = tmp_path / "picture.png"
    Image.new("RGB", (100, 60), "teal").save(picture)
    done = run_lily(
        "chat", "--model", "demo", "--device", "sim", "--temperature", "0", "--max-tokens", "2",
        "--no-thinking", "--image", str(picture), input="What is it?\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The image's 70 tokens (100 x 60 is scaled up to 320 x 224) are in the prompt.
    prompt_tokens = int(re.search(r"\[(\d+) prompt", done.stdout)[1])
    assert prompt_tokens > 70, done.stdout
    missing = run_lily("chat", "--model", "demo", "--image", str(tmp_path / "none.png"))
    assert missing.returncode == 2 and "no image file" in missing.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lily_serve_on_a_port_in_use_says_so_in_one_line_before_loading(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model directory that does not exist: the port must be refused before any load.
        started = time.monotonic()
        done = run_lily("serve", "--model", str(tmp_path / "absent"), "--port", str(port))
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == f"lily serve: error: cannot listen on 127.0.0.1:{port}: the port is in use"
    assert time.monotonic() - started < 30


def test_lily_serve_answers_then_stops_on_ctrl_c() -> None:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "lily.cli", "serve", "--model", "demo", "--device", "sim",
         "--port", str(port), "--max-seq", "64", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={name: value for name, value in os.environ.items() if name != "LILY_API_KEY"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "lily serve did not come up"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health").json()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health["model"] == "demo" and health["device"] == "sim"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "demo"
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_serve_speculative_settings_reach_the_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict] = []
    monkeypatch.setattr("lily.server.app.serve", lambda *a, **k: calls.append(k))
    main(["serve"])
    main(["serve", "--speculative", "ngram", "--draft-tokens", "8"])
    main(["serve", "--speculative", "mtp"])
    defaults, chosen, head = calls
    assert (defaults["speculative"], defaults["draft_tokens"]) == ("auto", 4)
    assert (chosen["speculative"], chosen["draft_tokens"]) == ("ngram", 8)
    assert head["speculative"] == "mtp"
    with pytest.raises(SystemExit):
        main(["serve", "--speculative", "eagle"])
    assert "speculative must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--draft-tokens", "9"])
    assert "invalid choice" in capsys.readouterr().err
