"""Where a prompt's images sit, and what that changes for the language model: the rotary
positions of every token (M-RoPE) and the token ids the prefix cache keys it by.

A prompt holds one run of `image_token_id` per image, `image.num_tokens` long, in the images'
order; the engine puts the image's encoded rows in place of the run's embeddings. Positions
(docs/vision.md, "Image tokens in the language model"): every token has three, temporal, height
and width. A text token's three equal its rope position, which is the token index until the first
image and afterwards continues from the largest position so far plus one. An image's tokens, in
merge-block raster order, sit at (start + frame, start + row, start + column) of its merged grid,
`start` being where the text before it stopped; so after an image of t x h x w merged tokens the
positions run ahead of the token index by max(t, h, w) - t*h*w (an offset that then holds for
every later token: the KV cache slot stays the token index).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lily.checkpoint.config import ModelConfig
from lily.engine.image_input import ImagePatches
from lily.errors import ImagesUnsupportedError, ImageTokensError

# Prefix-cache ids of image tokens: above every vocabulary (MAX_VOCAB is 2^24) and within uint32
# (the disk tier stores ids as uint32).
IMAGE_KEY_BASE = 1 << 31


@dataclass(frozen=True)
class ImageRun:
    """An image and the position of the first token of its run in the prompt."""

    start: int
    image: ImagePatches

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        """(frames, rows, columns) of the image's language-model tokens."""
        t, h, w = self.image.grid_thw
        merge = self.image.merge_size
        return t, h // merge, w // merge


def image_runs(
    prompt: Sequence[int], images: Sequence[ImagePatches], config: ModelConfig
) -> list[ImageRun]:
    """The images' runs in `prompt`, checked against the contract: ImageTokensError if the runs
    of `image_token_id` are not one per image, each exactly the image's length;
    ImagesUnsupportedError if the model takes no images but some are given. Without images
    the prompt is text whatever ids it holds, fed exactly as before images existed (an
    `<|image_pad|>` id is then the text token it is, as mlx-lm feeds it)."""
    if not images:
        return []
    if not config.takes_images:
        raise ImagesUnsupportedError("this model has no vision tower: it cannot take images")
    token = config.image_token_id
    flags = np.asarray(prompt) == token
    edges = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]).astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]
    if len(starts) != len(images):
        raise ImageTokensError(
            f"the prompt holds {len(starts)} run(s) of image tokens for {len(images)} image(s)"
        )
    runs = []
    for i, (start, end, image) in enumerate(zip(starts, ends, images, strict=True)):
        if end - start != image.num_tokens:
            raise ImageTokensError(
                f"image {i} has {image.num_tokens} tokens but its run in the prompt has "
                f"{end - start}"
            )
        runs.append(ImageRun(int(start), image))
    return runs


def rope_positions(length: int, runs: Sequence[ImageRun]) -> tuple[np.ndarray, int]:
    """The three rotary positions [3, length] (temporal, height, width; int64) of a prompt of
    `length` tokens with these image runs, and the offset of every later token's positions
    from its index."""
    positions = np.empty((3, length), np.int64)
    offset = 0  # rope position minus token index, for the text so far
    cursor = 0
    for run in runs:
        positions[:, cursor : run.start] = np.arange(cursor, run.start) + offset
        start = run.start + offset
        frames, rows, columns = run.merged_grid
        grid = np.indices((frames, rows, columns)).reshape(3, -1)
        positions[:, run.start : run.end] = start + grid
        offset = start + max(frames, rows, columns) - run.end
        cursor = run.end
    positions[:, cursor:] = np.arange(cursor, length) + offset
    return positions, offset


def cache_tokens(prompt: Sequence[int], runs: Sequence[ImageRun]) -> list[int]:
    """The ids the prefix cache keys `prompt` by: its own, with each image run's replaced by ids
    from the image's digest (outside the vocabulary), so that two prompts share a cached prefix
    past an image's first token only if they hold the same image there."""
    keyed = [int(t) for t in prompt]
    for run in runs:
        keyed[run.start : run.end] = image_key_ids(run.image.digest, run.image.num_tokens)
    return keyed


