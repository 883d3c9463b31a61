"""The quantized GEMMs of batched prefill (`metal/quantized_gemm.metal`) against float64 numpy.

The GEMMs multiply half operands. The reference rounds them as the kernels do: x to half (row r
first scaled by 2^-e[r] under the range guard, its outputs by 2^e[r]; both exact), each w = scale
* code + bias dequantized in fp32 by one fma (one rounding) and then to half. Products of halves
are exact in fp32, the sum is accumulated in any order (in_dim roundings at most); so an output
is within (in_dim + 8) float32 ulps of the magnitude sum_k |w_k| |x_k| against that reference.
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

from lily.checkpoint.quant import bf16_to_float32, unpack_codes
from lily.device import Graph
from lily.diagnostics.kernel_checks import (
    qgemm_ulps,
    reference_qgemm,
    reference_row_exponents,
    swiglu_bound,
)
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized_gemm import (
    BAND_TOKENS,
    record_qgemm,
    record_qgemm_grouped,
    record_qgemm_row_exponents,
)


def assert_swiglu_within(actual, gate, gate_mag, up, up_mag, in_dim: int) -> None:
    assert_within(actual, *swiglu_bound(gate, gate_mag, up, up_mag, in_dim))


def random_x(rng: np.random.Generator, rows: int, in_dim: int) -> np.ndarray:
    return rng.normal(0, 1, (rows, in_dim)).astype(np.float32)


def unbounded_x(rng: np.random.Generator, rows: int, in_dim: int) -> np.ndarray:
    """Rows of very different ranges, as a SwiGLU hidden state or attention output can have:
    scaled by 10^u, u uniform in [-6, 6], and a few values of 1e6 (past half's 65504)."""
    x = random_x(rng, rows, in_dim) * (10.0 ** rng.uniform(-6, 6, (rows, 1))).astype(np.float32)
    spikes = rng.integers(0, rows * in_dim, max(1, rows // 3))
    x.flat[spikes] = 1e6
    return x


def exact_qgemm(triple, bits: int, x: np.ndarray) -> np.ndarray:
    """x W^T in float64 with nothing rounded: what half operands are judged against."""
    codes = unpack_codes(triple[0], bits).astype(np.float64)
    s, b = (np.repeat(bf16_to_float32(a).astype(np.float64), 64, axis=-1) for a in triple[1:])
    return x.astype(np.float64) @ (s * codes + b).T


def int32_buffer(device, values: np.ndarray):
    return device.wrap(np.ascontiguousarray(values, dtype=np.int32))


# ---- dense: up to four projections sharing one input ------------------------------------------


def check_qgemm(
    lane_order: str,
    tokens: int,
    in_dim: int,
    rows: list[int],
    bits: int,
    guarded: bool = False,
    tensor_ops: bool = False,
) -> None:
    """With `guarded`, x has unbounded rows (`unbounded_x`) and the GEMM takes their exponents.
    `tensor_ops`: on a device that runs the tensor-op kernels."""
    rng = np.random.default_rng(tokens * 1000 + in_dim + sum(rows) + bits)
    device = sim_device(lane_order, tensor_ops)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    x = unbounded_x(rng, tokens, in_dim) if guarded else random_x(rng, tokens, in_dim)
    exponents = reference_row_exponents(x) if guarded else None
    # The outputs lie back to back in one buffer, so a write past one output's end shows up as a
    # wrong value in the next.
    sizes = [tokens * r for r in rows]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = float_buffer(device, int(offsets[-1]))
    projections = [
        (wrap_quant_weight(device, *t), (out, 4 * int(o)))
        for t, o in zip(triples, offsets[:-1], strict=True)
    ]
    x_exponents = None if exponents is None else int32_buffer(device, exponents)
    run(
        device,
        lambda g: record_qgemm(g, device, device.wrap(x), projections, tokens, x_exponents),
    )
    result = as_float32(out, int(offsets[-1]))
    for triple, r, o in zip(triples, rows, offsets[:-1], strict=True):
        expected, magnitude = reference_qgemm(*triple, bits, x, exponents)
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


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_qgemm_launch_bands(lane_order):
    """More token tiles than one launch band: 18 tiles of 64 tokens run as a band of 16 and a
    narrower one of 2, each over the three weight tiles of two projections; a tile computed twice
    or never shows as a wrong output."""
    check_qgemm(lane_order, BAND_TOKENS + 76, 64, [200, 72], 4)


def test_qgemm_4097_tokens():
    """A long chunk: 65 tiles of 64 tokens, the last with one."""
    check_qgemm("forward", 4097, 64, [24], 4)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("tokens", "in_dim", "rows", "bits"),
    [
        (1, 64, [40], 4),
        (7, 128, [72, 200], 8),
        (64, 192, [40, 1, 72], 4),
        (300, 64, [200, 40, 72, 8], 8),
    ],
)
def test_qgemm_guarded(lane_order, tokens, in_dim, rows, bits):
    """Rows from 1e-6 to 1e6 in scale, some holding 1e6: each staged at its own power of two."""
    check_qgemm(lane_order, tokens, in_dim, rows, bits, guarded=True)


def test_qgemm_guarded_4097_tokens():
    check_qgemm("random", 4097, 64, [24], 8, guarded=True)


def test_half_operands_round_the_products():
    """The kernel's operands are half: it lands on the half-rounded reference, off the exact one
    by more than the bound an fp32 GEMM would meet."""
    device = sim_device("forward")
    rng = np.random.default_rng(11)
    triple = random_quantized(rng, 16, 256, 4)
    x = random_x(rng, 8, 256)
    out = float_buffer(device, 8 * 16)
    weight = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_qgemm(g, device, device.wrap(x), [(weight, out)], 8))
    actual = as_float32(out, 8 * 16).reshape(8, 16)
    rounded, magnitude = reference_qgemm(*triple, 4, x)
    assert_within_ulps(actual, rounded, magnitude, qgemm_ulps(256))
    exact = exact_qgemm(triple, 4, x)
    error = np.abs(actual - exact)
    assert np.max(error / (qgemm_ulps(256) * np.finfo(np.float32).eps * magnitude)) > 1


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_guard_keeps_values_past_half_finite(lane_order):
    """A row holding 1e6 (past half's 65504): unguarded it stages as inf and its outputs are
    inf or NaN; guarded (2^-11 for it) they match the reference to the usual bound, as do the
    rows around it (one of 1e-7 values, half subnormals unguarded, and one of zeros)."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(21)
    tokens, in_dim, rows = 9, 128, 40
    triple = random_quantized(rng, rows, in_dim, 4)
    weight = wrap_quant_weight(device, *triple)
    x = random_x(rng, tokens, in_dim)
    x[2] = rng.uniform(-5e5, 5e5, in_dim)
    x[2, 5] = 1e6
    x[4] *= 1e-7
    x[6] = 0.0
    exponents = reference_row_exponents(x)
    assert exponents[2] == 11 and exponents[6] == 0
    outs = {}
    for guarded in (False, True):
        out = outs[guarded] = float_buffer(device, tokens * rows)
        x_exponents = int32_buffer(device, exponents) if guarded else None
        run(
            device,
            lambda g, out=out, e=x_exponents: record_qgemm(
                g, device, device.wrap(x), [(weight, out)], tokens, e
            ),
        )
    unguarded = as_float32(outs[False], tokens * rows).reshape(tokens, rows)
    assert not np.any(np.isfinite(unguarded[2]))
    guarded = as_float32(outs[True], tokens * rows).reshape(tokens, rows)
    expected, magnitude = reference_qgemm(*triple, 4, x, exponents)
    assert_within_ulps(guarded, expected, magnitude, qgemm_ulps(in_dim))
    np.testing.assert_array_equal(guarded[6], 0.0)
    # Against the exact product too: the guard costs half's rounding only.
    exact = exact_qgemm(triple, 4, x)
    assert np.all(np.abs(guarded - exact) <= 2.0**-9 * magnitude)


# ---- the range guard's exponents --------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "in_dim"), [(1, 4), (7, 68), (64, 512), (300, 260), (4097, 8)])
def test_row_exponents(lane_order, rows, in_dim):
    """Exactly the reference's, over rows from 1e-30 to 1e30 in scale (both past the clamp at
    |e| = 64) and, where there are rows enough, a row of zeros (e = 0), one holding an inf (0),
    one holding a NaN (ignored: its products propagate it whatever e is), one of fp32
    subnormals (0: they round to half's zero either way), and rows whose largest is 256 (0),
    511.99 (0) and -1e6 (11: 1e6 = 1.9 * 2^19)."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(rows + in_dim)
    x = random_x(rng, rows, in_dim) * (10.0 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    special = [(0.0, 0.0, 0), (1.0, np.inf, 0), (1.0, np.nan, None), (1e-40, 1e-40, 0)]
    special += [(100.0, 256.0, 0), (100.0, 511.99, 0), (1e3, -1e6, 11)]
    expected_special = {}
    for row, (scale, value, exponent) in zip(range(0, rows, 3), special, strict=False):
        x[row] = rng.uniform(-1, 1, in_dim).astype(np.float32) * np.float32(scale)
        x[row, rng.integers(in_dim)] = value
        expected_special[row] = exponent
    exponents = float_buffer(device, rows)
    run(
        device,
        lambda g: record_qgemm_row_exponents(g, device, device.wrap(x), rows, in_dim, exponents),
    )
    actual = exponents.numpy()[: 4 * rows].view(np.int32)
    expected = reference_row_exponents(x)
    np.testing.assert_array_equal(actual, expected)
    for row, exponent in expected_special.items():
        if exponent is not None:
            assert expected[row] == exponent, row
    assert np.max(np.abs(expected)) <= 64


def test_row_exponents_need_float4_rows():
    device = sim_device("forward")
    x, out = float_buffer(device, 6), float_buffer(device, 1)
    with pytest.raises(ValueError, match="multiple of 4"):
        record_qgemm_row_exponents(Graph(), device, x, 1, 6, out)


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
    guarded: bool = False,
    tensor_ops: bool = False,
) -> None:
    """`spare_rows` more output rows than assignments: the kernel must leave them untouched.
    `guarded`: x has unbounded rows (`unbounded_x`) and the GEMM takes their exponents.
    `tensor_ops`: on a device that runs the tensor-op kernels."""
    rng = np.random.default_rng(seed)
    device = sim_device(lane_order, tensor_ops)
    sorted_experts, row_index, offsets = sort_by_expert(choices, experts)
    assignments = len(sorted_experts)
    capacity = assignments + spare_rows
    triples = [random_quantized(rng, rows, in_dim, bits, experts) for _ in range(1 + swiglu)]
    # An expert without assignments gets NaN scales: any product that read them would show it.
    empty = np.setdiff1d(np.arange(experts), sorted_experts)
    for _, scales, _ in triples:
        scales[empty] = 0x7FC0
    # With gather, x is one row per token; without, one row per sorted assignment.
    x_count = choices.shape[0] if gather else assignments
    x = unbounded_x(rng, x_count, in_dim) if guarded else random_x(rng, x_count, in_dim)
    x_rows = x[row_index] if gather else x
    exponents = reference_row_exponents(x) if guarded else None
    row_exponents = None if exponents is None else exponents[row_index] if gather else exponents

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
            None if exponents is None else int32_buffer(device, exponents),
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
                *expert_triple,
                bits,
                x_rows[mine],
                None if row_exponents is None else row_exponents[mine],
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
@pytest.mark.parametrize("guarded", [False, True])
def test_grouped_identity_rows(lane_order, bits, guarded):
    """The down projection: assignment a reads row a of its input; guarded, rows of any range
    (the SwiGLU hidden state), some holding 1e6."""
    rng = np.random.default_rng(3)
    choices = random_choices(rng, 23, 4, np.arange(6))
    check_grouped(
        lane_order, choices, 6, 192, 200, bits, False, gather=False, seed=3, guarded=guarded
    )


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_guarded_gather(lane_order, swiglu):
    """Gathered rows take the exponents of the x rows they read."""
    rng = np.random.default_rng(15)
    choices = random_choices(rng, 37, 3, np.arange(10))
    check_grouped(lane_order, choices, 10, 128, 72, 8, swiglu, spare_rows=5, seed=15, guarded=True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("swiglu", "guarded"), [(True, False), (False, True)])
def test_grouped_tile_sizes(lane_order, swiglu, guarded):
    """Experts of 0, 1, 8, 9, 17, 33, 49, 57, 64 and 130 assignments: every tile size (8, 16, 32,
    64) and every way of cutting an expert into them (16 + 8, 32 + 16 + 8, 64 + 64 + 8, ...)."""
    counts = [0, 1, 8, 9, 17, 33, 49, 57, 64, 130]
    choices = np.repeat(np.arange(len(counts)), counts)[:, None]
    np.random.default_rng(6).shuffle(choices)
    check_grouped(
        lane_order,
        choices,
        len(counts),
        64,
        40,
        4,
        swiglu,
        gather=not guarded,
        seed=6,
        guarded=guarded,
    )


def test_grouped_grid_covers_the_most_tiles():
    """Every expert at 49 (or 113) assignments: three tiles past its whole 64s (32 + 16 + 8), the
    most any expert has: 19 tiles, where the grid has 23 rows (a tile the grid left out would
    leave its rows unwritten)."""
    counts = [49, 49, 113, 49, 49, 49]
    choices = np.repeat(np.arange(len(counts)), counts)[:, None]
    np.random.default_rng(14).shuffle(choices)
    check_grouped("random", choices, len(counts), 64, 40, 4, True, seed=14)


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
