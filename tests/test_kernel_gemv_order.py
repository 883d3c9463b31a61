"""The GEMV-shaped kernels (`qgemv*`, `moe_gate_up_swiglu*`, `moe_down`) bit for bit against a
float32 numpy model of the exact order in which they add on the sim.

The other kernel tests bound the error against float64; these pin the order itself, so a change
to how the kernels load x or walk their rows (vector loads, constant trip counts) is shown to
change no rounding at all. The model, per row:
- lane l owns chunks l, l + 32, ... of `128 / bits` inputs (one 16-byte load of codes each);
- per chunk, xsum = x_0 + x_1 + ... and dot = code_0 x_0 + code_1 x_1 + ..., left to right, and
  the chunk's term is scale * dot + bias * xsum (each product and sum rounded to float32; the sim
  is built without fused multiply-adds);
- a lane adds its terms in chunk order, and simd_sum adds the lanes in lane order (the sim's
  reduction order; a GPU may reduce in another order, which is why the other tests use bounds);
- a folded norm feeds x * gain and scales the sum by 1 / sqrt(sum(x^2) / in_dim + eps), where
  each lane sums its own x^2 in the same walk.
The gate/up kernel's silu uses the C library's expf, as the sim's `exp` does, so the model calls
the same function.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    float_buffer,
    random_bf16,
    random_quantized,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32, unpack_codes
from lily.device import Graph
from lily.kernels.moe import MoeWeights, record_moe_down, record_moe_gate_up
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized import record_qgemv

F32 = np.float32
LANES = 32


def chunk_terms(triple, bits: int, x: np.ndarray) -> np.ndarray:
    """[rows, chunks]: scale * (codes . x) + bias * sum(x) per chunk, in the kernel's order."""
    words, scales, biases = triple
    chunk = 128 // bits
    x_chunks = x.astype(F32).reshape(-1, chunk)
    codes = unpack_codes(words, bits).astype(F32).reshape(words.shape[0], -1, chunk)
    xsum = np.zeros(x_chunks.shape[0], F32)
    dot = np.zeros(codes.shape[:2], F32)
    for i in range(chunk):
        xsum = xsum + x_chunks[:, i]
        dot = dot + codes[:, :, i] * x_chunks[:, i]
    group = np.arange(x_chunks.shape[0]) * chunk // 64
    scale = bf16_to_float32(scales)[:, group]
    bias = bf16_to_float32(biases)[:, group]
    return scale * dot + bias * xsum


def lane_walk(terms: np.ndarray) -> np.ndarray:
    """[rows, 32]: each lane's running sum of its chunks' terms (chunks l, l + 32, ...)."""
    acc = np.zeros((terms.shape[0], LANES), F32)
    for c in range(terms.shape[1]):
        acc[:, c % LANES] = acc[:, c % LANES] + terms[:, c]
    return acc


def simd_sum(per_lane: np.ndarray) -> np.ndarray:
    """The sum over the last axis (the 32 lanes), left to right."""
    total = per_lane[..., 0]
    for lane in range(1, LANES):
        total = total + per_lane[..., lane]
    return total


def folded_scale(x: np.ndarray, bits: int, eps: float) -> F32:
    """1 / sqrt(mean(x^2) + eps), each lane summing the squares of its chunks first."""
    chunk = 128 // bits
    squares = (x.astype(F32) * x.astype(F32)).reshape(-1, chunk)
    per_lane = np.zeros(LANES, F32)
    for c in range(squares.shape[0]):
        for i in range(chunk):
            per_lane[c % LANES] = per_lane[c % LANES] + squares[c, i]
    mean = simd_sum(per_lane) / F32(x.size)
    return F32(1) / np.sqrt(mean + F32(eps))


def model_qgemv(triple, bits: int, x: np.ndarray, gain=None, eps: float = 0.0) -> np.ndarray:
    """y = W x (or W rms_norm(x) with a bf16 `gain`), as the qgemv kernels add it up."""
    if gain is None:
        return simd_sum(lane_walk(chunk_terms(triple, bits, x)))
    gained = x.astype(F32) * bf16_to_float32(gain)
    return simd_sum(lane_walk(chunk_terms(triple, bits, gained))) * folded_scale(x, bits, eps)