def image_key_ids(digest: str, count: int) -> list[int]:
    """`count` ids standing for the image of this digest: its 31-bit words in turn, each made
    distinct by its index in the run, above IMAGE_KEY_BASE."""
    words = np.frombuffer(hashlib.sha256(bytes.fromhex(digest)).digest(), np.uint32)
    index = np.arange(count, dtype=np.uint32)
    mixed = (words[index % len(words)] ^ (index * np.uint32(0x9E3779B1))) >> np.uint32(1)
    return [IMAGE_KEY_BASE | int(w) for w in mixed]


class PromptImages:
    """A prompt's images as an engine feeds it: the runs (checked), the ids the prefix cache
    keys the prompt by, the rotary positions, and each image's rows, encoded by `encode` when a
    pass first needs them (an image inside a cached prefix is never encoded)."""

    def __init__(
        self,
        prompt: Sequence[int],
        images: Sequence[ImagePatches],
        config: ModelConfig,
        encode: Callable[[ImagePatches], np.ndarray],
    ) -> None:
        self.runs = image_runs(prompt, images, config)
        self.cache_tokens = cache_tokens(prompt, self.runs)
        self.positions: np.ndarray | None = None
        self.rope_offset = 0
        if self.runs:
            self.positions, self.rope_offset = rope_positions(len(prompt), self.runs)
        self._encode = encode
        # Each image's rows, held for this request whatever the encoder keeps.
        self._rows: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self.runs)

    def touches(self, begin: int, end: int) -> bool:
        """Whether tokens [begin, end) hold an image token."""
        return any(run.start < end and begin < run.end for run in self.runs)

    def flags_in(self, begin: int, end: int) -> np.ndarray:
        """Which of tokens [begin, end) are image tokens (bool [end - begin])."""
        flags = np.zeros(end - begin, bool)
        for run in self.runs:
            flags[max(begin, run.start) - begin : max(begin, min(end, run.end)) - begin] = True
        return flags

    def rows_in(self, begin: int, end: int) -> np.ndarray | None:
        """The encoded rows of the image tokens among tokens [begin, end), in order (None if
        there are none)."""
        parts = []
        for run in self.runs:
            low, high = max(begin, run.start), min(end, run.end)
            if low < high:
                rows = self._rows.get(run.image.digest)
                if rows is None:
                    rows = self._rows[run.image.digest] = self._encode(run.image)
                parts.append(rows[low - run.start : high - run.start])
        return np.concatenate(parts) if parts else None

    def positions_in(self, begin: int, end: int) -> np.ndarray | None:
        """The rotary positions [3, end - begin] of tokens [begin, end) (None without images)."""
        return None if self.positions is None else self.positions[:, begin:end]


class EncodedImages:
    """The vision tower's rows of recent images by digest, least recently used dropped past
    `budget_bytes`: an image is encoded once per request, and a follow-up turn that feeds it
    again (its prefix evicted) finds it here. It holds rows only, not the encoder: an engine
    keeps one, and a reference back to the engine would keep the engine (and its device)
    alive until the garbage collector's next full pass."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()

    def rows(self, image: ImagePatches, encode: Callable[[ImagePatches], np.ndarray]) -> np.ndarray:
        """The image's rows, kept or made by `encode`."""
        rows = self._rows.pop(image.digest, None)
        if rows is None:
            rows = np.ascontiguousarray(encode(image), np.float32)
            if rows.shape[0] != image.num_tokens:
                raise ValueError(f"the tower gave {rows.shape[0]} rows for {image.num_tokens}")
        self._rows[image.digest] = rows
        while sum(r.nbytes for r in self._rows.values()) > self.budget_bytes and self._rows:
            self._rows.popitem(last=False)
        return rows
