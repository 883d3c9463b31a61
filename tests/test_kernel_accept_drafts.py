"""A verify pass's acceptance on the device: the sampler's draw per row (`record_sample` with a
row stride and the drafts counted for the penalties) and `accept_drafts` (sampling.metal), and
word copies (`copy.metal`).

The numpy reference of the acceptance is the rule itself (with what the next pass reads: the
position and the step at the model's own token; and the host's copy of the outcome in the ring
entry of the pass's position): the accepted drafts are the longest
prefix equal to the rows' own tokens, followed by the own token of the first row that differs
(or of the row after the last draft). A row's own token is, greedy, the argmax of its adjusted,
masked logits (ties to the lowest id, as the decode step's sampler breaks them); sampling, the
winner of the reference Gumbel race of `test_kernel_sampling` keyed on the row's position, so
the device's draws are pinned down token for token. Drawing the row's token and accepting the
draft when they agree is the rejection rule for a draft proposing x with probability 1: x is
accepted with probability p(x), and a rejected row yields a token distributed as p with x
removed and renormalised; the chi-square tests check that on the device's output.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, run, sim_device
from test_kernel_sampling import (
    P_VALUE_THRESHOLD,
    check_logprobs,
    chi_square_p_value,
    masked,
    peaked_logits,
    race_scores,
    reference_adjusted,
    reference_probabilities,
)

from lily.device import Graph
from lily.engine.constraint import mask_from_tokens
from lily.engine.sampling import SamplingParams
from lily.kernels.copy import record_copy
from lily.kernels.sampling import (
    MAX_DRAFTS,
    NO_TOKEN,
    SAMPLING_PARAMS_BYTES,
    LogitAdjustments,
    PassOutcome,
    accepted_bytes,
    logprob_ring_bytes,
    outcome_ring_bytes,
    read_accepted,
    read_outcome,
    record_accept_drafts,
    record_sample,
    sample_partials_bytes,
    token_mask_bytes,
    token_mask_words,
    write_logit_adjustments,
    write_sampling_params,
    write_token_mask,
    write_token_masks,
)

CAPACITY = 64
POSITION = 20  # the token row 0 consumes: the drafts sit at POSITION + 1 on
RING_SLOTS = 16
# Vocabularies that end inside a block: of the sampler's 2048-token slices (2 slices, the last
# holding 5 tokens), and of its threads (fewer tokens than the 64 threads of a threadgroup).
VOCABS = (2053, 45)


def reference_accept(drafts: Sequence[int], own: Sequence[int]) -> list[int]:
    """The acceptance rule: the drafts up to the first row whose own token differs, then that
    row's own token (or the last row's, when every draft agrees)."""
    out: list[int] = []
    for i, token in enumerate(own):
        out.append(int(token))
        if i == len(drafts) or token != drafts[i]:
            return out
    raise AssertionError("one own token per row: len(drafts) + 1")


class Verify:
    """One verify pass's sampling and acceptance on a device, recorded once: rows of logits
    (stride `stride` >= vocab, the padding past the vocabulary at +1e30: never drawable), the
    drafts in the history after POSITION. The rows obey one mask (`allowed`), or with
    `row_allowed` each its own (None: no mask for that row)."""

    def __init__(self, device, rows: np.ndarray, vocab: int, params: SamplingParams, *,
                 prompt: Sequence[int] = (), generated: Sequence[int] = (),
                 allowed: np.ndarray | None = None,
                 row_allowed: Sequence[np.ndarray | None] | None = None, threads: int = 64,
                 capacity: int = CAPACITY) -> None:  # fmt: skip
        self.device, self.vocab, self.params = device, vocab, params
        count, stride = rows.shape
        self.drafts = count - 1
        self.parameters = device.alloc(SAMPLING_PARAMS_BYTES)
        write_sampling_params(self.parameters, params)
        mask_stride = 0
        if row_allowed is None:
            self.token_mask = device.alloc(token_mask_bytes(vocab))
            mask = None if allowed is None else mask_from_tokens(allowed, vocab)
            write_token_mask(self.token_mask, mask)
        else:
            self.token_mask = device.alloc(token_mask_bytes(vocab, count))
            masks = [None if a is None else mask_from_tokens(a, vocab) for a in row_allowed]
            write_token_masks(self.token_mask, masks, vocab)
            mask_stride = token_mask_words(vocab)
        self.adjustments = LogitAdjustments.allocate(device, vocab)
        write_logit_adjustments(self.adjustments, params, prompt, vocab, generated)
        self.logits = device.wrap(np.ascontiguousarray(rows, dtype=np.float32))
        self.position = device.wrap(np.array([POSITION], np.uint32))
        self.history = device.wrap(np.zeros(capacity, np.uint32))
        self.drawn = device.alloc(4 * count)
        self.accepted = device.alloc(accepted_bytes(MAX_DRAFTS))
        self.ring = device.alloc(logprob_ring_bytes(RING_SLOTS))
        self.step = device.wrap(np.zeros(3, np.uint32))
        self.outcomes = device.alloc(outcome_ring_bytes(RING_SLOTS))
        self.capacity = capacity
        self.graph = Graph()
        record_sample(
            self.graph,
            device,
            logits=self.logits,
            logits_stride=stride,
            vocab=vocab,
            params=self.parameters,
            position=self.position,
            predicted=self.drawn,
            logprob_ring=self.ring,
            ring_slots=RING_SLOTS,
            token_mask=self.token_mask,
            adjustments=self.adjustments,
            partials=device.scratch(sample_partials_bytes(vocab, count)),
            draws=count,
            threads=threads,
            slice_threads=threads,
            drafts=self.history,
            mask_stride=mask_stride,
        )
        self.graph.barrier()
        record_accept_drafts(
            self.graph,
            device,
            drafts=self.drafts,
            vocab=vocab,
            params=self.parameters,
            position=self.position,
            drawn=self.drawn,
            history=self.history,
            capacity=capacity,
            counts=self.adjustments.counts,
            accepted=self.accepted,
            step=self.step,
            outcomes=self.outcomes,
            outcome_slots=RING_SLOTS,
        )

    def __call__(self, drafts: Sequence[int], position: int = POSITION) -> list[int]:
        """The accepted tokens, having checked what the acceptance writes besides them."""
        history = self.history.numpy().view(np.uint32)
        history[:] = 0
        history[position + 1 : position + 1 + len(drafts)] = drafts
        last = self.capacity - 1
        checked = [int(history[min(position + 1 + i, last)]) for i in range(self.drafts)]
        self.position.numpy().view(np.uint32)[0] = position
        self.device.run(self.graph)
        accepted = read_accepted(self.accepted)
        assert read_outcome(self.outcomes, RING_SLOTS, position, self.drafts) == PassOutcome(
            checked, accepted
        )
        own = position + len(accepted)  # the model's token: the next pass consumes it
        assert self.position.numpy().view(np.uint32)[0] == own
        assert self.step.numpy().view(np.uint32).tolist() == [own, own + 1, accepted[-1]]
        return accepted

    def counts(self) -> np.ndarray:
        return self.adjustments.counts.numpy()[: 4 * self.vocab].view(np.uint32).copy()


def padded(rows: np.ndarray, stride: int) -> np.ndarray:
    """The rows at `stride` floats apart, the padding past the vocabulary at +1e30 (the lm_head's
    padding rows: a draw reading them would pick them)."""
    out = np.full((len(rows), stride), 1e30, np.float32)
    out[:, : rows.shape[1]] = rows
    return out


def greedy_own(rows: np.ndarray, params, prompt, generated, drafts, allowed=None) -> list[int]:
    """Each row's argmax of its adjusted (the drafts before it counted as generated), masked
    logits, ties to the lowest id (np.argmax's)."""
    own = []
    for g, row in enumerate(rows):
        values = reference_adjusted(row, params, prompt, [*generated, *drafts[:g]])
        if allowed is not None:
            values = masked(values, allowed)
        own.append(int(np.argmax(values)))
    return own


def sampled_own(rows: np.ndarray, params, prompt, generated, drafts, allowed=None) -> list[int]:
    """Each row's winner of the reference race keyed on its position (POSITION + g)."""
    own = []
    for g, row in enumerate(rows):
        values = reference_adjusted(row, params, prompt, [*generated, *drafts[:g]])
        if allowed is not None:
            values = masked(values, allowed)
        own.append(int(np.argmax(race_scores(values, params, POSITION + g))))
    return own


def tied_rows(vocab: int, count: int, seed: int) -> np.ndarray:
    """Rows whose largest logit is held by two tokens each (the lower id must win)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0.0, 1.0, (count, vocab)).astype(np.float32)
    for row in rows:
        low, high = sorted(rng.choice(vocab, 2, replace=False))
        row[low] = row[high] = row.max() + 1.0
    return rows


def wrong(token: int, vocab: int) -> int:
    return (token + 1) % vocab


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", range(1, MAX_DRAFTS + 1))
def test_greedy_acceptance_is_the_longest_prefix_of_the_argmaxes(lane_order, vocab, k):
    device = sim_device(lane_order)
    rows = tied_rows(vocab, k + 1, seed=100 * k + vocab)
    params = SamplingParams(temperature=0.0, seed=1)
    verify = Verify(device, padded(rows, vocab + 7), vocab, params)
    own = greedy_own(rows, params, (), (), [])
    # All accepted, none, and a wrong draft after the first half (a draft equal to the tie's
    # higher id is wrong too: ties go to the lower).
    for right in sorted({k, 0, k // 2}):
        drafts = own[:right] + [wrong(t, vocab) for t in own[right:k]]
        if right < k:
            tied = np.flatnonzero(rows[right] == rows[right].max())
            drafts[right] = int(tied[-1])
        expected = reference_accept(drafts, own)
        assert len(expected) == right + 1
        assert verify(drafts) == expected
        history = verify.history.numpy().view(np.uint32)
        # The model's own token follows the accepted drafts in the history.
        assert history[POSITION + 1 + right] == expected[-1]


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("k", [1, 4, MAX_DRAFTS])
def test_sampled_acceptance_replays_the_reference_race_with_every_transform(lane_order, k):
    """Temperature, top-k, top-p and min-p, a bias, the three penalties (row g counting the g drafts
    before it), and a token mask: each row draws exactly the reference race's winner, the
    acceptance keeps the agreeing prefix, counts its tokens for the penalties, and the rows'
    log-probabilities are their own rows' log_softmax."""
    vocab = 2053
    device = sim_device(lane_order)
    rng = np.random.default_rng(k)
    rows = np.stack([peaked_logits(vocab, seed=50 + 7 * k + g) for g in range(k + 1)])
    order = np.argsort(rows[0])[::-1].tolist()
    prompt, generated = order[:4], order[4:6] * 2
    params = SamplingParams(
        temperature=0.8,
        top_k=60,
        top_p=0.9,
        min_p=0.01,
        seed=5 + k,
        logit_bias=((order[10], 2.0),),
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        top_logprobs=3,
    )
    allowed = np.flatnonzero(rng.random(vocab) < 0.9)
    verify = Verify(device, padded(rows, vocab + 3), vocab, params, prompt=prompt,
                    generated=generated, allowed=allowed)  # fmt: skip
    before = verify.counts()
    # Drafts that agree with the race as far as it goes: each row's own token depends on the
    # drafts before it, so build them row by row; then break them after `right`.
    for right in sorted({k, 0, (k + 1) // 2}):
        drafts: list[int] = []
        for g in range(k):
            own = sampled_own(rows[: g + 1], params, prompt, generated, drafts, allowed)[g]
            drafts.append(own if g < right else wrong(own, vocab))
        own = sampled_own(rows, params, prompt, generated, drafts, allowed)
        expected = reference_accept(drafts, own)
        write_logit_adjustments(verify.adjustments, params, prompt, vocab, generated)
        assert verify(drafts) == expected
        counted = verify.counts() - before
        assert counted.sum() == len(expected)
        assert np.array_equal(np.flatnonzero(counted), np.unique(expected))
        for g, token in enumerate(expected):
            check_logprobs(verify.ring, RING_SLOTS, POSITION + g, rows[g], token, 3, 64)


def disjoint_masks(vocab: int, rows: int, seed: int) -> list[np.ndarray | None]:
    """Row 1 without a mask; the others each allow a random part of the vocabulary, the parts
    disjoint, so that a row drawing under any mask but its own draws another token."""
    parts = np.random.default_rng(seed).integers(0, rows - 1, vocab)
    masks: list[np.ndarray | None] = [np.flatnonzero(parts == g) for g in range(rows - 1)]
    masks.insert(1, None)
    return masks


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=0.8, top_k=25, seed=3)],
    ids=["greedy", "sampled"],
)
def test_each_row_draws_under_its_own_mask(lane_order, vocab, params):
    """A verify pass under a grammar: row g draws under the grammar's mask after the g drafts
    before it, so each row reads its own mask (`mask_stride`). Every row's draw is the
    reference's under that row's mask (none for row 1), and the acceptance follows them."""
    k = 4
    device = sim_device(lane_order)
    rows = np.stack([peaked_logits(vocab, seed=vocab + 11 * g) for g in range(k + 1)])
    masks = disjoint_masks(vocab, k + 1, seed=vocab)
    verify = Verify(device, padded(rows, vocab + 5), vocab, params, row_allowed=masks)
    own = []
    for g, (row, allowed) in enumerate(zip(rows, masks, strict=True)):
        values = row if allowed is None else masked(row, allowed)
        if not params.greedy:
            values = race_scores(values, params, POSITION + g)
        own.append(int(np.argmax(values)))
        assert allowed is None or own[-1] in allowed
    for right in (k, 1):
        drafts = own[:right] + [wrong(t, vocab) for t in own[right:k]]
        assert verify(drafts) == reference_accept(drafts, own)
        drawn = verify.drawn.numpy()[: 4 * (k + 1)].view(np.uint32)
        assert drawn.tolist() == own


