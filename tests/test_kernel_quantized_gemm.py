"""The quantized GEMMs of batched prefill (`metal/quantized_gemm.metal`) against float64 numpy.

Error bound: an output element is a length-in_dim sum of w * x in fp32, each w = scale * code + bias
dequantized in fp32 by one fma (one rounding), each product rounded once, the sum accumulated in
any order (in_dim roundings at most); so it is within (in_dim + 8) float32 ulps of the magnitude
sum_k |w_k| |x_k|. With bfloat or half operands the reference rounds x and each dequantized w to
that type as the kernel does (their products are then exact in fp32), and the same bound holds
against it.
With SwiGLU, silu(g) * u is bounded by propagating those bounds on g and u (|silu'| <= 1.1) plus
8 ulps of |silu(g) u| for the silu and the product.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within,
    assert_within_ulps,
    float_buffer,
    random_quantized,
    run,
    sim_device,
)

from lily.device import Graph
from lily.diagnostics.kernel_checks import qgemm_ulps, reference_qgemm, swiglu_bound
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized_gemm import record_qgemm, record_qgemm_grouped


def assert_swiglu_within(actual, gate, gate_mag, up, up_mag, in_dim: int) -> None:
    assert_within(actual, *swiglu_bound(gate, gate_mag, up, up_mag, in_dim))


def random_x(rng: np.random.Generator, rows: int, in_dim: int) -> np.ndarray:
    return rng.normal(0, 1, (rows, in_dim)).astype(np.float32)


# ---- dense: up to four projections sharing one input ------------------------------------------


def check_qgemm(
    lane_order: str, tokens: int, in_dim: int, rows: list[int], bits: int, operands="float32"
) -> None:
    rng = np.random.default_rng(tokens * 1000 + in_dim + sum(rows) + bits)
    device = sim_device(lane_order)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    x = random_x(rng, tokens, in_dim)
    # The outputs lie back to back in one buffer, so a write past one output's end shows up as a
    # wrong value in the next.
    sizes = [tokens * r for r in rows]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = float_buffer(device, int(offsets[-1]))
    projections = [
        (wrap_quant_weight(device, *t), (out, 4 * int(o)))
        for t, o in zip(triples, offsets[:-1], strict=True)
    ]
    run(device, lambda g: record_qgemm(g, device, device.wrap(x), projections, tokens, operands))
    result = as_float32(out, int(offsets[-1]))
    for triple, r, o in zip(triples, rows, offsets[:-1], strict=True):
        expected, magnitude = reference_qgemm(*triple, bits, x, operands)
        actual = result[o : o + tokens * r].reshape(tokens, r)
        assert_within_ulps(actual, expected, magnitude, qgemm_ulps(in_dim))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "in_dim", "rows", "bits"),
    [
        (1, 64, [40], 4),
        (7, 128, [72, 200], 4),
        (64, 192, [40, 1, 72], 8),  # router | shared-expert gate style, 8-bit
        (300, 64, [200, 40, 72, 8], 4),  # four projections, ragged everywhere
        (33, 256, [128], 8),  # one full weight tile, a ragged token tile
    ],
)
def test_qgemm_ragged(lane_order, tokens, in_dim, rows, bits):
    check_qgemm(lane_order, tokens, in_dim, rows, bits)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_qgemm_long_input(lane_order):
    check_qgemm(lane_order, 9, 2048, [64], 4)


def test_qgemm_bigger_chunk():
    check_qgemm("random", 520, 128, [136, 264], 4)


def test_qgemm_4097_tokens():
    """A long chunk: 65 tiles of 64 tokens, the last with one."""
    check_qgemm("forward", 4097, 64, [24], 4)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "in_dim", "rows", "operands"),
    [
        (1, 64, [40], "bfloat16"),
        (7, 128, [72, 200], "float16"),
        (64, 192, [40, 1, 72], "bfloat16"),
        (300, 64, [200, 40, 72, 8], "float16"),
    ],
)
def test_qgemm_two_byte_operands(lane_order, tokens, in_dim, rows, operands):
    check_qgemm(lane_order, tokens, in_dim, rows, 4, operands)


def test_bfloat_operands_round_the_products():
    """The bfloat kernel is not the fp32 one: it lands on the rounded-operand reference, off the
    exact one by more than the fp32 kernel's bound."""
    device = sim_device("forward")
    rng = np.random.default_rng(11)
    triple = random_quantized(rng, 16, 256, 4)
    x = random_x(rng, 8, 256)
    out = float_buffer(device, 8 * 16)
    weight = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_qgemm(g, device, device.wrap(x), [(weight, out)], 8, "bfloat16"))
    exact, magnitude = reference_qgemm(*triple, 4, x)
    error = np.abs(as_float32(out, 8 * 16).reshape(8, 16) - exact)
    assert np.max(error / (qgemm_ulps(256) * np.finfo(np.float32).eps * magnitude)) > 1


