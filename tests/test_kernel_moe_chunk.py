"""The MoE block of a chunk of tokens (`metal/moe_chunk.metal` and `record_moe_chunk`) against
float64 numpy, and against decode's one-token block (`record_moe`) row by row.

- the sort must equal numpy's stable argsort of the expert ids exactly, including experts no
  token chose and one expert every token chose;
- SwiGLU: exp, a division and two multiplies, within 8 ulps of |silu(g) u|;
- combine: top_k + 1 products added in order, each within (top_k + 2) ulps of the sum of the
  terms' magnitudes, plus 4 ulps of the shared term for the sigmoid.
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
    run,
    sim_device,
)

from lily import reference
from lily.kernels.moe import record_moe_route
from lily.kernels.moe_chunk import record_moe_chunk_swiglu, record_moe_combine, record_moe_sort


def uint32s(buffer, count: int) -> np.ndarray:
    return buffer.numpy()[: 4 * count].view(np.uint32)


# -- the counting sort ----------------------------------------------------------------------------


def reference_sort(ids: np.ndarray, experts: int):
    """(expert_offsets, row_index, slot_of) of a stable sort of ids [T, top_k] by expert."""
    order = np.argsort(ids.ravel(), kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(ids.ravel(), minlength=experts))])
    slot_of = np.empty_like(order)
    slot_of[order] = np.arange(order.size)
    return offsets, order // ids.shape[1], slot_of


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
    # Router logits crafted so that one expert tops every token: the sort sees all T tokens in one
    # expert, in token order, at a different k each time since that expert is always rank 0.
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


def reference_combine(down, slot_of, weights, shared_logit, shared_down):
    routed = np.einsum("tk,tkh->th", weights, down[slot_of])
    gate = reference.sigmoid(shared_logit)[:, None]
    magnitude = np.einsum("tk,tkh->th", np.abs(weights), np.abs(down[slot_of]))
    return routed + gate * shared_down, magnitude + gate * np.abs(shared_down), gate * shared_down


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
