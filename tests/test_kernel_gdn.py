"""gdn_step (metal/gdn.metal) on the sim against the float64 numpy reference.

The kernel fuses the q/k L2 norms, the g/beta gates, the delta-rule update of the fp32 state,
the readout and the gated RMSNorm; the reference composes the same steps from lily.reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device

from lily import reference
from lily.device import Graph
from lily.kernels.gdn import KEY_HEAD_DIM, VALUE_HEAD_DIM, record_gdn_step, state_bytes
from lily.quant import bf16_to_float32, float32_to_bf16

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
        f64 = np.float64
        key_total = self.num_key_heads * KEY_HEAD_DIM
        qkv = self.qkv.astype(f64)
        q = qkv[:key_total].reshape(self.num_key_heads, KEY_HEAD_DIM)
        k = qkv[key_total : 2 * key_total].reshape(self.num_key_heads, KEY_HEAD_DIM)
        v = qkv[2 * key_total :].reshape(self.num_value_heads, VALUE_HEAD_DIM)
        q = reference.l2_normalize(q) * KEY_HEAD_DIM**-0.5
        k = reference.l2_normalize(k)
        g, beta = reference.gdn_gates(
            self.a.astype(f64),
            self.b.astype(f64),
            self.a_log.astype(f64),
            bf16_to_float32(self.dt_bias).astype(f64),
        )
        o, new_state = reference.gated_delta_step(state.astype(f64), q, k, v, g, beta)
        z = self.z.astype(f64).reshape(self.num_value_heads, VALUE_HEAD_DIM)
        weight = bf16_to_float32(self.norm_weight).astype(f64)
        return reference.gated_rms_norm(o, weight, z, EPS).reshape(-1), new_state


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
