"""MLX affine quantization and bfloat16, in plain numpy.

MLX stores a quantized projection as three arrays: `weight` (uint32 words of packed codes, low
bits first along the input dimension), and `scales` / `biases` (one per group of `group_size`
inputs, bf16 in the files). A weight is recovered as `w = scale * code + bias`.

bf16 is the upper half of an IEEE float32, so files hand it over as raw `uint16` bits; the
helpers here convert those bits to and from float32.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_BITS = (4, 8)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bf16 bits (uint16) to float32; exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits (uint16), to nearest with ties to even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
    # half is above the midpoint, or at the midpoint with an odd kept half.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    quiet_nan = (bits >> 16) | np.uint32(0x0040)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, returned as float32."""
    return bf16_to_float32(float32_to_bf16(x))


def _check_layout(bits: int, group_size: int, in_dim: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; expected one of {SUPPORTED_BITS}")
    if in_dim % group_size:
        raise ValueError(f"input dimension {in_dim} is not a multiple of group size {group_size}")


def unpack_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint32 words [..., n] -> integer codes [..., n * 32 / bits], low bits first."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    mask = np.uint32((1 << bits) - 1)
    codes = (np.asarray(words, dtype=np.uint32)[..., None] >> shifts) & mask
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [..., m] -> packed uint32 words [..., m * bits / 32], low bits first."""
    per_word = 32 // bits
    grouped = np.asarray(codes, dtype=np.uint32).reshape(*codes.shape[:-1], -1, per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint32)


def dequantize(
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group_size: int = 64,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """Recover `scale * code + bias` from an MLX quantized triple.

    `weight` is uint32 [..., out, in * bits / 32]; `scales` and `biases` are [..., out,
    in / group_size], either raw bf16 bits (uint16) or floats. Leading axes (stacked experts)
    are carried through. The result has shape [..., out, in] in `dtype`.
    """
    codes = unpack_codes(weight, bits)
    _check_layout(bits, group_size, codes.shape[-1])
    scales = _as_float(scales, dtype)[..., None]
    biases = _as_float(biases, dtype)[..., None]
    grouped = codes.reshape(*codes.shape[:-1], -1, group_size).astype(dtype)
    return (scales * grouped + biases).reshape(codes.shape)


def quantize(
    w: np.ndarray, bits: int, group_size: int = 64
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize float weights [..., out, in] the way MLX's `mx.quantize` does.

    Returns `(weight uint32, scales bf16 bits, biases bf16 bits)`. Per group, the range
    [min, max] is split into 2**bits - 1 steps; the end with the larger magnitude is made exactly
    representable (MLX's choice), codes are computed with the float32 scale and bias, and the
    scale and bias are then rounded to bf16 for storage.
    """
    w = np.asarray(w, dtype=np.float32)
    _check_layout(bits, group_size, w.shape[-1])
    n_bins = np.float32((1 << bits) - 1)
    groups = w.reshape(*w.shape[:-1], -1, group_size)
    w_max = groups.max(axis=-1)
    w_min = groups.min(axis=-1)
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(min_is_edge, scale, -scale)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, 1), scale).astype(np.float32)
    bias = np.where(nonzero, edge, 0).astype(np.float32)
    codes = np.rint((groups - bias[..., None]) / scale[..., None])
    codes = np.clip(codes, 0, n_bins).reshape(w.shape)
    return pack_codes(codes, bits), float32_to_bf16(scale), float32_to_bf16(bias)


def _as_float(x: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    if x.dtype == np.uint16:
        return bf16_to_float32(x).astype(dtype)
    return np.asarray(x, dtype=dtype)
