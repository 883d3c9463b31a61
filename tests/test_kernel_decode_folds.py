"""The decode step's folds, against float64 numpy on the sim: the residual add + RMSNorm folded
into the GEMVs (`qgemv_normed_*`: y = W rms_norm(x); `accumulate`: y += W x), and the MoE
kernels' forms of both (`moe_gate_up_swiglu_normed_4`, `moe_down` with accumulate); the conv1d
step in the in_proj GEMV's epilogue; routing inside the gate/up kernel (the whole block), also
over a verify pass's tokens (each token's block the one-token block's, bit for bit; the GEMVs'
folds over several tokens are test_kernel_qgemv_tokens.py's).

Error bounds: the GEMV's own bound (test_kernel_quantized.ulps_for) on the magnitude of the
normed dot products, one more ulp for x * gain, plus the inverse RMS's relative error: a lane's
sum of squares over its in_dim / 32 inputs and the SIMD-group sum's 31 roundings, halved by the
square root, and a few for rsqrt, the division by in_dim and the final multiply.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    FLOAT32_EPS,
    LANE_ORDERS,
    as_float32,
    assert_within,
    float_buffer,
    random_bf16,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)
from test_kernel_moe import REAL, TINY, bind, check_down, check_gate_up, uint32s
from test_kernel_quantized import ulps_for

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.engine import reference
from lily.kernels.conv1d import KERNEL_TAPS, FoldedConvStep, record_conv1d_step
from lily.kernels.moe import MoeScratch, record_moe, record_moe_down, record_moe_gate_up
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import record_qgemv

EPS = 1e-6


def inv_rms_ulps(in_dim: int) -> float:
    return (in_dim / 32 + 31) / 2 + 4


def residual_and_gain(rng: np.random.Generator, in_dim: int):
    """A residual far from unit RMS (so a missing norm shows) and a stored gain far from 1."""
    x = rng.normal(0.5, 3.0, in_dim).astype(np.float32)
    gain = random_bf16(rng, in_dim, scale=0.2, loc=1.0)
    return x, gain


def normed_reference(x: np.ndarray, gain: np.ndarray) -> tuple[np.ndarray, float]:
    """(x * gain as the kernel forms it, in float64; the float64 inverse RMS of x)."""
    x64 = x.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64) + EPS)
    return x64 * bf16_to_float32(gain).astype(np.float64), float(inv_rms)


def check_normed_qgemv(lane_order: str, rows: list[int], in_dim: int, bits: int) -> None:
    rng = np.random.default_rng(in_dim + bits + len(rows))
    device = sim_device(lane_order)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    x, gain = residual_and_gain(rng, in_dim)
    outs = [float_buffer(device, r) for r in rows]
    projections = [
        (wrap_quant_weight(device, *t), out) for t, out in zip(triples, outs, strict=True)
    ]
    norm = FoldedNorm(device.wrap(gain), EPS)
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), projections, norm=norm))
    gained, inv_rms = normed_reference(x, gain)
    for triple, out, r in zip(triples, outs, rows, strict=True):
        dot, magnitude = reference_qgemv(*triple, bits, gained)
        expected = inv_rms * dot
        bound = (ulps_for(in_dim, bits) + 1) * FLOAT32_EPS * inv_rms * magnitude
        bound += inv_rms_ulps(in_dim) * FLOAT32_EPS * np.abs(expected)
        assert_within(as_float32(out, r), expected, bound)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "in_dim", "bits"),
    [
        ([256, 1], 2048, 8),  # router | shared-expert gate after the post-attention norm
        ([4096, 512, 512], 2048, 4),  # attention q | k | v after the input norm
        ([13, 5], 1088, 4),  # ragged
        ([7], 192, 8),
    ],
)
def test_qgemv_with_folded_norm(lane_order, rows, in_dim, bits):
    check_normed_qgemv(lane_order, rows, in_dim, bits)


def test_folded_norm_needs_an_fp32_residual():
    device = sim_device("forward")
    triple = random_quantized(np.random.default_rng(0), 4, 64, 4)
    weight = wrap_quant_weight(device, *triple)
    norm = FoldedNorm(device.wrap(np.ones(64, np.uint16)), EPS)
    x = device.wrap(np.zeros(64, np.uint16))
    with pytest.raises(ValueError, match="fp32"):
        record_qgemv(Graph(), device, x, [(weight, float_buffer(device, 4))], "bfloat16", norm)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "in_dim"), [(2048, 4096), (37, 1088)])
def test_qgemv_accumulates_into_the_residual(lane_order, rows, in_dim):
    """The output projection adds to the residual in place: y = residual + W x."""
    rng = np.random.default_rng(rows)
    device = sim_device(lane_order)
    triple = random_quantized(rng, rows, in_dim, 4)
    x = rng.normal(0, 1, in_dim).astype(np.float32)
    residual = rng.normal(0, 4, rows).astype(np.float32)
    y = device.wrap(residual.copy())
    weight = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), [(weight, y)], accumulate=True))
    dot, magnitude = reference_qgemv(*triple, 4, x.astype(np.float64))
    expected = residual.astype(np.float64) + dot
    bound = ulps_for(in_dim, 4) * FLOAT32_EPS * magnitude + FLOAT32_EPS * np.abs(expected)
    assert_within(as_float32(y, rows), expected, bound)


# -- the MoE block ----------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_gate_up_with_folded_norm(lane_order, dims):
    """gate/up of rms_norm(x): the same as the plain kernel on the float64-normed input, within
    the plain bound plus the inverse RMS's relative error on each product."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(6)
    x, gain = residual_and_gain(rng, dims.hidden)
    ids = rng.permutation(dims.experts)[: dims.top_k].astype(np.uint32)
    total = dims.top_k * dims.expert_rows + dims.shared_rows
    hidden = float_buffer(device, total)
    weights = bind(device, dims)
    norm = FoldedNorm(device.wrap(gain), EPS)
    run(
        device,
        lambda g: record_moe_gate_up(
            g, device, device.wrap(x), device.wrap(ids), dims.top_k, weights, hidden, norm
        ),
    )
    gained, inv_rms = normed_reference(x, gain)
    # g and u each carry the inverse RMS's relative error r, so silu(g) * u about 3 r; one more
    # ulp for x * gain is within the plain bound's slack.
    relative = 3 * inv_rms_ulps(dims.hidden) * FLOAT32_EPS
    check_gate_up(dims, gained * inv_rms, ids, as_float32(hidden, total), relative)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_down_accumulates_into_the_residual(lane_order, dims):
    device = sim_device(lane_order)
    rng = np.random.default_rng(7)
    total = dims.top_k * dims.expert_rows + dims.shared_rows
    hidden = rng.normal(0, 1, total).astype(np.float32)
    ids = rng.permutation(dims.experts)[: dims.top_k].astype(np.uint32)
    weights = rng.dirichlet(np.ones(dims.top_k)).astype(np.float32)
    shared_logit = np.array([-0.3], dtype=np.float32)
    residual = rng.normal(0, 4, dims.hidden).astype(np.float32)
    out = device.wrap(residual.copy())
    bound = bind(device, dims)
    run(
        device,
        lambda g: record_moe_down(
            g,
            device,
            device.wrap(hidden),
            device.wrap(ids),
            device.wrap(weights),
            device.wrap(shared_logit),
            dims.top_k,
            bound,
            out,
            accumulate=True,
        ),
    )
    # The block's part alone, with the plain kernel's bound plus the residual add's rounding.
    result = as_float32(out, dims.hidden).astype(np.float64)
    block = result - residual
    check_down(dims, hidden, ids, weights, shared_logit[0], block, FLOAT32_EPS * np.abs(result))


