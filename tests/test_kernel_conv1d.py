"""conv1d_step and conv1d_chunk (metal/conv1d.metal) on the sim against float64 numpy
references, and the chunk against the same tokens stepped one by one; a verify pass's chunk
(its tail) and conv1d_commit against the window the kept tokens leave."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, assert_within_ulps, sim_device

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.engine import reference
from lily.kernels import RowSlots
from lily.kernels.conv1d import (
    KERNEL_TAPS,
    record_conv1d_chunk,
    record_conv1d_commit,
    record_conv1d_step,
    tail_bytes,
    window_bytes,
)

# conv_dim of the real model (2 * 2048 + 4096), of the tiny config (2 * 256 + 512), and a count
# that leaves the last threadgroup partly idle.
CHANNELS = [8192, 1024, 300]


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


def _conv_case(channels: int, seed: int):
    rng = np.random.default_rng(seed)
    weight_bits = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
    window = rng.normal(0, 1, (KERNEL_TAPS - 1, channels)).astype(np.float32)
    x = rng.normal(0, 1, channels).astype(np.float32)
    return weight_bits, window, x


def _record(device, buffers: dict, channels: int) -> Graph:
    graph = Graph()
    record_conv1d_step(graph, device, channels=channels, **buffers)
    return graph


@pytest.mark.parametrize("channels", CHANNELS)
def test_one_step_matches_reference(device, channels: int) -> None:
    weight_bits, window, x = _conv_case(channels, seed=channels)
    out = np.full(channels, np.nan, dtype=np.float32)
    window_dev = window.copy()
    buffers = {
        "x": device.wrap(x),
        "weight": device.wrap(weight_bits),
        "window": device.wrap(window_dev),
        "out": device.wrap(out),
    }
    device.run(_record(device, buffers, channels))

    weight = bf16_to_float32(weight_bits)[:, :, 0].astype(np.float64)
    expected, expected_window = reference.causal_conv1d_step(
        window.astype(np.float64), x.astype(np.float64), weight
    )
    # Four fp32 products, a sum and SiLU: a few ulp of the largest term.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # The window shift copies fp32 values: exact.
    np.testing.assert_array_equal(window_dev, expected_window.astype(np.float32))


def test_replayed_graph_carries_the_window(device) -> None:
    """One recorded graph replayed over a sequence from zero history equals the convolution of
    the whole sequence: the window is the only state and lives on the device."""
    channels = 1024
    steps = 6
    weight_bits, _, _ = _conv_case(channels, seed=7)
    sequence = np.random.default_rng(8).normal(0, 1, (steps, channels)).astype(np.float32)
    x = np.zeros(channels, dtype=np.float32)
    window = np.zeros((KERNEL_TAPS - 1, channels), dtype=np.float32)
    out = np.zeros(channels, dtype=np.float32)
    buffers = {
        "x": device.wrap(x),
        "weight": device.wrap(weight_bits),
        "window": device.wrap(window),
        "out": device.wrap(out),
    }
    graph = _record(device, buffers, channels)

    weight = bf16_to_float32(weight_bits)[:, :, 0].astype(np.float64)
    padded = np.concatenate([np.zeros((KERNEL_TAPS - 1, channels)), sequence.astype(np.float64)])
    for t in range(steps):
        x[:] = sequence[t]
        device.run(graph)
        # Direct definition: c_t = sum_j w[:, j] * x_{t-3+j}, zero before the first step.
        conv = np.einsum("jc,cj->c", padded[t : t + KERNEL_TAPS], weight)
        np.testing.assert_allclose(out, reference.silu(conv), rtol=1e-5, atol=1e-6)


# Chunk lengths: shorter than the window (the new window keeps old rows), exactly the window, a
# partial first block, several blocks with a ragged last one, and a longer prompt.
CHUNK_TOKENS = [1, 2, 3, 7, 64, 300, 1111]


def _chunk_buffers(device, x, weight_bits, window, out) -> dict:
    return {
        "x": device.wrap(x),
        "weight": device.wrap(weight_bits),
        "window": device.wrap(window),
        "out": device.wrap(out),
    }


def _record_chunk(device, buffers: dict, channels: int, tokens: int) -> Graph:
    graph = Graph()
    record_conv1d_chunk(graph, device, channels=channels, tokens=tokens, **buffers)
    return graph


def _chunk_case(channels: int, tokens: int, seed: int):
    weight_bits, window, _ = _conv_case(channels, seed)
    x = np.random.default_rng(seed + 1).normal(0, 1, (tokens, channels)).astype(np.float32)
    return weight_bits, window, x


def _expected_chunk(weight_bits, window, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out, magnitude of the rounding, new window) in float64, from the definition: output t
    convolves rows t..t+3 of (window ++ x)."""
    weight = bf16_to_float32(weight_bits)[:, :, 0].astype(np.float64)
    rows = np.concatenate([window, x]).astype(np.float64)
    tokens = x.shape[0]
    taps = np.stack([rows[j : j + tokens] for j in range(KERNEL_TAPS)])  # [K, T, C]
    conv = np.einsum("jtc,cj->tc", taps, weight)
    magnitude = np.einsum("jtc,cj->tc", np.abs(taps), np.abs(weight))
    return reference.silu(conv), magnitude, rows[tokens:]


