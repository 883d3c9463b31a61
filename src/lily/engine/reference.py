"""The numpy reference model: the forward pass of spec/model.md section 2, written to be read.

This is the oracle every kernel and the engine are checked against, so it favours literal math
over speed: one token at a time through the Gated DeltaNet recurrence, full softmax attention over
the KV cache, and each routed expert computed separately. Weights are the MLX-format tensors of a
checkpoint (full names, bf16 as raw uint16 bits) and are dequantized layer by layer on use, so the
model never holds a dequantized copy of the whole checkpoint.

The module-level functions are the per-operation math; kernel tests use them directly. They
compute in the dtype of their inputs (float32, or float64 for tighter checks).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig
from lily.checkpoint.mtp import (
    MTP_FC,
    MTP_FINAL_NORM,
    MTP_LAYER,
    MTP_NORM_EMBEDDING,
    MTP_NORM_HIDDEN,
    is_mtp,
    mtp_quant,
)
from lily.checkpoint.quant import bf16_to_float32, dequantize, round_to_bf16

# ---------------------------------------------------------------------------------------------
# Per-operation math
# ---------------------------------------------------------------------------------------------


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) without overflow for large x.
    return np.logaddexp(x, 0)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last axis (weight as stored: MLX files
    already hold 1+w for the zero-centred norms)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def gated_rms_norm(x: np.ndarray, weight: np.ndarray, z: np.ndarray, eps: float) -> np.ndarray:
    """The Gated DeltaNet output norm: a plain gain, then a SiLU gate."""
    return rms_norm(x, weight, eps) * silu(z)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv1d_step(
    window: np.ndarray, x: np.ndarray, weight: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One time step of the depthwise causal convolution, then SiLU.

    window [K-1, C]: the previous K-1 pre-convolution rows (zeros at the start); x [C]: this
    step's row; weight [C, K] (tap K-1 multiplies the current row). Returns (y [C], new window).
    """
    rows = np.concatenate([window, x[None, :]], axis=0)  # [K, C], oldest first
    y = np.sum(weight.T * rows, axis=0)
    return silu(y), rows[1:]


def gdn_log_decay(a: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray) -> np.ndarray:
    """Per value head: log g = -exp(A_log) * softplus(a + dt_bias) (the chunkwise form sums it)."""
    return -np.exp(A_log) * softplus(a + dt_bias)


