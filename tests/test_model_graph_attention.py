"""The decode step's and the verify pass's attention as the model graph records them: the split
grid and its partial buffers follow the capacity the graph was built for (one split per 256
positions, at least 32, at most 128), and a step or a verify pass with the cache full to its
last row runs within those buffers on the checking sim. A verify pass (2 to 9 tokens) runs the
multi-query decode attention, whose logits match a verify pass through the chunk kernel."""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from test_speculative import _prompt, _Scripted
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import ModelGraph
from lily.kernels import attention
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


def _attention_kernels(graph) -> list[str]:
    return [r.kernel for r in graph.dispatches if r.kernel.startswith("attention_")]


@pytest.mark.parametrize("tokens", [2, 5, 9])
def test_a_verify_pass_runs_the_multi_query_decode_attention(checkpoint, tokens: int) -> None:
    c = checkpoint.config
    model = ModelGraph(
        checkpoint, open_device("sim", execute=False), 8000, c.vocab_size, max_chunk=16
    )
    graph = model.verify_graph(tokens, min(tokens, 9))
    layers = len(c.full_attention_layers)
    expected = ["attention_prepare", "attention_decode_tokens", "attention_combine"] * layers
    assert _attention_kernels(graph) == expected
    decode = [r for r in graph.dispatches if r.kernel == "attention_decode_tokens"]
    combine = [r for r in graph.dispatches if r.kernel == "attention_combine"]
    # The decode grid of the capacity, one simdgroup per token; the combine per token.
    assert {(r.threadgroups, r.threads) for r in decode} == {
        ((32, c.num_key_value_heads, 1), (32 * tokens, 1, 1))
    }
    assert {r.threadgroups for r in combine} == {(c.num_attention_heads, HEAD_DIM // 64, tokens)}
    # Past the kernel's tokens, the chunk kernel.
    assert "attention_chunk" in _attention_kernels(model.verify_graph(10, 9))


def test_a_verify_pass_at_the_last_rows_stays_inside_the_partials(checkpoint) -> None:
    """Nine tokens at positions 991-999 of a 1000-row cache reach all 32 splits of the grid for
    each token: every per-token partial slot is written and read back, which the checking sim
    fails if the buffers were sized for one token."""
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", check=True), 1000, c.vocab_size, max_chunk=9)
    model.step_view()[0] = 991
    model.device.run(model.verify_graph(9, 9))
    assert np.all(np.isfinite(model.verify_logits_view(9)))


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_verify_rows_match_a_verify_pass_through_the_chunk_kernel(
    checkpoint, kv_cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same generation with drafts (every verify pass of 5 tokens) on two engines, one of
    which records attention_chunk for every pass of more than one token: the last verify pass's
    logits agree within the chunk kernel's 2-byte operands: it rounds Q to half and the softmax
    weights to bfloat (2^-8 of each), the decode kernel keeps fp32. Measured 2.4e-4 of a scale of
    3.8 (9.1e-4); the bound 2^-10 of the scale is 4x above that, while one missed or extra key
    moves a logit by a whole softmax weight."""

    def last_verify_rows(engine: DeviceEngine) -> np.ndarray:
        drafter = _Scripted(engine, prompt, answer, right=4, k=4)
        list(engine.generate(prompt, 6, drafter=drafter))
        return engine._model.verify_logits_view(5).copy()

    def make_engine() -> DeviceEngine:
        vocab = checkpoint.config.vocab_size
        return DeviceEngine(checkpoint, open_test_device(), 256, vocab, 64, kv_cache=kv_cache)

    plain = make_engine()
    prompt = _prompt(checkpoint)
    answer = [t.id for t in plain.generate(prompt, 8)]
    decode_rows = last_verify_rows(plain)
    verify = plain._model.verify_graph(5, 5)
    assert "attention_decode_tokens" in " ".join(_attention_kernels(verify))

    monkeypatch.setattr(attention, "MAX_DECODE_TOKENS", 1)
    chunked = make_engine()
    chunk_rows = last_verify_rows(chunked)
    chunk_kernels = _attention_kernels(chunked._model.verify_graph(5, 5))
    assert not any(k.startswith("attention_decode_tokens") for k in chunk_kernels)
    scale = np.abs(chunk_rows).max()
    np.testing.assert_allclose(decode_rows, chunk_rows, rtol=0, atol=2.0**-10 * scale)
    assert np.array_equal(decode_rows.argmax(axis=-1), chunk_rows.argmax(axis=-1))
