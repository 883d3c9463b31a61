"""The quantized GEMV over a verify pass's few tokens (`qgemv_tokens`, quantized_gemv.metal)
against float64 numpy on the sim: each token's rows within the single-token GEMV's bound, and
bit for bit what the single-token GEMV computes for that token (the same products in the same
order, with each weight read once for all tokens). The same with the decode step's folds per
token: the input norm (`qgemv_tokens_normed_*`), the residual add (`accumulate`) and the GDN's
conv, which over several tokens leaves the window alone and writes conv1d_chunk's tail."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    FLOAT32_EPS,
    LANE_ORDERS,
    as_float32,
    assert_within,
    assert_within_ulps,
    float_buffer,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)
from test_kernel_decode_folds import EPS, inv_rms_ulps, normed_reference, residual_and_gain

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.device import Graph
from lily.diagnostics.kernel_checks import qgemv_ulps
from lily.engine import reference
from lily.kernels.conv1d import (
    KERNEL_TAPS,
    FoldedConvStep,
    record_conv1d_chunk,
    tail_bytes,
    tail_rows,
)
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import MAX_TOKENS, record_qgemv


def check_tokens(lane_order: str, tokens: int, rows: list[int], in_dim: int, bits: int, seed: int):
    rng = np.random.default_rng(seed)
    device = sim_device(lane_order)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    weights = [wrap_quant_weight(device, *t) for t in triples]
    x = rng.normal(0, 1, (tokens, in_dim)).astype(np.float32)
    outs = [float_buffer(device, tokens * r) for r in rows]
    projections = list(zip(weights, outs, strict=True))
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), projections, tokens=tokens))
    for triple, out, r in zip(triples, outs, rows, strict=True):
        got = as_float32(out, tokens * r).reshape(tokens, r)
        for n in range(tokens):
            expected, magnitude = reference_qgemv(*triple, bits, x[n].astype(np.float64))
            assert_within_ulps(got[n], expected, magnitude, qgemv_ulps(in_dim, bits))
    # Each token's rows are the single-token GEMV's for that token, bit for bit.
    for n in (0, tokens - 1):
        single = [float_buffer(device, r) for r in rows]
        row = device.wrap(x[n].copy())
        pairs = list(zip(weights, single, strict=True))
        run(device, lambda g, row=row, pairs=pairs: record_qgemv(g, device, row, pairs))
        for out, one, r in zip(outs, single, rows, strict=True):
            got = as_float32(out, tokens * r).reshape(tokens, r)[n]
            np.testing.assert_array_equal(got, as_float32(one, r))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "rows", "in_dim", "bits"),
    [
        (2, [37], 512, 4),  # rows not a multiple of a SIMD-group's four
        (5, [64, 8, 3, 130], 1024, 4),  # four projections, one of three rows
        (9, [257], 2048, 8),  # the most tokens: a verify pass of 8 drafts
        (7, [300, 50], 448, 8),  # an input dimension of 28 chunks: lanes idle at the end
    ],
)
def test_qgemv_tokens_matches_the_reference_and_the_single_token_gemv(
    lane_order, tokens, rows, in_dim, bits
):
    check_tokens(lane_order, tokens, rows, in_dim, bits, seed=tokens)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "rows", "in_dim", "bits"),
    [
        (2, [256, 1], 2048, 8),  # the router | shared-expert gate after the post-attention norm
        (5, [13, 5], 1088, 4),  # ragged
        (9, [37, 64, 3], 512, 4),  # the most tokens
    ],
)
def test_qgemv_tokens_folds_each_tokens_norm_and_residual_add(
    lane_order, tokens, rows, in_dim, bits
):
    """y_i[n] += W_i rms_norm(x[n]) per token: within the normed GEMV's float64 bound, and bit
    for bit the single-token normed, accumulating GEMV (the decode step's) for that token."""
    rng = np.random.default_rng(tokens + in_dim)
    device = sim_device(lane_order)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    weights = [wrap_quant_weight(device, *t) for t in triples]
    xs, gain = zip(*(residual_and_gain(rng, in_dim) for _ in range(tokens)), strict=True)
    gain = gain[0]
    x = np.stack(xs)
    norm = FoldedNorm(device.wrap(gain), EPS)
    before = [rng.normal(0, 4, (tokens, r)).astype(np.float32) for r in rows]
    outs = [device.wrap(b.copy()) for b in before]
    projections = list(zip(weights, outs, strict=True))
    run(
        device,
        lambda g: record_qgemv(
            g, device, device.wrap(x), projections, norm=norm, accumulate=True, tokens=tokens
        ),
    )
    for triple, out, start, r in zip(triples, outs, before, rows, strict=True):
        got = as_float32(out, tokens * r).reshape(tokens, r)
        for n in range(tokens):
            gained, inv_rms = normed_reference(x[n], gain)
            dot, magnitude = reference_qgemv(*triple, bits, gained)
            expected = start[n] + inv_rms * dot
            bound = (qgemv_ulps(in_dim, bits) + 1) * FLOAT32_EPS * inv_rms * magnitude
            bound += inv_rms_ulps(in_dim) * FLOAT32_EPS * np.abs(inv_rms * dot)
            bound += FLOAT32_EPS * np.abs(expected)
            assert_within(got[n], expected, bound)
    for n in (0, tokens - 1):
        singles = [device.wrap(b[n].copy()) for b in before]
        row = device.wrap(x[n].copy())
        pairs = list(zip(weights, singles, strict=True))
        run(
            device,
            lambda g, row=row, pairs=pairs: record_qgemv(
                g, device, row, pairs, norm=norm, accumulate=True
            ),
        )
        for out, one, r in zip(outs, singles, rows, strict=True):
            got = as_float32(out, tokens * r).reshape(tokens, r)[n]
            np.testing.assert_array_equal(got, as_float32(one, r))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "candidates", "rows", "in_dim"),
    [
        (2, 2, [8192, 4096, 32, 32], 2048),  # the real in_proj qkv | z | a | b, one draft
        (5, 5, [300, 7], 192),  # ragged channels
        (9, 3, [64, 4], 128),  # tokens before the candidates (the tail starts in the tokens)
        (2, 1, [36], 64),  # one candidate: the tail holds window rows still
    ],
)
def test_qgemv_tokens_runs_the_conv_and_leaves_conv1d_chunks_tail(
    lane_order, tokens, candidates, rows, in_dim
):
    """Projection 0 leaves through the conv over the tokens from the window: its outputs and
    tail bit for bit the plain GEMV followed by conv1d_chunk in tail mode, the window left as
    it was, the other projections untouched; and within the GEMV's bound, through the conv and
    SiLU, of float64 steps from the window."""
    rng = np.random.default_rng(tokens * 100 + rows[0])
    device = sim_device(lane_order)
    channels = rows[0]
    triples = [random_quantized(rng, r, in_dim, 4) for r in rows]
    weights = [wrap_quant_weight(device, *t) for t in triples]
    x = rng.normal(0, 1, (tokens, in_dim)).astype(np.float32)
    conv_bits = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
    window = rng.normal(0, 1, (KERNEL_TAPS - 1, channels)).astype(np.float32)
    tail_count = tail_rows(candidates) * channels

    fused_window = device.wrap(window.copy())
    fused_tail = device.scratch(tail_bytes(channels, candidates))
    fused = [float_buffer(device, tokens * r) for r in rows]
    conv = FoldedConvStep(device.wrap(conv_bits), fused_window, fused_tail, candidates)
    projections = list(zip(weights, fused, strict=True))
    run(
        device,
        lambda g: record_qgemv(g, device, device.wrap(x), projections, conv=conv, tokens=tokens),
    )

    plain = [float_buffer(device, tokens * r) for r in rows]
    chunk_window = device.wrap(window.copy())
    chunk_tail = device.scratch(tail_bytes(channels, candidates))
    chunk_out = float_buffer(device, tokens * channels)

    def two_dispatches(graph: Graph) -> None:
        pairs = list(zip(weights, plain, strict=True))
        record_qgemv(graph, device, device.wrap(x), pairs, tokens=tokens)
        graph.barrier()
        record_conv1d_chunk(
            graph,
            device,
            x=plain[0],
            weight=device.wrap(conv_bits),
            window=chunk_window,
            out=chunk_out,
            channels=channels,
            tokens=tokens,
            tail=chunk_tail,
            candidates=candidates,
        )

    run(device, two_dispatches)
    outputs = tokens * channels
    np.testing.assert_array_equal(as_float32(fused[0], outputs), as_float32(chunk_out, outputs))
    np.testing.assert_array_equal(
        as_float32(fused_tail, tail_count), as_float32(chunk_tail, tail_count)
    )
    np.testing.assert_array_equal(as_float32(fused_window, window.size), window.ravel())
    for fused_out, plain_out, r in list(zip(fused, plain, rows, strict=True))[1:]:
        np.testing.assert_array_equal(
            as_float32(fused_out, tokens * r), as_float32(plain_out, tokens * r)
        )

    filters = bf16_to_float32(conv_bits)[:, :, 0].astype(np.float64)
    history = window.astype(np.float64)
    got = as_float32(fused[0], outputs).reshape(tokens, channels)
    projected_rows = []
    for n in range(tokens):
        projected, magnitude = reference_qgemv(*triples[0], 4, x[n].astype(np.float64))
        projected_rows.append(projected)
        expected, next_history = reference.causal_conv1d_step(history, projected, filters)
        # The current tap carries this token's GEMV error, the history earlier tokens'.
        terms = np.abs(filters[:, :-1].T * history).sum(axis=0) + np.abs(filters[:, -1] * projected)
        gemv_error = qgemv_ulps(in_dim, 4) * FLOAT32_EPS * magnitude
        bound = 1.1 * np.abs(filters).sum(axis=1) * gemv_error
        bound += 8 * FLOAT32_EPS * (terms + np.abs(expected))
        assert_within(got[n], expected, bound)
        history = next_history
    # The tail: the last candidates + 2 rows of (window, then the tokens' projections).
    sequence = np.concatenate([window.astype(np.float64), np.stack(projected_rows)])
    expected_tail = sequence[-tail_rows(candidates) :]
    tail = as_float32(fused_tail, tail_count).reshape(-1, channels)
    assert_within(tail, expected_tail, 1e-4 * (1 + np.abs(expected_tail)))


