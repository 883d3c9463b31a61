"""The numpy vision tower (lily.engine.vision_reference) against mlx-vlm's (the pinned oracle,
CPU MLX, float32) on the tiny checkpoints' random tower, fed by Lily's own preprocessor."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
from PIL import Image
from tiny_models import TINY_VISION, tiny_checkpoint

from lily.chat.images import ProcessorConfig, preprocess_image
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.quant import dequantize, quantize
from lily.checkpoint.vision import VISION_PREFIX, parse_vision_config, vision_weights
from lily.engine.image_input import ImagePatches
from lily.engine.vision_reference import (
    VisionTower,
    interpolated_position_embedding,
    rotary_angles,
)
from lily.errors import ConfigError


@pytest.fixture(scope="module")
def small_tower() -> VisionTower:
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    config = parse_vision_config(checkpoint.config.raw)
    return VisionTower(config, vision_weights(checkpoint.tensors, checkpoint.config))


@functools.cache
def mlx_vlm_tower(name: str):
    """mlx-vlm's tower with the weights of mlx's own (unaligned) file, in float32."""
    import json

    import mlx.core as mx
    from mlx_vlm.models.qwen3_5_moe import VisionConfig, VisionModel

    path = tiny_checkpoint(name, aligned=False)
    raw = json.loads((path / "config.json").read_text())["vision_config"]
    model = VisionModel(VisionConfig.from_dict(raw))
    weights = mx.load(str(path / "model.safetensors"))
    model.load_weights(
        [
            (n.removeprefix(VISION_PREFIX), w)
            for n, w in weights.items()
            if n.startswith(VISION_PREFIX)
        ],
        strict=True,
    )
    model.set_dtype(mx.float32)
    return model


def image_patches(width: int, height: int, seed: int) -> ImagePatches:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return preprocess_image(out.getvalue(), ProcessorConfig())


def run_mlx_vlm(model, rows: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
    import mlx.core as mx

    merged, deepstack = model(mx.array(rows), mx.array([list(grid_thw)]))
    assert deepstack == []
    return np.array(merged)


@pytest.mark.parametrize(
    ("name", "size"), [("small", (37, 53)), ("small", (1000, 17)), ("wide", (53, 37))]
)
def test_merged_embeddings_equal_mlx_vlm(name: str, size: tuple[int, int]) -> None:
    checkpoint = load_checkpoint(tiny_checkpoint(name))
    tower = VisionTower(
        parse_vision_config(checkpoint.config.raw),
        vision_weights(checkpoint.tensors, checkpoint.config),
    )
    patches = image_patches(*size, seed=sum(size))
    expected = run_mlx_vlm(mlx_vlm_tower(name), patches.pixel_values, patches.grid_thw)
    ours = tower(patches.pixel_values, patches.grid_thw)
    assert ours.shape == (patches.num_tokens, checkpoint.config.hidden_size) == expected.shape
    scale = np.abs(expected).max()
    # Both in float32: they differ by rounding (measured: 1e-6 of the largest value).
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5 * scale)
    exact = tower(patches.pixel_values.astype(np.float64), patches.grid_thw)
    np.testing.assert_allclose(expected, exact, rtol=0, atol=1e-5 * scale)


def test_frames_attend_within_themselves_as_mlx_vlm_does(small_tower: VisionTower) -> None:
    # Two temporal patches (a video's layout): 2 x 4 x 6 patch rows, random values.
    grid = (2, 4, 6)
    rows = np.random.default_rng(5).normal(0, 1, (48, small_tower.config.patch_values))
    rows = rows.astype(np.float32)
    expected = run_mlx_vlm(mlx_vlm_tower("small"), rows, grid)
    ours = small_tower(rows, grid)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    # The second frame alone gives the second frame's embeddings: no attention across frames.
    second = small_tower(rows[24:], (1, 4, 6))
    np.testing.assert_allclose(ours[6:], second, rtol=0, atol=1e-5 * np.abs(second).max())


def test_the_loader_keeps_skipping_the_tower() -> None:
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    names = [n for n in checkpoint.tensors if n.startswith(VISION_PREFIX)]
    # patch embedding (2) + position grid + 12 per block + merger (6)
    assert len(names) == 2 + 1 + 12 * TINY_VISION.depth + 6
    assert checkpoint.tensors["vision_tower.blocks.0.attn.qkv.weight"].dtype == np.uint16  # bf16
    config = parse_vision_config(checkpoint.config.raw)
    assert config.out_hidden_size == checkpoint.config.hidden_size
    assert checkpoint.tensors["vision_tower.patch_embed.proj.weight"].shape == (
        config.hidden_size, config.temporal_patch_size, config.patch_size, config.patch_size, 3,
    )  # fmt: skip


def test_a_quantized_projection_is_dequantized() -> None:
    # mlx-vlm's converter leaves the tower in bf16, but a checkpoint converted with another
    # predicate carries a (weight, scales, biases) triple: the config's 4-bit group-64 applies.
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    tensors = dict(checkpoint.tensors)
    path = "vision_tower.blocks.0.mlp.linear_fc1"
    plain = vision_weights(tensors, checkpoint.config)["blocks.0.mlp.linear_fc1.weight"]
    triple = quantize(plain, 4, 64)
    tensors[f"{path}.weight"], tensors[f"{path}.scales"], tensors[f"{path}.biases"] = triple
    weights = vision_weights(tensors, checkpoint.config)
    assert not any(name.endswith((".scales", ".biases")) for name in weights)
    np.testing.assert_array_equal(
        weights["blocks.0.mlp.linear_fc1.weight"], dequantize(*triple, 4, 64)
    )
    step = np.abs(plain).max() * 2 / 15
    np.testing.assert_allclose(weights["blocks.0.mlp.linear_fc1.weight"], plain, atol=step)


def test_the_position_grid_at_its_own_size_is_the_table_in_block_order() -> None:
    side, dim = 4, 3
    table = np.arange(side * side * dim, dtype=np.float64).reshape(side * side, dim)
    resampled = interpolated_position_embedding(table, (1, side, side), merge=2)
    # Merge-block order: grid cells (0,0), (0,1), (1,0), (1,1), then (0,2), ...
    np.testing.assert_array_equal(resampled[:5], table[[0, 1, 4, 5, 2]])
    halfway = interpolated_position_embedding(table, (1, 1, 7), merge=1)
    np.testing.assert_allclose(halfway[1], (table[0] + table[1]) / 2)  # column 0.5 of 0..3


def test_rotary_angles_rotate_by_row_then_column() -> None:
    angles = rotary_angles((1, 2, 4), merge=2, head_dim=8, theta=100.0)
    # head_dim 8: two frequencies per axis, 1 and 100^-0.5; the second patch of the first merge
    # block is at row 0, column 1.
    np.testing.assert_allclose(angles[1], [0, 0, 1, 0.1])
    np.testing.assert_allclose(angles[2], [1, 0.1, 0, 0])


def test_a_tower_this_reference_does_not_compute_is_refused() -> None:
    raw = {"vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27}}
    with pytest.raises(ConfigError, match="deepstack"):
        parse_vision_config(raw)
    with pytest.raises(ConfigError, match="no vision_config"):
        parse_vision_config({"text_config": {}})
