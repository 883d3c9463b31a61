"""What a generation samples from, and how: the request's sampling parameters, and the numpy
definition of the sampling distribution, used by the reference engine. The device sampler
(`kernels/sampling.py`) implements the same definition in fp32 and documents its rounding.

The distribution, in the order vLLM applies its steps:
0. the logits are adjusted (`adjusted_logits`): the logit bias is added (a bias of -100 bans the
   token outright: it is never drawn), then the repetition penalty divides the positive and
   multiplies the negative logits of every token the prompt or the completion so far holds (as
   vLLM and mlx-lm define it; the window is the whole prompt and completion), then OpenAI's
   frequency and presence penalties subtract ``count * frequency + (count > 0) * presence``,
   where count is how many times the completion so far holds the token;
1. a temperature below 1e-5 (0 included) means greedy (argmax, ties to the lowest id), as in
   vLLM; otherwise p = softmax(logits / T);
2. top-k (0 = off): keep the tokens at least as probable as the k-th most probable one;
3. top-p (1 = off): keep the most probable remaining tokens, down to the first probability at
   which their renormalised mass reaches top_p (always at least one token);
4. min-p (0 = off): drop tokens whose probability is below min_p times the largest one;
then renormalise and draw. Tokens tied with a filter's boundary are all kept.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lily.errors import RequestError

MAX_TOP_LOGPROBS = 20
# The device sampler reads top_k as a uint32 (any value at or above the vocabulary size is off).
MAX_TOP_K = 2**32 - 1
# Seeds are 64-bit: the device sampler's Philox key, numpy's generator seed.
MAX_SEED = 2**64 - 1
# OpenAI's ranges. A bias of exactly -BIAS_LIMIT bans the token.
BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0
# Temperatures below this decode greedily (as vLLM does), so that 1 / temperature stays finite.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What the sampler at the end of each decode step is asked to do and to report.

    Defaults are OpenAI's (temperature 1, no filters). `top_logprobs`: None for no
    log-probabilities, else how many alternatives to report with each token's own (0..20).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # None: a fresh random seed per generation. A seed reproduces a run exactly.
    seed: int | None = None
    top_logprobs: int | None = None
    # (token id, bias) pairs, OpenAI's logit_bias.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # 1: off. vLLM's and mlx-lm's definition (not an OpenAI parameter).
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        top = self.top_logprobs
        checks = [
            ("temperature", "between 0 and 2", 0.0 <= self.temperature <= 2.0),
            (
                "top_k",
                f"an integer from 0 to {MAX_TOP_K}",
                _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
            ),
            ("top_p", "in (0, 1]", 0.0 < self.top_p <= 1.0),
            ("min_p", "in [0, 1]", 0.0 <= self.min_p <= 1.0),
            (
                "seed",
                f"an integer from 0 to {MAX_SEED}",
                self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
            ),
            (
                "top_logprobs",
                f"an integer from 0 to {MAX_TOP_LOGPROBS}",
                top is None or (isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS),
            ),
            (
                "logit_bias",
                f"pairs of a token id >= 0 and a bias in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]",
                all(
                    _is_int(t) and t >= 0 and _is_number(b) and -BIAS_LIMIT <= b <= BIAS_LIMIT
                    for t, b in self.logit_bias
                ),
            ),
            (
                "presence_penalty",
                f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]",
                _is_number(self.presence_penalty)
                and -PENALTY_LIMIT <= self.presence_penalty <= PENALTY_LIMIT,
            ),
            (
                "frequency_penalty",
                f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]",
                _is_number(self.frequency_penalty)
                and -PENALTY_LIMIT <= self.frequency_penalty <= PENALTY_LIMIT,
            ),
            (
                "repetition_penalty",
                "a finite number > 0",
                _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf,
            ),
        ]
        for name, allowed, ok in checks:
            if not ok:
                raise RequestError(
                    f"{name} must be {allowed}, got {getattr(self, name)!r}", param=name
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether any bias or penalty changes the logits before the filters."""
        return (
            any(b != 0 for _, b in self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def check_token_ids(self, token_count: int) -> None:
        """Refuses a logit_bias for an id past the `token_count` ids the tokenizer produces."""
        for token, _ in self.logit_bias:
            if token >= token_count:
                raise RequestError(
                    f"logit_bias names token {token}, but the vocabulary has {token_count} tokens",
                    param="logit_bias",
                )

    def banned_tokens(self) -> list[int]:
        """The tokens a bias of -100 rules out."""
        return [t for t, b in self.logit_bias if b == -BIAS_LIMIT]

    def with_seed(self) -> SamplingParams:
        """These parameters with a concrete seed (drawn at random when none was given)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(64))


@dataclass(frozen=True)
class TokenLogprobs:
    """log_softmax of the model's raw logits for the chosen token and the most likely ones."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GeneratedToken:
    id: int
    logprobs: TokenLogprobs | None = None


def token_counts(tokens: Sequence[int], vocab: int) -> np.ndarray:
    """How often each of the `vocab` ids occurs in `tokens`: what the frequency and presence
    penalties count."""
    return np.bincount(np.asarray(tokens, np.int64), minlength=vocab)[:vocab]


def adjusted_logits(
    logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
) -> np.ndarray:
    """The logits (float64) after the bias and the penalties, given the prompt's tokens and the
    completion's so far; banned tokens (a bias of -100) are -inf."""
    adjusted = np.asarray(logits, np.float64).copy()
    vocab = adjusted.size
    for token, bias in params.logit_bias:
        if token < vocab:
            adjusted[token] += bias
    counts = token_counts(generated, vocab)
    seen = counts > 0
    seen[[t for t in prompt if t < vocab]] = True
    penalty = params.repetition_penalty
    adjusted = np.where(
        seen, np.where(adjusted > 0, adjusted / penalty, adjusted * penalty), adjusted
    )
    adjusted -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    banned = [t for t in params.banned_tokens() if t < vocab]
    adjusted[banned] = -np.inf
    return adjusted


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
    keep = np.ones(p.size, bool)
    if 0 < params.top_k < p.size:
        keep &= p >= np.sort(p)[-params.top_k]
    if params.top_p < 1.0:
        ranked = np.sort(p[keep])[::-1]
        mass = np.cumsum(ranked) / ranked.sum()
        keep &= p >= ranked[min(int(np.searchsorted(mass, params.top_p)), ranked.size - 1)]
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