@pytest.mark.parametrize("tokens", CHUNK_TOKENS)
def test_chunk_matches_reference(device, tokens: int) -> None:
    channels = 300
    weight_bits, window, x = _chunk_case(channels, tokens, seed=tokens)
    out = np.full((tokens, channels), np.nan, dtype=np.float32)
    window_dev = window.copy()
    buffers = _chunk_buffers(device, x, weight_bits, window_dev, out)
    device.run(_record_chunk(device, buffers, channels, tokens))

    expected, magnitude, expected_window = _expected_chunk(weight_bits, window, x)
    # Four fp32 products and their sum round to a few ulp of the sum of |terms|; SiLU's slope is
    # at most 1.1 and adds a few ulp of the result.
    assert_within_ulps(out, expected, magnitude + np.abs(expected), 4)
    # The window only moves fp32 values: exact, old rows included when tokens < 3.
    np.testing.assert_array_equal(window_dev, expected_window.astype(np.float32))


def test_chunk_at_model_width(device) -> None:
    channels, tokens = 8192, 37
    weight_bits, window, x = _chunk_case(channels, tokens, seed=3)
    out = np.full((tokens, channels), np.nan, dtype=np.float32)
    window_dev = window.copy()
    assert window_dev.nbytes == window_bytes(channels)
    buffers = _chunk_buffers(device, x, weight_bits, window_dev, out)
    device.run(_record_chunk(device, buffers, channels, tokens))

    expected, magnitude, expected_window = _expected_chunk(weight_bits, window, x)
    assert_within_ulps(out, expected, magnitude + np.abs(expected), 4)
    np.testing.assert_array_equal(window_dev, expected_window.astype(np.float32))


@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
def test_chunk_equals_the_same_tokens_stepped(device, tokens: int) -> None:
    """A chunk computes each output with the step kernel's arithmetic, so prefill then decode
    equals decode alone bit for bit: same outputs, same window left behind."""
    channels = 300
    weight_bits, window, x = _chunk_case(channels, tokens, seed=50 + tokens)
    chunk_out = np.full((tokens, channels), np.nan, dtype=np.float32)
    chunk_window = window.copy()
    buffers = _chunk_buffers(device, x, weight_bits, chunk_window, chunk_out)
    device.run(_record_chunk(device, buffers, channels, tokens))

    step_out = np.full((tokens, channels), np.nan, dtype=np.float32)
    step_window = window.copy()
    x_dev, out_dev = device.wrap(x), device.wrap(step_out)
    weight_dev, window_dev = device.wrap(weight_bits), device.wrap(step_window)
    graph = Graph()
    for t in range(tokens):
        record_conv1d_step(
            graph,
            device,
            x=(x_dev, 4 * channels * t),
            weight=weight_dev,
            window=window_dev,
            out=(out_dev, 4 * channels * t),
            channels=channels,
        )
        graph.barrier()
    device.run(graph)

    np.testing.assert_array_equal(chunk_out, step_out)
    np.testing.assert_array_equal(chunk_window, step_window)


