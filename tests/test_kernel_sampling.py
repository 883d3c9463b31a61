"""Sampling and log-probabilities on the device (`metal/sampling.metal`).

The numpy reference below is the definition in `lily.kernels.sampling`, written independently:
the kept set by sorting (the kernel bisects), the probabilities in float64. Three kinds of check:

- statistics: many draws (one per position, in one dispatch) against the reference
  distribution with a chi-square test that fails on a wrong distribution (shown with the
  temperature off by 2x);
- exact replay: a numpy replica of the Gumbel race with Philox4x32-10 (checked against the
  Random123 known answers) picks the same token as the kernel, so the counter layout, the seed
  and the kept set are all pinned down, including at the full 248320-token vocabulary;
- edge cases and log-probabilities against float64 log_softmax, under all three lane orders;
- the token mask (a constraint's allowed tokens): the same checks on the logits with every
  disallowed token at -inf, and log-probabilities that ignore it;
- the two dispatches: over many slices the draws replay the race token for token whichever way
  the finish decides (the slices' winners, their candidates, or the logits after all), the
  finish reads no logits when the slices decide, and with bookkeeping it counts the token and
  advances the step buffer as the decode step needs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import pytest
from kernel_testing import FLOAT32_EPS, LANE_ORDERS, assert_within, run, sim_device

from lily.device import Graph, open_device
from lily.engine.constraint import mask_from_tokens
from lily.engine.sampling import SamplingParams, adjusted_logits
from lily.kernels import RowSlots
from lily.kernels.sampling import (
    GATHER_CAPACITY,
    LOGPROB_ENTRIES,
    LOGPROB_ENTRY,
    SAMPLING_PARAMS_BYTES,
    LogitAdjustments,
    StepBookkeeping,
    logprob_ring_bytes,
    read_logprobs,
    record_sample,
    sample_partials_bytes,
    token_mask_bytes,
    write_logit_adjustments,
    write_sampling_params,
    write_token_mask,
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
        deciding = cumulative[max(boundary - 1, 0) : boundary + 1]
        assert np.all(np.abs(deciding - target) > 1e-4 * target), "top_p on a rounding boundary"
        kept &= keys >= distinct[boundary]
    if params.min_p > 0:
        relative = z - np.float32(z.max())
        log_min_p = np.float32(math.log(params.min_p))
        assert np.all(np.abs(relative[kept] - log_min_p) > 1e-4), "min_p on a rounding boundary"
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
    allowed: np.ndarray | None = None,
    prompt: Sequence[int] = (),
    generated: Sequence[int] = (),
    slices: int | None = None,
) -> tuple[np.ndarray, object]:
    """Tokens for positions position .. position + draws - 1, and the log-probability ring.
    `allowed`: the ids the token mask allows, or None for no mask. `prompt` and `generated`:
    the tokens the penalties count (every draw sees the same). `slices`: of the vocabulary
    for the first dispatch (its default gives small vocabularies one or two)."""
    ring_slots = ring_slots or draws
    parameters = device.alloc(SAMPLING_PARAMS_BYTES)
    write_sampling_params(parameters, params)
    token_mask = device.alloc(token_mask_bytes(len(logits)))
    write_token_mask(
        token_mask, None if allowed is None else mask_from_tokens(allowed, len(logits))
    )
    adjustments = LogitAdjustments.allocate(device, len(logits))
    write_logit_adjustments(adjustments, params, prompt, len(logits))
    counts = adjustments.counts.numpy().view(np.uint32)
    np.add.at(counts, np.asarray(generated, np.int64), 1)
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
            token_mask=token_mask,
            adjustments=adjustments,
            partials=device.scratch(sample_partials_bytes(len(logits), draws, slices)),
            draws=draws,
            threads=threads,
            slices=slices,
            slice_threads=min(threads, 256),
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

# Past the gather capacity and not a multiple of the threadgroup: the cases without top-k run
# over the logits in device memory, the top-k cases over the gathered tokens.
STATISTICS_VOCAB = GATHER_CAPACITY + 952
DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=1.0, seed=11),
    "cold top-k": SamplingParams(temperature=0.7, top_k=12, seed=12),
    "hot top-p": SamplingParams(temperature=1.3, top_p=0.75, seed=13),
    "min-p": SamplingParams(temperature=1.0, min_p=0.08, seed=14),
    "all filters": SamplingParams(temperature=0.9, top_k=25, top_p=0.95, min_p=0.2, seed=15),
}


DRAWS = 3000
REAL_CASE = SamplingParams(
    temperature=0.8, top_k=30, top_p=0.9, min_p=0.3, top_logprobs=20, seed=20
)


@functools.cache
def drawn_tokens(case: str) -> np.ndarray:
    """DRAWS tokens (positions 0..DRAWS-1, one dispatch) under a case's parameters."""
    params = DISTRIBUTION_CASES[case]
    logits = peaked_logits(STATISTICS_VOCAB, seed=params.seed)
    tokens, _ = device_sample(sim_device("forward"), logits, params, draws=DRAWS)
    return tokens


def drawn_counts(case: str) -> np.ndarray:
    return np.bincount(drawn_tokens(case), minlength=STATISTICS_VOCAB)


def test_each_filter_removes_tokens_in_the_combined_cases():
    """Otherwise the combined cases would not test how the filters compose."""
    for params, vocab in (
        (DISTRIBUTION_CASES["all filters"], STATISTICS_VOCAB),
        (REAL_CASE, REAL_VOCAB),
    ):
        logits = peaked_logits(vocab, params.seed)
        stages = [
            SamplingParams(temperature=params.temperature),
            SamplingParams(temperature=params.temperature, top_k=params.top_k),
            SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p),
            params,
        ]
        sizes = [int(reference_kept(logits, stage).sum()) for stage in stages]
        assert sizes == sorted(set(sizes), reverse=True), sizes


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


