"""The end of a decode step as the decode graph records it: the lm_head GEMV, then the sampler
at temperature 0, which writes the greedy next token id on the device.

The logits are checked with the GEMV's error bound (see test_kernel_quantized.py); the token must
be their argmax, ties to the lowest index as numpy's argmax.
"""

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
from test_kernel_quantized import ulps_for

from lily.engine.sampling import SamplingParams
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import record_qgemv
from lily.kernels.sampling import (
    SAMPLING_PARAMS_BYTES,
    LogitAdjustments,
    logprob_ring_bytes,
    record_sample,
    sample_partials_bytes,
    token_mask_bytes,
    write_sampling_params,
)

GREEDY = SamplingParams(temperature=0.0, seed=0)


def record_head(graph, device, x, weights, logits, token, vocab: int) -> None:
    params = device.alloc(SAMPLING_PARAMS_BYTES)
    write_sampling_params(params, GREEDY)
    record_qgemv(graph, device, x, [(weights, logits)])
    graph.barrier()
    record_sample(
        graph,
        device,
        logits=logits,
        vocab=vocab,
        params=params,
        position=device.alloc(4),
        predicted=token,
        logprob_ring=device.alloc(logprob_ring_bytes(1)),
        ring_slots=1,
        token_mask=device.alloc(token_mask_bytes(vocab)),
        adjustments=LogitAdjustments.allocate(device, vocab),
        partials=device.scratch(sample_partials_bytes(vocab)),
    )


def check_lm_head(lane_order: str, vocab: int, hidden: int):
    rng = np.random.default_rng(vocab)
    device = sim_device(lane_order)
    triple = random_quantized(rng, vocab, hidden, 4)
    x = rng.normal(0, 1, hidden).astype(np.float32)
    logits = float_buffer(device, vocab)
    token = device.alloc(4)
    weights = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_head(g, device, device.wrap(x), weights, logits, token, vocab))

    actual = as_float32(logits, vocab)
    expected, magnitude = reference_qgemv(*triple, 4, x.astype(np.float64))
    assert_within_ulps(actual, expected, magnitude, ulps_for(hidden, 4))
    chosen = int(token.numpy().view(np.uint32)[0])
    assert chosen == int(np.argmax(actual))
    top2 = np.sort(expected)[-2:]
    if top2[1] - top2[0] > 2 * ulps_for(hidden, 4) * np.finfo(np.float32).eps * magnitude.max():
        assert chosen == int(np.argmax(expected))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_lm_head_tiny(lane_order):
    check_lm_head(lane_order, 4096, 128)


def test_lm_head_real_size():
    # The largest GEMV of the model (248320 x 2048, 4-bit), run once.
    check_lm_head("forward", 248320, 2048)