def test_per_row_masks_are_checked():
    device = sim_device("forward")
    vocab = 45
    one_row = device.alloc(token_mask_bytes(vocab))
    with pytest.raises(ValueError, match="2 token masks need"):
        write_token_masks(one_row, [None, None], vocab)
    with pytest.raises(ValueError, match="2 words at most"):
        write_token_masks(one_row, [np.zeros(3, np.uint32)], vocab)
    kwargs = dict(logits=device.alloc(4 * 2 * vocab), logits_stride=vocab, vocab=vocab,
                  params=device.alloc(SAMPLING_PARAMS_BYTES), position=device.alloc(4),
                  predicted=device.alloc(8), logprob_ring=device.alloc(logprob_ring_bytes(1)),
                  ring_slots=1, adjustments=LogitAdjustments.allocate(device, vocab),
                  partials=device.alloc(sample_partials_bytes(vocab, 2)), draws=2)  # fmt: skip
    with pytest.raises(ValueError, match="mask_stride must be 0 or at least 3 words"):
        record_sample(Graph(), device, token_mask=one_row, mask_stride=2, **kwargs)
    with pytest.raises(ValueError, match="token_mask needs 24 bytes"):
        record_sample(Graph(), device, token_mask=one_row, mask_stride=3, **kwargs)