_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.expf.restype = ctypes.c_float
_libm.expf.argtypes = [ctypes.c_float]


def model_silu(x: np.ndarray) -> np.ndarray:
    """x * (1 / (1 + exp(-x))) with the C library's expf, as common.h's silu on the sim."""
    e = np.array([_libm.expf(float(-v)) for v in x], F32)
    return x * (F32(1) / (F32(1) + e))


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype == F32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


# -- qgemv --------------------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "in_dim", "bits", "dtype"),
    [
        (96, 2048, 4, "float32"),
        (40, 4096, 4, "bfloat16"),
        (37, 1088, 4, "float32"),  # ragged: rows not a multiple of 4, lanes left idle
        (13, 192, 4, "bfloat16"),
        (29, 1600, 8, "float32"),
        (1, 2048, 8, "bfloat16"),  # one row: every SIMD-group slot past the first is surplus
    ],
)
def test_qgemv_adds_in_the_model_order(lane_order, rows, in_dim, bits, dtype):
    rng = np.random.default_rng(rows + in_dim)
    device = sim_device(lane_order)
    triple = random_quantized(rng, rows, in_dim, bits)
    if dtype == "bfloat16":
        x_bound = random_bf16(rng, in_dim)
        x = bf16_to_float32(x_bound)
    else:
        x_bound = x = rng.normal(0, 1, in_dim).astype(F32)
    out = float_buffer(device, rows)
    weight = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_qgemv(g, device, device.wrap(x_bound), [(weight, out)], dtype))
    assert_bits_equal(as_float32(out, rows), model_qgemv(triple, bits, x))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(("rows", "in_dim", "bits"), [(64, 2048, 4), (13, 192, 4), (9, 2048, 8)])
def test_normed_accumulating_qgemv_adds_in_the_model_order(lane_order, rows, in_dim, bits):
    rng = np.random.default_rng(rows * in_dim)
    device = sim_device(lane_order)
    triple = random_quantized(rng, rows, in_dim, bits)
    x = rng.normal(0, 2, in_dim).astype(F32)
    gain = random_bf16(rng, in_dim, 0.3, 1.0)
    start = rng.normal(0, 1, rows).astype(F32)
    out = device.wrap(start.copy())
    weight = wrap_quant_weight(device, *triple)
    norm = FoldedNorm(device.wrap(gain), 1e-6)
    run(
        device,
        lambda g: record_qgemv(
            g, device, device.wrap(x), [(weight, out)], norm=norm, accumulate=True
        ),
    )
    expected = start + model_qgemv(triple, bits, x, gain, 1e-6)
    assert_bits_equal(as_float32(out, rows), expected)


# -- MoE gate/up and down -----------------------------------------------------------------------

EXPERTS, TOP_K = 6, 3


@dataclass(frozen=True)
class MoeDims:
    hidden: int
    expert_rows: int
    shared_rows: int
    threads: int  # per threadgroup, as gemv_simdgroups chooses for the kernel under test


# The gate/up kernel at its real row count (one SIMD-group per threadgroup) and with enough
# rows for two; the down kernel likewise (its rows are the hidden size).
GATE_UP_DIMS = [MoeDims(2048, 256, 512, 32), MoeDims(64, 2048, 512, 64)]
DOWN_DIMS = [MoeDims(2048, 256, 512, 32), MoeDims(8192, 64, 128, 64)]


def moe_layer(rng: np.random.Generator, d: MoeDims):
    return {
        "router": random_quantized(rng, EXPERTS, d.hidden, 8),
        "shared_expert_gate": random_quantized(rng, 1, d.hidden, 8),
        "expert_gate": random_quantized(rng, d.expert_rows, d.hidden, 4, experts=EXPERTS),
        "expert_up": random_quantized(rng, d.expert_rows, d.hidden, 4, experts=EXPERTS),
        "expert_down": random_quantized(rng, d.hidden, d.expert_rows, 4, experts=EXPERTS),
        "shared_gate": random_quantized(rng, d.shared_rows, d.hidden, 4),
        "shared_up": random_quantized(rng, d.shared_rows, d.hidden, 4),
        "shared_down": random_quantized(rng, d.hidden, d.shared_rows, 4),
    }


def expert_of(triple, e: int):
    return tuple(a[e] for a in triple)


