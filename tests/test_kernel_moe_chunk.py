"""The MoE block of a chunk of tokens (`metal/moe_chunk.metal` and `record_moe_chunk`) against
float64 numpy, and against decode's one-token block (`record_moe`) row by row.

- the sort must equal numpy's stable argsort of the expert ids exactly, including experts no
  token chose and one expert every token chose;
- the GEMMs multiply half operands (`chunk_gemm_error`), the down projections under the range
  guard, so a hidden state past half's 65504 comes out right;
- SwiGLU: exp, a division and two multiplies, within 8 ulps of |silu(g) u|;
- combine: top_k + 1 products added in order, each within (top_k + 2) ulps of the sum of the
  terms' magnitudes, plus 4 ulps of the shared term for the sigmoid.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from kernel_testing import (
    FLOAT32_EPS,
    LANE_ORDERS,
    as_float32,
    assert_within,
    float_buffer,
    run,
    sim_device,
)
from test_kernel_moe import TINY, Dims, layer, uint32s
from test_kernel_quantized import ulps_for

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16, unpack_codes
from lily.device import Graph
from lily.diagnostics.kernel_checks import reference_combine, reference_sort
from lily.engine import reference
from lily.kernels import offset_by
from lily.kernels.moe import MoeScratch, MoeWeights, record_moe, record_moe_route
from lily.kernels.moe_chunk import (
    MoeChunkScratch,
    moe_chunk_scratch_bytes,
    record_moe_chunk,
    record_moe_chunk_swiglu,
    record_moe_combine,
    record_moe_sort,
)
from lily.kernels.quant_weight import wrap_quant_weight

# -- the counting sort ----------------------------------------------------------------------------


def run_sort(device, ids: np.ndarray, experts: int):
    tokens, top_k = ids.shape
    offsets, row_index, slot_of = (
        device.alloc(4 * (experts + 1)),
        device.alloc(4 * tokens * top_k),
        device.alloc(4 * tokens * top_k),
    )
    run(
        device,
        lambda g: record_moe_sort(
            g,
            device,
            device.wrap(np.ascontiguousarray(ids, dtype=np.uint32)),
            tokens,
            top_k,
            experts,
            offsets,
            row_index,
            slot_of,
        ),
    )
    n = tokens * top_k
    return uint32s(offsets, experts + 1), uint32s(row_index, n), uint32s(slot_of, n)


def check_sort(device, ids: np.ndarray, experts: int) -> None:
    for got, expected, name in zip(
        run_sort(device, ids, experts),
        reference_sort(ids, experts),
        ("expert_offsets", "row_index", "slot_of"),
        strict=True,
    ):
        np.testing.assert_array_equal(got, expected, err_msg=name)


def distinct_choices(rng, tokens: int, top_k: int, candidates: np.ndarray) -> np.ndarray:
    """top_k distinct experts per token, drawn from `candidates`, as routing produces them."""
    return np.stack([rng.choice(candidates, top_k, replace=False) for _ in range(tokens)])


SORT_CASES = [(1, 16, 4), (7, 16, 4), (64, 32, 8), (300, 40, 6), (300, 256, 8)]


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), SORT_CASES)
def test_sort_leaves_unchosen_experts_empty(lane_order, tokens, experts, top_k):
    rng = np.random.default_rng(tokens + experts)
    # Only some experts are ever chosen, the first and last among the unchosen.
    candidates = rng.permutation(np.arange(1, experts - 1))[: max(top_k, (experts - 2) // 2)]
    ids = distinct_choices(rng, tokens, top_k, candidates)
    check_sort(sim_device(lane_order), ids, experts)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), SORT_CASES)
def test_sort_after_routing_with_one_expert_always_chosen(lane_order, tokens, experts, top_k):
    # Router logits crafted so that one expert tops every token: the sort puts all T tokens in one
    # expert, in token order.
    device = sim_device(lane_order)
    rng = np.random.default_rng(tokens)
    logits = rng.normal(0, 1, (tokens, experts)).astype(np.float32)
    hot = experts // 3
    logits[:, hot] = 10.0
    ids, weights = device.alloc(4 * tokens * top_k), float_buffer(device, tokens * top_k)
    run(
        device,
        lambda g: record_moe_route(
            g, device, device.wrap(logits), experts, top_k, ids, weights, True, tokens
        ),
    )
    routed = uint32s(ids, tokens * top_k).reshape(tokens, top_k).copy()
    expected_ids, _ = reference.moe_route(logits.astype(np.float64), top_k, True)
    np.testing.assert_array_equal(routed, expected_ids)
    assert np.all(routed[:, 0] == hot)
    check_sort(device, routed, experts)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_sort_large_chunk(lane_order):
    # 32k assignments over 16 token tiles, skewed so expert sizes range from a few to thousands.
    rng = np.random.default_rng(5)
    tokens, experts, top_k = 4096, 256, 8
    popularity = rng.pareto(1.0, experts) + 0.01
    ids = np.stack(
        [
            rng.choice(experts, top_k, replace=False, p=popularity / popularity.sum())
            for _ in range(tokens)
        ]
    )
    check_sort(sim_device(lane_order), ids, experts)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_sort_repeated_expert_within_a_token(lane_order):
    # Routing never picks an expert twice for one token, but the sort does not rely on it.
    ids = np.random.default_rng(6).integers(0, 5, (37, 6))
    check_sort(sim_device(lane_order), ids, 5)


# -- shared-expert SwiGLU -------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("count", [1, 130, 7 * 128])
def test_swiglu_in_place(lane_order, count):
    device = sim_device(lane_order)
    rng = np.random.default_rng(count)
    gate = rng.normal(0, 3, count).astype(np.float32)
    up = rng.normal(0, 1, count).astype(np.float32)
    gate_then_hidden = device.wrap(gate.copy())
    run(
        device,
        lambda g: record_moe_chunk_swiglu(g, device, gate_then_hidden, device.wrap(up), count),
    )
    expected = reference.silu(gate.astype(np.float64)) * up
    assert_within(as_float32(gate_then_hidden, count), expected, 8 * FLOAT32_EPS * np.abs(expected))


# -- combine --------------------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 4, 128), (7, 8, 64), (300, 6, 1028)])
def test_combine(lane_order, tokens, top_k, hidden):
    device = sim_device(lane_order)
    rng = np.random.default_rng(tokens)
    n = tokens * top_k
    down = rng.normal(0, 1, (n, hidden)).astype(np.float32)
    slot_of = rng.permutation(n).reshape(tokens, top_k).astype(np.uint32)
    weights = rng.dirichlet(np.ones(top_k), tokens).astype(np.float32)
    shared_logit = rng.normal(0, 2, tokens).astype(np.float32)
    shared_down = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    out = float_buffer(device, tokens * hidden)
    run(
        device,
        lambda g: record_moe_combine(
            g,
            device,
            device.wrap(down),
            device.wrap(slot_of),
            device.wrap(weights),
            device.wrap(shared_logit),
            device.wrap(shared_down),
            out,
            tokens,
            top_k,
            hidden,
        ),
    )
    expected, magnitude, shared_term = reference_combine(
        *(
            a.astype(np.float64) if a.dtype == np.float32 else a
            for a in (down, slot_of, weights, shared_logit, shared_down)
        )
    )
    bound = (top_k + 2) * FLOAT32_EPS * magnitude + 4 * FLOAT32_EPS * np.abs(shared_term)
    assert_within(as_float32(out, tokens * hidden).reshape(tokens, hidden), expected, bound)


# -- the whole block ------------------------------------------------------------------------------
#
# Against a float64 model of the block, with an error bound carried through every stage from the
# fp32 rounding of each GEMM, which differs between the two paths:
# - the chunk's GEMMs dequantize each weight to fp32 (scale * code is exact, adding the bias
#   rounds once) and sum in_dim products: within (in_dim + 2) ulps of sum |w x|;
# - decode's GEMVs evaluate scale * sum(code x) + bias * sum(x) per chunk: within ulps_for of the
#   affine magnitude sum |scale code x| + |bias x| (see test_kernel_quantized.py).
# The chunk is held to its own bound against float64, and to the sum of both against decode.

MID = Dims(hidden=128, experts=32, top_k=8, expert_rows=128, shared_rows=64)
WIDE = Dims(hidden=128, experts=256, top_k=8, expert_rows=64, shared_rows=128)


@dataclass(frozen=True)
class Float64Weight:
    """An MLX-quantized matrix in float64: W [rows, in] = scale * code + bias, with its codes
    [rows, groups, 64] and scales and biases [rows, groups] (a leading expert axis on all four
    for stacked experts)."""

    dense: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int

    @staticmethod
    def of(triple, bits: int) -> Float64Weight:
        weight, scales, biases = triple
        codes = unpack_codes(weight, bits).astype(np.float64)
        codes = codes.reshape(*codes.shape[:-1], -1, 64)
        s = bf16_to_float32(scales).astype(np.float64)
        b = bf16_to_float32(biases).astype(np.float64)
        dense = (codes * s[..., None] + b[..., None]).reshape(*s.shape[:-1], -1)
        return Float64Weight(dense, codes, s, b, bits)

    def expert(self, e: int) -> Float64Weight:
        return Float64Weight(
            self.dense[e], self.codes[e], self.scales[e], self.biases[e], self.bits
        )


def chunk_gemm_error(m: Float64Weight, x_abs: np.ndarray) -> np.ndarray:
    """The chunk's GEMMs multiply half operands: x and each dequantized weight round to half
    (2^-11 relative while normal; 2^-25 absolute below half's smallest normal, for x in units
    of its row's largest under the range guard, generously 2^-24 (1 + largest)), then fp32
    sums of in_dim products."""
    dense_abs = np.abs(m.dense)
    relative = (2.0**-10 + 2.0**-21 + (m.dense.shape[1] + 2) * FLOAT32_EPS) * (x_abs @ dense_abs.T)
    largest = x_abs.max(axis=1, keepdims=True)
    subnormal = 2.0**-24 * (x_abs.sum(axis=1, keepdims=True) + (1 + largest) * dense_abs.sum(1))
    return relative + subnormal


def decode_gemv_error(m: Float64Weight, x_abs: np.ndarray) -> np.ndarray:
    groups = x_abs.reshape(len(x_abs), -1, 64)
    magnitude = groups.sum(axis=-1) @ np.abs(m.biases).T
    for group in range(groups.shape[1]):
        magnitude += (groups[:, group] @ m.codes[:, group].T) * np.abs(m.scales[:, group])
    return ulps_for(x_abs.shape[1], m.bits) * FLOAT32_EPS * magnitude


def reference_expert(gate, up, down, x: np.ndarray, gemm_error):
    """down(silu(gate x) * up x) for the rows of x, and a bound on the kernels' error in it."""
    eps = FLOAT32_EPS
    g, u = x @ gate.dense.T, x @ up.dense.T
    dg, du = gemm_error(gate, np.abs(x)), gemm_error(up, np.abs(x))
    h = reference.silu(g) * u
    # |silu'| < 1.1; then exp, a division and two multiplies.
    dh = 1.1 * dg * np.abs(u) + np.abs(reference.silu(g)) * du + dg * du + 8 * eps * np.abs(h)
    dy = gemm_error(down, np.abs(h) + dh) + dh @ np.abs(down.dense).T
    return h @ down.dense.T, dy


def reference_block(
    w: dict[str, Float64Weight], dims: Dims, x: np.ndarray, gemm_error, device_ids=None
):
    """(out, error bound, expert ids) of the MoE block over the rows of x, in float64. With
    `device_ids` (the routing the kernels chose), a token whose choice differs from float64's
    must be a near-tie (each expert chosen within twice the logit error bound of the top_k-th
    float64 logit), and its block is then the float64 block of the device's choice."""
    eps = FLOAT32_EPS
    logits = x @ w["router"].dense.T
    ids, weights = reference.moe_route(logits, dims.top_k, True)
    # A logit error d moves a renormalised weight by at most w (d_k + max_j d_j); the routing
    # kernel's own rounding is within 16 + experts / 8 ulps (test_kernel_moe.py).
    logit_error = gemm_error(w["router"], np.abs(x)).max(axis=1)
    if device_ids is not None:
        kth = np.sort(logits, axis=1)[:, -dims.top_k]
        chosen = np.take_along_axis(logits, device_ids.astype(np.int64), axis=1)
        assert np.all(chosen >= (kth - 2 * logit_error)[:, None]), "a choice beyond a near-tie"
        ids = device_ids.astype(np.int64)
        shifted = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        weights = shifted / shifted.sum(axis=1, keepdims=True)
    weight_error = weights * (2 * logit_error + (16 + dims.experts / 8) * eps)[:, None]
    out = np.zeros_like(x)
    bound = np.zeros_like(x)
    terms = np.zeros_like(x)  # sum of |w_k y_k|, which the combine's own rounding scales with
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        gate, up, down = (w[name].expert(e) for name in ("expert_gate", "expert_up", "expert_down"))
        y, dy = reference_expert(gate, up, down, x[rows], gemm_error)
        weight, dw = weights[rows, slot][:, None], weight_error[rows, slot][:, None]
        out[rows] += weight * y
        bound[rows] += weight * dy + dw * (np.abs(y) + dy)
        terms[rows] += weight * (np.abs(y) + dy)
    y, dy = reference_expert(w["shared_gate"], w["shared_up"], w["shared_down"], x, gemm_error)
    gate = reference.sigmoid(x @ w["shared_expert_gate"].dense.T)
    d_gate = 0.25 * gemm_error(w["shared_expert_gate"], np.abs(x)) + 4 * eps * gate
    out += gate * y
    bound += gate * dy + d_gate * (np.abs(y) + dy)
    # top_k + 1 weighted terms added in order (decode adds them inside one long dot product).
    bound += (dims.top_k + 2) * eps * (terms + gate * (np.abs(y) + dy))
    return out, bound, ids


def layer_weights(dims: Dims, hot_expert: int | None):
    """The layer of test_kernel_moe; with `hot_expert`, its router row gets a large bias, so that
    for inputs with a positive mean every token chooses it."""
    w = dict(layer(dims))
    if hot_expert is not None:
        weight, scales, biases = w["router"]
        biases = biases.copy()
        biases[hot_expert] = float32_to_bf16(np.full(biases.shape[1], 1.0, dtype=np.float32))
        w["router"] = (weight, scales, biases)
    return w


@functools.cache
def float64_layer(dims: Dims, hot_expert: int | None) -> dict[str, Float64Weight]:
    eight_bit = ("router", "shared_expert_gate")
    return {
        name: Float64Weight.of(t, 8 if name in eight_bit else 4)
        for name, t in layer_weights(dims, hot_expert).items()
    }


def run_chunk(device, dims: Dims, weights: MoeWeights, x: np.ndarray):
    tokens = len(x)
    scratch = MoeChunkScratch.allocate(
        device,
        dims.experts,
        dims.top_k,
        dims.expert_rows,
        dims.shared_rows,
        dims.hidden,
        tokens + 3,
    )
    out = float_buffer(device, tokens * dims.hidden)
    run(
        device,
        lambda g: record_moe_chunk(
            g, device, device.wrap(x), weights, dims.top_k, scratch, out, tokens
        ),
    )
    return as_float32(out, tokens * dims.hidden).reshape(tokens, dims.hidden), scratch


def run_decode_per_token(device, dims: Dims, weights: MoeWeights, x: np.ndarray) -> np.ndarray:
    """Decode's one-token block on every row of x in turn, in one graph."""
    scratch = MoeScratch.allocate(
        device, dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows
    )
    x_buffer = device.wrap(np.ascontiguousarray(x))
    out = float_buffer(device, x.size)
    row_bytes = 4 * dims.hidden

    def record(graph):
        for t in range(len(x)):
            record_moe(
                graph,
                device,
                offset_by(x_buffer, t * row_bytes),
                weights,
                dims.top_k,
                scratch,
                offset_by(out, t * row_bytes),
            )
            graph.barrier()

    run(device, record)
    return as_float32(out, x.size).reshape(x.shape)


CHUNK_CASES = [
    (TINY, 1, None),
    (TINY, 7, None),
    (TINY, 64, None),
    (TINY, 300, None),
    (MID, 7, None),
    (MID, 64, 5),
    (TINY, 1000, None),
    (WIDE, 64, None),
]


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("dims", "tokens", "hot_expert"),
    CHUNK_CASES,
    ids=[
        f"{d.experts}x{d.top_k}-T{t}" + ("-hot" if h is not None else "") for d, t, h in CHUNK_CASES
    ],
)
def test_moe_chunk(lane_order, dims, tokens, hot_expert):
    device = sim_device(lane_order)
    w = layer_weights(dims, hot_expert)
    weights = MoeWeights(**{name: wrap_quant_weight(device, *t) for name, t in w.items()})
    mean = 0.0 if hot_expert is None else 0.3
    x = np.random.default_rng(tokens).normal(mean, 1, (tokens, dims.hidden)).astype(np.float32)
    out, scratch = run_chunk(device, dims, weights, x)

    x64 = x.astype(np.float64)
    exact = float64_layer(dims, hot_expert)
    n = tokens * dims.top_k
    # The device routes as the float64 model but for near-ties (half operands round the
    # router's logits), and sorts its routing exactly as numpy.
    device_ids = uint32s(scratch.expert_ids, n).reshape(tokens, dims.top_k)
    expected, bound, ids = reference_block(exact, dims, x64, chunk_gemm_error, device_ids)
    if hot_expert is not None:
        assert np.all(np.any(ids == hot_expert, axis=1))
    sorted_on_device = (
        uint32s(scratch.expert_offsets, dims.experts + 1),
        uint32s(scratch.row_index, n),
        uint32s(scratch.slot_of, n),
    )
    for got, want in zip(sorted_on_device, reference_sort(ids, dims.experts), strict=True):
        np.testing.assert_array_equal(got, want)
    assert_within(out, expected, bound)

    # Rows are independent: at most 300 of them, evenly spread, keep decode's token loop short.
    rows = slice(None, None, -(-tokens // 300))
    decoded = run_decode_per_token(device, dims, weights, x[rows])
    _, decode_bound, _ = reference_block(
        exact, dims, x64[rows], decode_gemv_error, device_ids[rows]
    )
    assert_within(out[rows], decoded.astype(np.float64), bound[rows] + decode_bound)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_moe_chunk_hidden_state_past_half(lane_order):
    """Inputs scaled so that the SwiGLU hidden states (which the down projections read) reach
    past 1e6, far past half's 65504: the range guard keeps every output finite and within the
    half-operand bound of the float64 block (unguarded, those rows would be inf or NaN)."""
    device = sim_device(lane_order)
    dims, tokens = TINY, 64
    w = layer_weights(dims, None)
    weights = MoeWeights(**{name: wrap_quant_weight(device, *t) for name, t in w.items()})
    x = np.random.default_rng(23).normal(0, 1, (tokens, dims.hidden)).astype(np.float32)
    x[::5] *= 3000.0  # every fifth token
    out, scratch = run_chunk(device, dims, weights, x)
    exact = float64_layer(dims, None)
    n = tokens * dims.top_k
    device_ids = uint32s(scratch.expert_ids, n).reshape(tokens, dims.top_k)
    expected, bound, _ = reference_block(
        exact, dims, x.astype(np.float64), chunk_gemm_error, device_ids
    )
    hidden = as_float32(scratch.expert_hidden, n * dims.expert_rows)
    assert np.abs(hidden).max() > 1e6
    shared = as_float32(scratch.shared_hidden, tokens * dims.shared_rows)
    assert np.abs(shared).max() > 1e6
    assert np.all(np.isfinite(out))
    assert_within(out, expected, bound)


def test_moe_chunk_dispatches_levels_and_scratch():
    device = sim_device("forward")
    d = MID
    scratch = MoeChunkScratch.allocate(
        device, d.experts, d.top_k, d.expert_rows, d.shared_rows, d.hidden, 40
    )
    buffers = [v for v in vars(scratch).values() if not isinstance(v, int)]
    assert sum(b.size for b in buffers) == moe_chunk_scratch_bytes(
        d.experts, d.top_k, d.expert_rows, d.shared_rows, d.hidden, 40
    )
    weights = MoeWeights(**{n: wrap_quant_weight(device, *t) for n, t in layer(d).items()})
    x, out = float_buffer(device, 40 * d.hidden), float_buffer(device, 40 * d.hidden)
    graph = Graph()
    record_moe_chunk(graph, device, x, weights, d.top_k, scratch, out, 40)
    assert (graph.dispatch_count, graph.barrier_count + 1) == (11, 7)
    with pytest.raises(ValueError, match="scratch holds"):
        record_moe_chunk(Graph(), device, x, weights, d.top_k, scratch, out, 41)
    with pytest.raises(ValueError, match="differ from the scratch"):
        record_moe_chunk(Graph(), device, x, weights, d.top_k - 1, scratch, out, 40)
