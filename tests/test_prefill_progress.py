"""Progress on long prompts (issue 28, item 5): the engines tell a `progress` callback how far a
prompt has been fed, the Python API passes one through (`chat.completions.create(progress=...)`,
`stream(progress=...)`), and `lily chat` / `lily generate` show it as a line on a terminal."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

import lily
from lily.api import Lily
from lily.cli import PrefillProgress
from lily.errors import RequestError

LONG = "Tell me everything you know about the history of the river and its bridges. " * 3


@pytest.fixture(scope="module", params=["sim", "reference"])
def chunked(request: pytest.FixtureRequest) -> Iterator[Lily]:
    """The demo, feeding prompts 8 tokens per prefill pass (on the sim)."""
    with lily.load("demo", device=request.param, max_seq=160, prefill_chunk=8) as llm:
        yield llm


def test_chat_progress_counts_up_to_the_prompt(chunked: Lily) -> None:
    calls: list[tuple[int, int]] = []
    r = chunked.chat.completions.create(
        messages=[{"role": "user", "content": LONG}],
        max_tokens=1,
        progress=lambda fed, total: calls.append((fed, total)),
    )
    total = r.usage.prompt_tokens
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    fed = [f for f, _ in calls]
    assert fed == sorted(fed) and len(set(fed)) == len(fed)
    if chunked.device == "sim":
        # One call per prefill pass of at most 8 tokens (message boundaries cut passes too).
        steps = [b - a for a, b in zip(fed, fed[1:], strict=False)]
        assert len(calls) >= total // 8 and all(step <= 8 for step in steps)


def test_raw_stream_progress(chunked: Lily) -> None:
    calls: list[tuple[int, int]] = []
    text = "".join(chunked.stream(LONG, 2, progress=lambda f, t: calls.append((f, t))))
    assert text and calls[-1][0] == calls[-1][1] == len(chunked.tokenizer.encode(LONG))


def test_progress_must_be_callable(chunked: Lily) -> None:
    with pytest.raises(RequestError) as refused:
        chunked.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}], max_tokens=1, progress=3
        )
    assert refused.value.param == "progress"


def test_the_progress_line_shows_after_its_delay_and_is_erased() -> None:
    out = io.StringIO()
    line = PrefillProgress(out, after=0)
    line(8, 40)
    line(16, 40)
    assert out.getvalue() == "\r[prompt: 8/40 tokens]\r[prompt: 16/40 tokens]"
    line(40, 40)
    assert out.getvalue().endswith("\r\033[K")
    quiet = io.StringIO()
    slow = PrefillProgress(quiet, after=60)
    slow(8, 40)
    slow(40, 40)
    assert quiet.getvalue() == ""
