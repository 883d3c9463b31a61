"""gdn_out_proj (metal/gdn_out_proj.metal), the decode step's GDN output projection with the
gated RMSNorm folded in, on the sim against float64 numpy: alone, and after gdn_step as the
decode step chains them; and over a verify pass's tokens (gdn_out_proj_tokens), each token's
rows against float64 and bit for bit what the one-token kernel gives for that token.

Error bound alone: the quantized GEMV's (test_kernel_quantized.py) plus the relative error of
each normed input (kernel_checks.gdn_out_proj_ulps), in ulps of the GEMV's magnitude, and one
ulp of the result for the add into the residual.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    FLOAT32_EPS,
    LANE_ORDERS,
    as_float32,
    assert_within,
    random_quantized,
    reference_qgemv,
    sim_device,
)
from test_kernel_gdn import READOUT_ATOL, READOUT_RTOL, GdnCase

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.diagnostics.kernel_checks import gdn_out_proj_ulps, reference_gated_norm
from lily.kernels.gdn import VALUE_HEAD_DIM
from lily.kernels.gdn_out_proj import MAX_TOKENS, record_gdn_out_proj
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import wrap_quant_weight

EPS = 1e-6


@pytest.fixture(params=LANE_ORDERS)
def device(request: pytest.FixtureRequest):
    return sim_device(request.param)


class OutProjCase:
    """A random out_proj, gain, z and residual for `num_value_heads` heads, and a readout whose
    heads differ in scale by up to 1000x, so that a norm taken over anything but each head on
    its own is far off."""

    def __init__(self, device, rows: int, num_value_heads: int, bits: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        in_dim = num_value_heads * VALUE_HEAD_DIM
        self.rows, self.in_dim, self.bits = rows, in_dim, bits
        f32 = np.float32
        self.triple = random_quantized(rng, rows, in_dim, bits)
        head_scale = np.exp(rng.uniform(np.log(0.03), np.log(30), num_value_heads))
        self.readout = (rng.normal(0, 1, in_dim) * np.repeat(head_scale, VALUE_HEAD_DIM)).astype(
            f32
        )
        self.z = rng.normal(0, 1.5, in_dim).astype(f32)
        self.gain = float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32))
        self.residual = rng.normal(0, 1, rows).astype(f32)
        self.initial_residual = self.residual.copy()
        self.weight = wrap_quant_weight(device, *self.triple)
        self.buffers = {
            "readout": device.wrap(self.readout),
            "z": device.wrap(self.z),
            "norm": FoldedNorm(device.wrap(self.gain), EPS),
            "weight": self.weight,
            "residual": device.wrap(self.residual),
        }

    def record(self, graph: Graph, device) -> None:
        record_gdn_out_proj(graph, device, **self.buffers)

    def check(self, readout: np.ndarray, readout_error=0.0) -> None:
        """The residual against initial residual + W gated_rms_norm(readout) in float64, with
        the kernel's own bound plus `readout_error` (a bound per element of the readout the
        kernel read, against `readout`) carried through the norm and |W|."""
        x = reference_gated_norm(readout, self.z, self.gain, EPS)
        y, magnitude = reference_qgemv(*self.triple, self.bits, x)
        expected = self.initial_residual + y
        bound = FLOAT32_EPS * (gdn_out_proj_ulps(self.in_dim, self.bits) * magnitude)
        bound += FLOAT32_EPS * np.abs(expected)
        if np.any(readout_error):
            input_error = normed_error_bound(readout, readout_error, self.z, self.gain)
            bound += reference_qgemv(*self.triple, self.bits, input_error)[1]
        assert_within(self.residual, expected, bound)


def normed_error_bound(readout, readout_error, z, gain) -> np.ndarray:
    """A bound on |gated_rms_norm(o + d) - gated_rms_norm(o)| per element for |d| <= readout_error,
    to first order: with r the head's inverse RMS over n dims, d x_i / d o_j = r g_i silu(z_i)
    (delta_ij - r^2 o_i o_j / n). It is doubled to cover the second-order terms and eps."""
    o = np.abs(np.asarray(readout, np.float64)).reshape(-1, VALUE_HEAD_DIM)
    error = np.broadcast_to(np.asarray(readout_error, np.float64), o.size).reshape(o.shape)
    inv_rms = 1 / np.sqrt(np.mean(o * o, axis=1, keepdims=True) + EPS)
    z = np.asarray(z, np.float64).reshape(o.shape)
    gate = np.abs(bf16_to_float32(gain).astype(np.float64) * z / (1 + np.exp(-z)))
    cross = inv_rms**2 * o * np.sum(o * error, axis=1, keepdims=True) / VALUE_HEAD_DIM
    return (2 * inv_rms * gate * (error + cross)).reshape(-1)


@pytest.mark.parametrize(
    ("rows", "num_value_heads", "bits"),
    [
        (2048, 32, 4),  # the real model's out_proj
        (128, 4, 4),  # the tiny config: half the lanes idle
        (64, 1, 4),  # one head: 4 lanes hold it, 28 idle
        (64, 32, 8),
        (64, 4, 8),  # 8-bit chunks: 8 lanes to a head, one full pass
        (16, 2, 8),
    ],
)
def test_matches_reference(device, rows: int, num_value_heads: int, bits: int) -> None:
    case = OutProjCase(device, rows, num_value_heads, bits, seed=rows + num_value_heads)
    graph = Graph()
    case.record(graph, device)
    device.run(graph)
    case.check(case.readout)


@pytest.mark.parametrize(("num_key_heads", "num_value_heads"), [(16, 32), (2, 4)])
def test_after_gdn_step_matches_the_token_reference(
    device, num_key_heads: int, num_value_heads: int
) -> None:
    """gdn_step then gdn_out_proj, as the decode step records them, against one float64 token
    through the recurrence, the gated RMSNorm and out_proj (the readout's tolerance carried
    through the norm and the projection)."""
    step = GdnCase(device, num_key_heads, num_value_heads, seed=num_value_heads)
    initial_state = step.state.copy()
    rows = 256
    case = OutProjCase(device, rows, num_value_heads, 4, seed=7)
    case.buffers["readout"] = step.buffers["readout"]
    graph = step.record(device)
    graph.barrier()
    case.record(graph, device)
    device.run(graph)

    readout, _ = step.expected(initial_state)
    case.check(readout, READOUT_ATOL + READOUT_RTOL * np.abs(readout))


@pytest.mark.parametrize(
    ("tokens", "rows", "num_value_heads", "bits"),
    [(2, 2048, 32, 4), (5, 128, 4, 4), (9, 64, 1, 4), (3, 16, 2, 8)],
    ids=["real", "tiny", "one-head", "8-bit"],
)
def test_a_verify_pass_tokens_each_match_the_one_token_kernel(
    device, tokens: int, rows: int, num_value_heads: int, bits: int
) -> None:
    """Each token's readout and z normed, gated and projected into its own residual row, the
    weights read once for all tokens: within the float64 bound, and bit for bit the one-token
    kernel's result for that token (which the decode step runs)."""
    rng = np.random.default_rng(tokens + rows)
    case = OutProjCase(device, rows, num_value_heads, bits, seed=rows + num_value_heads)
    weight, triple, gain, in_dim = case.weight, case.triple, case.gain, case.in_dim
    # Per token, heads of scales up to 1000x apart (the token's own norm is what counts).
    scales = np.exp(rng.uniform(np.log(0.03), np.log(30), (tokens, num_value_heads)))
    readouts = (rng.normal(0, 1, (tokens, in_dim)) * np.repeat(scales, 128, axis=1)).astype(
        np.float32
    )
    zs = rng.normal(0, 1.5, (tokens, in_dim)).astype(np.float32)
    residuals = rng.normal(0, 1, (tokens, rows)).astype(np.float32)
    out = device.wrap(residuals.copy())
    norm = FoldedNorm(device.wrap(gain), EPS)
    graph = Graph()
    record_gdn_out_proj(
        graph,
        device,
        readout=device.wrap(readouts),
        z=device.wrap(zs),
        norm=norm,
        weight=weight,
        residual=out,
        tokens=tokens,
    )
    device.run(graph)
    got = as_float32(out, tokens * rows).reshape(tokens, rows)
    for n in range(tokens):
        x = reference_gated_norm(readouts[n], zs[n], gain, EPS)
        y, magnitude = reference_qgemv(*triple, bits, x)
        expected = residuals[n] + y
        bound = FLOAT32_EPS * (gdn_out_proj_ulps(in_dim, bits) * magnitude + np.abs(expected))
        assert_within(got[n], expected, bound)
    for n in (0, tokens - 1):
        single = device.wrap(residuals[n].copy())
        one = Graph()
        record_gdn_out_proj(
            one,
            device,
            readout=device.wrap(readouts[n].copy()),
            z=device.wrap(zs[n].copy()),
            norm=norm,
            weight=weight,
            residual=single,
        )
        device.run(one)
        np.testing.assert_array_equal(got[n], as_float32(single, rows))