# -- the conv1d step in the in_proj GEMV's epilogue --------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "in_dim"),
    [([8192, 4096, 32, 32], 2048), ([1024, 512, 4, 4], 128), ([300, 7], 192)],
    ids=["real", "tiny", "ragged"],
)
def test_conv_step_in_the_gemv_epilogue(lane_order, rows, in_dim):
    """Projection 0 leaves through the conv step: bit for bit the plain GEMV followed by the
    conv1d_step kernel (one shared expression), the window shifted alike, the other projections
    untouched; and within the GEMV's bound, through the conv and SiLU, of float64."""
    rng = np.random.default_rng(rows[0])
    device = sim_device(lane_order)
    channels = rows[0]
    triples = [random_quantized(rng, r, in_dim, 4) for r in rows]
    weights = [wrap_quant_weight(device, *t) for t in triples]
    x = rng.normal(0, 1, in_dim).astype(np.float32)
    conv_bits = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
    window = rng.normal(0, 1, (KERNEL_TAPS - 1, channels)).astype(np.float32)

    fused_window = device.wrap(window.copy())
    fused = [float_buffer(device, r) for r in rows]
    conv = FoldedConvStep(device.wrap(conv_bits), fused_window)
    projections = list(zip(weights, fused, strict=True))
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), projections, conv=conv))

    plain = [float_buffer(device, r) for r in rows]
    stepped_window, stepped = device.wrap(window.copy()), float_buffer(device, channels)

    def two_dispatches(graph: Graph) -> None:
        record_qgemv(graph, device, device.wrap(x), list(zip(weights, plain, strict=True)))
        graph.barrier()
        record_conv1d_step(
            graph,
            device,
            x=plain[0],
            weight=device.wrap(conv_bits),
            window=stepped_window,
            out=stepped,
            channels=channels,
        )

    run(device, two_dispatches)
    np.testing.assert_array_equal(as_float32(fused[0], channels), as_float32(stepped, channels))
    np.testing.assert_array_equal(
        as_float32(fused_window, window.size), as_float32(stepped_window, window.size)
    )
    for fused_out, plain_out, r in list(zip(fused, plain, rows, strict=True))[1:]:
        np.testing.assert_array_equal(as_float32(fused_out, r), as_float32(plain_out, r))

    projected, magnitude = reference_qgemv(*triples[0], 4, x.astype(np.float64))
    filters = bf16_to_float32(conv_bits)[:, :, 0].astype(np.float64)
    expected, expected_window = reference.causal_conv1d_step(
        window.astype(np.float64), projected, filters
    )
    # The current tap carries the GEMV's error, |silu'| < 1.1; a few ulps of the conv's terms.
    terms = np.abs(filters[:, :-1].T * window).sum(axis=0) + np.abs(filters[:, -1] * projected)
    bound = 1.1 * np.abs(filters[:, -1]) * ulps_for(in_dim, 4) * FLOAT32_EPS * magnitude
    bound += 8 * FLOAT32_EPS * (terms + np.abs(expected))
    assert_within(as_float32(fused[0], channels), expected, bound)
    assert_within(
        as_float32(fused_window, window.size)[: 2 * channels],
        expected_window[:2].ravel(),
        0.0,
    )