def test_a_refused_row_ends_the_acceptance_with_no_token():
    vocab = 45
    device = sim_device("forward")
    rows = np.random.default_rng(3).normal(size=(4, vocab)).astype(np.float32)
    rows[2, 7] = np.nan
    params = SamplingParams(temperature=0.0, seed=1)
    own = [int(np.argmax(r)) for r in rows[:2]]
    verify = Verify(device, rows, vocab, params)
    assert verify([*own, 0]) == [*own, NO_TOKEN]


SAMPLED_VOCAB = 40
SAMPLED_RUNS = 1500


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_sampled_acceptance_gives_the_target_distribution(lane_order):
    """Over many positions (independent random numbers), with a likely first draft: the first
    token is distributed as row 0's target (accepting the draft with probability p(draft)), the
    second, after an accepted first draft, as row 1's; the other arm checks a draft the target
    cannot draw (top-k drops it): never accepted."""
    device = sim_device(lane_order)
    rows = np.stack([peaked_logits(SAMPLED_VOCAB, seed=s) for s in (1, 2, 3)])
    params = SamplingParams(temperature=1.0, top_k=12, seed=9)
    targets = [reference_probabilities(row, params) for row in rows]
    likely = int(np.argsort(targets[0])[-2])  # the second most likely: p about 0.2
    impossible = int(np.argmin(targets[0]))
    verify = Verify(device, rows, SAMPLED_VOCAB, params, capacity=3 * SAMPLED_RUNS + 3)
    firsts, seconds, accepted = [], [], 0
    for run_index in range(SAMPLED_RUNS):
        out = verify([likely, 0], position=3 * run_index)
        firsts.append(out[0])
        if len(out) > 1:
            accepted += 1
            seconds.append(out[1])
    first_counts = np.bincount(firsts, minlength=SAMPLED_VOCAB)
    assert chi_square_p_value(first_counts, targets[0]) > P_VALUE_THRESHOLD
    second_counts = np.bincount(seconds, minlength=SAMPLED_VOCAB)
    assert chi_square_p_value(second_counts, targets[1]) > P_VALUE_THRESHOLD
    p = targets[0][likely]
    assert abs(accepted - SAMPLED_RUNS * p) <= 4 * np.sqrt(SAMPLED_RUNS * p * (1 - p))
    never = [verify([impossible], position=2 * i)[0] for i in range(200)]
    assert impossible not in never
    assert chi_square_p_value(np.bincount(never, minlength=SAMPLED_VOCAB), targets[0]) > (
        P_VALUE_THRESHOLD
    )


