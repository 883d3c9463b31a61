"""Sampling and log-probabilities on the device (`metal/sampling.metal`).

The numpy reference below is the definition in `lily.kernels.sampling`, written independently:
the kept set by sorting (the kernel bisects), the probabilities in float64. Three kinds of check:

- statistics: many draws (one per position, in one dispatch) against the reference
  distribution with a chi-square test that fails on a wrong distribution (shown with the
  temperature off by 2x);
- exact replay: a numpy replica of the Gumbel race with Philox4x32-10 (checked against the
  Random123 known answers) picks the same token as the kernel, so the counter layout, the seed
  and the kept set are all pinned down, including at the full 248320-token vocabulary;
- edge cases and log-probabilities against float64 log_softmax, under all three lane orders.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from kernel_testing import FLOAT32_EPS, LANE_ORDERS, assert_within, run, sim_device

from lily.kernels.sampling import (
    LOGPROB_ENTRIES,
    LOGPROB_ENTRY,
    SAMPLING_PARAMS_BYTES,
    SamplingParams,
    logprob_ring_bytes,
    read_logprobs,
    record_sample,
    write_sampling_params,
)

P_VALUE_THRESHOLD = 1e-3
REAL_VOCAB = 248320

# ---- reference ---------------------------------------------------------------------------------


def order_keys(z: np.ndarray) -> np.ndarray:
    """uint32 keys that sort like the float32 values, -0 counted as +0."""
    bits = np.where(z == 0, np.float32(0), z).astype(np.float32).view(np.uint32)
    return np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def scaled_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return logits.astype(np.float32) * np.float32(1.0 / params.temperature)


def reference_kept(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens that survive top-k, top-p and min-p, by sorting. Refuses logits whose top-p
    boundary lies within rounding of top_p, where the definition itself is not sharp."""
    z = scaled_logits(logits, params)
    keys = order_keys(z)
    kept = np.ones(len(z), dtype=bool)
    if 0 < params.top_k < len(z):
        kept &= keys >= np.sort(keys)[-params.top_k]
    mass = np.exp(z.astype(np.float64) - float(z.max()))
    if params.top_p < 1:
        target = np.float64(np.float32(params.top_p)) * mass[kept].sum()
        distinct = np.unique(keys[kept])[::-1]
        cumulative = np.array([mass[kept & (keys >= k)].sum() for k in distinct])
        boundary = int(np.argmax(cumulative >= target))
        near = np.abs(cumulative - target) / target
        assert near.min() > 1e-4, "top_p lies on a rounding boundary of these logits"
        kept &= keys >= distinct[boundary]
    if params.min_p > 0:
        relative = z - np.float32(z.max())
        log_min_p = np.float32(math.log(params.min_p))
        assert np.all(np.abs(relative - log_min_p) > 1e-4), "min_p on a rounding boundary"
        kept &= relative >= log_min_p
    return kept


def reference_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    z = scaled_logits(logits, params).astype(np.float64)
    weights = np.where(reference_kept(logits, params), np.exp(z - z.max()), 0.0)
    return weights / weights.sum()


PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of counters [..., 4] under keys [..., 2] (uint32), from Salmon et al."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k = [key[..., i].astype(np.uint64) for i in range(2)]
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(PHILOX_M[0]) * c[0]
        p1 = np.uint64(PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k[1],
             p0 & mask]  # fmt: skip
        k = [(k[0] + np.uint64(PHILOX_W[0])) & mask, (k[1] + np.uint64(PHILOX_W[1])) & mask]
    return np.stack(c, axis=-1).astype(np.uint32)


def race_scores(logits: np.ndarray, params: SamplingParams, position: int) -> np.ndarray:
    """The Gumbel race of one draw, as the kernel runs it (float32), -inf for dropped tokens."""
    z = scaled_logits(logits, params)
    ids = np.arange(len(z), dtype=np.uint32)
    counter = np.stack([ids, np.full_like(ids, position), 0 * ids, 0 * ids], axis=-1)
    seed = params.seed % 2**64
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    bits = philox4x32_10(counter, np.broadcast_to(key, (len(z), 2)))[:, 0]
    u = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)
    u = np.minimum(u, np.float32(1 - 2.0**-24))
    series = u * (np.float32(1) + np.float32(0.5) * u)
    exponential = np.where(u < np.float32(2.0**-12), series, -np.log(np.float32(1) - u))
    scores = z - np.log(exponential.astype(np.float32))
    return np.where(reference_kept(logits, params), scores, -np.inf)


def chi_square_p_value(observed: np.ndarray, probabilities: np.ndarray) -> float:
    """Pearson's test of counts against probabilities. Categories expected fewer than 5 times
    are pooled; a count in a category of probability 0 gives p = 0."""
    total = observed.sum()
    if observed[probabilities == 0].sum() > 0:
        return 0.0
    expected = total * probabilities
    large = expected >= 5
    obs = np.append(observed[large], observed[~large].sum())
    exp = np.append(expected[large], expected[~large].sum())
    if exp[-1] < 5:  # too little pooled mass for its own category: merge it into the smallest
        smallest = int(np.argmin(exp[:-1]))
        obs[smallest] += obs[-1]
        exp[smallest] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return regularized_upper_gamma((len(obs) - 1) / 2, statistic / 2)