def run_one_dispatch(device, record: Callable[[Graph], None], threads: int) -> None:
    """Records one dispatch, checks its threadgroup size, and runs it."""
    graph = Graph()
    record(graph)
    (dispatch,) = graph.dispatches
    assert dispatch.threads == (threads, 1, 1)
    device.run(graph)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("dims", GATE_UP_DIMS, ids=lambda d: f"{d.threads}threads")
def test_moe_gate_up_adds_in_the_model_order(lane_order, normed, dims):
    rng = np.random.default_rng(7)
    device = sim_device(lane_order)
    layer = moe_layer(rng, dims)
    weights = MoeWeights(**{k: wrap_quant_weight(device, *t) for k, t in layer.items()})
    x = rng.normal(0, 1, dims.hidden).astype(F32)
    gain = random_bf16(rng, dims.hidden, 0.3, 1.0)
    ids = np.array([4, 1, 4], np.uint32)  # a repeated expert reads the same rows twice
    norm = FoldedNorm(device.wrap(gain), 1e-6) if normed else None
    total = TOP_K * dims.expert_rows + dims.shared_rows
    hidden = float_buffer(device, total)
    run_one_dispatch(
        device,
        lambda g: record_moe_gate_up(
            g, device, device.wrap(x), device.wrap(ids), TOP_K, weights, hidden, norm
        ),
        dims.threads,
    )
    expected = []
    pairs = [(expert_of(layer["expert_gate"], e), expert_of(layer["expert_up"], e)) for e in ids]
    for gate, up in [*pairs, (layer["shared_gate"], layer["shared_up"])]:
        if normed:
            g, u = (model_qgemv(m, 4, x, gain, 1e-6) for m in (gate, up))
        else:
            g, u = (model_qgemv(m, 4, x) for m in (gate, up))
        expected.append(model_silu(g) * u)
    assert_bits_equal(as_float32(hidden, total), np.concatenate(expected))


def model_moe_down(layer, ids, weights, shared_weight, hidden, expert_rows: int):
    """Each lane adds its routed chunks (across the concatenated expert inputs), then its
    shared-expert chunks, every term scaled by its router weight first."""
    routed = [
        weights[slot] * chunk_terms(expert_of(layer["expert_down"], e), 4, part)
        for slot, (e, part) in enumerate(
            zip(ids, hidden[: TOP_K * expert_rows].reshape(TOP_K, -1), strict=True)
        )
    ]
    shared = shared_weight * chunk_terms(layer["shared_down"], 4, hidden[TOP_K * expert_rows :])
    acc = lane_walk(np.concatenate(routed, axis=1))
    for c in range(shared.shape[1]):
        acc[:, c % LANES] = acc[:, c % LANES] + shared[:, c]
    return simd_sum(acc)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("dims", DOWN_DIMS, ids=lambda d: f"{d.threads}threads")
def test_moe_down_adds_in_the_model_order(lane_order, accumulate, dims):
    rng = np.random.default_rng(8)
    device = sim_device(lane_order)
    layer = moe_layer(rng, dims)
    weights = MoeWeights(**{k: wrap_quant_weight(device, *t) for k, t in layer.items()})
    total = TOP_K * dims.expert_rows + dims.shared_rows
    hidden = rng.normal(0, 1, total).astype(F32)
    ids = np.array([2, 5, 2], np.uint32)
    router_weights = rng.uniform(0.1, 0.5, TOP_K).astype(F32)
    # sigmoid(0) = 1 / (1 + exp(0)) is exactly 0.5 whatever the C library's exp.
    shared_logit = np.zeros(1, F32)
    start = rng.normal(0, 1, dims.hidden).astype(F32)
    out = device.wrap(start.copy()) if accumulate else float_buffer(device, dims.hidden)
    run_one_dispatch(
        device,
        lambda g: record_moe_down(
            g,
            device,
            device.wrap(hidden),
            device.wrap(ids),
            device.wrap(router_weights),
            device.wrap(shared_logit),
            TOP_K,
            weights,
            out,
            accumulate,
        ),
        dims.threads,
    )
    expected = model_moe_down(layer, ids, router_weights, F32(0.5), hidden, dims.expert_rows)
    if accumulate:
        expected = start + expected
    assert_bits_equal(as_float32(out, dims.hidden), expected)
