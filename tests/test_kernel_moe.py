"""The MoE kernels (`metal/moe.metal`) against float64 numpy, at the real dims (256 experts,
top-8, expert and shared size 512, hidden 2048) and the tiny config's (16 experts, top-4, expert
64, shared 128, hidden 128).

Error bounds follow the fp32 arithmetic of each kernel:
- routing: exp, a sum of at most 256 terms and a division, within 16 + experts/8 ulps of each
  weight; the chosen ids must be exactly numpy's (stable sort: ties to the lowest id);
- gate/up: each GEMV within ulps_for(in_dim) of its magnitude (see test_kernel_quantized.py),
  propagated through silu(g) * u (|silu'| < 1.1), plus 8 ulps of |h| for exp, divide, multiplies;
- down: each chunk's dot within (chunk + 3) ulps, one more for the router weight, the lane's
  chunks, and up to 31 for the SIMD-group sum, all times the router-weighted magnitudes.
The whole block is checked stage by stage on the kernels' own intermediate buffers, so each stage
keeps its tight bound, and its expert choice against the float64 reference end to end.
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
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)
from test_kernel_quantized import ulps_for

from lily.device import Graph
from lily.engine import reference
from lily.kernels.moe import (
    InKernelRouting,
    MoeScratch,
    MoeWeights,
    record_moe,
    record_moe_down,
    record_moe_gate_up,
    record_moe_route,
)
from lily.kernels.quant_weight import wrap_quant_weight


@dataclass(frozen=True)
class Dims:
    hidden: int
    experts: int
    top_k: int
    expert_rows: int
    shared_rows: int


REAL = Dims(hidden=2048, experts=256, top_k=8, expert_rows=512, shared_rows=512)
TINY = Dims(hidden=128, experts=16, top_k=4, expert_rows=64, shared_rows=128)


@functools.cache
def layer(dims: Dims) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random MoE weights of one layer, as MLX-quantized triples (router gates 8-bit)."""
    rng = np.random.default_rng(dims.experts)
    d = dims
    return {
        "router": random_quantized(rng, d.experts, d.hidden, 8),
        "shared_expert_gate": random_quantized(rng, 1, d.hidden, 8),
        "expert_gate": random_quantized(rng, d.expert_rows, d.hidden, 4, experts=d.experts),
        "expert_up": random_quantized(rng, d.expert_rows, d.hidden, 4, experts=d.experts),
        "expert_down": random_quantized(rng, d.hidden, d.expert_rows, 4, experts=d.experts),
        "shared_gate": random_quantized(rng, d.shared_rows, d.hidden, 4),
        "shared_up": random_quantized(rng, d.shared_rows, d.hidden, 4),
        "shared_down": random_quantized(rng, d.hidden, d.shared_rows, 4),
    }


def bind(device, dims: Dims) -> MoeWeights:
    return MoeWeights(**{name: wrap_quant_weight(device, *t) for name, t in layer(dims).items()})


def expert(triple, e: int | None):
    return triple if e is None else tuple(a[e] for a in triple)


def uint32s(buffer, count: int) -> np.ndarray:
    return buffer.numpy()[: 4 * count].view(np.uint32)


# -- routing --------------------------------------------------------------------------------------


def check_route(logits: np.ndarray, top_k: int, ids: np.ndarray, weights: np.ndarray, normalize):
    expected_ids, expected_weights = reference.moe_route(
        logits.astype(np.float64), top_k, normalize
    )
    np.testing.assert_array_equal(ids, expected_ids)
    ulps = 16 + len(logits) / 8
    assert_within(weights, expected_weights, ulps * FLOAT32_EPS * expected_weights)


def run_route(device, logits: np.ndarray, top_k: int, normalize: bool = True):
    ids, weights = device.alloc(4 * top_k), float_buffer(device, top_k)
    run(
        device,
        lambda g: record_moe_route(
            g, device, device.wrap(logits), len(logits), top_k, ids, weights, normalize
        ),
    )
    return uint32s(ids, top_k), as_float32(weights, top_k)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
@pytest.mark.parametrize("normalize", [True, False])
def test_route(lane_order, dims, normalize):
    device = sim_device(lane_order)
    logits = np.random.default_rng(dims.experts).normal(0, 2, dims.experts).astype(np.float32)
    ids, weights = run_route(device, logits, dims.top_k, normalize)
    check_route(logits, dims.top_k, ids, weights, normalize)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("experts", [256, 16, 40])
def test_route_ties_go_to_the_lowest_expert(lane_order, experts):
    # Few distinct values, so the top-k crosses many ties held by different lanes.
    logits = np.random.default_rng(1).integers(-2, 3, experts).astype(np.float32)
    ids, weights = run_route(sim_device(lane_order), logits, 8)
    check_route(logits, 8, ids, weights, True)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("nan_experts", ["all", "some"])
