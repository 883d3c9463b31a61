"""The decode step's first GEMV with the embedding lookup folded in (`qgemv_embedded_*`): x is
the embedding row of the token at the step's position, dequantized by the GEMV from the table,
with the layer's input norm folded in; the GEMV also writes the row to the residual.

Two properties: the folded dispatch is bit for bit the embedding dispatch followed by the normed
GEMV (every projection, the conv step's outputs and window, the residual), so folding changes
nothing the decode step computes; and it equals float64 numpy within the normed GEMV's bound
(test_kernel_decode_folds) and the embedding's (test_kernel_embedding).
"""

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
    random_bf16,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)
from test_kernel_decode_folds import EPS, inv_rms_ulps, normed_reference
from test_kernel_embedding import expected_rows
from test_kernel_quantized import ulps_for

from lily.checkpoint.quant import float32_to_bf16
from lily.device import Graph
from lily.kernels.conv1d import KERNEL_TAPS, FoldedConvStep
from lily.kernels.embedding import EmbeddedInput, record_embedding
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import record_qgemv

VOCAB = 300
# The history the step reads its token from: the token sits at POSITION, among others.
POSITION = 3


class Case:
    """Random weights of one first-GEMV shape: the projections, an embedding table, a gain."""

    def __init__(self, rows: list[int], in_dim: int, bits: int, embed_bits: int, conv: bool):
        rng = np.random.default_rng(sum(rows) + in_dim + bits + 2 * embed_bits)
        self.rows, self.in_dim, self.bits, self.embed_bits = rows, in_dim, bits, embed_bits
        self.triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
        self.table = random_quantized(rng, VOCAB, in_dim, embed_bits)
        self.gain = random_bf16(rng, in_dim, scale=0.2, loc=1.0)
        self.conv_weight = (
            float32_to_bf16(rng.normal(0, 0.5, (rows[0], KERNEL_TAPS, 1)).astype(np.float32))
            if conv
            else None
        )
        self.window = rng.normal(0, 1, (KERNEL_TAPS - 1, rows[0])).astype(np.float32)

    def history(self, token: int) -> np.ndarray:
        ids = np.array([5, VOCAB - 1, 0, token, 17], np.uint32)
        assert ids[POSITION] == token
        return ids


class Outputs:
    """Buffers one run writes: every projection's output, the conv window, the residual."""

    def __init__(self, device, case: Case) -> None:
        self.device, self.case = device, case
        self.outs = [float_buffer(device, r) for r in case.rows]
        self.window = device.wrap(case.window.copy())
        self.residual = float_buffer(device, case.in_dim)

    def record_gemv(self, graph: Graph, x) -> None:
        c, device = self.case, self.device
        weights = [wrap_quant_weight(device, *t) for t in c.triples]
        conv = None
        if c.conv_weight is not None:
            conv = FoldedConvStep(device.wrap(c.conv_weight), self.window)
        norm = FoldedNorm(device.wrap(c.gain), EPS)
        projections = list(zip(weights, self.outs, strict=True))
        record_qgemv(graph, device, x, projections, norm=norm, conv=conv)

    def values(self) -> list[np.ndarray]:
        c = self.case
        outs = [as_float32(out, r) for out, r in zip(self.outs, c.rows, strict=True)]
        return [*outs, as_float32(self.window, c.window.size), as_float32(self.residual, c.in_dim)]


def run_folded(device, case: Case, token: int) -> Outputs:
    out = Outputs(device, case)
    embedded = EmbeddedInput(
        tokens=device.wrap(case.history(token)),
        position=device.wrap(np.array([POSITION], np.uint32)),
        table=wrap_quant_weight(device, *case.table),
        residual=out.residual,
    )
    run(device, lambda g: out.record_gemv(g, embedded))
    return out


def run_embedding_then_gemv(device, case: Case, token: int) -> Outputs:
    out = Outputs(device, case)
    table = wrap_quant_weight(device, *case.table)
    history = device.wrap(case.history(token))
    position = device.wrap(np.array([POSITION], np.uint32))

    def record(graph: Graph) -> None:
        record_embedding(graph, device, history, position, table, out.residual)
        graph.barrier()
        out.record_gemv(graph, out.residual)

    run(device, record)
    return out