def test_chunks_carry_the_window(device) -> None:
    """Chunks of 2, 1 and 20 tokens (two shorter than the window) in one graph equal one chunk
    of 23."""
    channels, lengths = 300, (2, 1, 20)
    weight_bits, window, x = _chunk_case(channels, sum(lengths), seed=9)
    whole_out = np.full(x.shape, np.nan, dtype=np.float32)
    whole_window = window.copy()
    buffers = _chunk_buffers(device, x, weight_bits, whole_window, whole_out)
    device.run(_record_chunk(device, buffers, channels, x.shape[0]))

    split_out = np.full(x.shape, np.nan, dtype=np.float32)
    split_window = window.copy()
    buffers = _chunk_buffers(device, x, weight_bits, split_window, split_out)
    graph = Graph()
    start = 0
    for length in lengths:
        offset = 4 * channels * start
        record_conv1d_chunk(
            graph,
            device,
            x=(buffers["x"], offset),
            weight=buffers["weight"],
            window=buffers["window"],
            out=(buffers["out"], offset),
            channels=channels,
            tokens=length,
        )
        graph.barrier()
        start += length
    device.run(graph)

    np.testing.assert_array_equal(split_out, whole_out)
    np.testing.assert_array_equal(split_window, whole_window)


def test_chunk_rejects_an_empty_chunk(device) -> None:
    buffer = device.alloc(window_bytes(64))
    with pytest.raises(ValueError, match="at least one token"):
        record_conv1d_chunk(
            Graph(),
            device,
            x=buffer,
            weight=buffer,
            window=buffer,
            out=buffer,
            channels=64,
            tokens=0,
        )


# ---- a verify pass: the tail and conv1d_commit ---------------------------------------------------


