"""The numpy reference of the DFlash block drafter (docs/dflash.md): the oracle its device passes
are checked against, written to be read.

Two passes share one drafter cache (per layer, the keys and values of the context rows):

- *catch-up* over the target's rows whose tokens were kept: the residual stream after the
  target's `target_layer_ids` layers, concatenated per row, through `fc` and `hidden_norm`
  (the context rows), then per layer only `k_proj`/`v_proj`, `k_norm` and RoPE at the rows'
  positions, appended to the cache. Context rows are never transformed by the layers.
- *block* at the position p after the cache's rows: the target's embedding of the newest token
  followed by n mask tokens, through every layer (queries from the block only; keys and values
  are the cache's followed by the block's own, which are not kept), the final norm and the
  target's lm_head; rows 1..n give the n drafts.

Attention inside the block is not causal on full-attention layers (every block row sees every
context and block row); a sliding layer sees context keys less than its window behind the
query and is causal inside the block unless the config says otherwise (z-lab's rule). RoPE turns
all head dims, with YaRN's blend of frequencies and its attention factor. Every norm is a plain
RMSNorm with the gain as stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass, field

import numpy as np

from lily.checkpoint.dflash import DRAFTER_QUANT, DFlashConfig, DFlashDrafter, YarnRope
from lily.checkpoint.quant import bf16_to_float32, dequantize, round_to_bf16
from lily.engine.reference import ReferenceModel, rms_norm, silu

# ---------------------------------------------------------------------------------------------
# Per-operation math
# ---------------------------------------------------------------------------------------------


def yarn_ramp(head_dim: int, rope: YarnRope) -> tuple[float, float]:
    """YaRN's blend of rotary pairs (low, high): pair i is extrapolated below `low` and
    interpolated from `high`, linearly blended between. The pair turning r times over
    original_max_position_embeddings L sits at d ln(L / (2 pi r)) / (2 ln theta); low is the
    floor of it at beta_fast, high the ceil at beta_slow (a step if they meet)."""

    def pair_turning(turns: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low = max(math.floor(pair_turning(rope.beta_fast)), 0)
    high = min(math.ceil(pair_turning(rope.beta_slow)), head_dim - 1)
    return float(low), high + 0.001 if low == high else float(high)


def yarn_inverse_frequencies(head_dim: int, rope: YarnRope) -> np.ndarray:
    """The angle per position of each of the head_dim / 2 rotary pairs (float64): plain RoPE's
    theta^(-2i/d) where a pair turns many times over the original context (extrapolated), that
    divided by `factor` where it turns less than about once (interpolated), blended between
    (yarn_ramp); plain RoPE's alone at factor 1."""
    half = head_dim // 2
    extrapolated = rope.theta ** (-np.arange(half, dtype=np.float64) * 2 / head_dim)
    if rope.factor <= 1:
        return extrapolated
    low, high = yarn_ramp(head_dim, rope)
    interpolated_share = np.clip((np.arange(half) - low) / (high - low), 0, 1)
    return extrapolated * (1 - interpolated_share) + extrapolated / rope.factor * interpolated_share


def yarn_attention_factor(factor: float) -> float:
    """YaRN's scale of queries and keys alike after rotation: 0.1 ln(factor) + 1 (1 unscaled)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def apply_yarn_rope(x: np.ndarray, positions: np.ndarray, rope: YarnRope) -> np.ndarray:
    """Rotate-half RoPE over all dims of x [..., T, D] at `positions` [T] with
    yarn_inverse_frequencies, then YaRN's attention factor."""
    half = x.shape[-1] // 2
    inv_freq = yarn_inverse_frequencies(x.shape[-1], rope)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated * x.dtype.type(yarn_attention_factor(rope.factor))


