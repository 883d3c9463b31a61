"""The quantized GEMV (`metal/quantized_gemv.metal`) against float64 numpy on the sim.

Error bound: each lane sums one chunk of `c` code*x products (c = 32 inputs at 4 bits, 16 at 8),
applies scale and bias (3 roundings), adds its chunks (in_dim / (32 c) of them), and the SIMD-group
sum adds at most 31 more roundings; so the fp32 result is within (c + 3 + in_dim/(32 c) + 31)
float32 ulps of the magnitude |scale| sum|code x| + |bias| sum|x| summed over groups.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import (
    LANE_ORDERS,
    as_float32,
    assert_within_ulps,
    float_buffer,
    random_bf16,
    random_quantized,
    reference_qgemv,
    run,
    sim_device,
)

from lily.checkpoint.quant import bf16_to_float32
from lily.device import Graph
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import QuantWeight, wrap_quant_weight
from lily.kernels.quantized import record_qgemv


def ulps_for(in_dim: int, bits: int) -> float:
    chunk = 128 // bits
    return chunk + 3 + in_dim / (32 * chunk) + 31


def random_input(rng: np.random.Generator, in_dim: int, dtype: str):
    """(array to bind, its values as float64)."""
    if dtype == "bfloat16":
        bits = random_bf16(rng, in_dim)
        return bits, bf16_to_float32(bits).astype(np.float64)
    x = rng.normal(0, 1, in_dim).astype(np.float32)
    return x, x.astype(np.float64)


def check_qgemv(lane_order: str, rows: int, in_dim: int, bits: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    device = sim_device(lane_order)
    triple = random_quantized(rng, rows, in_dim, bits)
    x, x64 = random_input(rng, in_dim, dtype)
    out = float_buffer(device, rows)
    weight = wrap_quant_weight(device, *triple)
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), [(weight, out)], x_dtype=dtype))
    expected, magnitude = reference_qgemv(*triple, bits, x64)
    assert_within_ulps(as_float32(out, rows), expected, magnitude, ulps_for(in_dim, bits))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "in_dim", "bits", "dtype"),
    [
        (8192, 2048, 4, "float32"),  # GDN in_proj_qkv, attention q_proj
        (2048, 4096, 4, "bfloat16"),  # GDN out_proj
        (256, 2048, 8, "float32"),  # MoE router
        (1, 2048, 8, "bfloat16"),  # shared-expert gate
    ],
)
def test_qgemv_real_sizes(lane_order, rows, in_dim, bits, dtype):
    check_qgemv(lane_order, rows, in_dim, bits, dtype)


# The 248320 x 2048 lm_head size runs once, through the lm_head path (test_kernel_lm_head.py).


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("rows", "in_dim", "bits"),
    [(1, 64, 4), (13, 192, 4), (37, 1088, 4), (5, 64, 8), (29, 1600, 8), (9, 4160, 8)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qgemv_ragged_sizes(lane_order, rows, in_dim, bits, dtype):
    check_qgemv(lane_order, rows, in_dim, bits, dtype, seed=rows)


def check_multi_projection(lane_order: str, in_dim: int, rows: list[int], bits: int = 4):
    """Several projections in one dispatch, each bound at its byte offset inside one shared
    weight blob (as in a checkpoint shard) and writing at its offset inside one output buffer."""
    rng = np.random.default_rng(len(rows) * in_dim)
    device = sim_device(lane_order)
    triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
    # Tensors start on 16-byte boundaries, as in an aligned checkpoint shard.
    pieces, offsets, offset = [], [], 0
    for array in (a for triple in triples for a in triple):
        offsets.append(offset)
        padded = -(-array.nbytes // 16) * 16
        pieces.append(np.pad(array.view(np.uint8).ravel(), (0, padded - array.nbytes)))
        offset += padded
    blob_buffer = device.wrap(np.concatenate(pieces))
    out = float_buffer(device, sum(rows))
    x, x64 = random_input(rng, in_dim, "float32")

    projections, out_offset = [], 0
    for i, r in enumerate(rows):
        refs = [(blob_buffer, offsets[3 * i + j]) for j in range(3)]
        projections.append(
            (QuantWeight(*refs, rows=r, in_dim=in_dim, bits=bits), (out, out_offset))
        )
        out_offset += 4 * r
    run(device, lambda g: record_qgemv(g, device, device.wrap(x), projections))

    result = as_float32(out, sum(rows))
    start = 0
    for triple, r in zip(triples, rows, strict=True):
        expected, magnitude = reference_qgemv(*triple, bits, x64)
        assert_within_ulps(result[start : start + r], expected, magnitude, ulps_for(in_dim, bits))
        start += r


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_multi_projection_gdn_in_proj_real(lane_order):
    check_multi_projection(lane_order, 2048, [8192, 4096, 32, 32])  # qkv | z | b | a


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    "rows",
    [
        [1024, 512, 4, 4],  # tiny GDN: 2 key heads, 4 value heads of 128
        [2048, 512, 512],  # tiny attention q|k|v: 4 heads x (query, gate) x 256, 2 kv heads
        [128, 128],  # tiny shared expert gate|up
        [3, 11, 1],  # ragged
    ],
)
def test_multi_projection_tiny(lane_order, rows):
    check_multi_projection(lane_order, 128, rows)


def test_misaligned_weight_is_refused():
    device = sim_device("forward")
    words, scales, biases = random_quantized(np.random.default_rng(0), 4, 64, 4)
    buffer = device.wrap(np.concatenate([np.zeros(1, np.uint32), words.ravel()]))
    with pytest.raises(ValueError, match="offset 4"):
        QuantWeight(
            (buffer, 4), device.wrap(scales), device.wrap(biases), rows=4, in_dim=64, bits=4
        )


@pytest.mark.parametrize(("dtype", "offset"), [("float32", 8), ("bfloat16", 4)])
def test_input_not_aligned_to_four_elements_is_refused(dtype, offset):
    """x is read four elements at a time, so a binding between two such vectors is refused."""
    device = sim_device("forward")
    weight = wrap_quant_weight(device, *random_quantized(np.random.default_rng(0), 4, 64, 4))
    x = device.wrap(np.zeros(80, np.float32))
    with pytest.raises(ValueError, match=f"GEMV input is bound at byte offset {offset}"):
        record_qgemv(Graph(), device, (x, offset), [(weight, float_buffer(device, 4))], dtype)


def test_folded_norm_gain_not_aligned_is_refused():
    device = sim_device("forward")
    weight = wrap_quant_weight(device, *random_quantized(np.random.default_rng(0), 4, 64, 4))
    gain = device.wrap(np.zeros(80, np.uint16))
    norm = FoldedNorm((gain, 2), 1e-6)
    with pytest.raises(ValueError, match="folded norm gain is bound at byte offset 2"):
        record_qgemv(
            Graph(),
            device,
            device.wrap(np.zeros(64, np.float32)),
            [(weight, float_buffer(device, 4))],
            norm=norm,
        )


@pytest.mark.parametrize(
    ("rows", "threadgroups", "threads"),
    [
        # A 2048-row projection (out_proj, o_proj): 512 threadgroups of one SIMD-group, 12.8 per
        # core of a 40-core GPU, rather than 256 of two (6.4: a 40%-full last round).
        ([2048], 512, 32),
        ([256, 1], 65, 32),  # router + shared-expert gate: more threadgroups than 40 cores
        # GDN in_proj qkv|z|a|b: 3,088 SIMD-groups, plenty of threadgroups of two.
        ([8192, 4096, 32, 32], 1024 + 512 + 4 + 4, 64),
    ],
)
def test_threadgroup_size_follows_the_dispatch_size(rows, threadgroups, threads):
    device = sim_device("forward")
    rng = np.random.default_rng(0)
    projections = [
        (wrap_quant_weight(device, *random_quantized(rng, r, 64, 4)), float_buffer(device, r))
        for r in rows
    ]
    graph = Graph()
    record_qgemv(graph, device, device.wrap(np.zeros(64, np.float32)), projections)
    (dispatch,) = graph.dispatches
    assert dispatch.threadgroups == (threadgroups, 1, 1)
    assert dispatch.threads == (threads, 1, 1)