# ---- reproducibility ---------------------------------------------------------------------------


def test_a_seed_and_position_always_give_the_same_token():
    device = sim_device("random")
    logits = peaked_logits(500, seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=2**40 + 7)
    first, _ = device_sample(device, logits, params, draws=64, position=1000)
    again, _ = device_sample(device, logits, params, draws=64, position=1000)
    shifted, _ = device_sample(device, logits, params, draws=32, position=1032)
    np.testing.assert_array_equal(first, again)
    # The counter is the position, not the draw's place in a dispatch.
    np.testing.assert_array_equal(first[32:], shifted)
    single, _ = device_sample(device, logits, params, draws=1, position=1010)
    assert single[0] == first[10]


def test_different_seeds_give_different_tokens():
    device = sim_device("forward")
    logits = peaked_logits(500, seed=4)
    runs = [
        device_sample(device, logits, SamplingParams(temperature=1.0, seed=seed), draws=100)[0]
        for seed in (1, 2, 2**32 + 1, 2**64 - 1)
    ]
    for i in range(len(runs)):
        for j in range(i):
            assert np.mean(runs[i] == runs[j]) < 0.5, (i, j)


# ---- greedy and edge cases ---------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_is_the_argmax_with_ties_to_the_lowest_id(lane_order, temperature):
    device = sim_device(lane_order)
    logits = np.random.default_rng(5).normal(0, 1, 5000).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=3, seed=9)
    for tied in ([4999, 1025, 3000], [2047, 1023], [17]):
        values = logits.copy()
        values[tied] = 6.0
        tokens, _ = device_sample(device, values, params, draws=2, threads=1024)
        assert tokens.tolist() == [min(tied)] * 2


def test_top_k_one_keeps_only_the_largest_and_its_ties():
    device = sim_device("forward")
    logits = peaked_logits(300, seed=6)
    hot = SamplingParams(temperature=2.0, top_k=1, seed=1)
    tokens, _ = device_sample(device, logits, hot, draws=64)
    assert set(tokens.tolist()) == {int(np.argmax(logits))}
    tied = logits.copy()
    tied[[7, 250]] = logits.max()
    tokens, _ = device_sample(device, tied, hot, draws=64)
    assert set(tokens.tolist()) == {7, 250, int(np.argmax(logits))}


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_filters_at_their_limits(lane_order):
    device = sim_device(lane_order)
    logits = peaked_logits(777, seed=7)
    top = int(np.argmax(logits))
    for params in (
        SamplingParams(temperature=2.0, top_p=1e-6, seed=2),
        SamplingParams(temperature=2.0, min_p=1.0, seed=3),
        SamplingParams(temperature=2.0, top_k=5, top_p=1e-30, seed=4),
    ):
        tokens, _ = device_sample(device, logits, params, draws=16)
        assert set(tokens.tolist()) == {top}, params
    # top_k at or past the vocab is off: the same race as without it.
    off, _ = device_sample(device, logits, SamplingParams(seed=5), draws=32)
    for top_k in (777, 5000):
        same, _ = device_sample(device, logits, SamplingParams(top_k=top_k, seed=5), draws=32)
        np.testing.assert_array_equal(same, off)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_only_finite_logits_are_drawn(lane_order):
    device = sim_device(lane_order)
    logits = np.full(1000, -np.inf, dtype=np.float32)
    logits[613] = -3.0
    params = SamplingParams(temperature=1.0, top_p=0.5, top_logprobs=3, seed=8)
    tokens, ring = device_sample(device, logits, params, draws=8)
    assert set(tokens.tolist()) == {613}
    chosen, alternatives = read_logprobs(ring, 8, 0, 3)
    assert chosen == (613, 0.0)
    assert alternatives == [(613, 0.0), (0, -math.inf), (1, -math.inf)]


