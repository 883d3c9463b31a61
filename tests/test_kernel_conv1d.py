"""conv1d_step (metal/conv1d.metal) on the sim against the float64 numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, sim_device

from lily import reference
from lily.device import Graph
from lily.kernels.conv1d import KERNEL_TAPS, record_conv1d_step
from lily.quant import bf16_to_float32, float32_to_bf16

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
