"""The quantized GEMV over a verify pass's few tokens (`qgemv_tokens`, quantized_gemv.metal)
against float64 numpy on the sim: each token's rows within the single-token GEMV's bound, and
bit for bit what the single-token GEMV computes for that token (the same products in the same
order, with each weight read once for all tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)

from lily.device import Graph
from lily.diagnostics.kernel_checks import qgemv_ulps
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


def test_qgemv_tokens_refuses_what_it_does_not_do():
    device = sim_device("forward")
    rng = np.random.default_rng(0)
    weight = wrap_quant_weight(device, *random_quantized(rng, 8, 64, 4))
    x = device.wrap(np.zeros((MAX_TOKENS + 1, 64), np.float32))
    out = [(weight, float_buffer(device, 8 * (MAX_TOKENS + 1)))]
    with pytest.raises(ValueError, match="1 to 9 tokens"):
        record_qgemv(Graph(), device, x, out, tokens=MAX_TOKENS + 1)
    gain = device.wrap(np.zeros(64, np.uint16))
    with pytest.raises(ValueError, match="plain fp32 x"):
        record_qgemv(Graph(), device, x, out, norm=FoldedNorm(gain, 1e-6), tokens=2)
    with pytest.raises(ValueError, match="plain fp32 x"):
        record_qgemv(Graph(), device, x, out, accumulate=True, tokens=2)
    with pytest.raises(ValueError, match="reads an fp32 x"):
        record_qgemv(Graph(), device, x, out, x_dtype="bfloat16", tokens=2)