def test_route_of_nan_logits_stays_within_the_experts(lane_order, nan_experts):
    """NaN router logits (from a broken activation) have no argmax; the ids must still name
    experts of the layer, or the expert GEMVs would read outside the stacked tensors."""
    logits = np.random.default_rng(5).normal(0, 2, TINY.experts).astype(np.float32)
    logits[:: 1 if nan_experts == "all" else 3] = np.nan
    ids, _ = run_route(sim_device(lane_order), logits, TINY.top_k)
    assert ids.max() < TINY.experts, ids


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_moe_block_of_a_nan_activation_reads_only_its_weights(lane_order):
    """The whole block on a NaN input: every access stays in bounds (the checking sim raises
    otherwise) and the NaN reaches the output instead of being hidden."""
    device = sim_device(lane_order)
    dims = TINY
    x = np.full(dims.hidden, np.nan, dtype=np.float32)
    scratch = MoeScratch.allocate(
        device, dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows
    )
    out = float_buffer(device, dims.hidden)
    weights = bind(device, dims)
    run(device, lambda g: record_moe(g, device, device.wrap(x), weights, dims.top_k, scratch, out))
    assert uint32s(scratch.expert_ids, dims.top_k).max() < dims.experts
    assert np.isnan(as_float32(out, dims.hidden)).all()


# -- gate/up with SwiGLU --------------------------------------------------------------------------


def check_gate_up(
    dims: Dims, x: np.ndarray, ids: np.ndarray, hidden: np.ndarray, relative: float = 0.0
):
    """`relative`: a further error bound relative to |h| (a folded norm's inverse RMS)."""
    w = layer(dims)
    ulps = ulps_for(dims.hidden, 4) * FLOAT32_EPS
    slots = [(e, "expert_gate", "expert_up", dims.expert_rows) for e in ids]
    slots.append((None, "shared_gate", "shared_up", dims.shared_rows))
    start = 0
    for e, gate_name, up_name, rows in slots:
        g, g_mag = reference_qgemv(*expert(w[gate_name], e), 4, x)
        u, u_mag = reference_qgemv(*expert(w[up_name], e), 4, x)
        h = reference.silu(g) * u
        dg, du = ulps * g_mag, ulps * u_mag
        bound = 1.1 * dg * np.abs(u) + np.abs(reference.silu(g)) * du + dg * du
        bound += (8 * FLOAT32_EPS + relative) * np.abs(h)
        assert_within(hidden[start : start + rows], h, bound)
        start += rows


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_gate_up_swiglu(lane_order, dims):
    device = sim_device(lane_order)
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, dims.hidden).astype(np.float32)
    # The last expert and the first among them, to check the stacked-tensor strides.
    ids = np.concatenate(
        [[dims.experts - 1, 0], rng.permutation(dims.experts - 2)[: dims.top_k - 2] + 1]
    )
    ids = ids.astype(np.uint32)
    hidden = float_buffer(device, dims.top_k * dims.expert_rows + dims.shared_rows)
    weights = bind(device, dims)
    run(
        device,
        lambda g: record_moe_gate_up(
            g, device, device.wrap(x), device.wrap(ids), dims.top_k, weights, hidden
        ),
    )
    total = dims.top_k * dims.expert_rows + dims.shared_rows
    check_gate_up(dims, x.astype(np.float64), ids, as_float32(hidden, total))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_gate_up_split_into_slot_runs_is_bit_identical(lane_order, dims):
    """The decode step runs the shared expert's slot and the routed slots as two dispatches: the
    same code per slot, so together they write exactly what one dispatch of every slot does."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(9)
    x = device.wrap(rng.normal(0, 1, dims.hidden).astype(np.float32))
    ids = device.wrap(rng.permutation(dims.experts)[: dims.top_k].astype(np.uint32))
    total = dims.top_k * dims.expert_rows + dims.shared_rows
    weights = bind(device, dims)
    whole, split = float_buffer(device, total), float_buffer(device, total)
    run(device, lambda g: record_moe_gate_up(g, device, x, ids, dims.top_k, weights, whole))

    def runs(g):
        for slots in (range(dims.top_k, dims.top_k + 1), range(dims.top_k)):
            record_moe_gate_up(g, device, x, ids, dims.top_k, weights, split, slots=slots)

    run(device, runs)
    np.testing.assert_array_equal(as_float32(split, total), as_float32(whole, total))


@pytest.mark.parametrize(
    "slots, routed, message",
    [
        (range(0, 6), False, "slots must be a run"),
        (range(2, 2), False, "slots must be a run"),
        (range(0, 5, 2), False, "slots must be a run"),
        (range(1, 4), True, "needs slot 0"),
    ],
)
def test_gate_up_refuses_slot_runs_it_cannot_serve(slots, routed, message):
    device = sim_device("forward")
    d = TINY
    x = device.wrap(np.zeros(d.hidden, np.float32))
    scratch = MoeScratch.allocate(device, d.experts, d.top_k, d.expert_rows, d.shared_rows)
    routing = InKernelRouting(scratch.logits, d.experts, scratch.expert_weights)
    with pytest.raises(ValueError, match=message):
        record_moe_gate_up(
            Graph(),
            device,
            x,
            scratch.expert_ids,
            d.top_k,
            bind(device, d),
            scratch.hidden,
            routing=routing if routed else None,
            slots=slots,
        )


# -- down, weighted, with the shared expert -------------------------------------------------------


def check_down(dims, hidden, ids, weights, shared_logit, out, slack=0.0):
    """`slack`: a further absolute error bound (a residual add's rounding)."""
    w = layer(dims)
    chunk = 32
    chunks_per_lane = -(-dims.top_k * dims.expert_rows // (32 * chunk)) + -(
        -dims.shared_rows // (32 * chunk)
    )
    ulps = (chunk + 5 + chunks_per_lane + 31) * FLOAT32_EPS
    h = hidden.astype(np.float64)
    expected = np.zeros(dims.hidden)
    magnitude = np.zeros(dims.hidden)
    for slot, e in enumerate(ids):
        inputs = h[slot * dims.expert_rows : (slot + 1) * dims.expert_rows]
        y, mag = reference_qgemv(*expert(w["expert_down"], e), 4, inputs)
        expected += float(weights[slot]) * y
        magnitude += abs(float(weights[slot])) * mag
    gate = float(reference.sigmoid(np.float64(shared_logit)))
    y, mag = reference_qgemv(*w["shared_down"], 4, h[dims.top_k * dims.expert_rows :])
    expected += gate * y
    magnitude += gate * mag
    assert_within(out, expected, ulps * magnitude + 4 * FLOAT32_EPS * gate * np.abs(y) + slack)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_down_combine(lane_order, dims):
    device = sim_device(lane_order)
    rng = np.random.default_rng(3)
    total = dims.top_k * dims.expert_rows + dims.shared_rows
    hidden = rng.normal(0, 1, total).astype(np.float32)
    ids = rng.permutation(dims.experts)[: dims.top_k].astype(np.uint32)
    ids[0] = dims.experts - 1
    weights = rng.dirichlet(np.ones(dims.top_k)).astype(np.float32)
    shared_logit = np.array([0.7], dtype=np.float32)
    out = float_buffer(device, dims.hidden)
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
        ),
    )
    check_down(dims, hidden, ids, weights, shared_logit[0], as_float32(out, dims.hidden))