def block_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    context: int,
    causal: bool,
    window: int | None,
) -> np.ndarray:
    """Softmax attention of a block's queries over context keys then block keys, grouped KV.

    q [Hq, B, D]; k, v [Hkv, context + B, D], key j at position j (the block's own keys last),
    query i at position context + i. A context key is seen by every query (within `window`: a
    key less than that many positions behind the query); a block key by every query unless
    `causal`, then by queries at or after it. Returns [Hq, B, D]."""
    n_q_heads, n_kv_heads = q.shape[0], k.shape[0]
    kv_head = np.arange(n_q_heads) // (n_q_heads // n_kv_heads)
    k, v = k[kv_head], v[kv_head]
    query = context + np.arange(q.shape[1])[:, None]
    key = np.arange(k.shape[1])[None, :]
    in_context = (key < context) & (True if window is None else query - key < window)
    in_block = (key >= context) & (key <= query if causal else True)
    scores = np.einsum("hqd,hkd->hqk", q, k) * scale
    scores = np.where((in_context | in_block)[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", probs, v)


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterCache:
    """Per drafter layer, the rotated keys and the values of the context rows [Hkv, T, D]; row
    j is the token at position j."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


class DFlashReference:
    """The drafter's passes over its tensors (lily.checkpoint.dflash's layout) and the target's
    embedding and lm_head, in the target reference's dtype."""

    def __init__(
        self, drafter: DFlashDrafter, target: ReferenceModel, bf16_cache: bool = False
    ) -> None:
        """`bf16_cache` rounds keys and values to bf16, as the device's drafter cache holds them
        (the block's own too, which the device reads back from it)."""
        self.config: DFlashConfig = drafter.config
        self.tensors = drafter.tensors
        self.target = target
        self.dtype = target.dtype
        self.bf16_cache = bf16_cache

    def new_cache(self) -> DrafterCache:
        c = self.config
        empty = np.zeros((c.num_key_value_heads, 0, c.head_dim), self.dtype)
        return DrafterCache([empty] * c.num_hidden_layers, [empty] * c.num_hidden_layers)

    def target_layers(self) -> dict[int, np.ndarray]:
        """The `layer_outputs` to hand ReferenceModel.hidden_states for the features."""
        return dict.fromkeys(self.config.target_layer_ids)

    def features(self, layer_outputs: dict[int, np.ndarray]) -> np.ndarray:
        """The target rows the drafter reads: the residual after each of its target layers,
        concatenated per row in target_layer_ids order [T, len(ids) * hidden]."""
        return np.concatenate([layer_outputs[i] for i in self.config.target_layer_ids], axis=-1)

    def context(self, features: np.ndarray) -> np.ndarray:
        """hidden_norm(fc(features)): the context rows [T, hidden] every layer reads."""
        x = np.asarray(features, self.dtype) @ self._dequantized("fc").T
        return rms_norm(x, self._float("hidden_norm.weight"), self.config.rms_norm_eps)

    def catch_up(self, features: np.ndarray, cache: DrafterCache) -> None:
        """Appends the context rows of `features` (the next rows after the cache's) to every
        layer's keys and values."""
        ctx = self.context(features)
        positions = cache.length + np.arange(len(ctx))
        for i in range(self.config.num_hidden_layers):
            k, v = self._keys_values(i, ctx, positions)
            cache.keys[i] = np.concatenate([cache.keys[i], k], axis=1)
            cache.values[i] = np.concatenate([cache.values[i], v], axis=1)

    def block_logits(self, newest: int, n: int, cache: DrafterCache) -> np.ndarray:
        """The logits [n, vocab] of the n drafts after `newest`, the token at the position
        after the cache's rows (not yet fed to the target). Leaves the cache as it was."""
        c = self.config
        tokens = np.array([newest] + [c.mask_token_id] * n, np.int64)
        x = self.target.embed(tokens)
        context = cache.length
        positions = context + np.arange(n + 1)
        for i in range(c.num_hidden_layers):
            layer = f"layers.{i}."
            normed = rms_norm(x, self._float(layer + "input_layernorm.weight"), c.rms_norm_eps)
            x = x + self._attention(i, normed, positions, cache)
            normed = rms_norm(
                x, self._float(layer + "post_attention_layernorm.weight"), c.rms_norm_eps
            )
            gate = normed @ self._dequantized(layer + "mlp.gate_proj").T
            up = normed @ self._dequantized(layer + "mlp.up_proj").T
            x = x + (silu(gate) * up) @ self._dequantized(layer + "mlp.down_proj").T
        out = rms_norm(x[1:], self._float("norm.weight"), c.rms_norm_eps)
        return self.target.lm_head(out)

    def draft(self, newest: int, n: int, cache: DrafterCache) -> list[int]:
        """n greedy drafts after `newest` (argmax per row, ties to the lowest id)."""
        return [int(t) for t in np.argmax(self.block_logits(newest, n, cache), axis=-1)]

    def _keys_values(
        self, layer: int, x: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s rotated keys and values of rows x at `positions` [Hkv, T, D]."""
        c, prefix = self.config, f"layers.{layer}.self_attn."
        k = (x @ self._dequantized(prefix + "k_proj").T).reshape(len(x), -1, c.head_dim)
        v = (x @ self._dequantized(prefix + "v_proj").T).reshape(len(x), -1, c.head_dim)
        k = rms_norm(k, self._float(prefix + "k_norm.weight"), c.rms_norm_eps)
        k, v = apply_yarn_rope(k.transpose(1, 0, 2), positions, c.rope), v.transpose(1, 0, 2)
        if self.bf16_cache:
            k, v = round_to_bf16(k).astype(self.dtype), round_to_bf16(v).astype(self.dtype)
        return k, v

    def _attention(
        self, layer: int, x: np.ndarray, positions: np.ndarray, cache: DrafterCache
    ) -> np.ndarray:
        c, prefix = self.config, f"layers.{layer}.self_attn."
        q = (x @ self._dequantized(prefix + "q_proj").T).reshape(len(x), -1, c.head_dim)
        q = rms_norm(q, self._float(prefix + "q_norm.weight"), c.rms_norm_eps)
        q = apply_yarn_rope(q.transpose(1, 0, 2), positions, c.rope)
        k, v = self._keys_values(layer, x, positions)
        out = block_attention(
            q,
            np.concatenate([cache.keys[layer], k], axis=1),
            np.concatenate([cache.values[layer], v], axis=1),
            c.head_dim**-0.5,
            cache.length,
            c.causal_in_block(layer),
            c.window(layer),
        )
        return out.transpose(1, 0, 2).reshape(len(x), -1) @ self._dequantized(prefix + "o_proj").T

    def _float(self, name: str) -> np.ndarray:
        return bf16_to_float32(self.tensors[name]).astype(self.dtype)

    def _dequantized(self, base: str) -> np.ndarray:
        return dequantize(
            self.tensors[base + ".weight"],
            self.tensors[base + ".scales"],
            self.tensors[base + ".biases"],
            DRAFTER_QUANT.bits,
            DRAFTER_QUANT.group_size,
            self.dtype,
        )


def greedy_with_drafts(
    target: ReferenceModel,
    drafter: DFlashReference,
    prompt: Sequence[int],
    max_new_tokens: int,
    draft_tokens: int,
) -> tuple[list[int], list[int]]:
    """Greedy decoding where each target pass verifies a block of drafts (the loop the engine
    runs, in its simplest form): feed [newest, drafts...], keep the drafts equal to the target's
    argmax, then its own token; the drafter catches up on the kept rows. Returns (the tokens,
    the number of drafts kept per pass). The tokens equal target.generate_greedy's whatever the
    drafts: the target decides every one."""
    state, cache = target.new_state(), drafter.new_cache()
    outputs = drafter.target_layers()
    hidden = target.hidden_states(prompt, state, layer_outputs=outputs)
    drafter.catch_up(drafter.features(outputs), cache)
    newest = int(np.argmax(target.lm_head(hidden[-1:])[0]))
    tokens, kept_per_pass = [newest], []
    while len(tokens) < max_new_tokens:
        n = min(draft_tokens, max_new_tokens - len(tokens))
        drafts = drafter.draft(newest, n, cache)
        # The target's pass over the block; its state is rebuilt from the kept rows below.
        trial = deepcopy(state)
        outputs = drafter.target_layers()
        block = [newest, *drafts]
        picks = np.argmax(
            target.lm_head(target.hidden_states(block, trial, layer_outputs=outputs)), axis=-1
        )
        kept = 0
        while kept < n and drafts[kept] == picks[kept]:
            kept += 1
        kept_per_pass.append(kept)
        rows = kept + 1  # the newest token and the kept drafts were right
        outputs = drafter.target_layers()
        target.hidden_states(block[:rows], state, layer_outputs=outputs)
        drafter.catch_up(drafter.features(outputs), cache)
        tokens += [int(t) for t in picks[:rows]]
        newest = tokens[-1]
    return tokens[:max_new_tokens], kept_per_pass
