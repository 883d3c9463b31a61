"""The numpy reference of the vision tower: from an image's patch rows to its embeddings in the
language model's hidden size (docs/vision.md, "The vision tower"), written to be read.

It is the oracle the tower's kernels will be checked against, as lily.engine.reference is the
language model's. Functions compute in the dtype of their inputs (float32, or float64 for tighter
checks); weights are the float32 arrays of lily.checkpoint.vision.vision_weights.

The flow for one image of grid (t, h, w) patches, rows in merge-block order
(lily.chat.images):
  patch rows -> patch_embed (a linear map of each C x T x P x P patch)
  + interpolated_position_embedding (the learned square grid resampled to h x w)
  -> depth x block (pre-norm LayerNorm; attention over the frame's patches with 2-D rotary
     positions; pre-norm LayerNorm; tanh-GELU MLP)
  -> merge (LayerNorm, then each merge x merge block of patches concatenated and mapped by a
     2-layer erf-GELU MLP to the LM's hidden size): t*h*w / merge^2 embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from lily.checkpoint.vision import VisionConfig

# ---------------------------------------------------------------------------------------------
# Per-operation math
# ---------------------------------------------------------------------------------------------


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(variance + eps) * weight + bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1 + np.tanh(inner))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf per element is slow but exact, which a reference wants.
    erf = np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2)).astype(x.dtype)
    return 0.5 * x * (1 + erf)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """`x @ weight.T + bias`, weight [out, in] as stored."""
    return x @ weight.T.astype(x.dtype) + bias.astype(x.dtype)


def patch_embed(rows: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """rows [N, C*T*P*P] (channel-major: C, then frame, then pixel row and column) -> [N, D].

    The weight is the converted checkpoint's 3-D convolution kernel [D, T, P, P, C] (channels
    last, as MLX stores convolutions); the convolution's stride equals its kernel, so it is one
    linear map per patch."""
    dim, frames, size, _, channels = weight.shape
    patches = rows.reshape(-1, channels, frames, size, size).transpose(0, 2, 3, 4, 1)
    return linear(patches.reshape(len(rows), -1), weight.reshape(dim, -1), bias)


def block_order(grid: np.ndarray, merge: int) -> np.ndarray:
    """[h, w, ...] in raster order -> [h*w, ...] in merge-block order (the rows' order)."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:])
    return blocks.swapaxes(1, 2).reshape(h * w, *grid.shape[2:])


def interpolated_position_embedding(
    table: np.ndarray, grid_thw: tuple[int, int, int], merge: int
) -> np.ndarray:
    """The learned [G*G, D] position grid resampled bilinearly (corners aligned: the image's
    first and last patch rows and columns take the grid's first and last) to h x w, in
    merge-block order and repeated for each of the t frames: [t*h*w, D]."""
    t, h, w = grid_thw
    side = math.isqrt(len(table))
    grid = table.reshape(side, side, -1)

    def axis(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        position = np.linspace(0, side - 1, n)
        low = position.astype(np.int64)
        high = np.minimum(low + 1, side - 1)
        return low, high, (position - low).astype(table.dtype)

    (h0, h1, dh), (w0, w1, dw) = axis(h), axis(w)
    dh, dw = dh[:, None, None], dw[None, :, None]
    resampled = (
        grid[h0][:, w0] * (1 - dh) * (1 - dw)
        + grid[h0][:, w1] * (1 - dh) * dw
        + grid[h1][:, w0] * dh * (1 - dw)
        + grid[h1][:, w1] * dh * dw
    )
    return np.tile(block_order(resampled, merge), (t, 1))


def rotary_angles(
    grid_thw: tuple[int, int, int], merge: int, head_dim: int, theta: float
) -> np.ndarray:
    """Each patch's rotary angles [t*h*w, head_dim / 2]: the first half rotates by its patch row,
    the second by its patch column, each over head_dim / 4 frequencies theta^(-2i / (head_dim /
    2)). Frames share positions (no temporal rotary inside the tower)."""
    t, h, w = grid_thw
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (np.arange(quarter) * 2 / (head_dim // 2))
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    coords = block_order(np.stack([rows, cols], axis=-1), merge)
    angles = np.concatenate(
        [coords[:, :1] * inv_freq[None], coords[:, 1:] * inv_freq[None]], axis=-1
    )
    return np.tile(angles, (t, 1))


def apply_rotary(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """x [N, heads, head_dim] rotated pairwise (i, i + head_dim / 2) by angles [N, head_dim / 2]."""
    cos = np.cos(angles).astype(x.dtype)[:, None]
    sin = np.sin(angles).astype(x.dtype)[:, None]
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Bidirectional softmax attention, q/k/v [N, heads, head_dim] -> [N, heads, head_dim]."""
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


# ---------------------------------------------------------------------------------------------
# The tower
# ---------------------------------------------------------------------------------------------


class VisionTower:
    """The tower of one checkpoint: `VisionTower(config, weights)(rows, grid_thw)`."""

    def __init__(self, config: VisionConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.weights = weights

    def __call__(self, rows: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """Patch rows [t*h*w, C*T*P*P] of one image -> embeddings [t*h*w / merge^2, out]."""
        c, w = self.config, self.weights
        t, h, width = grid_thw
        if rows.shape != (t * h * width, c.patch_values):
            raise ValueError(f"rows {rows.shape} do not match grid {grid_thw} and the config")
        x = patch_embed(rows, w["patch_embed.proj.weight"], w["patch_embed.proj.bias"])
        table = w["pos_embed.weight"].astype(x.dtype)
        x = x + interpolated_position_embedding(table, grid_thw, c.spatial_merge_size)
        angles = rotary_angles(grid_thw, c.spatial_merge_size, c.head_dim, c.rope_theta)
        for i in range(c.depth):
            x = self.block(i, x, angles, frame=h * width)
        return self.merge(x)

    def block(self, i: int, x: np.ndarray, angles: np.ndarray, frame: int) -> np.ndarray:
        c, w, p = self.config, self.weights, f"blocks.{i}."
        normed = layer_norm(x, w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
        qkv = linear(normed, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(len(x), 3, c.num_heads, c.head_dim).transpose(1, 0, 2, 3)
        q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        # Each frame attends within itself (a still image is one frame).
        mixed = np.concatenate(
            [
                attention(q[s : s + frame], k[s : s + frame], v[s : s + frame])
                for s in range(0, len(x), frame)
            ]
        ).reshape(len(x), -1)
        x = x + linear(mixed, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        normed = layer_norm(x, w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
        hidden = gelu_tanh(
            linear(normed, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"])
        )
        return x + linear(hidden, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])

    def merge(self, x: np.ndarray) -> np.ndarray:
        c, w = self.config, self.weights
        normed = layer_norm(x, w["merger.norm.weight"], w["merger.norm.bias"], c.layer_norm_eps)
        blocks = normed.reshape(-1, c.hidden_size * c.spatial_merge_size**2)
        hidden = gelu_erf(
            linear(blocks, w["merger.linear_fc1.weight"], w["merger.linear_fc1.bias"])
        )
        return linear(hidden, w["merger.linear_fc2.weight"], w["merger.linear_fc2.bias"])
