"""Progress on long prompts (issue 28, item 5): the engines tell a `progress` callback how far a
prompt has been fed, the Python API passes one through (`chat.completions.create(progress=...)`,
`stream(progress=...)`), and `lily chat` / `lily generate` show it as a line on a terminal. The
device engine reports, and asks whether to stop, between the command buffers of a chunk (issue
38), and a stop there leaves the prefix cache right."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

import lily
from lily.api import Lily
from lily.checkpoint.loader import Checkpoint, load_checkpoint
from lily.cli import PrefillProgress
from lily.device import Device
from lily.engine.engine import PIPELINE_DEPTH, DeviceEngine
from lily.engine.model_graph import SIM_COMMAND_BUFFER_FLOPS, layer_flops
from lily.engine.sampling import SamplingParams
from lily.errors import GenerationCancelled, RequestError
from lily.kernels.gdn import CHUNK_SUB_CHUNK

CONTEXT = 256
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


# --- between the command buffers of a chunk (issue 38) ---------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint() -> Checkpoint:
    return load_checkpoint(tiny_checkpoint("small"))


class CountingDevice:
    """The engine's device, counting what is submitted to it."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.submitted = 0

    def submit(self, graph: Any) -> int:
        self.submitted += 1
        return self.device.submit(graph)

    def wait(self, ticket: int) -> None:
        self.device.wait(ticket)


def split_engine(checkpoint: Checkpoint, chunk: int = 64) -> tuple[DeviceEngine, int]:
    """An engine whose `chunk`-token passes are several command buffers (a budget of two
    layers at the longest context), and how many a chunk has."""
    c = checkpoint.config
    budget = 2 * max(layer_flops(c, CONTEXT - chunk, chunk))
    engine = DeviceEngine(
        checkpoint, open_test_device(), CONTEXT, c.vocab_size, chunk, command_buffer_flops=budget
    )
    buffers = len(engine._model.graph(chunk, predicts=False).command_buffers)
    assert buffers >= 3
    return engine, buffers


def prompt_of(checkpoint: Checkpoint, length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, checkpoint.config.vocab_size, length).tolist()


def test_progress_is_reported_between_the_command_buffers_of_a_chunk(
    small_checkpoint: Checkpoint,
) -> None:
    engine, buffers = split_engine(small_checkpoint)
    calls: list[tuple[int, int]] = []
    prompt = prompt_of(small_checkpoint, 128, seed=1)
    list(engine.generate(prompt, 1, progress=lambda f, t: calls.append((f, t))))
    fed = [f for f, _ in calls]
    assert calls[-1] == (128, 128) and fed == sorted(set(fed))
    # Two chunks, each reported once per command buffer: mid-chunk counts, not only 64, 128.
    assert len(calls) == 2 * buffers
    assert [f for f in fed if 0 < f < 64] and [f for f in fed if 64 < f < 128]


def test_a_stop_mid_chunk_runs_no_further_command_buffer_and_the_next_answer_is_right(
    small_checkpoint: Checkpoint,
) -> None:
    engine, buffers = split_engine(small_checkpoint)
    counting = CountingDevice(engine.device)
    engine.device = counting
    prompt = prompt_of(small_checkpoint, 128, seed=2)
    calls: list[int] = []
    # Stops once the second chunk has run a command buffer, its snapshot at 64 taken.
    tokens = engine.generate(
        prompt, 4, snapshot_at=64, progress=lambda f, t: calls.append(f),
        should_stop=lambda: bool(calls) and calls[-1] > 64,
    )  # fmt: skip
    with pytest.raises(GenerationCancelled):
        list(tokens)
    assert calls[-1] < 128
    # The first chunk whole, then what was in flight when the stop came (the pipeline's two).
    assert counting.submitted <= buffers + PIPELINE_DEPTH < 2 * buffers
    # The half-fed chunk left nothing behind: the snapshot at 64 is reused and the answer is
    # a fresh engine's, as is a prompt that branches off inside the abandoned chunk.
    assert engine.cached_prefix_length(prompt) == 64
    branch = prompt[:80] + prompt_of(small_checkpoint, 40, seed=3)
    fresh, _ = split_engine(small_checkpoint)
    for again in (prompt, branch):
        expected = [t.id for t in fresh.generate(again, 6)]
        assert [t.id for t in engine.generate(again, 6)] == expected


# --- on the sim, with what lily.load sets up (issue 38's acceptance) -------------------------


def test_the_sim_reports_progress_and_can_stop_within_a_long_prompts_first_chunk() -> None:
    """`lily.load` on the sim cuts command buffers (and chunks) by SIM_COMMAND_BUFFER_FLOPS:
    a long prompt is reported every few dozen tokens from its start, not once per
    4,096-token chunk (over a minute on the sim), and the chunks, cut at whole GDN sub-chunks,
    compute every bit as one chunk would."""
    prompt = np.random.default_rng(5).integers(0, 4000, 300).tolist()
    with lily.load("demo", device="sim", max_seq=512, cache_memory=0) as llm:
        engine = llm.engine
        assert isinstance(engine, DeviceEngine)
        assert engine.command_buffer_flops == SIM_COMMAND_BUFFER_FLOPS
        fed: list[int] = []
        params = SamplingParams(temperature=0, top_logprobs=2)
        cut = list(engine.generate(prompt, 3, sampling=params, progress=lambda f, t: fed.append(f)))
        assert fed[0] <= 64 and max(np.diff([0, *fed])) <= 64 and fed[-1] == len(prompt)
        ends, start = [], 0
        while start < len(prompt):
            start = engine._chunk_end(start, len(prompt))
            ends.append(start)
        assert len(ends) > 1 and all(end % CHUNK_SUB_CHUNK == 0 for end in ends[:-1])
        engine.command_buffer_flops = None  # one chunk, as the sim ran before
        assert engine.cached_prefix_length(prompt) == 0
        whole = list(engine.generate(prompt, 3, sampling=params))
    assert [t.id for t in cut] == [t.id for t in whole]
    assert [t.logprobs for t in cut] == [t.logprobs for t in whole]
