"""The decode step's attention as the model graph records it: the split grid and its partial
buffers follow the capacity the graph was built for (one split per 256 positions, at least 32,
at most 128),
and a step with the cache full to its last row runs within those buffers on the checking sim."""

from __future__ import annotations

import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.model_graph import ModelGraph
from lily.kernels.attention import HEAD_DIM


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(tiny_checkpoint("small"))


@pytest.mark.parametrize(("capacity", "splits"), [(100, 32), (8000, 32), (40000, 128)])
def test_the_split_grid_follows_the_capacity(checkpoint, capacity: int, splits: int) -> None:
    c = checkpoint.config
    model = ModelGraph(
        checkpoint, open_device("sim", execute=False), capacity, c.vocab_size, max_chunk=1
    )
    records = model.decode.dispatches
    fused = [r for r in records if r.kernel == "attention_decode_fused"]
    combine = [r for r in records if r.kernel == "attention_combine"]
    assert len(fused) == len(combine) == len(c.full_attention_layers)
    assert {r.threadgroups for r in fused} == {(splits, c.num_key_value_heads, 1)}
    # Four threadgroups of 64 dims per query head.
    assert {r.threadgroups for r in combine} == {(c.num_attention_heads, HEAD_DIM // 64, 1)}


def test_a_step_at_the_last_row_stays_inside_the_partials(checkpoint) -> None:
    """Position 999 of a 1000-row cache reaches all 32 splits of the grid (of 32 positions):
    every partial slot is written and read back, which the checking sim fails if the buffers
    were sized for fewer."""
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", check=True), 1000, c.vocab_size, max_chunk=1)
    model.step_view()[0] = 999
    model.device.run(model.decode)
    assert model.step_view()[0] == 1000
