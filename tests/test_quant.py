"""lily.checkpoint.quant against MLX's own quantize / dequantize and bf16 conversion."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily.checkpoint.quant import (
    bf16_to_float32,
    dequantize,
    float32_to_bf16,
    pack_codes,
    quantize,
    round_to_bf16,
    unpack_codes,
)


def mlx_bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))


def awkward_floats() -> np.ndarray:
    """Values around every rounding case: exact ties (both parities), just off ties, subnormals,
    the largest finite floats (which round up to infinity), infinities, signed zero."""
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], dtype=np.uint32)
    edge = np.array([0x00000001, 0x007FFFFF, 0x7F7FFFFF, 0x7F7F7FFF], dtype=np.uint32)
    special = np.array([0x7F800000, 0xFF800000, 0x80000000, 0], dtype=np.uint32)
    bits = np.concatenate([ties, edge, special])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    random = np.random.default_rng(0).normal(0, 10, 4096).astype(np.float32)
    return np.concatenate([bits.view(np.float32), random])


def test_float32_to_bf16_rounds_like_mlx() -> None:
    x = awkward_floats()
    np.testing.assert_array_equal(float32_to_bf16(x), mlx_bf16_bits(x))


def test_float32_to_bf16_keeps_nan() -> None:
    out = bf16_to_float32(float32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32)))
    assert np.isnan(out).all()


def test_bf16_to_float32_is_exact_widening() -> None:
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    finite = ((bits >> 7) & 0xFF) != 0xFF  # exponent not all ones
    mlx_values = np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(bf16_to_float32(bits)[finite], mlx_values[finite])
    x = awkward_floats()
    np.testing.assert_array_equal(round_to_bf16(x), bf16_to_float32(mlx_bf16_bits(x)))


def test_packing_is_low_bits_first() -> None:
    # spec/model.md: 4-bit element c = (word[c/8] >> 4*(c%8)) & 0xF.
    codes = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8]])
    np.testing.assert_array_equal(pack_codes(codes, 4), [[0x76543210, 0x89ABCDEF]])
    np.testing.assert_array_equal(pack_codes(np.array([[1, 2, 3, 255]]), 8), [[0xFF030201]])
    words = np.array([[0x76543210]], np.uint32)
    np.testing.assert_array_equal(unpack_codes(words, 4), codes[:, :8])


def weights_with_edge_groups(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random weights whose first groups are constant, all-positive and all-negative."""
    w = rng.normal(0, 0.05, shape).astype(np.float32)
    w[..., 0, :64] = 0.25
    w[..., 1, :64] = np.abs(w[..., 1, :64]) + 0.1
    w[..., 2, :64] = -np.abs(w[..., 2, :64]) - 0.1
    w[..., 3, :64] = 0.0
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(96, 256), (3, 32, 128)])
def test_quantize_matches_mlx(bits: int, shape: tuple[int, ...]) -> None:
    w = weights_with_edge_groups(np.random.default_rng(bits), shape)
    w_bf16 = mx.array(w).astype(mx.bfloat16)  # as in a real checkpoint
    mlx_w, mlx_scales, mlx_biases = mx.quantize(w_bf16, group_size=64, bits=bits)
    ours = quantize(np.array(w_bf16.astype(mx.float32)), bits, 64)
    np.testing.assert_array_equal(ours[0], np.array(mlx_w))
    np.testing.assert_array_equal(ours[1], np.array(mlx_scales.view(mx.uint16)))
    np.testing.assert_array_equal(ours[2], np.array(mlx_biases.view(mx.uint16)))


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_matches_mlx(bits: int) -> None:
    rng = np.random.default_rng(10 + bits)
    w_q, scales, biases = mx.quantize(
        mx.array(rng.normal(0, 0.05, (4, 64, 192)).astype(np.float32)).astype(mx.bfloat16),
        group_size=64,
        bits=bits,
    )
    # Float32 scales make MLX dequantize in float32, the precision the reference uses.
    expected = mx.dequantize(
        w_q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=bits
    )
    ours = dequantize(
        np.array(w_q), np.array(scales.view(mx.uint16)), np.array(biases.view(mx.uint16)), bits
    )
    assert ours.dtype == np.float32 and ours.shape == (4, 64, 192)
    np.testing.assert_allclose(ours, np.array(expected), rtol=1e-6, atol=1e-7)
    ours64 = dequantize(
        np.array(w_q), np.array(scales.view(mx.uint16)), np.array(biases.view(mx.uint16)), bits,
        dtype=np.float64,
    )  # fmt: skip
    assert ours64.dtype == np.float64
    np.testing.assert_allclose(ours64, ours, rtol=1e-6, atol=1e-7)


def test_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="bit width"):
        quantize(np.zeros((2, 64), np.float32), 3)
    with pytest.raises(ValueError, match="group size"):
        quantize(np.zeros((2, 96), np.float32), 4, 64)