def test_rejects_shapes_it_was_not_built_for(device) -> None:
    case = OutProjCase(device, 64, 4, 4, seed=0)
    ragged_rows = wrap_quant_weight(device, *random_quantized(np.random.default_rng(0), 62, 512, 4))
    with pytest.raises(ValueError, match="multiple of 4"):
        record_gdn_out_proj(Graph(), device, **{**case.buffers, "weight": ragged_rows})
    partial_head = wrap_quant_weight(
        device, *random_quantized(np.random.default_rng(0), 64, 192, 4)
    )
    with pytest.raises(ValueError, match="128-heads"):
        record_gdn_out_proj(Graph(), device, **{**case.buffers, "weight": partial_head})
    with pytest.raises(ValueError, match="z"):
        record_gdn_out_proj(Graph(), device, **{**case.buffers, "z": (case.buffers["z"], 8)})
    with pytest.raises(ValueError, match=f"1 to {MAX_TOKENS} tokens"):
        record_gdn_out_proj(Graph(), device, **case.buffers, tokens=MAX_TOKENS + 1)


def test_the_real_out_proj_spreads_over_512_threadgroups(device) -> None:
    """2048 rows in threadgroups of one SIMD-group (4 rows): 12.8 rounds per core of a 40-core
    GPU, where threadgroups of 8 rows would leave a last round 40% full."""
    case = OutProjCase(device, 2048, 32, 4, seed=1)
    graph = Graph()
    case.record(graph, device)
    (dispatch,) = graph.dispatches
    assert dispatch.threadgroups == (512, 1, 1)