NO_TOKEN = 0xFFFFFFFF


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=1.0, seed=2, top_logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, top_logprobs=20),
    ],
    ids=["greedy", "sampled", "filtered"],
)
@pytest.mark.parametrize("broken", ["all NaN", "one NaN", "one +inf"])
def test_nan_or_plus_infinity_in_the_logits_yields_no_token(lane_order, params, broken):
    """A broken row is refused with NO_TOKEN, reading nothing outside the logits (the checking
    sim raises on any such read) and writing no log-probabilities."""
    device = sim_device(lane_order)
    logits = peaked_logits(1000, seed=21)
    if broken == "all NaN":
        logits[:] = np.nan
    else:
        logits[417] = np.nan if broken == "one NaN" else np.inf
    tokens, ring = device_sample(device, logits, params, draws=4)
    assert tokens.tolist() == [NO_TOKEN] * 4
    untouched = ring.numpy()[: logprob_ring_bytes(4)]
    assert not untouched.any(), "log-probabilities were written for a refused row"


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_fewer_tokens_than_threads(lane_order):
    """33 tokens in a 1024-thread threadgroup: most threads hold nothing."""
    device = sim_device(lane_order)
    logits = np.linspace(-1, 1, 33).astype(np.float32)
    params = SamplingParams(temperature=0.5, top_k=4, seed=10)
    tokens, _ = device_sample(device, logits, params, draws=64, threads=1024)
    assert set(tokens.tolist()) == {29, 30, 31, 32}
    for position in range(0, 64, 8):
        assert tokens[position] == int(np.argmax(race_scores(logits, params, position)))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_top_k_with_more_ties_than_can_be_gathered(lane_order):
    """Logits on a few levels: the gather bound admits thousands of tokens, so top-k runs over
    the logits in memory and keeps every token tied with the k-th; the alternatives are the
    lowest ids of the top level."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(13)
    logits = rng.integers(0, 3, 10000).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=5, top_logprobs=20, seed=21)
    assert reference_kept(logits, params).sum() > GATHER_CAPACITY
    tokens, ring = device_sample(device, logits, params, draws=16)
    for position in range(16):
        assert tokens[position] == int(np.argmax(race_scores(logits, params, position)))
    check_logprobs(ring, 16, 3, logits, tokens[3], 20, threads=64)


# ---- log-probabilities -------------------------------------------------------------------------


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def check_logprobs(ring, ring_slots, position, logits, token, top_logprobs, threads):
    """The ring slot of `position` against float64 log_softmax. The kernel rounds x - max once
    and sums exp terms serially per thread (vocab / threads of them), then over the group."""
    expected = reference_log_softmax(logits)
    order = np.lexsort((np.arange(len(logits)), -logits.astype(np.float64)))[:top_logprobs]
    chosen, alternatives = read_logprobs(ring, ring_slots, position, top_logprobs)
    assert chosen[0] == token
    assert [t for t, _ in alternatives] == order.tolist()
    ids = np.array([token, *order.tolist()])
    actual = np.array([chosen[1], *(lp for _, lp in alternatives)])
    shifted = np.abs(logits[ids].astype(np.float64) - logits.max())
    bound = FLOAT32_EPS * (2 * shifted + len(logits) / threads + 64)
    assert_within(actual, expected[ids], bound)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_logprobs_match_log_softmax_with_ties_ordered_by_id(lane_order):
    device = sim_device(lane_order)
    logits = peaked_logits(4096, seed=12)
    logits[[4000, 100, 2500]] = logits.max()  # a three-way tie at the top
    logits[[3, 1500]] = np.sort(logits)[-10]  # and one further down
    params = SamplingParams(temperature=1.0, top_k=50, top_logprobs=20, seed=3)
    tokens, ring = device_sample(device, logits, params, draws=3, position=5, ring_slots=4)
    for draw in range(3):
        check_logprobs(ring, 4, 5 + draw, logits, tokens[draw], 20, threads=64)
    # Position 4 (slot 0) was not drawn: its slot is untouched.
    untouched = ring.numpy()[: LOGPROB_ENTRIES * LOGPROB_ENTRY.itemsize]
    assert not untouched.any()


def test_no_logprobs_requested_leaves_the_ring_alone():
    device = sim_device("forward")
    _, ring = device_sample(device, peaked_logits(300, 1), SamplingParams(seed=1), draws=4)
    assert not ring.numpy().any()


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "in-memory"])
def test_real_vocabulary(lane_order, gathered):
    """248320 tokens, 1024 threads, every filter and 20 alternatives: the tokens replay the
    reference race and the log-probabilities match log_softmax. A top_k above the thread count
    gives no bound to gather by, so every pass reads the logits."""
    device = sim_device(lane_order)
    params = REAL_CASE if gathered else dataclasses.replace(REAL_CASE, top_k=1100)
    logits = peaked_logits(REAL_VOCAB, seed=params.seed)
    tokens, ring = device_sample(device, logits, params, draws=2, position=123, threads=1024)
    for draw in range(2):
        scores = race_scores(logits, params, 123 + draw)
        assert tokens[draw] == int(np.argmax(scores))
        check_logprobs(ring, 2, 123 + draw, logits, tokens[draw], 20, threads=1024)


# ---- host-side checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": math.inf},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.01},
        {"top_logprobs": 21},
    ],
)
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_recording_refuses_bad_launches():
    device = sim_device("forward")
    buffer = device.alloc(4096)
    small = device.alloc(4)
    common = dict(
        logits=buffer,
        params=buffer,
        position=buffer,
        predicted=buffer,
        token_mask=buffer,
        adjustments=LogitAdjustments(buffer, buffer, buffer),
        partials=buffer,
    )
    with pytest.raises(ValueError, match="threads"):
        record_sample(
            Graph(), device, vocab=64, logprob_ring=buffer, ring_slots=1, threads=48, **common
        )
    with pytest.raises(ValueError, match="logprob_ring"):
        record_sample(Graph(), device, vocab=64, logprob_ring=small, ring_slots=1, **common)
    with pytest.raises(ValueError, match="logits"):
        record_sample(Graph(), device, vocab=2048, logprob_ring=buffer, ring_slots=1, **common)


# ---- the token mask ----------------------------------------------------------------------------


def masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The logits the definition ranks under a mask: -inf for every token it does not allow."""
    out = np.full_like(logits, -np.inf)
    out[allowed] = logits[allowed]
    return out


def allowed_set(vocab: int, seed: int, logits: np.ndarray) -> np.ndarray:
    """About a third of the tokens, never the five most likely ones: the mask changes the
    greedy choice, and what top-k and top-p keep."""
    rng = np.random.default_rng(seed)
    allowed = rng.random(vocab) < 1 / 3
    allowed[np.argsort(logits)[-5:]] = False
    return np.flatnonzero(allowed)


MASK_CASES = {
    "temperature": SamplingParams(temperature=1.0, seed=31),
    "all filters": SamplingParams(temperature=0.9, top_k=25, top_p=0.95, min_p=0.2, seed=32),
}
MASK_DRAWS = 2000