def test_qgemv_tokens_refuses_what_it_does_not_do():
    device = sim_device("forward")
    rng = np.random.default_rng(0)
    weight = wrap_quant_weight(device, *random_quantized(rng, 8, 64, 4))
    x = device.wrap(np.zeros((MAX_TOKENS + 1, 64), np.float32))
    out = [(weight, float_buffer(device, 8 * (MAX_TOKENS + 1)))]
    with pytest.raises(ValueError, match="1 to 9 tokens"):
        record_qgemv(Graph(), device, x, out, tokens=MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="reads an fp32 x"):
        record_qgemv(Graph(), device, x, out, x_dtype="bfloat16", tokens=2)
    conv_weight = device.wrap(np.zeros((8, KERNEL_TAPS), np.uint16))
    window = device.wrap(np.zeros((KERNEL_TAPS - 1, 8), np.float32))
    with pytest.raises(ValueError, match="leaves a tail"):
        record_qgemv(Graph(), device, x, out, conv=FoldedConvStep(conv_weight, window), tokens=2)
    tail = device.scratch(tail_bytes(8, 3))
    with pytest.raises(ValueError, match="1 to 2 candidates"):
        conv = FoldedConvStep(conv_weight, window, tail, candidates=3)
        record_qgemv(Graph(), device, x, out, conv=conv, tokens=2)