# -- the whole block ------------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("dims", [REAL, TINY], ids=["real", "tiny"])
def test_moe_block(lane_order, dims):
    device = sim_device(lane_order)
    x = np.random.default_rng(4).normal(0, 1, dims.hidden).astype(np.float32)
    scratch = MoeScratch.allocate(
        device, dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows
    )
    out = float_buffer(device, dims.hidden)
    weights = bind(device, dims)
    run(device, lambda g: record_moe(g, device, device.wrap(x), weights, dims.top_k, scratch, out))

    x64 = x.astype(np.float64)
    w = layer(dims)
    logits = as_float32(scratch.logits, dims.experts + 1)
    for start, name in ((0, "router"), (dims.experts, "shared_expert_gate")):
        expected, magnitude = reference_qgemv(*w[name], 8, x64)
        assert_within(
            logits[start : start + len(expected)],
            expected,
            ulps_for(dims.hidden, 8) * FLOAT32_EPS * magnitude,
        )
    ids = uint32s(scratch.expert_ids, dims.top_k)
    weights_out = as_float32(scratch.expert_weights, dims.top_k)
    check_route(logits[: dims.experts], dims.top_k, ids, weights_out, True)
    # The float64 model picks the same experts (no near-ties in these logits).
    reference_ids, _ = reference.moe_route(
        reference_qgemv(*w["router"], 8, x64)[0], dims.top_k, True
    )
    np.testing.assert_array_equal(ids, reference_ids)

    total = dims.top_k * dims.expert_rows + dims.shared_rows
    hidden = as_float32(scratch.hidden, total)
    check_gate_up(dims, x64, ids, hidden)
    check_down(dims, hidden, ids, weights_out, logits[dims.experts], as_float32(out, dims.hidden))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("dims", "tokens"), [(TINY, 9), (REAL, 3)], ids=["tiny-9", "real-3"])