def regularized_upper_gamma(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): the chi-square survival function at 2x with 2a
    degrees of freedom. Series below a + 1, Lentz's continued fraction above."""
    if x <= 0:
        return 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 1
        while abs(term) > 1e-16 * abs(total):
            term *= x / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - math.exp(log_prefactor) * total)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    fraction = d
    for n in range(1, 10_000):
        an = -n * (n - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        fraction *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * fraction


# ---- running the kernel ------------------------------------------------------------------------


def device_sample(
    device,
    logits: np.ndarray,
    params: SamplingParams,
    *,
    draws: int,
    position: int = 0,
    threads: int = 64,
    ring_slots: int | None = None,
) -> tuple[np.ndarray, object]:
    """Tokens for positions position .. position + draws - 1, and the log-probability ring."""
    ring_slots = ring_slots or draws
    parameters = device.alloc(SAMPLING_PARAMS_BYTES)
    write_sampling_params(parameters, params)
    step = device.wrap(np.array([position, 0, 0], dtype=np.uint32))
    predicted = device.alloc(4 * draws)
    predicted.numpy()[:] = 0xEE  # not a plausible token
    ring = device.alloc(logprob_ring_bytes(ring_slots))
    run(
        device,
        lambda g: record_sample(
            g,
            device,
            logits=device.wrap(np.ascontiguousarray(logits, dtype=np.float32)),
            vocab=len(logits),
            params=parameters,
            position=(step, 0),
            predicted=predicted,
            logprob_ring=ring,
            ring_slots=ring_slots,
            draws=draws,
            threads=threads,
        ),
    )
    return predicted.numpy().view(np.uint32).copy(), ring


def peaked_logits(vocab: int, seed: int) -> np.ndarray:
    """A long low tail with a few dozen likely tokens, like a language model's next token."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(-2.0, 1.5, vocab)
    head = rng.choice(vocab, 40, replace=False)
    logits[head] = rng.uniform(1.0, 5.0, 40)
    return logits.astype(np.float32)


# ---- Philox and the test's own statistics ------------------------------------------------------


def test_philox_reference_matches_random123_known_answers():
    cases = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
            [0xA4093822, 0x299F31D0],
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ),
    ]
    for counter, key, expected in cases:
        out = philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
        assert out.tolist() == expected


def test_chi_square_p_value_matches_known_quantiles():
    # Upper 5% and 0.1% points of the chi-square distribution (standard tables).
    for df, quantile, tail in [(1, 3.841, 0.05), (10, 18.307, 0.05), (50, 86.661, 0.001)]:
        assert regularized_upper_gamma(df / 2, quantile / 2) == pytest.approx(tail, rel=2e-3)
    assert regularized_upper_gamma(3.0, 0.0) == 1.0


# ---- distributions -----------------------------------------------------------------------------

STATISTICS_VOCAB = 1000  # not a multiple of the threadgroup
DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=1.0, seed=11),
    "cold top-k": SamplingParams(temperature=0.7, top_k=12, seed=12),
    "hot top-p": SamplingParams(temperature=1.3, top_p=0.75, seed=13),
    "min-p": SamplingParams(temperature=1.0, min_p=0.08, seed=14),
    "all filters": SamplingParams(temperature=0.9, top_k=25, top_p=0.9, min_p=0.03, seed=15),
}


DRAWS = 3000


@functools.cache
def drawn_tokens(case: str) -> np.ndarray:
    """DRAWS tokens (positions 0..DRAWS-1, one dispatch) under a case's parameters."""
    params = DISTRIBUTION_CASES[case]
    logits = peaked_logits(STATISTICS_VOCAB, seed=params.seed)
    tokens, _ = device_sample(sim_device("forward"), logits, params, draws=DRAWS)
    return tokens


def drawn_counts(case: str) -> np.ndarray:
    return np.bincount(drawn_tokens(case), minlength=STATISTICS_VOCAB)


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
def test_empirical_distribution_matches_the_definition(case):
    params = DISTRIBUTION_CASES[case]
    expected = reference_probabilities(peaked_logits(STATISTICS_VOCAB, params.seed), params)
    counts = drawn_counts(case)
    assert counts.sum() == DRAWS
    assert chi_square_p_value(counts, expected) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("case", ["temperature", "all filters"])
def test_chi_square_rejects_a_wrong_temperature(case):
    """The same draws fail the test against the distribution at twice the temperature."""
    params = DISTRIBUTION_CASES[case]
    wrong = SamplingParams(
        temperature=2 * params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
    )
    expected = reference_probabilities(peaked_logits(STATISTICS_VOCAB, params.seed), wrong)
    assert chi_square_p_value(drawn_counts(case), expected) < P_VALUE_THRESHOLD


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
def test_draws_replay_the_reference_race(case):
    """Each draw is the winner of the numpy replica of the race (near-ties excepted)."""
    params = DISTRIBUTION_CASES[case]
    logits = peaked_logits(STATISTICS_VOCAB, params.seed)
    positions = range(0, DRAWS, 97)
    tokens = drawn_tokens(case)
    checked = 0
    for position in positions:
        scores = race_scores(logits, params, position)
        second, first = np.sort(scores)[-2:]
        if first - second > 1e-4 * max(1.0, abs(first)):
            assert tokens[position] == int(np.argmax(scores)), f"position {position}"
            checked += 1
    assert checked > 0.9 * len(positions)
