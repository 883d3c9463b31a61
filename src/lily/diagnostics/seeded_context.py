"""A long context without feeding it: random KV rows and recurrent state, given to a device
engine's prefix cache and to the reference model alike, so that decoding after a context of any
length can be compared with the float64 reference in seconds. Feeding 8k prompt tokens through
the full-size model on the sim would take days (about 32 s per token); its decode kernels only
read what the cache holds, so a seeded cache tests them at that context just as well
(`benchmarks/full_size_check.py --context`, `tests/test_seeded_context.py`).

The keys stand in for rotated, RMS-normed keys, each row scaled by a random factor around
KEY_SCALE: a unit-RMS query then scores the positions with a spread of about KEY_SCALE, so that
attention is neither uniform over the context (which would hide a misplaced position) nor held by
one position (which would hide all the others). Values, conv windows and GDN states are random
normals. The KV values are put in the cache's format first (bf16, or int8
codes with an fp16 scale per 32 dims) and the reference gets exactly the values that format
stands for, so the engine and the reference start from the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig
from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16
from lily.engine.engine import DeviceEngine
from lily.engine.reference import ReferenceState, dequantize_int8, quantize_int8
from lily.kernels.attention import HEAD_DIM, INT8_GROUP, check_kv_cache, row_bytes

# The keys' RMS per dim: over 8k positions the largest softmax weight is then a few percent and
# the ten largest hold about a fifth of the mass.
KEY_SCALE = 1.0


def encode_kv_rows(values: np.ndarray, kv_cache: str) -> np.ndarray:
    """Rows [..., HEAD_DIM] as the KV cache stores them: bf16 bits (uint16), or int8 rows of
    HEAD_DIM codes then HEAD_DIM / INT8_GROUP fp16 scales, as bytes (kernels/attention.py)."""
    check_kv_cache(kv_cache)
    values = np.asarray(values, np.float32)
    if kv_cache == "bf16":
        return float32_to_bf16(values)
    codes, scales = quantize_int8(values, INT8_GROUP, fp16_scales=True)
    rows = np.empty((*values.shape[:-1], row_bytes(kv_cache)), np.uint8)
    rows[..., :HEAD_DIM] = codes.view(np.uint8)
    rows[..., HEAD_DIM:] = scales.astype(np.float16).view(np.uint8)
    return rows


def kv_row_values(rows: np.ndarray, kv_cache: str) -> np.ndarray:
    """The float64 values [..., HEAD_DIM] that cache rows stand for."""
    check_kv_cache(kv_cache)
    if kv_cache == "bf16":
        return bf16_to_float32(rows).astype(np.float64)
    codes = rows[..., :HEAD_DIM].view(np.int8)
    scales = np.ascontiguousarray(rows[..., HEAD_DIM:]).view(np.float16).astype(np.float64)
    return dequantize_int8(codes, scales)


@dataclass
class SeededContext:
    """`tokens` and what a model holds after them: per attention layer the cache's rows (K and V,
    [num_kv_heads, len(tokens), row] in `kv_cache`'s format), per GDN layer the conv window
    [K-1, conv_dim] and recurrent state [Hv, Dv, Dk] (float32, as the engine keeps them)."""

    tokens: list[int]
    kv_cache: str
    key_rows: dict[int, np.ndarray]
    value_rows: dict[int, np.ndarray]
    conv_windows: dict[int, np.ndarray]
    recurrent: dict[int, np.ndarray]

    def give_to(self, engine: DeviceEngine) -> None:
        """Puts the context in `engine`'s prefix cache: a prompt (or `teacher_forced_logits`
        with `reuse`) starting with `tokens` resumes after them."""
        rows = [
            rows[layer]
            for layer in sorted(self.key_rows)
            for rows in (self.key_rows, self.value_rows)
        ]
        state = [
            *(w.view(np.uint8).reshape(-1) for _, w in sorted(self.conv_windows.items())),
            *(s.view(np.uint8).reshape(-1) for _, s in sorted(self.recurrent.items())),
        ]
        if not engine.prefix_cache.add_sequence(self.tokens, rows, state):
            raise ValueError(f"a context of {len(self.tokens)} tokens exceeds the cache budget")

    def reference_state(self, dtype: np.dtype | type = np.float64) -> ReferenceState:
        """The reference model's state after `tokens`, holding the same values."""
        state = ReferenceState(position=len(self.tokens))
        for layer, rows in self.key_rows.items():
            state.keys[layer] = kv_row_values(rows, self.kv_cache).astype(dtype)
            state.values[layer] = kv_row_values(self.value_rows[layer], self.kv_cache).astype(dtype)
        for layer, window in self.conv_windows.items():
            state.conv_windows[layer] = window.astype(dtype)
            state.recurrent[layer] = self.recurrent[layer].astype(dtype)
        return state


def seed_context(config: ModelConfig, length: int, kv_cache: str, seed: int = 0) -> SeededContext:
    """A random context of `length` tokens for a model of `config` (see the module's text)."""
    check_kv_cache(kv_cache)
    if config.head_dim != HEAD_DIM:
        raise ValueError(f"the KV cache holds heads of {HEAD_DIM} dims, not {config.head_dim}")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, length).tolist()
    heads = config.num_key_value_heads
    context = SeededContext(tokens, kv_cache, {}, {}, {}, {})
    for layer, kind in enumerate(config.layer_types):
        if kind == FULL_ATTENTION:
            scale = KEY_SCALE * rng.lognormal(0.0, 0.25, (heads, length, 1))
            keys = rng.standard_normal((heads, length, HEAD_DIM)) * scale
            values = rng.standard_normal((heads, length, HEAD_DIM))
            context.key_rows[layer] = encode_kv_rows(keys, kv_cache)
            context.value_rows[layer] = encode_kv_rows(values, kv_cache)
        else:
            window = (config.linear_conv_kernel_dim - 1, config.linear_conv_dim)
            recurrent = (
                config.linear_num_value_heads,
                config.linear_value_head_dim,
                config.linear_key_head_dim,
            )
            context.conv_windows[layer] = rng.standard_normal(window).astype(np.float32)
            context.recurrent[layer] = (0.1 * rng.standard_normal(recurrent)).astype(np.float32)
    return context
