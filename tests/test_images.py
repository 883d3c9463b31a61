"""The image preprocessor (lily.chat.images) against the reference processor (transformers'
Qwen2-VL image processor on its Pillow backend, the processor class the checkpoint names), and
its refusals of bad images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lily.chat.images import ImageLimits, ProcessorConfig, preprocess_image
from lily.errors import (
    ImageShapeError,
    ImageTooLargeError,
    NotAnImageError,
    TruncatedImageError,
)


def reference_processor(config: ProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )


def encoded(width: int, height: int, mode: str, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode)
    if mode == "RGBA":  # some fully and some partly transparent pixels
        alpha = np.array(image.getchannel("A"))
        alpha[: height // 2] = 0
        image.putalpha(Image.fromarray(alpha))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


IMAGES = {
    "37x53": (37, 53, "RGB"),
    "1000x17": (1000, 17, "RGB"),
    "640x480": (640, 480, "RGB"),
    "1x1": (1, 1, "RGB"),
    "rgba": (301, 199, "RGBA"),
    "grayscale": (123, 77, "L"),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_patches_equal_the_reference_processor(name: str) -> None:
    width, height, mode = IMAGES[name]
    data = encoded(width, height, mode)
    config = ProcessorConfig()
    expected = reference_processor(config)(Image.open(io.BytesIO(data)), return_tensors="np")
    patches = preprocess_image(data, config)
    assert patches.grid_thw == tuple(expected["image_grid_thw"][0])
    assert patches.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(patches.pixel_values, expected["pixel_values"])


def test_shrinking_to_the_pixel_budget_equals_the_reference() -> None:
    # A budget of 40 merge blocks makes a 640x480 photo (JPEG) shrink.
    config = ProcessorConfig(min_pixels=4 * 32 * 32, max_pixels=40 * 32 * 32)
    data = encoded(640, 480, "RGB", seed=3, fmt="JPEG")
    expected = reference_processor(config)(Image.open(io.BytesIO(data)), return_tensors="np")
    patches = preprocess_image(data, config)
    t, h, w = patches.grid_thw
    assert h * w * 16 * 16 <= config.max_pixels
    assert patches.grid_thw == tuple(expected["image_grid_thw"][0])
    np.testing.assert_array_equal(patches.pixel_values, expected["pixel_values"])


def test_rows_are_merge_blocks_of_patches_with_the_frame_repeated() -> None:
    # A 64x64 image is 4x4 patches; with merge 2 the second row is patch (0, 1) and the third
    # patch (1, 0). Each patch is filled with its own grey level to tell them apart.
    grid = np.arange(16, dtype=np.uint8).reshape(4, 4) * 10
    pixels = np.kron(grid, np.ones((16, 16), np.uint8))
    out = io.BytesIO()
    Image.fromarray(pixels, "L").save(out, "PNG")
    config = ProcessorConfig(min_pixels=64 * 64)
    patches = preprocess_image(out.getvalue(), config)
    assert patches.grid_thw == (1, 4, 4)
    assert patches.num_tokens == 4
    levels = (patches.pixel_values[:, 0] * 0.5 + 0.5) * 255
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    np.testing.assert_allclose(levels[:8], [grid[r, c] for r, c in order], atol=1e-3)
    rows = patches.pixel_values.reshape(16, 3, 2, 16, 16)
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])


def test_not_an_image_is_refused() -> None:
    with pytest.raises(NotAnImageError) as caught:
        preprocess_image(b"this is plain text, not an image")
    assert caught.value.status == 400 and caught.value.code == "invalid_image"


def test_a_truncated_image_is_refused() -> None:
    data = encoded(200, 150, "RGB")
    with pytest.raises(TruncatedImageError):
        preprocess_image(data[: len(data) // 2])


def test_too_many_bytes_are_refused_before_decoding() -> None:
    data = encoded(64, 64, "RGB")
    with pytest.raises(ImageTooLargeError) as caught:
        preprocess_image(data, limits=ImageLimits(max_bytes=len(data) - 1))
    assert caught.value.code == "image_too_large"


def test_too_many_pixels_are_refused_from_the_header() -> None:
    # A 5000x5000 PNG of one colour is a few kilobytes.
    out = io.BytesIO()
    Image.new("RGB", (5000, 5000)).save(out, "PNG")
    with pytest.raises(ImageTooLargeError):
        preprocess_image(out.getvalue(), limits=ImageLimits(max_pixels=4999 * 5000))


def test_an_extreme_aspect_ratio_is_refused() -> None:
    with pytest.raises(ImageShapeError):
        preprocess_image(encoded(402, 2, "RGB"))


def test_the_config_reads_the_pixel_budget_from_size() -> None:
    # preprocessor_config.json's `size` holds pixel counts under edge-named keys.
    raw = {"size": {"shortest_edge": 4096, "longest_edge": 1_048_576}, "patch_size": 14}
    config = ProcessorConfig.from_json(raw)
    assert (config.min_pixels, config.max_pixels, config.patch_size) == (4096, 1_048_576, 14)
    assert config.factor == 28
