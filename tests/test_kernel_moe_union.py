"""A verify pass's MoE over the union of its tokens' experts (`moe_route_union`,
`moe_gate_up_union` in `metal/moe.metal`): the routing and the union against numpy, the gate/up
over the union against the per-token kernel (bit for bit) and the float64 model, and the whole
block with `union` against the block without it, at ragged sizes: 1 to 9 tokens, top-1 to top-8,
16 to 256 experts, tokens that all choose the same experts and tokens whose experts are all
distinct, inputs and experts that are no multiple of a SIMD-group's stride."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, as_float32, float_buffer, run, sim_device
from test_kernel_moe import REAL, TINY, Dims, bind, check_gate_up, check_route, uint32s

from lily.device import Graph
from lily.engine import reference
from lily.kernels.moe import (
    MoeScratch,
    record_moe,
    record_moe_gate_up,
    record_moe_gate_up_union,
    record_moe_route_union,
    union_entries,
    union_words,
)
from lily.kernels.norm import FoldedNorm

# Sizes no multiple of the tiles: 192 inputs (a SIMD-group strides 1,024: most lanes idle),
# 40 experts (lanes hold 1 or 2 router logits), 192 expert rows (48 SIMD-groups). Expert rows
# are the down projection's inputs, so a multiple of its group of 64.
RAGGED = Dims(hidden=192, experts=40, top_k=8, expert_rows=192, shared_rows=64)
EPS = 1e-6


def read_union(buffer, experts: int, top_k: int, tokens: int) -> list[tuple[int, list[int]]]:
    words = uint32s(buffer, union_words(experts, top_k, tokens))
    entries, pairs = union_entries(experts, top_k, tokens), tokens * top_k
    union = []
    for u in range(int(words[0])):
        count = int(words[1 + entries + u])
        base = 1 + 2 * entries + u * pairs
        union.append((int(words[1 + u]), words[base : base + count].tolist()))
    return union


def run_route_union(device, logits: np.ndarray, top_k: int, normalize: bool = True):
    tokens, experts = logits.shape
    ids, weights = device.alloc(4 * tokens * top_k), float_buffer(device, tokens * top_k)
    union = device.alloc(4 * union_words(experts, top_k, tokens))
    run(
        device,
        lambda g: record_moe_route_union(
            g, device, device.wrap(logits), experts, top_k, ids, weights, union, normalize, tokens
        ),
    )
    return (
        uint32s(ids, tokens * top_k).reshape(tokens, top_k),
        as_float32(weights, tokens * top_k).reshape(tokens, top_k),
        read_union(union, experts, top_k, tokens),
    )


def logits_of(kind: str, tokens: int, experts: int, top_k: int) -> np.ndarray:
    rng = np.random.default_rng(tokens * experts + top_k)
    if kind == "random":
        return rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    if kind == "same experts":
        # Every token chooses the same top_k (its order and weights differ per token).
        logits = rng.normal(0, 1, (tokens, experts))
        logits[:, rng.permutation(experts)[:top_k]] += 20
        return logits.astype(np.float32)
    if kind == "nan row":
        # The last token's NaN logits choose the last expert in every round: its union entry has
        # top_k pairs, more than the tokens a gate/up SIMD-group reduces at a time.
        logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
        logits[-1] = np.nan
        return logits
    # "all distinct": token t's experts are a block of its own.
    assert tokens * top_k <= experts
    logits = rng.normal(0, 1, (tokens, experts))
    order = rng.permutation(experts)
    for t in range(tokens):
        logits[t, order[t * top_k : (t + 1) * top_k]] += 20
    return logits.astype(np.float32)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("tokens", range(1, 10))
@pytest.mark.parametrize(
    ("experts", "top_k", "kind"),
    [
        (256, 8, "random"),
        (256, 8, "all distinct"),
        (40, 8, "random"),
        (16, 4, "same experts"),
        (16, 1, "random"),
    ],
)
def test_route_union(lane_order, tokens, experts, top_k, kind):
    logits = logits_of(kind, tokens, experts, top_k)
    ids, weights, union = run_route_union(sim_device(lane_order), logits, top_k)
    for t in range(tokens):
        check_route(logits[t], top_k, ids[t], weights[t], True)
    assert union == reference.moe_expert_union(ids)
    distinct = {"all distinct": tokens * top_k, "same experts": top_k}.get(kind)
    if distinct is not None:
        assert len(union) == distinct


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_route_union_of_nan_logits_lists_every_pair(lane_order):
    """NaN logits make a token choose the last expert in every round: the union must still list
    each of those pairs, or their hidden rows would go unwritten."""
    d = TINY
    logits = np.random.default_rng(6).normal(0, 2, (3, d.experts)).astype(np.float32)
    logits[1] = np.nan
    ids, _, union = run_route_union(sim_device(lane_order), logits, d.top_k)
    assert ids.max() < d.experts
    assert union == reference.moe_expert_union(ids)
    assert sum(len(pairs) for _, pairs in union) == 3 * d.top_k


def gate_up_both_ways(device, dims: Dims, tokens: int, kind: str, normed: bool):
    """hidden from the union kernel and from the per-token kernel, for routing of `kind`; the
    shared expert's slot filled by the per-token kernel in both."""
    rng = np.random.default_rng(tokens)
    x = rng.normal(0, 1, (tokens, dims.hidden)).astype(np.float32)
    logits = logits_of(kind, tokens, dims.experts, dims.top_k)
    gain = rng.normal(1, 0.2, dims.hidden).astype(np.float32).view(np.uint32) >> 16
    norm = FoldedNorm(device.wrap(gain.astype(np.uint16)), EPS) if normed else None
    shape = (dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows)
    scratch = MoeScratch.allocate(device, *shape, tokens=tokens)
    width = dims.top_k * dims.expert_rows + dims.shared_rows
    over_union, per_token = (
        float_buffer(device, tokens * width),
        float_buffer(device, tokens * width),
    )
    w = bind(device, dims)
    x_ref = device.wrap(x)
    common = dict(x=x_ref, top_k=dims.top_k, w=w, norm=norm, tokens=tokens)

    def record(g):
        record_moe_route_union(
            g, device, device.wrap(logits), dims.experts, dims.top_k, scratch.expert_ids,
            scratch.expert_weights, scratch.expert_union, True, tokens,
        )  # fmt: skip
        g.barrier()
        shared = range(dims.top_k, dims.top_k + 1)
        for hidden in (over_union, per_token):
            record_moe_gate_up(g, device, **common, expert_ids=scratch.expert_ids,
                               hidden=hidden, slots=shared)  # fmt: skip
        record_moe_gate_up_union(
            g, device, x_ref, scratch.expert_union, dims.experts, dims.top_k, w, over_union,
            norm, tokens,
        )  # fmt: skip
        record_moe_gate_up(g, device, **common, expert_ids=scratch.expert_ids,
                           hidden=per_token, slots=range(dims.top_k))  # fmt: skip

    run(device, record)
    ids = uint32s(scratch.expert_ids, tokens * dims.top_k).reshape(tokens, dims.top_k)
    return (
        x,
        ids,
        as_float32(over_union, tokens * width).reshape(tokens, width),
        as_float32(per_token, tokens * width).reshape(tokens, width),
    )


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("dims", "tokens", "kind", "normed"),
    [
        (TINY, 5, "random", False),
        (TINY, 9, "same experts", True),
        (RAGGED, 1, "random", True),
        (RAGGED, 4, "all distinct", False),
        (RAGGED, 7, "random", True),
        (REAL, 3, "random", True),
        (TINY, 2, "nan row", True),
        (RAGGED, 3, "nan row", False),
    ],
    ids=[
        "tiny-5",
        "tiny-9-same",
        "ragged-1",
        "ragged-4-distinct",
        "ragged-7",
        "real-3",
        "tiny-2-nan",
        "ragged-3-nan",
    ],
)
def test_gate_up_over_the_union_is_the_per_token_kernels(lane_order, dims, tokens, kind, normed):
    """Every (token, slot)'s hidden row, bit for bit the per-token kernel's (so a verify pass's
    rows stay the decode step's), and within the float64 model's bound; also when NaN logits
    give an expert more pairs than there are tokens (reduced over several runs)."""
    device = sim_device(lane_order)
    x, ids, over_union, per_token = gate_up_both_ways(device, dims, tokens, kind, normed)
    np.testing.assert_array_equal(over_union, per_token)
    if not normed:
        for t in range(tokens):
            check_gate_up(dims, x[t].astype(np.float64), ids[t], over_union[t])


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("dims", "tokens"), [(TINY, 2), (TINY, 9), (RAGGED, 6), (REAL, 4)])
def test_moe_block_over_the_union_is_the_block_per_token(lane_order, dims, tokens):
    """The whole block as a verify pass records it (norm and residual add folded in): with the
    union, the same ids, weights, hidden rows and output, bit for bit."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (tokens, dims.hidden)).astype(np.float32)
    residual = rng.normal(0, 1, (tokens, dims.hidden)).astype(np.float32)
    gain = (rng.normal(1, 0.2, dims.hidden).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    norm = FoldedNorm(device.wrap(gain), EPS)
    shape = (dims.experts, dims.top_k, dims.expert_rows, dims.shared_rows)
    w = bind(device, dims)
    results = []
    for union in (False, True):
        scratch = MoeScratch.allocate(device, *shape, tokens=tokens)
        out = device.wrap(residual.copy())
        run(
            device,
            lambda g, scratch=scratch, out=out, union=union: record_moe(
                g, device, device.wrap(x), w, dims.top_k, scratch, out, norm=norm,
                accumulate=True, tokens=tokens, union=union,
            ),
        )  # fmt: skip
        width = dims.top_k * dims.expert_rows + dims.shared_rows
        results.append(
            (
                uint32s(scratch.expert_ids, tokens * dims.top_k),
                as_float32(scratch.expert_weights, tokens * dims.top_k),
                as_float32(scratch.hidden, tokens * width),
                as_float32(out, tokens * dims.hidden),
            )
        )
    for per_token, over_union in zip(*results, strict=True):
        np.testing.assert_array_equal(over_union, per_token)
    assert not np.array_equal(results[0][3], residual.ravel())  # the block added something


def test_the_union_takes_one_level_more():
    """With `union`, routing is a level of its own (one threadgroup, a SIMD-group per token) and
    the gate/up's grid covers the most distinct experts the tokens can have."""
    device = sim_device("forward")
    d, tokens = REAL, 4
    scratch = MoeScratch.allocate(
        device, d.experts, d.top_k, d.expert_rows, d.shared_rows, tokens=tokens
    )
    graph = Graph()
    x = device.wrap(np.zeros((tokens, d.hidden), np.float32))
    out = float_buffer(device, tokens * d.hidden)
    record_moe(graph, device, x, bind(device, d), d.top_k, scratch, out, tokens=tokens, union=True)
    layout = [(r.kernel, r.threadgroups, r.threads, r.level) for r in graph.dispatches]
    assert layout == [
        ("qgemv_tokens_8", (65, 1, 1), (32, 1, 1), 0),
        ("moe_gate_up_swiglu_4", (128, 1, 4), (32, 1, 1), 0),
        ("moe_route_union", (1, 1, 1), (128, 1, 1), 1),
        ("moe_gate_up_union_4", (64, 32, 1), (64, 1, 1), 2),
        ("moe_down_4", (512, 4, 1), (32, 1, 1), 3),
    ]


@pytest.mark.parametrize(
    ("top_k", "tokens", "message"),
    [(9, 2, "top_k <= 8"), (4, 10, "1 to 9 tokens"), (4, 0, "1 to 9 tokens")],
)
def test_route_union_refuses_what_it_cannot_hold(top_k, tokens, message):
    device = sim_device("forward")
    buffer = device.alloc(4 * 4096)
    with pytest.raises(ValueError, match=message):
        record_moe_route_union(Graph(), device, buffer, 16, top_k, buffer, buffer, buffer,
                               tokens=tokens)  # fmt: skip