# -- the whole MoE block as the decode step runs it ------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_moe_block_with_folded_norm_and_residual(lane_order, dims):
    """record_moe on the un-normed residual with the norm folded in and the output added to the
    residual equals the block on the float64-normed input plus the residual: the same experts
    and weights, the output within the kernels' fp32 noise."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(8)
    x, gain = residual_and_gain(rng, dims.hidden)
    gained, inv_rms = normed_reference(x, gain)
    normed = (gained * inv_rms).astype(np.float32)
    residual = rng.normal(0, 4, dims.hidden).astype(np.float32)
    weights = bind(device, dims)
    shape = (dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows)

    folded_scratch, out = MoeScratch.allocate(device, *shape), device.wrap(residual.copy())
    norm = FoldedNorm(device.wrap(gain), EPS)
    run(
        device,
        lambda g: record_moe(
            g,
            device,
            device.wrap(x),
            weights,
            dims.top_k,
            folded_scratch,
            out,
            norm=norm,
            accumulate=True,
        ),
    )
    plain_scratch, plain = MoeScratch.allocate(device, *shape), float_buffer(device, dims.hidden)
    run(
        device,
        lambda g: record_moe(
            g, device, device.wrap(normed), weights, dims.top_k, plain_scratch, plain
        ),
    )
    np.testing.assert_array_equal(
        uint32s(folded_scratch.expert_ids, dims.top_k),
        uint32s(plain_scratch.expert_ids, dims.top_k),
    )
    assert_within(
        as_float32(folded_scratch.expert_weights, dims.top_k),
        as_float32(plain_scratch.expert_weights, dims.top_k).astype(np.float64),
        1e-5,
    )
    block = as_float32(out, dims.hidden).astype(np.float64) - residual
    expected = as_float32(plain, dims.hidden).astype(np.float64)
    assert_within(block, expected, 1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_moe_block_over_a_verify_pass_folds_each_tokens_norm_and_residual(lane_order, dims):
    """record_moe over 3 tokens with the norm folded in and the output added to the residual
    rows: each token's experts, weights and residual row bit for bit the one-token folded
    block's (the decode step's) for that token."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(9)
    tokens = 3
    xs, gain = zip(*(residual_and_gain(rng, dims.hidden) for _ in range(tokens)), strict=True)
    x = np.stack(xs)
    norm = FoldedNorm(device.wrap(gain[0]), EPS)
    residual = rng.normal(0, 4, (tokens, dims.hidden)).astype(np.float32)
    weights = bind(device, dims)
    shape = (dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows)
    scratch = MoeScratch.allocate(device, *shape, tokens=tokens)
    out = device.wrap(residual.copy())
    run(
        device,
        lambda g: record_moe(
            g, device, device.wrap(x), weights, dims.top_k, scratch, out,
            norm=norm, accumulate=True, tokens=tokens,
        ),
    )  # fmt: skip
    rows = as_float32(out, tokens * dims.hidden).reshape(tokens, dims.hidden)
    ids = uint32s(scratch.expert_ids, tokens * dims.top_k).reshape(tokens, dims.top_k)
    for n in range(tokens):
        one_scratch, one = MoeScratch.allocate(device, *shape), device.wrap(residual[n].copy())
        run(
            device,
            lambda g, n=n, one=one, one_scratch=one_scratch: record_moe(
                g, device, device.wrap(x[n].copy()), weights, dims.top_k, one_scratch, one,
                norm=norm, accumulate=True,
            ),
        )  # fmt: skip
        np.testing.assert_array_equal(ids[n], uint32s(one_scratch.expert_ids, dims.top_k))
        np.testing.assert_array_equal(rows[n], as_float32(one, dims.hidden))
