"""An image as the engine takes it: the vision tower's input rows, the patch grid, and a digest
of the content that keys the prefix cache.

The chat layer makes these (lily.chat.images) and puts one run of `image_token_id` per image in
the prompt, `num_tokens` long, in the images' order; the engine encodes each image with the
vision tower and puts the tower's rows in place of the run's embeddings (docs/vision.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ImagePatches:
    pixel_values: np.ndarray  # [t*h*w, C*T*P*P] float32, merge-block order
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int
    # sha256 of the grid and the pixel values: equal images, equal digests.
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hasher = hashlib.sha256(repr((self.grid_thw, self.merge_size)).encode())
        hasher.update(np.ascontiguousarray(self.pixel_values, np.float32).tobytes())
        object.__setattr__(self, "digest", hasher.hexdigest())

    @property
    def num_tokens(self) -> int:
        """Language-model tokens the image becomes: one per merge block."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2
