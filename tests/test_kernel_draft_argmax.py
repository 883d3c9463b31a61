"""The MTP head's greedy draft on the device (`draft_argmax`, sampling.metal): the numpy
reference is np.argmax over the ids a draft may be (the first of equal values; NaN left out),
written into the history after the head pass's newest token and into its slot of the pass's
drafts, the head's step moved to that token. And the head following a verify pass the host has
not read (`follow_kept_row`): its step at the pass's first position, or at the kept row's with
that row of the hidden states copied out."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, run, sim_device

from lily.kernels.sampling import record_draft_argmax, record_follow_kept_row

CAPACITY = 40


def reference_draft(logits: np.ndarray) -> int:
    values = np.where(np.isnan(logits), -np.inf, logits)
    if np.isnan(logits).all():
        return 0
    return int(np.argmax(values))


def drafted(device, logits: np.ndarray, vocab: int, rows: int, start: int) -> tuple:
    """(the drafted token, the head's step after, the history) for a pass of `rows` from `start`."""
    buffer = device.alloc(4 * len(logits))
    buffer.numpy()[:] = logits.astype(np.float32).view(np.uint8)
    step = device.alloc(4)
    step.numpy().view(np.uint32)[0] = start
    history = device.alloc(4 * CAPACITY)
    history.numpy().view(np.uint32)[:] = 7777
    drafts = device.alloc(4 * 3)
    run(
        device,
        lambda g: record_draft_argmax(
            g, device, logits=buffer, vocab=vocab, rows=rows, step=step, history=history,
            capacity=CAPACITY, drafts=drafts, index=2,
        ),
    )  # fmt: skip
    words = history.numpy().view(np.uint32)
    newest = start + rows
    token = int(drafts.numpy().view(np.uint32)[2])
    if newest + 1 < CAPACITY:
        assert words[newest + 1] == token
    return token, int(step.numpy().view(np.uint32)[0]), list(words)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("vocab", [45, 1000, 3001])
def test_the_draft_is_the_argmax_of_the_ids_a_draft_may_be(lane_order, vocab):
    device = sim_device(lane_order)
    rng = np.random.default_rng(vocab)
    # Integers: many ties, the first of which must win; padding rows past vocab are larger.
    logits = rng.integers(-20, 20, vocab + 9).astype(np.float32)
    logits[vocab:] = 100.0
    token, step, history = drafted(device, logits, vocab, rows=3, start=5)
    assert token == reference_draft(logits[:vocab])
    assert step == 8
    # Only the draft's slot changed.
    assert [i for i, w in enumerate(history) if w != 7777] == [9]


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_nan_is_never_drafted_and_the_last_id_can_be(lane_order):
    device = sim_device(lane_order)
    vocab = 300
    logits = np.full(vocab, -np.inf, np.float32)
    logits[::7] = np.nan
    logits[vocab - 1] = -1e30
    assert drafted(device, logits, vocab, rows=1, start=0)[0] == vocab - 1
    everything_nan = np.full(vocab, np.nan, np.float32)
    assert drafted(device, everything_nan, vocab, rows=1, start=0)[0] == 0
    # All -inf: the lowest id, as np.argmax gives it.
    assert drafted(device, np.full(vocab, -np.inf, np.float32), vocab, rows=2, start=3)[0] == 0


def test_a_draft_past_the_history_is_not_written():
    device = sim_device("forward")
    logits = np.arange(50, dtype=np.float32)
    token, step, history = drafted(device, logits, 50, rows=1, start=CAPACITY - 2)
    assert token == 49 and step == CAPACITY - 1 and all(w == 7777 for w in history)


def reference_follow(position: int, kept: int, rows: np.ndarray, kept_row: bool):
    """(the head's step, the row copied out or None): the verify pass consumed p and kept
    `kept` drafts, so the acceptance left `position` = p + kept + 1."""
    first = position - kept - 1
    return (first + kept, rows[kept]) if kept_row else (first, None)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize("kept", [0, 3, 8])
@pytest.mark.parametrize("kept_row", [False, True])
def test_the_head_follows_the_row_the_acceptance_kept(lane_order, kept, kept_row):
    device = sim_device(lane_order)
    hidden = 70  # not a multiple of the threadgroup's threads
    rows = np.random.default_rng(kept).normal(size=(9, hidden)).astype(np.float32)
    position = 11 + kept + 1
    hidden_rows = device.wrap(rows.copy())
    accepted = device.wrap(np.array([kept, 5, 6], np.uint32))
    where = device.wrap(np.array([position], np.uint32))
    head_step = device.wrap(np.array([999], np.uint32))
    out = device.wrap(np.full(hidden + 2, 7.0, np.float32))
    run(
        device,
        lambda g: record_follow_kept_row(
            g, device, position=where, accepted=accepted, rows=hidden_rows, kept=out,
            head_step=head_step, hidden=hidden, kept_row=kept_row,
        ),
    )  # fmt: skip
    step, row = reference_follow(position, kept, rows, kept_row)
    assert head_step.numpy().view(np.uint32)[0] == step
    copied = out.numpy().view(np.float32)
    np.testing.assert_array_equal(copied[:hidden], np.full(hidden, 7.0) if row is None else row)
    assert (copied[hidden:] == 7.0).all()
    assert where.numpy().view(np.uint32)[0] == position


def test_following_launches_are_checked():
    device = sim_device("forward")
    word = device.alloc(4)
    kwargs = dict(position=word, accepted=word, rows=device.alloc(40), kept=device.alloc(40),
                  head_step=word, hidden=10, kept_row=True)  # fmt: skip
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        run(device, lambda g: record_follow_kept_row(g, device, **{**kwargs, "hidden": 0}))
    with pytest.raises(ValueError, match="kept needs 40 bytes"):
        run(device, lambda g: record_follow_kept_row(g, device, **{**kwargs, "kept": word}))
