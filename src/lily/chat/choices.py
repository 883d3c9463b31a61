"""`n`: several choices for one request. Each is a generation of its own from the same prompt,
run one after the other on the one engine; the prompt is fed once (the first choice saves the
state before the last prompt token, and each later one restores it and feeds only that token).

Choice i samples with the seed ``(seed + i) mod 2^64``, so choice 0 is the run the same seed
gives with n = 1, and a seed reproduces every choice. Without a seed each choice draws its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lily.engine.sampling import MAX_SEED, SamplingParams
from lily.errors import RequestError

MAX_CHOICES = 8


def choice_count(value: Any) -> int:
    """The request's `n` (null: 1), refused outside 1..MAX_CHOICES."""
    if value is None:
        return 1
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CHOICES):
        raise RequestError(
            f"n must be an integer from 1 to {MAX_CHOICES}, got {value!r}", param="n"
        )
    return value


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: its own seed stream."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))