@functools.cache
def masked_draws(case: str, lane_order: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, allowed ids, MASK_DRAWS tokens) of a case under a mask."""
    params = MASK_CASES[case]
    logits = peaked_logits(STATISTICS_VOCAB, seed=params.seed)
    allowed = allowed_set(STATISTICS_VOCAB, params.seed, logits)
    tokens, _ = device_sample(
        sim_device(lane_order), logits, params, draws=MASK_DRAWS, allowed=allowed
    )
    return logits, allowed, tokens


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_masked_draws_follow_the_renormalised_distribution(case, lane_order):
    params = MASK_CASES[case]
    logits, allowed, tokens = masked_draws(case, lane_order)
    assert set(tokens.tolist()) <= set(allowed.tolist())
    counts = np.bincount(tokens, minlength=STATISTICS_VOCAB)
    expected = reference_probabilities(masked(logits, allowed), params)
    assert chi_square_p_value(counts, expected) > P_VALUE_THRESHOLD
    # Filtering first and masking after would give another distribution, which the test tells
    # apart: the filters must run over the allowed tokens only.
    if case == "all filters":
        filtered_then_masked = np.zeros(STATISTICS_VOCAB)
        filtered_then_masked[allowed] = reference_probabilities(logits, params)[allowed]
        wrong = filtered_then_masked / filtered_then_masked.sum()
        assert chi_square_p_value(counts, wrong) < P_VALUE_THRESHOLD


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_masked_draws_replay_the_reference_race(case, lane_order):
    params = MASK_CASES[case]
    logits, allowed, tokens = masked_draws(case, lane_order)
    ranked = masked(logits, allowed)
    checked = 0
    for position in range(0, MASK_DRAWS, 97):
        scores = race_scores(ranked, params, position)
        second, first = np.sort(scores)[-2:]
        if first - second > 1e-4 * max(1.0, abs(first)):
            assert tokens[position] == int(np.argmax(scores)), f"position {position}"
            checked += 1
    assert checked > 0.9 * len(range(0, MASK_DRAWS, 97))


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_greedy_under_a_mask_is_the_largest_allowed_logit(lane_order):
    device = sim_device(lane_order)
    logits = np.random.default_rng(33).normal(0, 1, 5000).astype(np.float32)
    logits[[10, 4000]] = 9.0  # the argmax, tied, both disallowed
    logits[[3333, 1200, 4999]] = 7.0  # the largest allowed, tied
    allowed = np.array([5, 1200, 2047, 3333, 4999, 4998])
    greedy = SamplingParams(temperature=0.0, seed=1)
    tokens, _ = device_sample(device, logits, greedy, draws=2, threads=1024, allowed=allowed)
    assert tokens.tolist() == [1200, 1200]
    # A single allowed token is the only possible draw at any temperature, even a -inf one.
    hot = SamplingParams(temperature=2.0, top_k=3, top_p=0.5, seed=2)
    for only in (4999, 10):
        one = np.array([only])
        tokens, _ = device_sample(device, logits, hot, draws=16, threads=1024, allowed=one)
        assert set(tokens.tolist()) == {only}
    hopeless = logits.copy()
    hopeless[77] = -np.inf
    tokens, _ = device_sample(device, hopeless, hot, draws=4, allowed=np.array([77]))
    assert set(tokens.tolist()) == {77}


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_logprobs_under_a_mask_are_the_models_own(lane_order):
    """The chosen token is allowed, but its logprob and the alternatives are those of the raw
    logits, disallowed tokens included."""
    device = sim_device(lane_order)
    logits = peaked_logits(4096, seed=34)
    allowed = allowed_set(4096, 34, logits)
    params = SamplingParams(temperature=1.0, top_k=50, top_logprobs=20, seed=4)
    tokens, ring = device_sample(device, logits, params, draws=3, allowed=allowed)
    for draw in range(3):
        assert tokens[draw] in allowed
        check_logprobs(ring, 3, draw, logits, tokens[draw], 20, threads=64)


def test_the_mask_switched_off_leaves_the_draws_alone():
    """The header word decides: with it clear, a bitmask allowing nothing changes nothing."""
    device = sim_device("forward")
    logits = peaked_logits(700, seed=35)
    params = SamplingParams(temperature=1.0, seed=5)
    plain, _ = device_sample(device, logits, params, draws=32)
    mask = device.alloc(token_mask_bytes(700))
    write_token_mask(mask, mask_from_tokens([3], 700))
    write_token_mask(mask, None)
    assert mask.numpy().view(np.uint32)[1] == 8  # the bits stay; only the flag is cleared
    predicted = device.alloc(4 * 32)
    parameters = device.alloc(SAMPLING_PARAMS_BYTES)
    write_sampling_params(parameters, params)
    run(
        device,
        lambda g: record_sample(
            g,
            device,
            logits=device.wrap(logits),
            vocab=700,
            params=parameters,
            position=(device.wrap(np.zeros(3, np.uint32)), 0),
            predicted=predicted,
            logprob_ring=device.alloc(logprob_ring_bytes(32)),
            ring_slots=32,
            token_mask=mask,
            adjustments=LogitAdjustments.allocate(device, 700),
            partials=device.scratch(sample_partials_bytes(700, 32)),
            draws=32,
        ),
    )
    np.testing.assert_array_equal(predicted.numpy().view(np.uint32), plain)


# ---- logit bias and penalties ------------------------------------------------------------------


def reference_adjusted(
    logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
) -> np.ndarray:
    """The adjusted logits in float32, in the kernel's order of operations (bias, repetition
    penalty, frequency and presence penalties)."""
    values = logits.astype(np.float32).copy()
    for token, bias in params.logit_bias:
        values[token] += np.float32(bias)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(values))
    seen = (counts > 0) | np.isin(np.arange(len(values)), prompt)
    r = np.float32(params.repetition_penalty)
    values = np.where(seen, np.where(values > 0, values / r, values * r), values)
    values = values - np.float32(params.frequency_penalty) * counts.astype(np.float32)
    values = values - np.where(counts > 0, np.float32(params.presence_penalty), np.float32(0))
    return values.astype(np.float32)


ADJUSTED_VOCAB = 3000
ADJUSTED_DRAWS = 3000


def adjusted_case(seed: int) -> tuple[np.ndarray, SamplingParams, list[int], list[int]]:
    """Peaked logits whose likely tokens are hit by every adjustment: the most likely ones are
    in the prompt and generated (some several times), two get a bias."""
    logits = peaked_logits(ADJUSTED_VOCAB, seed)
    order = np.argsort(logits)[::-1].tolist()
    prompt = order[0:6] + order[30:40]
    generated = order[0:3] * 3 + order[3:8] + order[50:52]
    params = SamplingParams(
        temperature=0.9,
        top_p=0.8,
        seed=seed,
        logit_bias=((order[20], 3.0), (order[1], -1.5)),
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
    )
    return logits, params, prompt, generated


def test_the_kernels_reference_adjustments_are_lily_sampling_definition():
    logits, params, prompt, generated = adjusted_case(40)
    np.testing.assert_allclose(
        reference_adjusted(logits, params, prompt, generated),
        adjusted_logits(logits, params, prompt, generated),
        rtol=1e-6,
        atol=1e-5,
    )


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_adjusted_draws_follow_the_adjusted_distribution(lane_order):
    logits, params, prompt, generated = adjusted_case(41)
    tokens, _ = device_sample(
        sim_device(lane_order),
        logits,
        params,
        draws=ADJUSTED_DRAWS,
        prompt=prompt,
        generated=generated,
    )
    counts = np.bincount(tokens, minlength=ADJUSTED_VOCAB)
    adjusted = reference_adjusted(logits, params, prompt, generated)
    assert chi_square_p_value(counts, reference_probabilities(adjusted, params)) > P_VALUE_THRESHOLD
    # The unadjusted distribution is told apart by the same test.
    assert chi_square_p_value(counts, reference_probabilities(logits, params)) < P_VALUE_THRESHOLD
    positions = range(0, ADJUSTED_DRAWS, 101)
    checked = 0
    for position in positions:
        scores = race_scores(adjusted, params, position)
        second, first = np.sort(scores)[-2:]
        if first - second > 1e-4 * max(1.0, abs(first)):
            assert tokens[position] == int(np.argmax(scores)), f"position {position}"
            checked += 1
    assert checked > 0.9 * len(positions)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_adjustments_decide_the_greedy_choice(lane_order):
    device = sim_device(lane_order)
    logits = np.zeros(500, np.float32)
    logits[[10, 20, 30, 40]] = [4.0, 3.0, -0.5, 2.5]
    logits[[50, 60]] = -1.0
    greedy = SamplingParams(temperature=0.0, seed=1)

    def choice(**adjust) -> int:
        params = dataclasses.replace(greedy, **{k: v for k, v in adjust.items() if k != "seen"})
        prompt, generated = adjust.get("seen", ((), ()))
        tokens, _ = device_sample(
            device, logits, params, draws=1, prompt=prompt, generated=generated
        )
        return int(tokens[0])

    assert choice() == 10
    assert choice(logit_bias=((30, 100.0),)) == 30  # +100 wins against any logit here
    assert choice(logit_bias=((10, -1.5),)) == 20
    # Repetition: 4 / 2 < 3 for a prompt token; a negative logit is multiplied.
    assert choice(repetition_penalty=2.0, seen=([10], [])) == 20
    # Frequency counts repeats, presence does not: 4 - 2 * 0.6 = 2.8 < 3; 4 - 0.6 > 3.
    assert choice(frequency_penalty=0.6, seen=([], [10, 10])) == 20
    assert choice(presence_penalty=0.6, seen=([], [10, 10])) == 10
    assert choice(presence_penalty=1.6, seen=([], [10])) == 20
    # A negative penalty favours the repeated token: 2.5 + 2 * 1.0 > 4.
    assert choice(frequency_penalty=-1.0, seen=([], [40, 40])) == 40
    # Among negative logits, the repetition penalty pushes a seen token further down.
    only_negative = logits.copy()
    only_negative[:] = -3.0
    only_negative[[50, 60]] = -1.0
    tokens, _ = device_sample(
        device,
        only_negative,
        dataclasses.replace(greedy, repetition_penalty=1.5),
        draws=1,
        prompt=[50],
    )
    assert tokens[0] == 60


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_logprobs_ignore_the_adjustments(lane_order):
    logits, params, prompt, generated = adjusted_case(42)
    params = dataclasses.replace(params, top_logprobs=20)
    tokens, ring = device_sample(
        sim_device(lane_order), logits, params, draws=2, prompt=prompt, generated=generated
    )
    for draw in range(2):
        check_logprobs(ring, 2, draw, logits, tokens[draw], 20, threads=64)


# ---- the slices and the finishing dispatch -----------------------------------------------------

# Many slices of a small vocabulary: 40 of 75 tokens, each listing 16 candidates.
SLICED_VOCAB = 3000
SLICES = 40


def flat_logits(vocab: int, seed: int) -> np.ndarray:
    """No token stands out: top-p and a loose min-p keep thousands of tokens, more than the
    slices list, so the finish must fall back to the logits."""
    return np.random.default_rng(seed).normal(0.0, 0.3, vocab).astype(np.float32)


def tied_logits(vocab: int, seed: int) -> np.ndarray:
    """A few tokens above a level that 900 share: every slice's last candidate sits on that
    level, which top-k's k-th value and top-p's boundary then reach."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(-8, 0, vocab).astype(np.float32)
    logits[rng.choice(vocab, 900, replace=False)] = 1.0
    logits[rng.choice(vocab, 12, replace=False)] = rng.uniform(1.5, 3.0, 12).astype(np.float32)
    return logits