def _verify_chunk(device, channels: int, tokens: int, candidates: int, kept: int | None):
    """conv1d_chunk of a verify pass over a random case, then (unless `kept` is None)
    conv1d_commit with `kept` accepted drafts: (case, out, window, tail)."""
    weight_bits, window, x = _chunk_case(channels, tokens, seed=60 + tokens + candidates)
    out = np.full((tokens, channels), np.nan, dtype=np.float32)
    window_dev = window.copy()
    tail = np.full(tail_bytes(channels, candidates) // 4, np.nan, np.float32)
    buffers = _chunk_buffers(device, x, weight_bits, window_dev, out)
    tail_dev = device.wrap(tail)
    graph = Graph()
    record_conv1d_chunk(
        graph, device, channels=channels, tokens=tokens, tail=tail_dev, candidates=candidates,
        **buffers,
    )  # fmt: skip
    if kept is not None:
        graph.barrier()
        accepted = device.wrap(np.array([kept, 0], np.uint32))
        record_conv1d_commit(
            graph,
            device,
            accepted=accepted,
            tail=tail_dev,
            window=buffers["window"],
            channels=channels,
            candidates=candidates,
        )
    device.run(graph)
    return (weight_bits, window, x), out, window_dev, tail.reshape(-1, channels)


# (tokens, candidates): the engine's passes (one waiting token and its drafts), tokens before
# the candidates, and a pass shorter than the window.
VERIFY_CASES = [(5, 5), (9, 9), (6, 3), (2, 2), (1, 1)]


@pytest.mark.parametrize(("tokens", "candidates"), VERIFY_CASES)
def test_verify_chunk_keeps_the_window_and_writes_the_tail(device, tokens, candidates) -> None:
    """The outputs are the chunk's; the window is untouched; the tail is the last
    candidates + 2 rows of (window ++ x), exactly."""
    channels = 300
    (weight_bits, window, x), out, window_dev, tail = _verify_chunk(
        device, channels, tokens, candidates, kept=None
    )
    expected, magnitude, _ = _expected_chunk(weight_bits, window, x)
    assert_within_ulps(out, expected, magnitude + np.abs(expected), 4)
    np.testing.assert_array_equal(window_dev, window)
    rows = np.concatenate([window, x])
    np.testing.assert_array_equal(tail, rows[len(rows) - candidates - 2 :])


@pytest.mark.parametrize(("tokens", "candidates"), VERIFY_CASES)
def test_commit_leaves_the_window_of_the_kept_tokens(device, tokens, candidates) -> None:
    """For every accepted count n, the window after the commit is the one a chunk of the tokens
    before the candidates, the first candidate and n more leaves, bit for bit; neighbouring
    counts leave different windows, so taking the wrong rows fails."""
    channels = 300
    windows = []
    for kept in range(candidates):
        (weight_bits, window, x), _, window_dev, _ = _verify_chunk(
            device, channels, tokens, candidates, kept
        )
        consumed = tokens - candidates + kept + 1
        chunk_window = window.copy()
        out = np.full((consumed, channels), np.nan, dtype=np.float32)
        buffers = _chunk_buffers(device, x[:consumed].copy(), weight_bits, chunk_window, out)
        device.run(_record_chunk(device, buffers, channels, consumed))
        np.testing.assert_array_equal(window_dev, chunk_window)
        windows.append(window_dev)
    for earlier, later in itertools.pairwise(windows):
        assert not np.array_equal(earlier, later)


def test_a_tail_needs_candidates(device) -> None:
    buffers = _chunk_buffers(
        device, *(np.zeros(s, np.float32) for s in ((3, 8), (8, 4), (3, 8), (3, 8)))
    )
    graph = Graph()
    with pytest.raises(ValueError, match="a tail needs 1 to 3 candidates, got 0"):
        record_conv1d_chunk(graph, device, channels=8, tokens=3, tail=buffers["out"], **buffers)
    with pytest.raises(ValueError, match="a tail needs 1 to 3 candidates, got 4"):
        record_conv1d_chunk(
            graph, device, channels=8, tokens=3, tail=buffers["out"], candidates=4, **buffers
        )


@pytest.mark.parametrize(("channels", "row_slots"), [(300, [3, 0, 2]), (1024, [1])])
def test_rows_step_each_row_on_its_slots_window(device, channels: int, row_slots) -> None:
    """A batched pass's conv steps in one dispatch: row r on window row_slots[r] of the slots'
    windows (ragged: slot 1 of 4 is no row's, and keeps its window)."""
    slots, rows = 4, len(row_slots)
    rng = np.random.default_rng(channels)
    weight_bits = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
    windows = rng.normal(0, 1, (slots, KERNEL_TAPS - 1, channels)).astype(np.float32)
    x = rng.normal(0, 1, (rows, channels)).astype(np.float32)
    out = np.full((rows, channels), np.nan, dtype=np.float32)
    stepped = windows.copy()
    table = np.array(row_slots, dtype=np.uint32)
    graph = Graph()
    record_conv1d_step(
        graph,
        device,
        x=device.wrap(x),
        weight=device.wrap(weight_bits),
        window=device.wrap(stepped),
        out=device.wrap(out),
        channels=channels,
        row_slots=RowSlots(device.wrap(table), rows),
    )
    device.run(graph)

    weight = bf16_to_float32(weight_bits)[:, :, 0].astype(np.float64)
    expected_windows = windows.copy()
    for row, slot in enumerate(row_slots):
        expected, expected_window = reference.causal_conv1d_step(
            windows[slot].astype(np.float64), x[row].astype(np.float64), weight
        )
        np.testing.assert_allclose(out[row], expected, rtol=1e-5, atol=1e-6)
        expected_windows[slot] = expected_window
        # The same arithmetic as the one-sequence kernel on that window: equal bit for bit.
        alone_window, alone_out = windows[slot].copy(), np.empty(channels, dtype=np.float32)
        buffers = {
            "x": device.wrap(x[row].copy()),
            "weight": device.wrap(weight_bits),
            "window": device.wrap(alone_window),
            "out": device.wrap(alone_out),
        }
        device.run(_record(device, buffers, channels))
        np.testing.assert_array_equal(out[row], alone_out)
    np.testing.assert_array_equal(stepped, expected_windows.astype(np.float32))
