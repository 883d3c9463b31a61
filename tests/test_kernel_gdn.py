"""gdn_step and gdn_chunk (metal/gdn.metal) on the sim against the float64 numpy reference,
and the chunk against the same tokens stepped one by one.

The kernels fuse the q/k L2 norms, the g/beta gates, the delta-rule update of the fp32 state,
the readout and the gated RMSNorm; the reference composes the same steps from lily.reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device

from lily.device import Graph
from lily.kernel_checks import reference_gdn_token
from lily.kernels.gdn import (
    KEY_HEAD_DIM,
    VALUE_HEAD_DIM,
    record_gdn_chunk,
    record_gdn_step,
    state_bytes,
)
from lily.quant import float32_to_bf16

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
        self.z = rng.normal(0, 1.5, value_total).astype(f32)
        self.a = rng.normal(0, 1, num_value_heads).astype(f32)
        self.b = rng.normal(0, 1.5, num_value_heads).astype(f32)
        self.a_log = np.log(rng.uniform(0.1, 4, num_value_heads)).astype(f32)
        self.dt_bias = float32_to_bf16(rng.normal(0, 0.5, num_value_heads).astype(f32))
        self.norm_weight = float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32))
        shape = (num_value_heads, VALUE_HEAD_DIM, KEY_HEAD_DIM)
        self.state = rng.normal(0, 0.3, shape).astype(f32)
        self.out = np.full(value_total, np.nan, dtype=f32)
        assert self.state.nbytes == state_bytes(num_value_heads)
        self.buffers = {
            name: device.wrap(getattr(self, name))
            for name in ("qkv", "z", "a", "b", "a_log", "dt_bias", "norm_weight", "state", "out")
        }

    def record(self, device) -> Graph:
        graph = Graph()
        record_gdn_step(
            graph,
            device,
            num_key_heads=self.num_key_heads,
            num_value_heads=self.num_value_heads,
            norm_eps=EPS,
            **self.buffers,
        )
        return graph

    def expected(self, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(out, new state) in float64 from the current inputs and `state`."""
        return expected_token(self, state, self.qkv, self.z, self.a, self.b)


def expected_token(case, state, qkv, z, a, b) -> tuple[np.ndarray, np.ndarray]:
    """(out [Hv*Dv], new state) of one token in float64, composed from lily.reference; `case`
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


@pytest.mark.parametrize(("num_key_heads", "num_value_heads"), HEADS)
def test_one_step_matches_reference(device, num_key_heads: int, num_value_heads: int) -> None:
    case = GdnCase(device, num_key_heads, num_value_heads, seed=num_value_heads)
    initial_state = case.state.copy()
    device.run(case.record(device))

    expected_out, expected_state = case.expected(initial_state)
    np.testing.assert_allclose(case.state, expected_state, rtol=1e-5, atol=STATE_ATOL)
    np.testing.assert_allclose(case.out, expected_out, rtol=OUT_RTOL, atol=OUT_ATOL)


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
        case.z[:] = rng.normal(0, 1, case.z.shape)
        case.a[:] = rng.normal(0, 1, case.a.shape)
        case.b[:] = rng.normal(0, 1, case.b.shape)
        device.run(graph)
        expected_out, state = case.expected(state)
        np.testing.assert_allclose(case.out, expected_out, rtol=OUT_RTOL, atol=OUT_ATOL)
        np.testing.assert_allclose(case.state, state, rtol=1e-5, atol=STATE_ATOL)


def test_rejects_head_dims_it_was_not_built_for(device) -> None:
    case = GdnCase(device, 2, 4, seed=0)
    with pytest.raises(ValueError, match="128-dim"):
        record_gdn_step(
            Graph(), device, num_key_heads=2, num_value_heads=4, key_head_dim=64, **case.buffers
        )


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

    def _buffers(self, device) -> tuple[dict, np.ndarray, np.ndarray]:
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
        buffers, out, state = self._buffers(device)
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
        """The same from `tokens` gdn_step dispatches, each bound to its token's rows."""
        buffers, out, state = self._buffers(device)
        graph = Graph()
        for t in range(self.tokens):
            rows = {
                name: (buffers[name], t * row.nbytes)
                for name, row in (
                    ("qkv", self.qkv[0]),
                    ("z", self.z[0]),
                    ("a", self.a[0]),
                    ("b", self.b[0]),
                    ("out", self.z[0]),
                )
            }
            record_gdn_step(
                graph,
                device,
                num_key_heads=self.num_key_heads,
                num_value_heads=self.num_value_heads,
                norm_eps=EPS,
                **{**buffers, **rows},
            )
            graph.barrier()
        device.run(graph)
        return out, state

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
    as written): same outputs, same state left behind."""
    case = GdnChunkCase(num_key_heads, num_value_heads, tokens, seed=100 + tokens)
    chunk_out, chunk_state = case.run_chunk(device)
    step_out, step_state = case.run_steps(device)

    np.testing.assert_array_equal(chunk_out, step_out)
    np.testing.assert_array_equal(chunk_state, step_state)


def test_chunk_rejects_an_empty_chunk(device) -> None:
    case = GdnCase(device, 2, 4, seed=0)
    with pytest.raises(ValueError, match="at least one token"):
        record_gdn_chunk(
            Graph(), device, num_key_heads=2, num_value_heads=4, tokens=0, **case.buffers
        )