def test_the_chi_square_test_sees_a_rule_that_favours_the_draft():
    """Accepting the draft whenever the target can draw it at all would be a wrong rule: the
    test's statistics must reject its output, or the test above proves nothing."""
    rows = np.stack([peaked_logits(SAMPLED_VOCAB, seed=s) for s in (1, 2)])
    params = SamplingParams(temperature=1.0, top_k=12, seed=9)
    target = reference_probabilities(rows[0], params)
    likely = int(np.argsort(target)[-2])
    rng = np.random.default_rng(0)
    favoured = np.where(rng.random(SAMPLED_RUNS) < 0.5, likely,
                        rng.choice(SAMPLED_VOCAB, SAMPLED_RUNS, p=target))  # fmt: skip
    counts = np.bincount(favoured, minlength=SAMPLED_VOCAB)
    assert chi_square_p_value(counts, target) < P_VALUE_THRESHOLD


def test_acceptance_launches_are_checked():
    device = sim_device("forward")
    graph = Graph()
    small = device.alloc(4)
    kwargs = dict(vocab=10, params=device.alloc(SAMPLING_PARAMS_BYTES), position=small,
                  drawn=device.alloc(40), history=device.alloc(4 * CAPACITY),
                  capacity=CAPACITY, counts=device.alloc(40),
                  accepted=device.alloc(accepted_bytes(MAX_DRAFTS)), step=device.alloc(12),
                  outcomes=device.alloc(outcome_ring_bytes(RING_SLOTS)),
                  outcome_slots=RING_SLOTS)  # fmt: skip
    with pytest.raises(ValueError, match="drafts must be 0 to 8"):
        record_accept_drafts(graph, device, drafts=MAX_DRAFTS + 1, **kwargs)
    with pytest.raises(ValueError, match="accepted needs"):
        record_accept_drafts(graph, device, drafts=4, **{**kwargs, "accepted": small})
    with pytest.raises(ValueError, match="step needs 12 bytes"):
        record_accept_drafts(graph, device, drafts=4, **{**kwargs, "step": small})
    with pytest.raises(ValueError, match="outcomes needs"):
        record_accept_drafts(graph, device, drafts=4, **{**kwargs, "outcome_slots": RING_SLOTS + 1})