def gdn_gates(
    a: np.ndarray, b: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per value head: decay `g = exp(-exp(A_log) * softplus(a + dt_bias))`, `beta = sigmoid(b)`."""
    return np.exp(gdn_log_decay(a, A_log, dt_bias)), sigmoid(b)


def gated_delta_step(
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """One step of the gated delta rule for all value heads.

    state [Hv, Dv, Dk]; q, k [Hk, Dk] (l2-normalised, q also scaled by Dk^-0.5); v [Hv, Dv];
    g, beta [Hv]. Value head h reads key head h // (Hv // Hk). Returns (o [Hv, Dv], new state).
    """
    n_value_heads, n_key_heads = v.shape[0], k.shape[0]
    key_head = np.arange(n_value_heads) // (n_value_heads // n_key_heads)
    q, k = q[key_head], k[key_head]
    decayed = g[:, None, None] * state
    remembered = np.einsum("hvk,hk->hv", decayed, k)
    delta = beta[:, None] * (v - remembered)
    new_state = decayed + delta[:, :, None] * k[:, None, :]
    return np.einsum("hvk,hk->hv", new_state, q), new_state


def gated_delta_chunk(
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    sub_chunk: int,
    half_operands: HalfOperands | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """T steps of the gated delta rule in chunkwise form, per sub-chunk of `sub_chunk` tokens:
    with Gamma_t the in-chunk sum of log g up to t and S the state before the sub-chunk,
      U = X (V - diag(e^Gamma) K S^T),  X = (I + M)^-1 diag(beta),
          M[i, j] = beta_i e^(Gamma_i - Gamma_j) k_i.k_j for j < i,
      O = diag(e^Gamma) Q S^T + P U,  P[i, j] = e^(Gamma_i - Gamma_j) q_i.k_j for j <= i,
      S <- e^Gamma_last S + U^T diag(e^(Gamma_last - Gamma)) K,
    which equals gated_delta_step token after token in real arithmetic.

    state [Hv, Dv, Dk]; q, k [T, Hk, Dk] (as gated_delta_step's); v [T, Hv, Dv]; log_decay,
    beta [T, Hv]. Returns (o [T, Hv, Dv], new state). `half_operands` rounds every product's
    operands to half where the prefill kernel (gdn_chunk) does, so that a reference can carry
    the kernel's deliberate rounding the way it carries the KV cache's."""
    tokens, num_value_heads = v.shape[0], v.shape[1]
    key_head = np.arange(num_value_heads) // (num_value_heads // k.shape[1])
    state = np.array(state, dtype=v.dtype)
    out = np.empty_like(v)
    for first in range(0, tokens, sub_chunk):
        n = min(sub_chunk, tokens - first)
        # Padded to a whole sub-chunk as the kernel pads it: no key, no value, g = 1, beta = 0.
        part = slice(first, first + n)
        qs, ks = (np.zeros((sub_chunk, num_value_heads, x.shape[-1]), v.dtype) for x in (q, k))
        qs[:n], ks[:n] = q[part][:, key_head], k[part][:, key_head]
        vs = np.zeros((sub_chunk, *v.shape[1:]), v.dtype)
        vs[:n] = v[part]
        gamma = np.zeros((sub_chunk, num_value_heads), v.dtype)
        gamma[:n] = np.cumsum(log_decay[part], axis=0)
        gamma[n:] = gamma[n - 1]
        bs = np.zeros((sub_chunk, num_value_heads), v.dtype)
        bs[:n] = beta[part]
        out[part] = _gated_delta_sub_chunk(state, qs, ks, vs, gamma, bs, half_operands)[:n]
    return out, state


@dataclass(frozen=True)
class HalfOperands:
    """Where a chunk kernel rounds products' operands to half. Unit-bounded operands (q, k, P,
    X) are rounded as they are; unbounded ones (S, V - K S^T, U) are first multiplied by one
    power of two per head and `scale_rows` value rows, the one that brings their largest |x|
    into [2^14, 2^15), and the product divided by it after."""

    scale_rows: int

    def range_factor(self, x: np.ndarray, head_axis: int, rows_axis: int) -> np.ndarray:
        """The powers of two for x, broadcastable against it."""
        moved = np.moveaxis(x, (head_axis, rows_axis), (0, -1))
        heads, rows = moved.shape[0], moved.shape[-1]
        grouped = moved.reshape(heads, -1, rows // self.scale_rows, self.scale_rows)
        largest = np.abs(grouped).max(axis=(1, 3)).astype(np.float32)
        # The largest's float32 biased exponent e, at least 15; the factor is 2^(141 - e).
        exponent = np.where(largest > 0, np.frexp(largest)[1] + 126, 0)
        factor = np.ldexp(1.0, 141 - np.maximum(exponent, 15)).astype(x.dtype)
        shape = [1] * x.ndim
        shape[head_axis], shape[rows_axis] = heads, rows
        return np.repeat(factor, self.scale_rows, axis=1).reshape(shape)

    def round_scaled(self, x: np.ndarray, head_axis: int, rows_axis: int) -> np.ndarray:
        factor = self.range_factor(x, head_axis, rows_axis)
        return round_to_half(x * factor) / factor


@dataclass(frozen=True)
class ChunkRounding:
    """How the engine's passes of several tokens compute, for a reference to do the same in the
    same passes (the metal/ files say why each kernel rounds what it does, and by how much):

    - a pass of more than one token runs the Gated DeltaNet chunkwise in sub-chunks of
      `gdn_sub_chunk` tokens (gated_delta_chunk), with gdn_chunk's half operands
      (`gdn_operands`; None: exact);
    - from `gemm_tokens` tokens (None: never) its projections are GEMMs on half operands:
      weights dequantized in float32 then rounded to half, inputs rounded to half where a norm
      bounds them and to half's 11 significant bits at any range where the GEMM's range guard
      scales them (mixer outputs, the SwiGLU's);
    - from `attention_tokens` tokens (None: never) attention is attention_chunk's
      (attention_in_tiles), in tiles of `attention_tile_keys` keys (the tensor-op kernel's are
      twice as long)."""

    gdn_sub_chunk: int
    gdn_operands: HalfOperands | None
    gemm_tokens: int | None = None
    attention_tokens: int | None = None
    attention_tile_keys: int = 16

    @classmethod
    def of_the_engine(cls, tensor_ops: bool = False) -> ChunkRounding:
        """The kernels' own settings, on a device whose `tensor_ops` is as given (with a bf16
        cache)."""
        from lily.kernels import attention, gdn, quantized

        return cls(
            gdn_sub_chunk=gdn.CHUNK_SUB_CHUNK,
            gdn_operands=HalfOperands(gdn.CHUNK_SCALE_ROWS),
            gemm_tokens=quantized.MAX_TOKENS + 1,
            attention_tokens=attention.MAX_DECODE_TOKENS + 1,
            attention_tile_keys=(
                attention.TENSOR_CHUNK_TILE_KEYS if tensor_ops else attention.CHUNK_TILE_KEYS
            ),
        )


def round_to_half(x: np.ndarray) -> np.ndarray:
    """x rounded to half (its range included), in x's dtype."""
    return x.astype(np.float16).astype(x.dtype)


def round_to_11_bits(x: np.ndarray) -> np.ndarray:
    """x rounded to half's 11 significant bits at any exponent (a range-guarded GEMM input)."""
    significand, exponent = np.frexp(x)
    return np.ldexp(np.round(significand * 2.0**11) / 2.0**11, exponent).astype(x.dtype)


def half_operand_gemm(x: np.ndarray, weight: np.ndarray, guarded: bool = False) -> np.ndarray:
    """x @ weight^T as the quantized GEMMs compute it: each dequantized weight rounded to float32
    (the kernel's fma) and then to half; x rounded to half, or (`guarded`, an input the range
    guard scales by a power of two per row first) to half's 11 significant bits at any range."""
    x = round_to_11_bits(x) if guarded else round_to_half(x)
    return x @ round_to_half(weight.astype(np.float32)).astype(x.dtype).T


def attention_in_tiles(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    q_positions: np.ndarray,
    tile_keys: int,
) -> np.ndarray:
    """`attention` as attention_chunk computes it from a bf16 cache: the scaled queries and the
    keys rounded to half; per query, the keys in tiles of `tile_keys` positions with the online
    softmax's running maximum over the visible keys so far, each weight exp(s - that maximum)
    rounded to bfloat and summed so in the denominator too. Shapes as `attention`'s."""
    n_q_heads, n_kv_heads = q.shape[0], k.shape[0]
    kv_head = np.arange(n_q_heads) // (n_q_heads // n_kv_heads)
    k, v = round_to_half(k[kv_head]), v[kv_head]
    scores = np.einsum("hqd,hkd->hqk", round_to_half(q * scale), k)
    visible = np.arange(k.shape[1])[None, :] <= np.asarray(q_positions)[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    # The running maximum after each tile, for the keys of that tile.
    tiles = -(-k.shape[1] // tile_keys)
    padded = np.full((*scores.shape[:2], tiles * tile_keys), -np.inf, scores.dtype)
    padded[..., : k.shape[1]] = scores
    running = np.maximum.accumulate(padded.reshape(*scores.shape[:2], tiles, tile_keys).max(-1), -1)
    at_key = np.repeat(running, tile_keys, axis=-1)[..., : k.shape[1]]
    weights = round_to_bf16(
        np.where(visible[None], np.exp(scores - at_key), 0.0).astype(np.float32)
    )
    # The rescales that carry each tile's weights to the final maximum.
    weights = weights.astype(q.dtype) * np.exp(at_key - running[..., -1:])
    return np.einsum("hqk,hkd->hqd", weights, v) / weights.sum(axis=-1, keepdims=True)


def _gated_delta_sub_chunk(
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    half: HalfOperands | None,
) -> np.ndarray:
    """One sub-chunk of gated_delta_chunk (inputs padded to the sub-chunk, per value head:
    q, k [n, Hv, Dk], v [n, Hv, Dv], gamma, beta [n, Hv]); updates `state` in place and returns
    O [n, Hv, Dv]."""
    n = q.shape[0]
    if half is not None:
        q, k = round_to_half(q), round_to_half(k)
    # [i, j, h]: e^(Gamma_i - Gamma_j), used for j <= i only, where it is at most 1 (the decays
    # are), and clamped there above: e^(Gamma_i - Gamma_j) for j > i can overflow in float32.
    decay = np.exp(np.minimum(gamma[:, None, :] - gamma[None, :, :], 0))
    below = np.tril(np.ones((n, n), v.dtype), -1)[:, :, None]
    eye = np.eye(n, dtype=v.dtype)
    m = beta[:, None, :] * decay * np.einsum("ihd,jhd->ijh", k, k) * below
    # X and P with heads first ([h, i, j]), for the batched solve.
    x = np.linalg.solve(eye + m.transpose(2, 0, 1), eye * beta.T[:, None, :])
    p = (decay * np.einsum("ihd,jhd->ijh", q, k) * (below + eye[:, :, None])).transpose(2, 0, 1)
    s = state
    if half is not None:
        x, p = round_to_half(x), round_to_half(p)
        s = half.round_scaled(state, head_axis=0, rows_axis=1)
    residual = v - np.exp(gamma)[:, :, None] * np.einsum("thd,hvd->thv", k, s)
    if half is not None:
        residual = half.round_scaled(residual, head_axis=1, rows_axis=2)
    u = np.einsum("hij,jhv->ihv", x, residual)
    u_to_end = u * np.exp(gamma[-1] - gamma)[:, :, None]
    if half is not None:
        # U and its decayed copy share U's factor, as in the kernel.
        factor = half.range_factor(u, head_axis=1, rows_axis=2)
        u = round_to_half(u * factor) / factor
        u_to_end = round_to_half(u_to_end * factor) / factor
    out = np.exp(gamma)[:, :, None] * np.einsum("thd,hvd->thv", q, s)
    out += np.einsum("hij,jhv->ihv", p, u)
    state *= np.exp(gamma[-1])[:, None, None]
    state += np.einsum("thv,thd->hvd", u_to_end, k)
    return out


def apply_rope(
    x: np.ndarray,
    positions: np.ndarray,
    rotary_dim: int,
    theta: float,
    streams: Sequence[int] | None = None,
) -> np.ndarray:
    """Rotate-half (NeoX) RoPE on the first `rotary_dim` dims of x [..., T, D]; the rest pass.

    Dim i of the first half pairs with dim i + rotary_dim/2, at frequency theta^(-2i/rotary_dim).
    `positions` is [T], or [3, T] multimodal positions (temporal, height, width) with `streams`
    naming the one each frequency's angle takes (ModelConfig.rope_streams: M-RoPE); with the
    three equal the angles are plain RoPE's, bit for bit.
    """
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=x.dtype) * 2 / rotary_dim)
    positions = np.asarray(positions)
    if positions.ndim == 2:
        per_frequency = positions[np.asarray(streams)].T  # [T, half]
        angles = per_frequency.astype(x.dtype) * inv_freq[None, :]
    else:
        angles = positions.astype(x.dtype)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[..., :half], x[..., half:rotary_dim]
    rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return np.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def quantize_int8(
    x: np.ndarray, group: int, fp16_scales: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes of x along its last axis, one scale per `group` values: scale =
    max |x| / 127 of the group, code = x / scale rounded to nearest (ties to even), so the
    group's largest magnitude maps to +-127 and every value is within scale / 2 of code * scale;
    an all-zero group gets scale 0 and codes 0. With `fp16_scales` the scales are first rounded
    to fp16, as the engine's int8 cache stores them, and the codes taken against those (clipped
    to +-127, which the rounding can pass). Returns int8 codes [..., D] and scales
    [..., D / group] in x's dtype."""
    if x.shape[-1] % group:
        raise ValueError(f"{x.shape[-1]} values do not split into groups of {group}")
    grouped = x.reshape(*x.shape[:-1], -1, group)
    scales = np.abs(grouped).max(axis=-1) / 127
    if fp16_scales:
        scales = scales.astype(np.float16).astype(x.dtype)
    safe = np.where(scales > 0, scales, 1)
    codes = np.clip(np.rint(grouped / safe[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The values quantize_int8's codes and scales stand for, in the scales' dtype."""
    group = codes.shape[-1] // scales.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], -1, group).astype(scales.dtype)
    return (grouped * scales[..., None]).reshape(codes.shape)


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, q_positions: np.ndarray
) -> np.ndarray:
    """Causal softmax attention with grouped KV heads.

    q [Hq, Tq, D]; k, v [Hkv, Tk, D] where key j sits at position j; query i attends to keys at
    positions <= q_positions[i]. Query head h reads KV head h // (Hq // Hkv). Returns [Hq, Tq, D].
    """
    n_q_heads, n_kv_heads = q.shape[0], k.shape[0]
    kv_head = np.arange(n_q_heads) // (n_q_heads // n_kv_heads)
    k, v = k[kv_head], v[kv_head]
    scores = np.einsum("hqd,hkd->hqk", q, k) * scale
    visible = np.arange(k.shape[1])[None, :] <= np.asarray(q_positions)[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", probs, v)


def router_probabilities(router_logits: np.ndarray) -> np.ndarray:
    """The softmax over all experts that moe_route picks from and weights by."""
    shifted = np.exp(router_logits - router_logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def moe_route(
    router_logits: np.ndarray, top_k: int, normalize: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, keep the top_k (ties to the lowest expert id), optionally
    renormalise their weights to sum to 1. router_logits [..., E] -> (ids, weights) [..., top_k].
    """
    probs = router_probabilities(router_logits)
    expert_ids = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
    weights = np.take_along_axis(probs, expert_ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return expert_ids, weights


def moe_expert_union(expert_ids: np.ndarray) -> list[tuple[int, list[int]]]:
    """The distinct experts of a few tokens' routing, ascending, each with the (token, slot)
    pairs that chose it as token * top_k + slot, in that order. expert_ids [tokens, top_k]."""
    flat = np.asarray(expert_ids).ravel()
    return [(int(e), np.flatnonzero(flat == e).tolist()) for e in np.unique(flat)]


def swiglu_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert (routed or shared): `down(silu(gate x) * up x)`; weights [out, in]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

MODEL_PREFIX = "language_model.model."


@dataclass
class ReferenceState:
    """Everything a decode step carries forward, per layer index.

    GDN layers keep the last K-1 pre-convolution rows [K-1, conv_dim] and the recurrent state
    [Hv, Dv, Dk]; attention layers keep rotated keys and values [Hkv, T, head_dim]. After an
    image, a token's rotary positions run ahead of its index by `rope_offset`
    (lily.engine.image_tokens); 0 for text.
    """

    position: int = 0
    rope_offset: int = 0
    conv_windows: dict[int, np.ndarray] = field(default_factory=dict)
    recurrent: dict[int, np.ndarray] = field(default_factory=dict)
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)


class ReferenceModel:
    """Forward pass over MLX-format tensors; `dtype` is float32 (default) or float64."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, np.ndarray],
        dtype: np.dtype | type = np.float32,
        bf16_kv_cache: bool = False,
        kv_int8_group: int | None = None,
        kv_int8_fp16_scales: bool = False,
        chunks: ChunkRounding | None = None,
    ) -> None:
        """`bf16_kv_cache` rounds cached keys and values to bf16, as the engine's cache stores
        them: comparing with and without it separates kernel errors from the cache's precision.
        `kv_int8_group` instead rounds them through int8 codes with one scale per that many dims
        (quantize_int8), as an int8 cache would hold them; `kv_int8_fp16_scales` also rounds
        the scales to fp16, as the engine's int8 cache (`kv_cache="int8"`, groups of 32) does.
        `chunks` computes a call of several tokens as the engine's pass of that many tokens
        does (ChunkRounding); a call of one token stays exact, as the engine's decode step is.
        Calls then matter: feed the tokens in the engine's passes."""
        if bf16_kv_cache and kv_int8_group is not None:
            raise ValueError("the KV cache is rounded to bf16 or through int8, not both")
        if chunks is not None and chunks.attention_tokens is not None and not bf16_kv_cache:
            raise ValueError("attention_chunk's rounding is modelled for a bf16 cache only")
        self.config = config
        self.tensors = tensors
        self.dtype = np.dtype(dtype)
        self.bf16_kv_cache = bf16_kv_cache
        self.kv_int8_group = kv_int8_group
        self.kv_int8_fp16_scales = kv_int8_fp16_scales
        self.chunks = chunks
        # The tokens of the call being computed: what `chunks` decides by.
        self._call_tokens = 1

    # -- public API ---------------------------------------------------------------------------

    def new_state(self) -> ReferenceState:
        c = self.config
        state = ReferenceState()
        for i, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION:
                empty = np.zeros((c.num_key_value_heads, 0, c.head_dim), self.dtype)
                state.keys[i], state.values[i] = empty, empty
            else:
                state.conv_windows[i] = np.zeros(
                    (c.linear_conv_kernel_dim - 1, c.linear_conv_dim), self.dtype
                )
                state.recurrent[i] = np.zeros(
                    (c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim),
                    self.dtype,
                )
        return state

    def prefill(
        self,
        tokens: Sequence[int],
        state: ReferenceState | None = None,
        image_rows: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, ReferenceState]:
        """Run `tokens` after whatever `state` holds (a fresh state if None).

        Returns logits [len(tokens), vocab] and the updated state (mutated in place).
        `image_rows` and `positions` as `hidden_states` takes them.
        """
        if state is None:
            state = self.new_state()
        hidden = self.hidden_states(tokens, state, image_rows, positions)
        return self.lm_head(hidden), state

    def hidden_states(
        self,
        tokens: Sequence[int],
        state: ReferenceState,
        image_rows: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        layer_outputs: dict[int, np.ndarray] | None = None,
    ) -> np.ndarray:
        """The final-normed hidden states [len(tokens), hidden] of `tokens` after `state` (the
        rows the lm_head reads, which also feed the MTP head); advances `state`.

        `image_rows` [n, hidden], if given, replace the embeddings of the n tokens that are
        `image_token_id`, in order; `positions` [3, len(tokens)], if given, are the tokens'
        multimodal rotary positions (lily.engine.image_tokens), else each token's index plus
        `state.rope_offset`. `layer_outputs`, if given, receives under each of its keys that
        is a layer index the residual stream after that layer [len(tokens), hidden] (what the
        DFlash drafter reads)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        c = self.config
        self._call_tokens = len(tokens)
        x = self.embed(tokens)
        if image_rows is not None:
            x[tokens == c.image_token_id] = image_rows
        if positions is None:
            positions = state.position + state.rope_offset + np.arange(len(tokens))
        for i, kind in enumerate(c.layer_types):
            layer = f"{MODEL_PREFIX}layers.{i}."
            x = self._decoder_layer(layer, i, kind, x, state, state.position, positions)
            if layer_outputs is not None and i in layer_outputs:
                layer_outputs[i] = x
        state.position += len(tokens)
        return rms_norm(x, self._float(MODEL_PREFIX + "norm.weight"), c.rms_norm_eps)

    def mtp(
        self, hidden: np.ndarray, next_tokens: Sequence[int], start: int, state: ReferenceState
    ) -> tuple[np.ndarray, np.ndarray]:
        """The multi-token-prediction head over rows at positions [start, start + T): row t
        pairs the hidden state `hidden[t]` (the main model's final-normed state at that
        position, or the head's own output when chaining drafts) with the embedding of the
        token that follows it, `next_tokens[t]`, and predicts the token after that one.

        fc([pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(hidden)]) goes through one
        full-attention decoder layer (gated attention with its own KV cache, the MoE) and the
        head's final norm; the shared lm_head makes the logits. The head's KV cache keeps the
        rows before `start` and drops the rest (rows of drafts later rejected), as the engine
        overwrites them. Returns (logits [T, vocab], the head's final-normed output [T, hidden],
        which feeds the next draft step)."""
        c = self.config
        self._call_tokens = 1  # the engine's MTP passes are not modelled: exact
        layer = self.mtp_layer
        if layer not in state.keys:
            empty = np.zeros((c.num_key_value_heads, 0, c.head_dim), self.dtype)
            state.keys[layer], state.values[layer] = empty, empty
        state.keys[layer] = state.keys[layer][:, :start]
        state.values[layer] = state.values[layer][:, :start]
        if state.keys[layer].shape[1] != start:
            raise ValueError(f"the MTP cache holds {state.keys[layer].shape[1]} rows, not {start}")
        embedded = rms_norm(
            self.embed(np.asarray(next_tokens, np.int64)),
            self._float(MTP_NORM_EMBEDDING),
            c.rms_norm_eps,
        )
        hidden = rms_norm(
            np.asarray(hidden, self.dtype), self._float(MTP_NORM_HIDDEN), c.rms_norm_eps
        )
        x = self._linear(MTP_FC, np.concatenate([embedded, hidden], axis=-1))
        x = self._decoder_layer(MTP_LAYER, layer, FULL_ATTENTION, x, state, start)
        out = rms_norm(x, self._float(MTP_FINAL_NORM), c.rms_norm_eps)
        return self.lm_head(out), out

    @property
    def mtp_layer(self) -> int:
        """The index the MTP layer's KV cache is kept under: the one after the main layers."""
        return self.config.num_hidden_layers

    def decode(self, token: int, state: ReferenceState) -> np.ndarray:
        """One token after `state`; returns logits [vocab] and advances `state`."""
        logits, _ = self.prefill([token], state)
        return logits[0]

    def generate_greedy(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
    ) -> list[int]:
        """Greedy decoding (argmax, ties to the lowest id); stops after a stop token."""
        logits, state = self.prefill(prompt)
        generated: list[int] = []
        next_logits = logits[-1]
        while len(generated) < max_new_tokens:
            token = int(np.argmax(next_logits))
            generated.append(token)
            if token in stop_token_ids:
                break
            next_logits = self.decode(token, state)
        return generated

    def _decoder_layer(
        self,
        layer: str,
        index: int,
        kind: str,
        x: np.ndarray,
        state: ReferenceState,
        start: int,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """One block over rows at positions [start, start + T): the mixer, then the MoE.
        `positions`: the rows' rotary positions, [T] or [3, T] (default: their own)."""
        c = self.config
        mixer_in = rms_norm(x, self._float(layer + "input_layernorm.weight"), c.rms_norm_eps)
        if kind == FULL_ATTENTION:
            rope = start + np.arange(len(x)) if positions is None else positions
            x = x + self._attention(layer + "self_attn.", index, mixer_in, state, start, rope)
        else:
            x = x + self._gated_deltanet(layer + "linear_attn.", index, mixer_in, state)
        moe_in = rms_norm(x, self._float(layer + "post_attention_layernorm.weight"), c.rms_norm_eps)
        return x + self._moe(layer + "mlp.", moe_in)

    def _swiglu(self, x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray):
        """swiglu_mlp, on half-operand GEMMs in a pass the engine computes with them (the
        SwiGLU's output is a range-guarded input of the down projection)."""
        if not self._half_gemms:
            return swiglu_mlp(x, gate, up, down)
        hidden = silu(half_operand_gemm(x, gate)) * half_operand_gemm(x, up)
        return half_operand_gemm(hidden, down, guarded=True)

    def lm_head(self, x: np.ndarray) -> np.ndarray:
        c = self.config
        head = MODEL_PREFIX + "embed_tokens" if c.tie_word_embeddings else "language_model.lm_head"
        return self._linear(head, x)

    # -- weights ------------------------------------------------------------------------------

    def _float(self, name: str) -> np.ndarray:
        """An unquantized tensor in the compute dtype (bf16 arrives as uint16 bits)."""
        t = self.tensors[name]
        return (bf16_to_float32(t) if t.dtype == np.uint16 else t).astype(self.dtype)

    def _dequantized(self, base: str, index: slice | int | np.ndarray = slice(None)) -> np.ndarray:
        """Dequantize `base` (optionally only rows/experts `index` of its leading axis)."""
        spec = mtp_quant(base) if is_mtp(base) else self.config.quant_for(base)
        return dequantize(
            self.tensors[base + ".weight"][index],
            self.tensors[base + ".scales"][index],
            self.tensors[base + ".biases"][index],
            spec.bits,
            spec.group_size,
            self.dtype,
        )

    def _linear(self, base: str, x: np.ndarray, guarded: bool = False) -> np.ndarray:
        """x @ W^T; in a pass the engine computes with half-operand GEMMs, as they do (x as a
        `guarded` input, one the GEMM's range guard scales, or as a normed one)."""
        if not self._half_gemms:
            return x @ self._dequantized(base).T
        return half_operand_gemm(x, self._dequantized(base), guarded)

    @property
    def _half_gemms(self) -> bool:
        gemm_tokens = None if self.chunks is None else self.chunks.gemm_tokens
        return gemm_tokens is not None and self._call_tokens >= gemm_tokens

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self._dequantized(MODEL_PREFIX + "embed_tokens", tokens)

    # -- mixers -------------------------------------------------------------------------------

    def _gated_deltanet(
        self, prefix: str, layer: int, x: np.ndarray, state: ReferenceState
    ) -> np.ndarray:
        c = self.config
        n_tokens = x.shape[0]
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        qkv = self._linear(prefix + "in_proj_qkv", x)
        z = self._linear(prefix + "in_proj_z", x).reshape(n_tokens, hv, dv)
        b = self._linear(prefix + "in_proj_b", x)
        a = self._linear(prefix + "in_proj_a", x)
        conv_weight = self._float(prefix + "conv1d.weight")[:, :, 0]  # MLX stores [C, K, 1]
        A_log, dt_bias = self._float(prefix + "A_log"), self._float(prefix + "dt_bias")
        norm_weight = self._float(prefix + "norm.weight")

        mixed = np.empty_like(qkv)
        for t in range(n_tokens):
            mixed[t], state.conv_windows[layer] = causal_conv1d_step(
                state.conv_windows[layer], qkv[t], conv_weight
            )
        q, k, v = np.split(mixed, [c.linear_key_dim, 2 * c.linear_key_dim], axis=-1)
        q = l2_normalize(q.reshape(n_tokens, hk, dk)) * dk**-0.5
        k = l2_normalize(k.reshape(n_tokens, hk, dk))
        v = v.reshape(n_tokens, hv, dv)
        log_decay, beta = gdn_log_decay(a, A_log, dt_bias), sigmoid(b)
        if self.chunks is not None and n_tokens > 1:
            o, state.recurrent[layer] = gated_delta_chunk(
                state.recurrent[layer],
                q,
                k,
                v,
                log_decay,
                beta,
                self.chunks.gdn_sub_chunk,
                self.chunks.gdn_operands,
            )
        else:
            o = np.empty_like(v)
            for t in range(n_tokens):
                o[t], state.recurrent[layer] = gated_delta_step(
                    state.recurrent[layer], q[t], k[t], v[t], np.exp(log_decay[t]), beta[t]
                )
        outputs = gated_rms_norm(o, norm_weight, z, c.rms_norm_eps).reshape(n_tokens, -1)
        return self._linear(prefix + "out_proj", outputs, guarded=True)

    def _attention(
        self,
        prefix: str,
        layer: int,
        x: np.ndarray,
        state: ReferenceState,
        start: int,
        rope: np.ndarray,
    ) -> np.ndarray:
        c = self.config
        n_tokens, d = x.shape[0], c.head_dim
        positions = start + np.arange(n_tokens)
        streams = c.rope_streams()
        q_and_gate = self._linear(prefix + "q_proj", x).reshape(n_tokens, -1, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:].reshape(n_tokens, -1)
        k = self._linear(prefix + "k_proj", x).reshape(n_tokens, -1, d)
        v = self._linear(prefix + "v_proj", x).reshape(n_tokens, -1, d)
        q = rms_norm(q, self._float(prefix + "q_norm.weight"), c.rms_norm_eps)
        k = rms_norm(k, self._float(prefix + "k_norm.weight"), c.rms_norm_eps)
        # [T, H, D] -> [H, T, D]; the cache holds keys already rotated.
        q = apply_rope(q.transpose(1, 0, 2), rope, c.rotary_dim, c.rope_theta, streams)
        k = apply_rope(k.transpose(1, 0, 2), rope, c.rotary_dim, c.rope_theta, streams)
        v = v.transpose(1, 0, 2)
        if self.bf16_kv_cache:
            k, v = round_to_bf16(k).astype(self.dtype), round_to_bf16(v).astype(self.dtype)
        elif self.kv_int8_group is not None:
            fp16 = self.kv_int8_fp16_scales
            k = dequantize_int8(*quantize_int8(k, self.kv_int8_group, fp16))
            v = dequantize_int8(*quantize_int8(v, self.kv_int8_group, fp16))
        state.keys[layer] = np.concatenate([state.keys[layer], k], axis=1)
        state.values[layer] = np.concatenate([state.values[layer], v], axis=1)
        attention_tokens = None if self.chunks is None else self.chunks.attention_tokens
        if attention_tokens is not None and n_tokens >= attention_tokens:
            keys = self.chunks.attention_tile_keys
            out = attention_in_tiles(
                q, state.keys[layer], state.values[layer], d**-0.5, positions, keys
            )
        else:
            out = attention(q, state.keys[layer], state.values[layer], d**-0.5, positions)
        out = out.transpose(1, 0, 2).reshape(n_tokens, -1)
        return self._linear(prefix + "o_proj", out * sigmoid(gate), guarded=True)

    # -- mixture of experts -------------------------------------------------------------------

    def _moe(self, prefix: str, x: np.ndarray) -> np.ndarray:
        c = self.config
        expert_ids, weights = moe_route(
            self._linear(prefix + "gate", x), c.num_experts_per_tok, c.norm_topk_prob
        )
        experts = prefix + "switch_mlp."
        out = np.zeros_like(x)
        for e in np.unique(expert_ids):
            token_rows, slot = np.nonzero(expert_ids == e)
            y = self._swiglu(
                x[token_rows],
                self._dequantized(experts + "gate_proj", e),
                self._dequantized(experts + "up_proj", e),
                self._dequantized(experts + "down_proj", e),
            )
            out[token_rows] += weights[token_rows, slot][:, None] * y
        shared = prefix + "shared_expert."
        shared_y = self._swiglu(
            x,
            self._dequantized(shared + "gate_proj"),
            self._dequantized(shared + "up_proj"),
            self._dequantized(shared + "down_proj"),
        )
        return out + sigmoid(self._linear(prefix + "shared_expert_gate", x)) * shared_y
