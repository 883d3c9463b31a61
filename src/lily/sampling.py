"""What a generation samples from, and how: the request's sampling parameters, and the numpy
definition of the sampling distribution that the device sampler implements and is tested against.

The distribution, in the order vLLM and transformers apply the filters:
1. temperature 0 means greedy (argmax, ties to the lowest id); otherwise p = softmax(logits / T);
2. top-k (0 = off): keep the k most probable tokens (ties to the lowest id);
3. top-p (1 = off): keep the smallest prefix of the remaining tokens, sorted by probability, whose
   renormalised mass reaches top_p (always at least one token);
4. min-p (0 = off): drop tokens whose probability is below min_p times the largest one;
then renormalise and draw.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from lily.errors import RequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # None: a fresh random seed per generation. A seed reproduces a run exactly.
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 2.0 and math.isfinite(self.temperature)),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0)),
        ]
        allowed = {
            "temperature": "between 0 and 2",
            "top_k": "an integer >= 0",
            "top_p": "in (0, 1]",
            "min_p": "in [0, 1]",
            "seed": "an integer >= 0",
        }
        for name, ok in checks:
            if not ok:
                raise RequestError(
                    f"{name} must be {allowed[name]}, got {getattr(self, name)!r}", param=name
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """These parameters with a concrete seed (drawn at random when none was given)."""
        if self.seed is not None:
            return self
        seed = int.from_bytes(os.urandom(8), "little") >> 1
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, seed)


@dataclass(frozen=True)
class TokenLogprobs:
    """log_softmax of the model's raw logits for the chosen token and the most likely ones."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GeneratedToken:
    id: int
    logprobs: TokenLogprobs | None = None


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities (float64, summing to 1) a sampler with `params` draws from."""
    logits = np.asarray(logits, np.float64)
    if params.greedy:
        p = np.zeros_like(logits)
        p[int(np.argmax(logits))] = 1.0
        return p
    scaled = logits / params.temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.lexsort((np.arange(p.size), -p))  # by probability, ties to the lowest id
    keep = np.zeros(p.size, bool)
    ranked = order if params.top_k == 0 else order[: params.top_k]
    if params.top_p < 1.0:
        mass = np.cumsum(p[ranked]) / p[ranked].sum()
        ranked = ranked[: int(np.searchsorted(mass, params.top_p)) + 1]
    keep[ranked] = True
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logits: np.ndarray, token: int, count: int) -> TokenLogprobs:
    """The chosen token's logprob and the `count` most likely tokens (ties to the lowest id)."""
    logprobs = log_softmax(logits)
    order = np.lexsort((np.arange(logprobs.size), -logprobs))[:count]
    return TokenLogprobs(float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in order))
