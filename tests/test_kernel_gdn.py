"""gdn_step and gdn_chunk (metal/gdn.metal) on the sim against the float64 numpy reference,
and the chunk against the same tokens stepped one by one.

The kernels fuse the q/k L2 norms, the g/beta gates, the delta-rule update of the fp32 state and
the readout; the chunk kernel also the gated RMSNorm, which at T = 1 is gdn_out_proj's
(test_kernel_gdn_out_proj.py). The reference composes the same steps from lily.engine.reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, assert_within_ulps, sim_device

from lily.checkpoint.quant import float32_to_bf16
from lily.device import Graph
from lily.diagnostics.kernel_checks import (
    reference_gated_norm,
    reference_gdn_readout,
    reference_gdn_token,
)
from lily.kernels.gdn import (
    KEY_HEAD_DIM,
    VALUE_HEAD_DIM,
    record_gdn_chunk,
    record_gdn_step,
    state_bytes,
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


def expected_token(case, state, qkv, z, a, b) -> tuple[np.ndarray, np.ndarray]:
    """(out [Hv*Dv], new state) of one token in float64, composed from lily.engine.reference; `case`
    gives the head counts and the per-layer weights."""
    return reference_gdn_token(
        state,
        qkv,
        z,
        a,
        b,
        a_log=case.a_log,
        dt_bias=case.dt_bias,
        norm_weight=case.norm_weight,
        num_key_heads=case.num_key_heads,
        num_value_heads=case.num_value_heads,
        eps=EPS,
    )


# fp32 sums of 128 products, against float64: relative errors stay around 1e-6; the bounds leave
# a margin of ~10x over what the sim shows and catch any formula error (those are >= 1e-2).
STATE_ATOL = 1e-5
OUT_RTOL, OUT_ATOL = 1e-4, 2e-5
# The readout S q, before the norm (|S q| < 0.1 at these input scales): an fp32 dot product of
# 128 terms of the updated state, with errors around 1.5e-8 on the sim.
READOUT_RTOL, READOUT_ATOL = 1e-5, 2e-7
# The chunk's gated RMSNorm of a readout, against float64 of that same fp32 readout: the sum of
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
    """One layer's weights, a non-zero initial state and the inputs of `tokens` tokens."""

    def __init__(self, num_key_heads: int, num_value_heads: int, tokens: int, seed: int) -> None:
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

    def run_chunk(self, device) -> tuple[np.ndarray, np.ndarray]:
        """(out [tokens, Hv*Dv], state after the chunk) from one gdn_chunk dispatch."""
        buffers, out, state = self.bind(device)
        graph = Graph()
        record_gdn_chunk(
            graph,
            device,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
            tokens=self.tokens,
            norm_eps=EPS,
            **buffers,
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

    def expected(self) -> tuple[np.ndarray, np.ndarray]:
        """(out, final state) in float64, token after token."""
        state = self.initial_state.astype(np.float64)
        outputs = []
        for t in range(self.tokens):
            out, state = expected_token(self, state, self.qkv[t], self.z[t], self.a[t], self.b[t])
            outputs.append(out)
        return np.stack(outputs), state


# Chunk lengths: one token, a few, and long enough for rounding to accumulate in the state.
CHUNK_TOKENS = [1, 2, 3, 7, 64, 300, 1024]


@pytest.mark.parametrize("tokens", CHUNK_TOKENS)
def test_chunk_matches_reference(device, tokens: int) -> None:
    case = GdnChunkCase(2, 4, tokens, seed=tokens)
    out, state = case.run_chunk(device)

    expected_out, expected_state = case.expected()
    np.testing.assert_allclose(state, expected_state, rtol=1e-5, atol=STATE_ATOL)
    np.testing.assert_allclose(out, expected_out, rtol=OUT_RTOL, atol=OUT_ATOL)


def test_chunk_at_model_size(device) -> None:
    case = GdnChunkCase(16, 32, 5, seed=5)
    assert case.initial_state.nbytes == state_bytes(32)
    out, state = case.run_chunk(device)

    expected_out, expected_state = case.expected()
    np.testing.assert_allclose(state, expected_state, rtol=1e-5, atol=STATE_ATOL)
    np.testing.assert_allclose(out, expected_out, rtol=OUT_RTOL, atol=OUT_ATOL)


@pytest.mark.parametrize(
    ("num_key_heads", "num_value_heads", "tokens"), [(2, 4, 1), (2, 4, 3), (1, 4, 37), (16, 32, 3)]
)
def test_chunk_equals_the_same_tokens_stepped(
    device, num_key_heads: int, num_value_heads: int, tokens: int
) -> None:
    """The chunk runs each token through the step kernel's arithmetic in the same order, so
    prefill then decode equals decode alone bit for bit (on the sim, which keeps fp32 rounding
    as written): the same state left behind, and outputs that are the gated RMSNorm of the
    step's readouts up to the norm's own rounding."""
    case = GdnChunkCase(num_key_heads, num_value_heads, tokens, seed=100 + tokens)
    chunk_out, chunk_state = case.run_chunk(device)
    step_readout, step_state = case.run_steps(device)

    np.testing.assert_array_equal(chunk_state, step_state)
    for t in range(tokens):
        normed = reference_gated_norm(step_readout[t], case.z[t], case.norm_weight, EPS)
        assert_within_ulps(chunk_out[t], normed, np.abs(normed), NORM_ULPS)


def test_chunk_rejects_an_empty_chunk(device) -> None:
    case = GdnChunkCase(2, 4, 1, seed=0)
    buffers, _, _ = case.bind(device)
    with pytest.raises(ValueError, match="at least one token"):
        record_gdn_chunk(Graph(), device, num_key_heads=2, num_value_heads=4, tokens=0, **buffers)