def test_moe_block_of_a_few_tokens_is_each_tokens_block(lane_order, dims, tokens):
    """A verify pass's tokens through the same kernels, token by token: every token's routing,
    hidden activations and output are, bit for bit, those of the block run on it alone (whose
    agreement with the float64 model test_moe_block checks)."""
    device = sim_device(lane_order)
    x = np.random.default_rng(5).normal(0, 1, (tokens, dims.hidden)).astype(np.float32)
    shape = (dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows)
    scratch = MoeScratch.allocate(device, *shape, tokens=tokens)
    out = float_buffer(device, tokens * dims.hidden)
    weights = bind(device, dims)
    run(
        device,
        lambda g: record_moe(
            g, device, device.wrap(x), weights, dims.top_k, scratch, out, tokens=tokens
        ),
    )
    hidden_width = dims.top_k * dims.expert_rows + dims.shared_rows
    all_ids = uint32s(scratch.expert_ids, tokens * dims.top_k).reshape(tokens, dims.top_k)
    all_hidden = as_float32(scratch.hidden, tokens * hidden_width).reshape(tokens, -1)
    all_out = as_float32(out, tokens * dims.hidden).reshape(tokens, dims.hidden)
    for n in range(tokens):
        alone = MoeScratch.allocate(device, *shape)
        one = float_buffer(device, dims.hidden)
        row = device.wrap(x[n].copy())
        run(
            device,
            lambda g, row=row, alone=alone, one=one: record_moe(
                g, device, row, weights, dims.top_k, alone, one
            ),
        )
        np.testing.assert_array_equal(all_ids[n], uint32s(alone.expert_ids, dims.top_k))
        np.testing.assert_array_equal(all_hidden[n], as_float32(alone.hidden, hidden_width))
        np.testing.assert_array_equal(all_out[n], as_float32(one, dims.hidden))
    # The tokens did not all choose the same experts: the per-token indexing was exercised.
    assert len({tuple(ids) for ids in all_ids}) > 1


def test_moe_block_refuses_more_tokens_than_its_scratch():
    device = sim_device("forward")
    d = TINY
    scratch = MoeScratch.allocate(device, d.experts, d.top_k, d.expert_rows, d.shared_rows)
    x = device.wrap(np.zeros((2, d.hidden), np.float32))
    with pytest.raises(ValueError, match="holds 1 to 1 tokens"):
        record_moe(
            Graph(), device, x, bind(device, d), d.top_k, scratch,
            float_buffer(device, 2 * d.hidden), tokens=2,
        )  # fmt: skip


# -- grid shapes ----------------------------------------------------------------------------------


def test_real_dims_grids_have_many_threadgroups_per_core():
    """At the real dims both kernels run one SIMD-group (4 rows) per threadgroup: gate/up as
    128 x 9 threadgroups (28.8 per core of a 40-core GPU, not 64 x 9 = 14.4) and down as 512
    (12.8 per core, not 256 = 6.4, whose last round would run 40% full)."""
    device = sim_device("forward")
    d = REAL
    w = bind(device, d)
    x = device.wrap(np.zeros(d.hidden, np.float32))
    scratch = MoeScratch.allocate(device, d.experts, d.top_k, d.expert_rows, d.shared_rows)
    graph = Graph()
    record_moe_gate_up(graph, device, x, scratch.expert_ids, d.top_k, w, scratch.hidden)
    record_moe_down(
        graph,
        device,
        scratch.hidden,
        scratch.expert_ids,
        scratch.expert_weights,
        scratch.logits,
        d.top_k,
        w,
        float_buffer(device, d.hidden),
    )
    gate_up, down = graph.dispatches
    assert (gate_up.threadgroups, gate_up.threads) == ((128, 9, 1), (32, 1, 1))
    assert (down.threadgroups, down.threads) == ((512, 1, 1), (32, 1, 1))


def test_the_shared_expert_runs_beside_the_router():
    """In the block, the shared expert's gate/up (no routing needed) shares the router's level,
    and the routed experts' gate/up and the down kernel follow it, one level each."""
    device = sim_device("forward")
    d = REAL
    scratch = MoeScratch.allocate(device, d.experts, d.top_k, d.expert_rows, d.shared_rows)
    graph = Graph()
    x = device.wrap(np.zeros(d.hidden, np.float32))
    record_moe(graph, device, x, bind(device, d), d.top_k, scratch, float_buffer(device, d.hidden))
    layout = [(r.kernel, r.threadgroups, r.level) for r in graph.dispatches]
    assert layout == [
        ("qgemv_8_float", (65, 1, 1), 0),  # router and shared-expert gate: 257 rows
        ("moe_gate_up_swiglu_4", (128, 1, 1), 0),  # the shared expert's 512 rows
        ("moe_gate_up_swiglu_routed_4", (128, 8, 1), 1),
        ("moe_down_4", (512, 1, 1), 2),
    ]