def test_a_ring_entry_outlives_the_pass_queued_behind_it():
    """Two passes run back to back, the second at the first's model token (where the first left
    the position, as a pass queued before the host read the first finds it): the first's
    outcome is still in its entry after the second has run."""
    vocab = 45
    device = sim_device("forward")
    rows = np.random.default_rng(8).normal(size=(5, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.0, seed=1)
    own = [int(np.argmax(r)) for r in rows]
    verify = Verify(device, rows, vocab, params)
    drafts = [*own[:2], wrong(own[2], vocab), 0]
    first = verify(drafts)
    assert first == own[:3]
    history = verify.history.numpy().view(np.uint32)
    history[POSITION + 4 : POSITION + 8] = own[:4]
    verify.device.run(verify.graph)
    assert read_outcome(verify.outcomes, RING_SLOTS, POSITION + 3, 4).tokens == own
    assert read_outcome(verify.outcomes, RING_SLOTS, POSITION, 4) == PassOutcome(drafts, first)


# ---- word copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("words", [1, 63, 64 * 64 + 5, 3 * 64 * 64])
def test_copies_every_word_and_nothing_past_it(lane_order, words):
    """A copy of a ragged length to a word offset writes every word and nothing past it."""
    device = sim_device(lane_order)
    rng = np.random.default_rng(words)
    state = device.wrap(rng.integers(0, 2**32, words + 3, dtype=np.uint32))
    original = state.numpy().view(np.uint32).copy()
    backup = device.wrap(np.zeros(words + 8, np.uint32))
    run(device, lambda g: record_copy(g, device, state, (backup, 16), 4 * words, threads=64))
    copied = backup.numpy().view(np.uint32)
    np.testing.assert_array_equal(copied[4 : 4 + words], original[:words])
    assert not copied[:4].any() and not copied[4 + words :].any()


def test_copy_launches_are_checked():
    device = sim_device("forward")
    graph = Graph()
    buffer = device.alloc(64)
    with pytest.raises(ValueError, match="whole number of 4-byte words"):
        record_copy(graph, device, buffer, buffer, 6)
    with pytest.raises(ValueError, match="destination needs 64 bytes"):
        record_copy(graph, device, buffer, (buffer, 4), 64)