SLICED_CASES = {
    "plain": (peaked_logits, SamplingParams(temperature=1.0, seed=51)),
    "min-p": (peaked_logits, SamplingParams(temperature=1.0, min_p=0.3, seed=52)),
    "loose min-p": (flat_logits, SamplingParams(temperature=1.0, min_p=0.05, seed=53)),
    "top-p": (peaked_logits, SamplingParams(temperature=1.0, top_p=0.5, seed=54)),
    "flat top-p": (flat_logits, SamplingParams(temperature=1.0, top_p=0.9, seed=58)),
    "tied top-p": (tied_logits, SamplingParams(temperature=1.0, top_p=0.3, seed=56)),
    "top-k": (peaked_logits, SamplingParams(temperature=0.8, top_k=30, seed=57)),
    "tied top-k": (tied_logits, SamplingParams(temperature=1.0, top_k=20, seed=58)),
    "large top-k": (flat_logits, SamplingParams(temperature=1.0, top_k=1500, seed=59)),
    "all filters": (
        peaked_logits,
        SamplingParams(temperature=0.9, top_k=200, top_p=0.6, min_p=0.05, seed=60),
    ),
}
SLICED_DRAWS = 48


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("case", sorted(SLICED_CASES))
def test_sliced_draws_replay_the_reference_race(case, lane_order):
    """Over 40 slices, token for token the winner of the numpy race over the kept set, whether
    the finish decides from the slices' winners, from their candidates, or from the logits."""
    make_logits, params = SLICED_CASES[case]
    logits = make_logits(SLICED_VOCAB, params.seed)
    tokens, _ = device_sample(
        sim_device(lane_order), logits, params, draws=SLICED_DRAWS, position=77, slices=SLICES
    )
    checked = 0
    for draw in range(SLICED_DRAWS):
        scores = race_scores(logits, params, 77 + draw)
        second, first = np.sort(scores)[-2:]
        if first - second > 1e-4 * max(1.0, abs(first)):
            assert tokens[draw] == int(np.argmax(scores)), f"draw {draw}"
            checked += 1
    assert checked > 0.9 * SLICED_DRAWS