def test_bfloat_operands_need_4_bit_weights():
    device = sim_device("forward")
    rng = np.random.default_rng(12)
    w8 = wrap_quant_weight(device, *random_quantized(rng, 8, 64, 8))
    x, out = float_buffer(device, 64), float_buffer(device, 8)
    with pytest.raises(ValueError, match="4-bit weights only"):
        record_qgemm(Graph(), device, x, [(w8, out)], 1, "bfloat16")


# ---- grouped: MoE experts over assignments sorted by expert -----------------------------------


def sort_by_expert(choices: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """choices [tokens, top_k] expert ids -> (expert of each sorted assignment, row_index
    (its token), expert_offsets [experts + 1]); a stable sort, as a routing kernel would emit."""
    flat = choices.ravel()
    order = np.argsort(flat, kind="stable")
    sorted_experts = flat[order]
    offsets = np.searchsorted(sorted_experts, np.arange(experts + 1)).astype(np.uint32)
    return sorted_experts, (order // choices.shape[1]).astype(np.uint32), offsets


def random_choices(rng, tokens: int, top_k: int, allowed: np.ndarray) -> np.ndarray:
    return np.stack([rng.choice(allowed, top_k, replace=False) for _ in range(tokens)])


def check_grouped(
    lane_order: str,
    choices: np.ndarray,
    experts: int,
    in_dim: int,
    rows: int,
    bits: int,
    swiglu: bool,
    gather: bool = True,
    spare_rows: int = 0,
    seed: int = 0,
    operands: str = "float32",
) -> None:
    """`spare_rows` more output rows than assignments: the kernel must leave them untouched."""
    rng = np.random.default_rng(seed)
    device = sim_device(lane_order)
    sorted_experts, row_index, offsets = sort_by_expert(choices, experts)
    assignments = len(sorted_experts)
    capacity = assignments + spare_rows
    triples = [random_quantized(rng, rows, in_dim, bits, experts) for _ in range(1 + swiglu)]
    # An expert without assignments gets NaN scales: any product that read them would show it.
    empty = np.setdiff1d(np.arange(experts), sorted_experts)
    for _, scales, _ in triples:
        scales[empty] = 0x7FC0
    # With gather, x is one row per token; without, one row per sorted assignment.
    x = random_x(rng, choices.shape[0] if gather else assignments, in_dim)
    x_rows = x[row_index] if gather else x

    out = device.alloc(4 * capacity * rows)  # zeroed: rows past the assignments must stay 0
    weights = [wrap_quant_weight(device, *t) for t in triples]
    run(
        device,
        lambda g: record_qgemm_grouped(
            g,
            device,
            device.wrap(x),
            weights,
            out,
            device.wrap(offsets),
            device.wrap(row_index) if gather else None,
            capacity,
            operands,
        ),
    )
    result = as_float32(out, capacity * rows).reshape(capacity, rows)
    assert np.all(result[assignments:] == 0), "wrote rows past the last assignment"
    result = result[:assignments]

    products = []
    for triple in triples:
        y = np.empty((assignments, rows))
        magnitude = np.empty((assignments, rows))
        for e in np.unique(sorted_experts):
            mine = sorted_experts == e
            expert_triple = tuple(a[e] for a in triple)
            y[mine], magnitude[mine] = reference_qgemm(
                *expert_triple, bits, x_rows[mine], operands
            )
        products.append((y, magnitude))
    if swiglu:
        (gate, gate_mag), (up, up_mag) = products
        assert_swiglu_within(result, gate, gate_mag, up, up_mag, in_dim)
    else:
        assert_within_ulps(result, *products[0], qgemm_ulps(in_dim))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("bits", "swiglu"), [(4, True), (4, False), (8, True), (8, False)])
def test_grouped_random_routing(lane_order, bits, swiglu):
    rng = np.random.default_rng(bits + swiglu)
    choices = random_choices(rng, 37, 3, np.arange(10))
    check_grouped(lane_order, choices, 10, 128, 72, bits, swiglu, spare_rows=5)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_grouped_empty_experts(lane_order):
    """Experts 0, 2-4, 7 and 10 get nothing."""
    rng = np.random.default_rng(1)
    choices = random_choices(rng, 29, 2, np.array([1, 5, 6, 8, 9]))
    check_grouped(lane_order, choices, 11, 64, 40, 4, swiglu=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_one_expert_takes_all(lane_order, swiglu):
    """70 assignments of one expert: three token tiles, the last ragged."""
    choices = np.full((70, 1), 3)
    check_grouped(lane_order, choices, 8, 128, 40, 4, swiglu, seed=2)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_identity_rows(lane_order, bits):
    """The down projection: assignment a reads row a of its input."""
    rng = np.random.default_rng(3)
    choices = random_choices(rng, 23, 4, np.arange(6))
    check_grouped(lane_order, choices, 6, 192, 200, bits, swiglu=False, gather=False, seed=3)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("swiglu", "operands"), [(True, "float32"), (False, "bfloat16"), (True, "float16")]
)
def test_grouped_tile_sizes(lane_order, swiglu, operands):
    """Experts of 0, 1, 8, 9, 17, 33, 49, 57, 64 and 130 assignments: every tile size (8, 16, 32,
    64) and every way of cutting an expert into them (16 + 8, 32 + 16 + 8, 64 + 64 + 8, ...)."""
    counts = [0, 1, 8, 9, 17, 33, 49, 57, 64, 130]
    choices = np.repeat(np.arange(len(counts)), counts)[:, None]
    np.random.default_rng(6).shuffle(choices)
    check_grouped(
        lane_order, choices, len(counts), 64, 40, 4, swiglu, seed=6, operands=operands
    )


def test_grouped_grid_covers_the_most_tiles():
    """Every expert at 49 (or 113) assignments: three tiles past its whole 64s (32 + 16 + 8), the
    most any expert has: 19 tiles, where the grid has 23 rows (a tile the grid left out would
    leave its rows unwritten)."""
    counts = [49, 49, 113, 49, 49, 49]
    choices = np.repeat(np.arange(len(counts)), counts)[:, None]
    np.random.default_rng(14).shuffle(choices)
    check_grouped("random", choices, len(counts), 64, 40, 4, True, seed=14)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_grouped_bfloat_random_routing(lane_order):
    rng = np.random.default_rng(13)
    choices = random_choices(rng, 37, 3, np.arange(10))
    check_grouped(lane_order, choices, 10, 128, 72, 4, True, spare_rows=5, operands="bfloat16")


def test_grouped_256_experts():
    """The model's 256 experts, top-8: eight experts per lane in the tile search."""
    rng = np.random.default_rng(4)
    choices = random_choices(rng, 40, 8, np.arange(256))
    check_grouped("random", choices, 256, 64, 24, 4, swiglu=True, seed=4)


def test_mismatched_weights_are_refused():
    device = sim_device("forward")
    rng = np.random.default_rng(5)
    w4 = wrap_quant_weight(device, *random_quantized(rng, 8, 64, 4))
    w8 = wrap_quant_weight(device, *random_quantized(rng, 8, 64, 8))
    x, out = float_buffer(device, 64), float_buffer(device, 8)
    with pytest.raises(ValueError, match="same input dimension and bit width"):
        record_qgemm(Graph(), device, x, [(w4, out), (w8, out)], 1)
    with pytest.raises(ValueError, match="one weight, or gate and up"):
        record_qgemm_grouped(Graph(), device, x, [w4, w4, w4], out, out, None, 1)
