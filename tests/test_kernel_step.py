"""The end-of-pass bookkeeping (`metal/step.metal`) against its rule: the position advances by
the tokens consumed; the next token comes from the prompt while inside it, else it is the
prediction, which is appended to the history; the position never passes the history."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import LANE_ORDERS, run, sim_device

from lily.kernels.step import POSITION, PROMPT_END, STEP_FIELDS, TOKEN, record_step_advance

CAPACITY = 16
PREDICTED = 777


def advance(lane_order: str, position: int, prompt_end: int, count: int):
    device = sim_device(lane_order)
    step = np.zeros(STEP_FIELDS, np.uint32)
    step[POSITION], step[PROMPT_END] = position, prompt_end
    history = np.arange(100, 100 + CAPACITY, dtype=np.uint32)
    step_buffer, history_buffer = device.wrap(step), device.wrap(history)
    predicted = device.wrap(np.array([PREDICTED], np.uint32))
    run(
        device,
        lambda g: record_step_advance(
            g, device, step_buffer, history_buffer, predicted, CAPACITY, count
        ),
    )
    return step, history


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
@pytest.mark.parametrize(
    ("position", "prompt_end", "count"),
    [(0, 10, 1), (0, 10, 7), (3, 10, 6), (9, 10, 1), (4, 10, 6), (12, 10, 1)],
)
def test_advance_by_count(lane_order, position, prompt_end, count):
    step, history = advance(lane_order, position, prompt_end, count)
    target = position + count
    assert step[POSITION] == target
    original = 100 + target
    expected = original if target < prompt_end else PREDICTED
    assert step[TOKEN] == expected
    assert history[target] == expected
    # Nothing else in the history changes.
    others = np.delete(history, target)
    assert np.array_equal(others, np.delete(np.arange(100, 100 + CAPACITY), target))


def test_position_saturates_at_the_capacity():
    step, history = advance("forward", CAPACITY - 2, 4, 5)
    assert step[POSITION] == CAPACITY
    assert np.array_equal(history, np.arange(100, 100 + CAPACITY))


def test_count_must_be_positive():
    device = sim_device("forward")
    buffer = device.alloc(4 * STEP_FIELDS)
    with pytest.raises(ValueError, match="count"):
        record_step_advance(None, device, buffer, buffer, buffer, CAPACITY, 0)  # type: ignore[arg-type]