def test_the_sliced_cases_reach_each_way_of_finishing():
    """The cases above are only worth their names if the kept sets are where they say: well
    within the slices' candidates (16 per slice), well past them, or ending on the level of
    900 ties that every slice's last candidate sits on (found there, the threshold is not
    above every unlisted token, so the finish must not trust the candidates)."""
    listed = SLICES * 16
    kept = {
        case: int(reference_kept(make_logits(SLICED_VOCAB, p.seed), p).sum())
        for case, (make_logits, p) in SLICED_CASES.items()
    }
    for case in ("min-p", "top-p", "top-k", "all filters"):
        assert kept[case] < listed // 4, (case, kept[case])
    for case in ("loose min-p", "flat top-p", "large top-k"):
        assert kept[case] > listed, (case, kept[case])
    for case in ("tied top-p", "tied top-k"):
        assert 900 < kept[case] < 920, (case, kept[case])


def finish_logits_bytes(logits: np.ndarray, params: SamplingParams) -> tuple[int, int]:
    """Distinct bytes of the logits the two dispatches read, on the counting sim."""
    device = open_device("sim", count_traffic=True)
    device_sample(device, logits, params, draws=1, slices=SLICES)
    traffic = device.traffic()
    assert [d.kernel for d in traffic] == ["sample_slices", "sample_token"]
    return traffic[0].buffers[2].read, traffic[1].buffers[2].read


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=1.0, seed=2, top_logprobs=5),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.1, seed=4),
    ],
    ids=["greedy", "plain", "top-p", "all filters"],
)
def test_the_finish_reads_no_logits_when_the_slices_decide(params):
    """The vocabulary is read by the slices, once; the finish reads a few logits by index
    (a slice's winner, the chosen token, the alternatives), not the 3000 a pass would."""
    logits = peaked_logits(SLICED_VOCAB, seed=61)
    spread, finish = finish_logits_bytes(logits, params)
    assert spread == logits.nbytes
    assert finish <= 4 * 4 * SLICES


def test_a_top_p_past_the_candidates_falls_back_to_the_logits():
    spread, finish = finish_logits_bytes(
        flat_logits(SLICED_VOCAB, seed=62), SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    )
    assert spread == finish == 4 * SLICED_VOCAB


def test_the_real_vocabulary_spreads_over_many_threadgroups():
    """Enough threadgroups for a 40-core GPU, each slice's candidates fitting the finish."""
    device = sim_device("forward")
    buffer = device.alloc(sample_partials_bytes(REAL_VOCAB))
    graph = Graph()
    record_sample(
        graph,
        device,
        logits=device.alloc(4 * REAL_VOCAB),
        vocab=REAL_VOCAB,
        params=buffer,
        position=buffer,
        predicted=buffer,
        logprob_ring=device.alloc(logprob_ring_bytes(1)),
        ring_slots=1,
        token_mask=device.alloc(token_mask_bytes(REAL_VOCAB)),
        adjustments=LogitAdjustments.allocate(device, REAL_VOCAB),
        partials=buffer,
    )
    spread, finish = graph.dispatches
    assert spread.threadgroups == (122, 1, 1) and finish.threadgroups == (1, 1, 1)
    assert finish.level == spread.level + 1
    assert GATHER_CAPACITY >= 122 * 16


# ---- bookkeeping: the decode step's count and advance ------------------------------------------

BOOKKEEPING_VOCAB = 300
HISTORY = 16


