"""From image bytes to the vision tower's input: decoding (Pillow), resizing onto the patch grid
and the patch layout, as the checkpoint's reference processor does it (docs/vision.md, "The
image preprocessor").

An image becomes `ImagePatches` (lily.engine.image_input): `pixel_values` [t*h*w, C*T*P*P] (one
row per patch of P x P pixels, T frames deep, channel-major inside the row) and `grid_thw`
(t, h, w) in patches. A still image is one temporal patch: its frame is repeated T times, as the
reference does, so the same layout serves video later. Rows come in merge-block order: the
merge x merge patches that the tower's merger turns into one language-model token are
consecutive.

The limits raise the named errors of lily.errors (400s); where a request's images come from is
lily.chat.image_sources.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lily.checkpoint.files import read_json_file
from lily.engine.image_input import ImagePatches
from lily.errors import (
    CheckpointError,
    ContextLengthError,
    ImageShapeError,
    ImageTooLargeError,
    NotAnImageError,
    TruncatedImageError,
)

# The reference processor refuses a side more than 200 times the other.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ProcessorConfig:
    """The values of the checkpoint's preprocessor_config.json that shape the patches; the
    defaults are Qwen3.6-35B-A3B's (docs/vision.md). `min_pixels` and `max_pixels` bound the
    resized image (the file's `size.shortest_edge` and `size.longest_edge`: pixel counts, not
    edges)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ProcessorConfig:
        default = cls()
        size = raw.get("size") or {}
        return cls(
            patch_size=int(raw.get("patch_size", default.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", default.min_pixels))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels", default.max_pixels))),
            image_mean=tuple(raw.get("image_mean", default.image_mean)),
            image_std=tuple(raw.get("image_std", default.image_std)),
            rescale_factor=float(raw.get("rescale_factor", default.rescale_factor)),
        )

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merge block of patches."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageLimits:
    """Bounds checked before any pixel is decoded: the encoded size, and the decoded image's
    pixel count from its header (a small file can declare a huge image)."""

    max_bytes: int = 20 * 2**20
    # Below Pillow's own decompression-bomb warning (about 89 M pixels).
    max_pixels: int = 40_000_000
    # Images in one request (each is also bounded by the context its tokens take).
    max_images: int = 32


def processor_config(model_dir: Path) -> ProcessorConfig | None:
    """How the checkpoint in `model_dir` cuts images into patches: its preprocessor_config.json,
    or the defaults (the real model's) if it has a vision tower but not that file; None if its
    config.json has no vision tower."""
    config = read_json_file(model_dir / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    path = model_dir / "preprocessor_config.json"
    if not path.exists():
        return ProcessorConfig()
    raw = read_json_file(path)
    try:
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        return ProcessorConfig.from_json(raw)
    except (TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path} is not an image processor's config: {error}") from None


def preprocess_image(
    data: bytes,
    config: ProcessorConfig | None = None,
    limits: ImageLimits | None = None,
    max_tokens: int | None = None,
) -> ImagePatches:
    """The tower's input for one encoded image (PNG, JPEG, WebP, GIF's first frame, ...).
    An image that would become more than `max_tokens` language-model tokens raises
    ContextLengthError once its size is known, before its pixels are converted."""
    config = config or ProcessorConfig()
    image = decode_image(data, limits or ImageLimits())
    height, width = resized_size(image.height, image.width, config)
    tokens = height * width // config.factor**2
    if max_tokens is not None and tokens > max_tokens:
        raise ContextLengthError(
            f"the image is {image.width}x{image.height}, resized to {width}x{height}: "
            f"{tokens} tokens, more than the {max_tokens} the context has room for"
        )
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = normalize(np.asarray(image), config)
    return patchify(pixels, config)


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image as 8-bit RGB; transparency is composited onto white, as the reference does."""
    if len(data) > limits.max_bytes:
        raise ImageTooLargeError(
            f"the image has {len(data)} bytes; at most {limits.max_bytes} are accepted"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError as error:
        raise NotAnImageError(str(error)) from None
    except (OSError, ValueError, SyntaxError) as error:
        raise TruncatedImageError(str(error)) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageTooLargeError(
            f"the image is {width}x{height} ({width * height} pixels); "
            f"at most {limits.max_pixels} pixels are accepted"
        )
    try:
        image.load()
    except Image.DecompressionBombError as error:  # a limit raised past Pillow's own
        raise ImageTooLargeError(str(error)) from None
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise TruncatedImageError(str(error)) from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def resized_size(height: int, width: int, config: ProcessorConfig) -> tuple[int, int]:
    """(height, width) on the patch grid: each side rounded to a multiple of `config.factor`,
    then both scaled by one factor into [min_pixels, max_pixels] (rounding down when shrinking,
    up when growing), keeping the aspect ratio as nearly as the grid allows."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ImageShapeError(
            f"the image is {width}x{height}: one side may be at most {MAX_ASPECT_RATIO} "
            "times the other"
        )
    factor = config.factor
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def normalize(rgb: np.ndarray, config: ProcessorConfig) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32: scaled to [0, 1], then (x - mean) / std."""
    # Scaled in float64 and rounded once, as the reference does: bit-identical values.
    x = (rgb.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, np.float32)
    std = np.asarray(config.image_std, np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


def patchify(pixels: np.ndarray, config: ProcessorConfig) -> ImagePatches:
    """[C, H, W] (H, W multiples of patch * merge) -> one row per patch, merge-block order,
    the frame repeated over the temporal patch."""
    channels, height, width = pixels.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> block row, block column, row in block, column in block, channel, pixel row, pixel col
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.repeat(blocks[:, :, :, :, :, None], t, axis=5)
    rows = frames.reshape(grid_h * grid_w, channels * t * p * p)
    return ImagePatches(np.ascontiguousarray(rows), (1, grid_h, grid_w), m)
