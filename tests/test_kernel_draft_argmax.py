"""The MTP head's greedy draft on the device (`draft_argmax`, sampling.metal): the numpy
reference is np.argmax over the ids a draft may be (the first of equal values; NaN left out),
written into the history after the head pass's newest token and into its slot of the pass's
drafts, the head's step moved to that token."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, run, sim_device

from lily.kernels.sampling import record_draft_argmax

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