def draw_and_advance(
    device, logits: np.ndarray, params: SamplingParams, step: list[int], draws_in_a_row: int = 1
):
    """The finishing dispatch with bookkeeping, replayed `draws_in_a_row` times as a decode
    graph is: (tokens drawn, step buffer, history, counts) afterwards."""
    parameters = device.alloc(SAMPLING_PARAMS_BYTES)
    write_sampling_params(parameters, params)
    adjustments = LogitAdjustments.allocate(device, BOOKKEEPING_VOCAB)
    write_logit_adjustments(adjustments, params, [], BOOKKEEPING_VOCAB)
    step_buffer = device.wrap(np.array(step, dtype=np.uint32))
    history = device.wrap(np.arange(100, 100 + HISTORY, dtype=np.uint32))
    predicted = device.alloc(4)
    graph = Graph()
    record_sample(
        graph,
        device,
        logits=device.wrap(logits),
        vocab=BOOKKEEPING_VOCAB,
        params=parameters,
        position=step_buffer,
        predicted=predicted,
        logprob_ring=device.alloc(logprob_ring_bytes(1)),
        ring_slots=1,
        token_mask=device.alloc(token_mask_bytes(BOOKKEEPING_VOCAB)),
        adjustments=adjustments,
        partials=device.scratch(sample_partials_bytes(BOOKKEEPING_VOCAB, slices=3)),
        slices=3,
        bookkeeping=StepBookkeeping(history, HISTORY),
    )
    drawn = []
    for _ in range(draws_in_a_row):
        device.run(graph)
        drawn.append(int(predicted.numpy().view(np.uint32)[0]))
    counts = adjustments.counts.numpy().view(np.uint32)[:BOOKKEEPING_VOCAB].copy()
    return drawn, step_buffer.numpy().view(np.uint32), history.numpy().view(np.uint32), counts


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_the_finish_counts_the_drawn_token_and_advances_the_step(lane_order):
    """Greedy under a frequency penalty, replayed: each draw sees the counts of those before
    it, and each appends its token to the history past the prompt."""
    device = sim_device(lane_order)
    logits = np.zeros(BOOKKEEPING_VOCAB, np.float32)
    logits[[10, 20, 30]] = [3.0, 2.5, 2.3]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.4, seed=1)
    drawn, step, history, counts = draw_and_advance(device, logits, params, [4, 3, 0], 4)
    # Token 10 at 3.0, then 2.6 > 2.5; at 2.2 it drops below 20 (2.5), which at 2.1 drops
    # below 30 (2.3).
    assert drawn == [10, 10, 20, 30]
    assert step.tolist() == [8, 3, 30]
    assert history[5:9].tolist() == drawn
    assert history[:5].tolist() == list(range(100, 105))
    assert history[9:].tolist() == list(range(109, 100 + HISTORY))
    assert counts[[10, 20, 30]].tolist() == [2, 1, 1] and counts.sum() == 4


def test_the_finish_counts_only_when_the_request_adjusts():
    logits = peaked_logits(BOOKKEEPING_VOCAB, seed=63)
    drawn, step, history, counts = draw_and_advance(
        sim_device("random"), logits, SamplingParams(temperature=1.0, seed=2), [0, 1, 0], 2
    )
    assert not counts.any()
    assert step.tolist() == [2, 1, drawn[1]] and history[1:3].tolist() == drawn


def test_the_finish_advances_inside_the_prompt_and_saturates_at_the_capacity():
    device = sim_device("forward")
    logits = peaked_logits(BOOKKEEPING_VOCAB, seed=64)
    greedy = SamplingParams(temperature=0.0, seed=3)
    _, step, history, _ = draw_and_advance(device, logits, greedy, [2, 10, 0])
    assert step.tolist() == [3, 10, 103] and history[3] == 103  # the prompt's own token
    _, step, history, _ = draw_and_advance(device, logits, greedy, [HISTORY - 1, 3, 0])
    assert step[0] == HISTORY
    assert history.tolist() == list(range(100, 100 + HISTORY))


def test_a_refused_row_still_advances_with_no_token():
    """As the separate step_advance did: the engine sees NO_TOKEN and refuses the step."""
    logits = peaked_logits(BOOKKEEPING_VOCAB, seed=65)
    logits[7] = np.nan
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=4)
    drawn, step, history, counts = draw_and_advance(sim_device("random"), logits, params, [5, 0, 0])
    assert drawn == [NO_TOKEN]
    assert step.tolist() == [6, 0, NO_TOKEN] and history[6] == NO_TOKEN
    assert not counts.any()


def test_bookkeeping_needs_a_single_draw():
    device = sim_device("forward")
    buffer = device.alloc(1 << 16)
    with pytest.raises(ValueError, match="one draw"):
        record_sample(
            Graph(),
            device,
            logits=buffer,
            vocab=64,
            params=buffer,
            position=buffer,
            predicted=buffer,
            logprob_ring=buffer,
            ring_slots=1,
            token_mask=buffer,
            adjustments=LogitAdjustments(buffer, buffer, buffer),
            partials=buffer,
            draws=2,
            bookkeeping=StepBookkeeping(buffer, 16),
        )


# ---- a batched decode pass: one draw per row, each on its own sequence slot ----------------------

ROWS_SLOTS = 4
ROW_SLOTS = [2, 0, 3]  # slot 1 is no row's
ROWS_LOGITS_STRIDE = BOOKKEEPING_VOCAB + 5
ROWS_RING_SLOTS = 4
SLOT_CASES = {
    # slot: (settings, step [position, prompt_end, token], generated, prompt, allowed ids)
    0: (
        SamplingParams(temperature=0.0, frequency_penalty=0.4, seed=1),
        [7, 3, 0],
        [10, 10],
        [],
        None,
    ),
    1: (SamplingParams(temperature=0.0, seed=2), [1, 0, 0], [], [], None),
    2: (
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, top_logprobs=2),
        [2, 5, 0],
        [],
        [3, 4],
        None,
    ),
    3: (
        SamplingParams(temperature=1.0, seed=9, presence_penalty=0.5, logit_bias=((5, 2.0),)),
        [HISTORY - 1, 0, 0],
        [5],
        [6],
        list(range(0, BOOKKEEPING_VOCAB, 3)),
    ),
}