SHAPES = [
    # layer 0 of the real model (GDN in_proj_qkv|z|a|b with the conv step), a smaller table
    pytest.param([8192, 4096, 32, 32], 2048, 4, 4, True, id="gdn-real"),
    pytest.param([1024, 512, 4, 4], 128, 4, 4, True, id="gdn-tiny"),
    # an attention-first model: q|k|v, no conv
    pytest.param([2048, 512, 512], 128, 4, 4, False, id="attention-tiny"),
    # the table's bit width differs from the projections' (and a ragged input dimension)
    pytest.param([300, 7], 192, 4, 8, True, id="q4-table8"),
    pytest.param([13, 5, 9], 1088, 8, 4, False, id="q8-table4"),
    pytest.param([40], 192, 8, 8, False, id="q8-table8"),
]


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "in_dim", "bits", "embed_bits", "conv"), SHAPES)
def test_folded_embedding_equals_the_embedding_dispatch_then_the_gemv(
    lane_order, rows, in_dim, bits, embed_bits, conv
):
    device = sim_device(lane_order)
    case = Case(rows, in_dim, bits, embed_bits, conv)
    folded = run_folded(device, case, token=VOCAB - 2)
    separate = run_embedding_then_gemv(device, case, token=VOCAB - 2)
    for actual, expected in zip(folded.values(), separate.values(), strict=True):
        np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_an_id_past_the_table_is_clamped_as_the_embedding_does(lane_order):
    device = sim_device(lane_order)
    case = Case([64, 8], 128, 4, 4, False)
    clamped = run_folded(device, case, token=VOCAB + 1000)
    last_row = run_folded(device, case, token=VOCAB - 1)
    separate = run_embedding_then_gemv(device, case, token=VOCAB + 1000)
    for a, b, c in zip(clamped.values(), last_row.values(), separate.values(), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "in_dim", "bits", "embed_bits", "conv"), SHAPES[1:])
def test_folded_embedding_against_float64(lane_order, rows, in_dim, bits, embed_bits, conv):
    """Without the conv step (its bound is test_kernel_decode_folds'): every projection is
    W rms_norm(e) of the float64 row e, the residual is e."""
    device = sim_device(lane_order)
    case = Case(rows, in_dim, bits, embed_bits, conv=False)
    token = 123
    out = run_folded(device, case, token)
    row, row_magnitude = expected_rows(case.table, embed_bits, np.array([token]))
    assert_within_ulps(as_float32(out.residual, in_dim), row[0], row_magnitude[0], 2)
    # The kernel norms its fp32 row, so the reference starts from that row: a bf16 scale times a
    # code of at most 8 bits is exact in fp32, so the row is the float64 value rounded once.
    gained, inv_rms = normed_reference(row[0].astype(np.float32), case.gain)
    for triple, buffer, r in zip(case.triples, out.outs, rows, strict=True):
        dot, magnitude = reference_qgemv(*triple, bits, gained)
        expected = inv_rms * dot
        bound = (ulps_for(in_dim, bits) + 1) * FLOAT32_EPS * inv_rms * magnitude
        bound += inv_rms_ulps(in_dim) * FLOAT32_EPS * np.abs(expected)
        assert_within(as_float32(buffer, r), expected, bound)


def test_an_embedded_input_needs_the_folded_norm():
    device = sim_device("forward")
    case = Case([4], 64, 4, 4, False)
    weight = wrap_quant_weight(device, *case.triples[0])
    embedded = EmbeddedInput(
        device.wrap(case.history(1)),
        device.wrap(np.array([POSITION], np.uint32)),
        wrap_quant_weight(device, *case.table),
        float_buffer(device, 64),
    )
    with pytest.raises(ValueError, match="input norm"):
        record_qgemv(Graph(), device, embedded, [(weight, float_buffer(device, 4))])


def test_an_embedding_table_of_another_width_is_refused():
    device = sim_device("forward")
    case = Case([4], 64, 4, 4, False)
    wide_table = random_quantized(np.random.default_rng(0), VOCAB, 128, 4)
    embedded = EmbeddedInput(
        device.wrap(case.history(1)),
        device.wrap(np.array([POSITION], np.uint32)),
        wrap_quant_weight(device, *wide_table),
        float_buffer(device, 128),
    )
    norm = FoldedNorm(device.wrap(case.gain), EPS)
    weight = wrap_quant_weight(device, *case.triples[0])
    with pytest.raises(ValueError, match="embedding rows of 128 for projections of 64"):
        record_qgemv(Graph(), device, embedded, [(weight, float_buffer(device, 4))], norm=norm)
