"""gdn_step, gdn_chunk and gdn_gated_norm (metal/gdn.metal) on the sim against the float64
numpy reference, and the chunk against the same tokens stepped one by one.

The step and chunk kernels fuse the q/k L2 norms, the g/beta gates, the delta-rule update of the
fp32 state and the readout S q; the gated RMSNorm is gdn_out_proj's after a step
(test_kernel_gdn_out_proj.py) and gdn_gated_norm's after a chunk. The reference composes the
same steps from lily.engine.reference, token after token; the chunk's own algorithm has a float64
reference too (lily.diagnostics.kernel_checks.reference_gdn_chunkwise), checked against it here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, assert_within_ulps, sim_device

from lily.checkpoint.quant import float32_to_bf16
from lily.device import Graph, MatrixProducts
from lily.diagnostics.kernel_checks import (
    GDN_CHUNK_OUT_TOLERANCE,
    GDN_CHUNK_READOUT_TOLERANCE,
    GDN_CHUNK_STATE_TOLERANCE,
    reference_gated_norm,
    reference_gdn_chunkwise,
    reference_gdn_commit,
    reference_gdn_readout,
    reference_gdn_tokens,
)
from lily.engine.reference import HalfOperands
from lily.kernels import RowSlots
from lily.kernels.gdn import (
    CHUNK_SCALE_ROWS,
    CHUNK_SUB_CHUNK,
    KEY_HEAD_DIM,
    VALUE_HEAD_DIM,
    VerifyUpdates,
    record_gdn_chunk,
    record_gdn_commit,
    record_gdn_gated_norm,
    record_gdn_step,
    record_gdn_tokens,
    state_bytes,
    verify_updates_bytes,
)

EPS = 1e-6
# (key heads, value heads): the real model, and the tiny config.
HEADS = [(16, 32), (2, 4)]


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


class GdnCase:
    """Inputs of one layer's step, plus device buffers over them (zero-copy)."""

    def __init__(self, device, num_key_heads: int, num_value_heads: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        key_total = num_key_heads * KEY_HEAD_DIM
        value_total = num_value_heads * VALUE_HEAD_DIM
        f32 = np.float32
        self.qkv = rng.normal(0, 1, 2 * key_total + value_total).astype(f32)
        self.a = rng.normal(0, 1, num_value_heads).astype(f32)
        self.b = rng.normal(0, 1.5, num_value_heads).astype(f32)
        self.a_log = np.log(rng.uniform(0.1, 4, num_value_heads)).astype(f32)
        self.dt_bias = float32_to_bf16(rng.normal(0, 0.5, num_value_heads).astype(f32))
        shape = (num_value_heads, VALUE_HEAD_DIM, KEY_HEAD_DIM)
        self.state = rng.normal(0, 0.3, shape).astype(f32)
        self.readout = np.full(value_total, np.nan, dtype=f32)
        assert self.state.nbytes == state_bytes(num_value_heads)
        self.buffers = {
            name: device.wrap(getattr(self, name))
            for name in ("qkv", "a", "b", "a_log", "dt_bias", "state", "readout")
        }

    def record(self, device) -> Graph:
        graph = Graph()
        record_gdn_step(
            graph,
            device,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
            **self.buffers,
        )
        return graph

    def expected(self, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(readout [Hv*Dv], new state) in float64 from the current inputs and `state`."""
        readout, new_state = reference_gdn_readout(
            state,
            self.qkv,
            self.a,
            self.b,
            a_log=self.a_log,
            dt_bias=self.dt_bias,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
        )
        return readout.reshape(-1), new_state


# The step's state: fp32 sums of 128 products, against float64: relative errors stay around
# 1e-6; the bound leaves a margin of ~10x over what the sim shows and catches any formula error
# (those are >= 1e-2).
STATE_ATOL = 1e-5
# The readout S q, before the norm (|S q| < 0.1 at these input scales): an fp32 dot product of
# 128 terms of the updated state, with errors around 1.5e-8 on the sim.
READOUT_RTOL, READOUT_ATOL = 1e-5, 2e-7
# gdn_gated_norm of a readout, against float64 of that same fp32 readout: the sum of
# 128 squares (at most 127 roundings) halved by the square root, the rsqrt (2), three products
# (3) and silu (7, see kernel_checks.gdn_out_proj_ulps).
NORM_ULPS = 127 / 2 + 2 + 3 + 7


@pytest.mark.parametrize(("num_key_heads", "num_value_heads"), HEADS)
def test_one_step_matches_reference(device, num_key_heads: int, num_value_heads: int) -> None:
    case = GdnCase(device, num_key_heads, num_value_heads, seed=num_value_heads)
    initial_state = case.state.copy()
    device.run(case.record(device))

    expected_readout, expected_state = case.expected(initial_state)
    np.testing.assert_allclose(case.state, expected_state, rtol=1e-5, atol=STATE_ATOL)
    np.testing.assert_allclose(case.readout, expected_readout, rtol=READOUT_RTOL, atol=READOUT_ATOL)


@pytest.mark.parametrize(("num_key_heads", "num_value_heads"), HEADS)
def test_rows_step_each_row_on_its_slots_state(
    device, num_key_heads: int, num_value_heads: int
) -> None:
    """A batched pass's steps in one dispatch: row r on state row_slots[r] of the slots'
    states (ragged: 3 rows of 4 slots out of order, slot 1 no row's, which keeps its state)."""
    row_slots = [2, 0, 3]
    cases = [GdnCase(device, num_key_heads, num_value_heads, seed=seed) for seed in range(4)]
    rows = [cases[slot] for slot in row_slots]  # each row's inputs and its slot's state
    initial = np.stack([case.state for case in cases])
    states = initial.copy()
    readout = np.full((len(rows), num_value_heads * VALUE_HEAD_DIM), np.nan, dtype=np.float32)
    graph = Graph()
    record_gdn_step(
        graph,
        device,
        qkv=device.wrap(np.stack([case.qkv for case in rows])),
        a=device.wrap(np.stack([case.a for case in rows])),
        b=device.wrap(np.stack([case.b for case in rows])),
        a_log=device.wrap(cases[0].a_log),
        dt_bias=device.wrap(cases[0].dt_bias),
        state=device.wrap(states),
        readout=device.wrap(readout),
        num_key_heads=num_key_heads,
        num_value_heads=num_value_heads,
        row_slots=RowSlots(device.wrap(np.array(row_slots, dtype=np.uint32)), len(rows)),
    )
    device.run(graph)

    for row, (slot, case) in enumerate(zip(row_slots, rows, strict=True)):
        case.a_log, case.dt_bias = cases[0].a_log, cases[0].dt_bias  # the layer's, shared
        expected_readout, expected_state = case.expected(initial[slot])
        np.testing.assert_allclose(states[slot], expected_state, rtol=1e-5, atol=STATE_ATOL)
        np.testing.assert_allclose(
            readout[row], expected_readout, rtol=READOUT_RTOL, atol=READOUT_ATOL
        )
        # The one-sequence kernel on the same inputs and state: equal bit for bit.
        case.buffers["a_log"], case.buffers["dt_bias"] = (
            device.wrap(case.a_log),
            device.wrap(case.dt_bias),
        )
        device.run(case.record(device))
        np.testing.assert_array_equal(states[slot], case.state)
        np.testing.assert_array_equal(readout[row], case.readout)
    np.testing.assert_array_equal(states[1], initial[1])


def test_replayed_graph_from_zero_state(device) -> None:
    """A recorded graph replayed over a short sequence, state starting at zero as in a fresh
    sequence, follows the reference recurrence step by step."""
    case = GdnCase(device, 2, 4, seed=11)
    case.state[:] = 0
    graph = case.record(device)
    rng = np.random.default_rng(12)
    state = np.zeros(case.state.shape)
    for _ in range(4):
        case.qkv[:] = rng.normal(0, 1, case.qkv.shape)
        case.a[:] = rng.normal(0, 1, case.a.shape)
        case.b[:] = rng.normal(0, 1, case.b.shape)
        device.run(graph)
        expected_readout, state = case.expected(state)
        np.testing.assert_allclose(
            case.readout, expected_readout, rtol=READOUT_RTOL, atol=READOUT_ATOL
        )
        np.testing.assert_allclose(case.state, state, rtol=1e-5, atol=STATE_ATOL)


def test_step_spreads_heads_over_many_threadgroups(device) -> None:
    """The real model's step fills the GPU: at least 40 threadgroups for its 32 heads."""
    case = GdnCase(device, 16, 32, seed=0)
    (dispatch,) = case.record(device).dispatches
    assert dispatch.threadgroups[0] * dispatch.threadgroups[1] * dispatch.threadgroups[2] >= 40


def test_rejects_head_dims_it_was_not_built_for(device) -> None:
    case = GdnCase(device, 2, 4, seed=0)
    with pytest.raises(ValueError, match="128-dim"):
        record_gdn_step(
            Graph(), device, num_key_heads=2, num_value_heads=4, key_head_dim=64, **case.buffers
        )


def test_rejects_a_misaligned_readout(device) -> None:
    case = GdnCase(device, 2, 4, seed=0)
    buffers = {**case.buffers, "readout": (case.buffers["readout"], 4)}
    with pytest.raises(ValueError, match="readout"):
        record_gdn_step(Graph(), device, num_key_heads=2, num_value_heads=4, **buffers)


class GdnChunkCase:
    """One layer's weights, an initial state (random, or zero as in a fresh sequence) and the
    inputs of `tokens` tokens."""

    def __init__(
        self,
        num_key_heads: int,
        num_value_heads: int,
        tokens: int,
        seed: int,
        zero_state: bool = False,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.tokens = tokens
        value_total = num_value_heads * VALUE_HEAD_DIM
        conv_dim = 2 * num_key_heads * KEY_HEAD_DIM + value_total
        f32 = np.float32
        self.a_log = np.log(rng.uniform(0.1, 4, num_value_heads)).astype(f32)
        self.dt_bias = float32_to_bf16(rng.normal(0, 0.5, num_value_heads).astype(f32))
        self.norm_weight = float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32))
        shape = (num_value_heads, VALUE_HEAD_DIM, KEY_HEAD_DIM)
        self.initial_state = rng.normal(0, 0.3, shape).astype(f32)
        if zero_state:
            self.initial_state[:] = 0
        self.qkv = rng.normal(0, 1, (tokens, conv_dim)).astype(f32)
        self.z = rng.normal(0, 1.5, (tokens, value_total)).astype(f32)
        self.a = rng.normal(0, 1, (tokens, num_value_heads)).astype(f32)
        self.b = rng.normal(0, 1.5, (tokens, num_value_heads)).astype(f32)

    def bind(self, device) -> tuple[dict, np.ndarray, np.ndarray]:
        state = self.initial_state.copy()
        out = np.full(self.z.shape, np.nan, dtype=np.float32)
        buffers = {
            name: device.wrap(getattr(self, name))
            for name in ("qkv", "z", "a", "b", "a_log", "dt_bias", "norm_weight")
        }
        buffers["state"], buffers["out"] = device.wrap(state), device.wrap(out)
        return buffers, out, state

    def record_chunk(self, graph: Graph, device, buffers: dict) -> None:
        record_gdn_chunk(
            graph,
            device,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
            tokens=self.tokens,
            readout=buffers["out"],
            **{name: buffers[name] for name in ("qkv", "a", "b", "a_log", "dt_bias", "state")},
        )

    def run_chunk(self, device, *, norm: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(out [tokens, Hv*Dv], state after the chunk) from one gdn_chunk dispatch, then, as in
        prefill, gdn_gated_norm over its readouts (`norm`) or not."""
        buffers, out, state = self.bind(device)
        graph = Graph()
        self.record_chunk(graph, device, buffers)
        if norm:
            graph.barrier()
            record_gdn_gated_norm(
                graph,
                device,
                x=buffers["out"],
                z=buffers["z"],
                norm_weight=buffers["norm_weight"],
                tokens=self.tokens,
                num_value_heads=self.num_value_heads,
                norm_eps=EPS,
            )
        device.run(graph)
        return out, state

    def run_steps(self, device) -> tuple[np.ndarray, np.ndarray]:
        """(readouts [tokens, Hv*Dv], state after them) from `tokens` gdn_step dispatches, each
        bound to its token's rows (the readouts to the rows of `out`)."""
        buffers, readout, state = self.bind(device)
        graph = Graph()
        for t in range(self.tokens):
            rows = {
                name: (buffers[name], t * row.nbytes)
                for name, row in (("qkv", self.qkv[0]), ("a", self.a[0]), ("b", self.b[0]))
            }
            record_gdn_step(
                graph,
                device,
                num_key_heads=self.num_key_heads,
                num_value_heads=self.num_value_heads,
                readout=(buffers["out"], t * self.z[0].nbytes),
                **{name: buffers[name] for name in ("a_log", "dt_bias", "state")},
                **rows,
            )
            graph.barrier()
        device.run(graph)
        return readout, state

    def expected(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(readouts, outs, final state) in float64, token after token."""
        state = self.initial_state.astype(np.float64)
        readouts, outputs = [], []
        for t in range(self.tokens):
            readout, state = reference_gdn_readout(
                state,
                self.qkv[t],
                self.a[t],
                self.b[t],
                a_log=self.a_log,
                dt_bias=self.dt_bias,
                num_key_heads=self.num_key_heads,
                num_value_heads=self.num_value_heads,
            )
            readouts.append(readout.reshape(-1))
            outputs.append(reference_gated_norm(readouts[-1], self.z[t], self.norm_weight, EPS))
        return np.stack(readouts), np.stack(outputs), state

    def expected_chunkwise(
        self, half_operands: HalfOperands | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(readouts, final state) in float64 by the chunkwise algorithm, its operands rounded
        as `half_operands` says."""
        return reference_gdn_chunkwise(
            self.initial_state,
            self.qkv,
            self.a,
            self.b,
            a_log=self.a_log,
            dt_bias=self.dt_bias,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
            sub_chunk=CHUNK_SUB_CHUNK,
            half_operands=half_operands,
        )


def assert_chunk_close(state, expected_state, out=None, expected_out=None) -> None:
    """Within the chunk's bounds (lily.diagnostics.kernel_checks, where they are explained)."""
    np.testing.assert_allclose(state, expected_state, *GDN_CHUNK_STATE_TOLERANCE)
    if out is not None:
        np.testing.assert_allclose(out, expected_out, *GDN_CHUNK_OUT_TOLERANCE)


# Chunk lengths: one token, a partial sub-chunk, exactly 4 sub-chunks and one token more, and
# long enough for rounding to accumulate in the state.
CHUNK_TOKENS = [1, 7, 64, 65, 300]


@pytest.mark.parametrize("zero_state", [False, True], ids=["with-state", "from-zero"])
@pytest.mark.parametrize("tokens", CHUNK_TOKENS)
def test_chunk_matches_reference(device, tokens: int, zero_state: bool) -> None:
    case = GdnChunkCase(2, 4, tokens, seed=tokens, zero_state=zero_state)
    out, state = case.run_chunk(device)

    _, expected_out, expected_state = case.expected()
    assert_chunk_close(state, expected_state, out, expected_out)


@pytest.mark.slow
def test_chunk_of_4097_tokens_matches_reference(device) -> None:
    """A chunk as long as the longest prefill chunks: 256 sub-chunks and one token, the state
    carried through all of them."""
    case = GdnChunkCase(2, 4, 4097, seed=4097)
    out, state = case.run_chunk(device)

    _, expected_out, expected_state = case.expected()
    assert_chunk_close(state, expected_state, out, expected_out)


@pytest.mark.parametrize("tokens", [1, 7, 17, 65])
def test_chunk_readouts_match_the_chunkwise_reference(device, tokens: int) -> None:
    """The readouts before the norm, against the float64 chunkwise algorithm, which itself
    equals the recurrence (test_chunkwise_reference_equals_the_recurrence)."""
    case = GdnChunkCase(1, 4, tokens, seed=200 + tokens)
    readout, state = case.run_chunk(device, norm=False)

    expected_readout, expected_state = case.expected_chunkwise()
    assert_chunk_close(state, expected_state)
    np.testing.assert_allclose(readout, expected_readout, *GDN_CHUNK_READOUT_TOLERANCE)


@pytest.mark.parametrize("tokens", [1, 7, 17, 65, 300])
def test_chunk_rounds_its_operands_where_the_emulating_reference_does(device, tokens: int) -> None:
    """reference.HalfOperands rounds the chunkwise algorithm's operands where gdn_chunk does
    (its scales per 8 state rows, a SIMD-group's): the kernel's state then sits within 1e-6 of
    it (measured 2e-7), where the float64 algorithm without the rounding is off by ~4e-4, and
    its readouts typically 1e-4 as far as from that (an operand near a rounding tie may round the
    other way in fp32, which moves a few readouts by ~1e-6)."""
    case = GdnChunkCase(2, 4, tokens, seed=200 + tokens)
    readout, state = case.run_chunk(device, norm=False)

    emulated_readout, emulated_state = case.expected_chunkwise(HalfOperands(CHUNK_SCALE_ROWS))
    exact_readout, exact_state = case.expected_chunkwise()
    np.testing.assert_allclose(state, emulated_state, rtol=0, atol=1e-6)
    assert np.abs(state - exact_state).max() > 100 * np.abs(state - emulated_state).max()
    emulated_error = np.median(np.abs(readout - emulated_readout))
    assert emulated_error < 1e-2 * np.median(np.abs(readout - exact_readout))
    np.testing.assert_allclose(readout, emulated_readout, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 16, 17, 65])
def test_chunkwise_reference_equals_the_recurrence(tokens: int) -> None:
    case = GdnChunkCase(2, 4, tokens, seed=300 + tokens)
    readout, _, state = case.expected()
    chunk_readout, chunk_state = case.expected_chunkwise()
    np.testing.assert_allclose(chunk_readout, readout, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(chunk_state, state, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("magnitude", [2.0**20, 2.0**-20], ids=["past-half", "under-half"])
def test_chunk_holds_states_and_values_past_half_range(device, magnitude: float) -> None:
    """The state and the values scaled by 2^20 (entries up to ~3e5, past half's 65504) or 2^-20
    (~1e-6, half subnormals): the recurrence is linear in them together, so the readouts and
    the state scale alike, and the power-of-two scales that bring S, R and U into half's range
    keep the chunk's bounds relative to them."""
    case = GdnChunkCase(2, 4, 37, seed=37)
    value_start = 2 * case.num_key_heads * KEY_HEAD_DIM
    case.qkv[:, value_start:] *= magnitude
    case.initial_state *= magnitude
    readout, state = case.run_chunk(device, norm=False)

    expected_readout, _, expected_state = case.expected()
    np.testing.assert_allclose(
        state / magnitude, expected_state / magnitude, *GDN_CHUNK_STATE_TOLERANCE
    )
    np.testing.assert_allclose(
        readout / magnitude, expected_readout / magnitude, *GDN_CHUNK_READOUT_TOLERANCE
    )


def test_chunk_products_take_half_operands() -> None:
    """Every product of the chunk has half operands: per threadgroup and sub-chunk of 16 tokens,
    the 3 lower-triangle tiles of K K^T and of Q K^T over 16 key tiles, and per SIMD-group (4)
    K S^T and Q S^T (2 token tiles x 16 key tiles each), U = X R and P U (3 tiles each) and the
    state's K^T U (16 key tiles x 2 token tiles)."""
    device = sim_device("forward")
    case = GdnChunkCase(2, 4, 17, seed=1)
    device.matrix_products()  # what earlier runs left
    case.run_chunk(device, norm=False)
    per_sub_chunk = 2 * 3 * 16 + 4 * (2 * 2 * 16 + 3 + 3 + 16 * 2)
    threadgroups, sub_chunks = 4 * 4, 2
    assert device.matrix_products() == {
        "gdn_chunk": MatrixProducts(half=threadgroups * sub_chunks * per_sub_chunk)
    }


def test_chunk_at_model_size(device) -> None:
    case = GdnChunkCase(16, 32, 19, seed=5)
    assert case.initial_state.nbytes == state_bytes(32)
    out, state = case.run_chunk(device)

    _, expected_out, expected_state = case.expected()
    assert_chunk_close(state, expected_state, out, expected_out)


def test_chunk_spreads_heads_over_4x_the_threadgroups(device) -> None:
    """At the real model's 32 heads the chunk runs 4 threadgroups per head (the serial scan it
    replaced ran one)."""
    case = GdnChunkCase(16, 32, 3, seed=0)
    buffers, _, _ = case.bind(device)
    graph = Graph()
    case.record_chunk(graph, device, buffers)
    (dispatch,) = graph.dispatches
    assert np.prod(dispatch.threadgroups) >= 4 * 32


@pytest.mark.parametrize(
    ("num_key_heads", "num_value_heads", "tokens"), [(2, 4, 1), (2, 4, 3), (1, 4, 37), (16, 32, 3)]
)
def test_chunk_equals_the_same_tokens_stepped(
    device, num_key_heads: int, num_value_heads: int, tokens: int
) -> None:
    """Prefill then decode equals decode alone within the chunk's bound: the state a chunk
    leaves equals the state `tokens` decode steps leave, and its outputs are the gated RMSNorm
    of the steps' readouts (the steps' own error is within the bounds at these lengths)."""
    case = GdnChunkCase(num_key_heads, num_value_heads, tokens, seed=100 + tokens)
    chunk_out, chunk_state = case.run_chunk(device)
    step_readout, step_state = case.run_steps(device)

    normed = np.stack(
        [
            reference_gated_norm(step_readout[t], case.z[t], case.norm_weight, EPS)
            for t in range(tokens)
        ]
    )
    assert_chunk_close(chunk_state, step_state, chunk_out, normed)


@pytest.mark.parametrize(("tokens", "num_value_heads"), [(1, 4), (3, 4), (5, 32)])
def test_gated_norm_matches_reference(device, tokens: int, num_value_heads: int) -> None:
    """gdn_gated_norm alone, in place, over rows that fill the last threadgroup partly."""
    rng = np.random.default_rng(tokens)
    shape = (tokens, num_value_heads * VALUE_HEAD_DIM)
    readout = rng.normal(0, 0.05, shape).astype(np.float32)
    z = rng.normal(0, 1.5, shape).astype(np.float32)
    norm_weight = float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(np.float32))
    x = readout.copy()
    graph = Graph()
    record_gdn_gated_norm(
        graph,
        device,
        x=device.wrap(x),
        z=device.wrap(z),
        norm_weight=device.wrap(norm_weight),
        tokens=tokens,
        num_value_heads=num_value_heads,
        norm_eps=EPS,
    )
    device.run(graph)
    for t in range(tokens):
        expected = reference_gated_norm(readout[t], z[t], norm_weight, EPS)
        assert_within_ulps(x[t], expected, np.abs(expected), NORM_ULPS)


def test_chunk_rejects_an_empty_chunk(device) -> None:
    case = GdnChunkCase(2, 4, 1, seed=0)
    buffers, _, _ = case.bind(device)
    case.tokens = 0
    with pytest.raises(ValueError, match="at least one token"):
        case.record_chunk(Graph(), device, buffers)


# ---- a verify pass: gdn_tokens and gdn_commit ----------------------------------------------------


def _run_verify(device, case: GdnChunkCase, candidates: int, kept: int | None):
    """gdn_tokens over the case's tokens with `candidates` candidates, then (unless `kept` is
    None) gdn_commit with `kept` accepted drafts: (readouts, state, (keys, deltas, decays))."""
    buffers, readout, state = case.bind(device)
    hk, hv = case.num_key_heads, case.num_value_heads
    kept_parts = np.full(verify_updates_bytes(hk, hv, candidates) // 4, np.nan, np.float32)
    updates = VerifyUpdates(device.wrap(kept_parts), hk, hv, candidates)
    accepted = device.wrap(np.array([0 if kept is None else kept, 0], np.uint32))
    graph = Graph()
    record_gdn_tokens(
        graph,
        device,
        readout=buffers["out"],
        updates=updates,
        tokens=case.tokens,
        **{name: buffers[name] for name in ("qkv", "a", "b", "a_log", "dt_bias", "state")},
    )
    if kept is not None:
        graph.barrier()
        record_gdn_commit(graph, device, accepted=accepted, state=buffers["state"], updates=updates)
    device.run(graph)
    key_words, delta_words = candidates * hk * KEY_HEAD_DIM, candidates * hv * VALUE_HEAD_DIM
    parts = (
        kept_parts[:key_words].reshape(candidates, hk, KEY_HEAD_DIM),
        kept_parts[key_words : key_words + delta_words].reshape(candidates, hv, VALUE_HEAD_DIM),
        kept_parts[key_words + delta_words :].reshape(candidates, hv),
    )
    return readout, state, parts


def _stepped_state(device, case: GdnChunkCase, tokens: int) -> np.ndarray:
    """The state after the case's first `tokens` tokens, one gdn_step each."""
    first = GdnChunkCase(case.num_key_heads, case.num_value_heads, tokens, seed=0)
    for name in ("qkv", "z", "a", "b"):
        setattr(first, name, getattr(case, name)[:tokens].copy())
    for name in ("a_log", "dt_bias", "norm_weight", "initial_state"):
        setattr(first, name, getattr(case, name))
    return first.run_steps(device)[1]


# (key heads, value heads, tokens, candidates): the engine's passes (candidates = tokens: one
# waiting token and its drafts), tokens before the candidates, one token, and the real model.
VERIFY_CASES = [(2, 4, 5, 5), (2, 4, 6, 3), (1, 4, 1, 1), (16, 32, 4, 4)]


@pytest.mark.parametrize(("num_key_heads", "num_value_heads", "tokens", "candidates"), VERIFY_CASES)
def test_verify_tokens_match_reference(
    device, num_key_heads: int, num_value_heads: int, tokens: int, candidates: int
) -> None:
    """Every token's readout, the state after the tokens before the candidates (untouched when
    there are none) and the candidates' keys, deltas and decays, against float64."""
    case = GdnChunkCase(num_key_heads, num_value_heads, tokens, seed=200 + tokens)
    readout, state, (keys, deltas, decays) = _run_verify(device, case, candidates, kept=None)
    expected_readouts, expected_state, expected_parts = reference_gdn_tokens(
        case.initial_state,
        case.qkv,
        case.a,
        case.b,
        a_log=case.a_log,
        dt_bias=case.dt_bias,
        num_key_heads=num_key_heads,
        num_value_heads=num_value_heads,
        candidates=candidates,
    )
    np.testing.assert_allclose(readout, expected_readouts, rtol=READOUT_RTOL, atol=READOUT_ATOL)
    if candidates == tokens:
        np.testing.assert_array_equal(state, case.initial_state)
    else:
        np.testing.assert_allclose(state, expected_state, rtol=1e-5, atol=STATE_ATOL)
    expected_keys, expected_deltas, expected_decays = expected_parts
    # Unit keys and decays in (0, 1]: a few fp32 roundings; the deltas are differences of
    # state-sized sums, as the state's entries.
    np.testing.assert_allclose(keys, expected_keys, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(decays, expected_decays, rtol=1e-5, atol=0)
    np.testing.assert_allclose(deltas, expected_deltas, rtol=1e-5, atol=STATE_ATOL)


@pytest.mark.parametrize(("num_key_heads", "num_value_heads", "tokens", "candidates"), VERIFY_CASES)
def test_commit_leaves_the_state_of_the_kept_tokens_stepped(
    device, num_key_heads: int, num_value_heads: int, tokens: int, candidates: int
) -> None:
    """For every accepted count n, gdn_tokens then gdn_commit leave bit for bit the state that
    the tokens before the candidates, the first candidate and n more leave when stepped one by
    one (gdn_step), and within fp32 rounding the float64 commit's; a neighbouring count's
    state differs, so taking the wrong candidate fails."""
    case = GdnChunkCase(num_key_heads, num_value_heads, tokens, seed=300 + tokens)
    states = []
    for kept in range(candidates):
        _, state, parts = _run_verify(device, case, candidates, kept)
        consumed = tokens - candidates + kept + 1
        np.testing.assert_array_equal(state, _stepped_state(device, case, consumed))
        _, before, _ = _run_verify(device, case, candidates, kept=None)
        expected = reference_gdn_commit(before, *parts, kept)
        np.testing.assert_allclose(state, expected, rtol=1e-5, atol=STATE_ATOL)
        states.append(state)
    for earlier, later in itertools.pairwise(states):
        assert np.abs(earlier - later).max() > 1e-3


def test_commit_takes_no_more_than_the_candidates(device) -> None:
    """An accepted count past the candidates (never written by accept_drafts) applies them all."""
    case = GdnChunkCase(2, 4, 3, seed=7)
    _, state, _ = _run_verify(device, case, 3, kept=7)
    np.testing.assert_array_equal(state, _stepped_state(device, case, 3))


def test_verify_tokens_reject_impossible_candidates(device) -> None:
    case = GdnChunkCase(2, 4, 3, seed=8)
    buffers, _, _ = case.bind(device)
    updates = VerifyUpdates(device.alloc(verify_updates_bytes(2, 4, 4)), 2, 4, 4)
    inputs = {name: buffers[name] for name in ("qkv", "a", "b", "a_log", "dt_bias", "state")}
    with pytest.raises(ValueError, match="keeps 1 to 3 candidates, got 4"):
        record_gdn_tokens(
            Graph(), device, readout=buffers["out"], updates=updates, tokens=3, **inputs
        )