class SlotSampler:
    """One sequence's sampler buffers, as the single-sequence decode step binds them."""

    def __init__(self, device, slot: int) -> None:
        params, step, generated, prompt, allowed = SLOT_CASES[slot]
        vocab = BOOKKEEPING_VOCAB
        self.params = device.alloc(SAMPLING_PARAMS_BYTES)
        write_sampling_params(self.params, params)
        self.adjustments = LogitAdjustments.allocate(device, vocab)
        write_logit_adjustments(self.adjustments, params, prompt, vocab, generated)
        self.token_mask = device.alloc(token_mask_bytes(vocab))
        write_token_mask(
            self.token_mask, None if allowed is None else mask_from_tokens(allowed, vocab)
        )
        self.step = device.wrap(np.array(step, dtype=np.uint32))
        self.history = device.wrap(np.arange(100 * slot, 100 * slot + HISTORY, dtype=np.uint32))
        self.predicted = device.alloc(4)
        self.ring = device.alloc(logprob_ring_bytes(ROWS_RING_SLOTS))

    def buffers(self) -> list:
        a = self.adjustments
        return [self.params, self.step, self.predicted, self.ring, self.token_mask, a.bias,
                a.counts, a.prompt_tokens, self.history]  # fmt: skip

    def record(self, graph: Graph, device, logits) -> None:
        record_sample(
            graph,
            device,
            logits=logits,
            vocab=BOOKKEEPING_VOCAB,
            params=self.params,
            position=self.step,
            predicted=self.predicted,
            logprob_ring=self.ring,
            ring_slots=ROWS_RING_SLOTS,
            token_mask=self.token_mask,
            adjustments=self.adjustments,
            partials=device.scratch(sample_partials_bytes(BOOKKEEPING_VOCAB, slices=3)),
            slices=3,
            bookkeeping=StepBookkeeping(self.history, HISTORY),
        )


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_rows_draw_each_row_as_its_slot_alone(lane_order):
    """A batched pass's draws in one sampler pass: row r draws for slot ROW_SLOTS[r] (ragged:
    3 rows of 4 slots out of order) under that slot's settings, mask, adjustments and position,
    and ends that slot's step. Each slot's buffers afterwards (token, step, history, counts,
    log-probabilities) equal those the single-sequence draw leaves on the same slot alone, bit
    for bit; the slot no row draws for is left as it was."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(70)
    logits = rng.normal(0, 2, (len(ROW_SLOTS), ROWS_LOGITS_STRIDE)).astype(np.float32)
    pooled_slots = [SlotSampler(device, slot) for slot in range(ROWS_SLOTS)]
    pools = [
        device.wrap(np.concatenate([slot.buffers()[kind].numpy() for slot in pooled_slots]))
        for kind in range(len(pooled_slots[0].buffers()))
    ]
    params, step, predicted, ring, token_mask, bias, counts, prompt_tokens, history = pools
    graph = Graph()
    record_sample(
        graph,
        device,
        logits=device.wrap(logits),
        logits_stride=ROWS_LOGITS_STRIDE,
        vocab=BOOKKEEPING_VOCAB,
        params=params,
        position=step,
        predicted=predicted,
        logprob_ring=ring,
        ring_slots=ROWS_RING_SLOTS,
        token_mask=token_mask,
        adjustments=LogitAdjustments(bias, counts, prompt_tokens),
        partials=device.scratch(sample_partials_bytes(BOOKKEEPING_VOCAB, len(ROW_SLOTS), 3)),
        slices=3,
        bookkeeping=StepBookkeeping(history, HISTORY),
        row_slots=RowSlots(device.wrap(np.array(ROW_SLOTS, dtype=np.uint32)), len(ROW_SLOTS)),
    )
    device.run(graph)

    for slot in range(ROWS_SLOTS):
        alone = SlotSampler(device, slot)
        if slot in ROW_SLOTS:
            row = ROW_SLOTS.index(slot)
            single = Graph()
            alone.record(single, device, device.wrap(logits[row, :BOOKKEEPING_VOCAB].copy()))
            device.run(single)
        for kind, (pool, expected) in enumerate(zip(pools, alone.buffers(), strict=True)):
            size = expected.size
            got = pool.numpy()[slot * size : (slot + 1) * size]
            np.testing.assert_array_equal(got, expected.numpy(), err_msg=f"slot {slot} {kind}")
    # The greedy row (slot 0): the largest penalised logit, appended past the prompt.
    drawn = predicted.numpy().view(np.uint32)
    penalised = logits[1, :BOOKKEEPING_VOCAB] - np.float32(0.8) * (np.arange(300) == 10)
    assert drawn[0] == np.argmax(penalised)
    assert step.numpy().view(np.uint32)[:3].tolist() == [8, 3, drawn[0]]
    assert drawn[1] == 0  # slot 1 drew nothing
    assert drawn[3] % 3 == 0  # slot 3's mask
    assert step.numpy().view(np.uint32)[9] == HISTORY  # slot 3 saturates at the capacity


def test_rows_need_the_bookkeeping():
    device = sim_device("forward")
    buffer = device.alloc(1 << 16)
    with pytest.raises(ValueError, match="each end their sequence's decode step"):
        record_sample(
            Graph(),
            device,
            logits=buffer,
            vocab=64,
            params=buffer,
            position=buffer,
            predicted=buffer,
            logprob_ring=buffer,
            ring_slots=1,
            token_mask=buffer,
            adjustments=LogitAdjustments(buffer, buffer, buffer),
            partials=buffer,
            row_slots=RowSlots(buffer, 2),
        )
