"""The DFlash drafter's passes on the device (lily.engine.dflash_graph) against the numpy
reference (lily.engine.dflash_reference) on the tiny random drafter: the catch-up's cache rows
and the block pass's logits and drafts, after a context fed in ragged pieces."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_testing import sim_device
from tiny_models import tiny_checkpoint, tiny_drafter

from lily.checkpoint.dflash import load_dflash
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.quant import bf16_to_float32
from lily.engine.device_weights import DeviceWeights
from lily.engine.dflash_graph import MAX_DRAFTS, DrafterGraph
from lily.engine.dflash_reference import DFlashReference
from lily.engine.model_graph import EMBED_TOKENS, LM_HEAD, ModelGraph
from lily.engine.reference import ReferenceModel

PROMPT = [5, 17, 300, 2, 99, 41, 7, 250, 12, 600, 3, 77, 18, 901]
CAPACITY = 32


@pytest.fixture(scope="module")
def setup():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    drafter = load_dflash(tiny_drafter("small"), checkpoint.config)
    target = ReferenceModel(checkpoint.config, checkpoint.tensors, np.float64)
    reference = DFlashReference(drafter, target, bf16_cache=True)
    outputs = reference.target_layers()
    target.hidden_states(PROMPT, target.new_state(), layer_outputs=outputs)
    features = np.stack([outputs[i] for i in drafter.config.target_layer_ids], axis=1)
    device = sim_device("random")  # the checking sim
    weights = DeviceWeights(checkpoint, device)
    graph = DrafterGraph(
        drafter, device, CAPACITY, weights.quantized(EMBED_TOKENS), weights.quantized(LM_HEAD)
    )
    return reference, graph, features


def test_catch_up_writes_the_reference_s_cache_rows(setup):
    reference, graph, features = setup
    # 14 rows: a pass of 9 then one of 5; then the same rows again from 0 overwrite them.
    graph.catch_up(features, 0)
    cache = reference.new_cache()
    reference.catch_up(
        reference.features(
            {i: features[:, n] for n, i in enumerate(reference.config.target_layer_ids)}
        ),
        cache,
    )
    kv_heads = reference.config.num_key_value_heads
    for layer in range(reference.config.num_hidden_layers):
        for buffer, expected in (
            (graph.keys[layer], cache.keys[layer]),
            (graph.values[layer], cache.values[layer]),
        ):
            rows = bf16_to_float32(buffer.numpy().view(np.uint16)).reshape(kv_heads, CAPACITY, -1)
            got = rows[:, : len(PROMPT)]
            # Both are bf16 roundings of values that differ by fp32 arithmetic (the reference
            # is float64): one bf16 step at most where the two round apart.
            np.testing.assert_allclose(got, expected, rtol=2.0**-7, atol=1e-5)


@pytest.mark.parametrize("drafts", [1, 4, MAX_DRAFTS])
def test_block_logits_and_drafts_match_the_reference(setup, drafts):
    reference, graph, features = setup
    context = len(PROMPT) - 1  # the last prompt token is the newest, not yet context
    graph.catch_up(features[:context], 0)
    cache = reference.new_cache()
    ids = reference.config.target_layer_ids
    reference.catch_up(
        reference.features({i: features[:context, n] for n, i in enumerate(ids)}), cache
    )
    newest = PROMPT[-1]
    got = graph.draft(newest, drafts, context)
    logits = graph.logits_view(drafts)
    expected = reference.block_logits(newest, drafts, cache)
    # fp32 GEMVs and attention against float64 (the same bf16 cache rounding on both sides, a
    # value rounding apart by one bf16 step now and then): measured 1.2e-5 of the largest logit.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, atol=1e-4 * scale)
    top = np.sort(expected, axis=-1)
    clear = top[:, -1] - top[:, -2] > 2e-4 * scale  # rows whose argmax no rounding flips
    assert clear.any()
    want = np.argmax(expected, axis=-1)
    assert [g for g, c in zip(got, clear, strict=True) if c] == list(want[clear])


def test_the_target_s_passes_keep_the_rows_the_drafter_reads(setup):
    reference, _, features = setup
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    ids = reference.config.target_layer_ids
    device, max_chunk, n = sim_device("random"), 16, len(PROMPT)
    model = ModelGraph(
        checkpoint, device, CAPACITY, checkpoint.config.vocab_size, max_chunk, kept_layers=ids
    )
    history, step = model.history_view(), model.step_view()
    history[:n] = PROMPT
    step[:3] = 0, n, PROMPT[0]
    kept = model.layer_outputs.numpy().view(np.float32).reshape(len(ids), max_chunk, -1)
    # A prompt chunk (the walk with norm dispatches, half-operand GEMMs past 9 tokens): within
    # the chunk kernels' rounding of the float64 reference (measured: 1.5e-3 of the largest).
    device.run(model.graph(n, predicts=True))
    scale = np.abs(features).max()
    np.testing.assert_allclose(kept[:, :n].transpose(1, 0, 2), features, atol=1e-2 * scale)
    # The decode step (the folded walk) keeps its one row.
    newest = int(history[n])
    device.run(model.decode)
    outputs = reference.target_layers()
    reference.target.hidden_states(
        [*PROMPT, newest], reference.target.new_state(), layer_outputs=outputs
    )
    expected = np.stack([outputs[i][n] for i in ids])
    np.testing.assert_allclose(kept[:, 0], expected, atol=1e-2 * scale)
    # The drafter reads them where the target left them: the same cache rows as from the host.
    weights = DeviceWeights(checkpoint, device)
    embedding, lm_head = weights.quantized(EMBED_TOKENS), weights.quantized(LM_HEAD)
    direct = DrafterGraph(
        load_dflash(tiny_drafter("small"), checkpoint.config),
        device,
        CAPACITY,
        embedding,
        lm_head,
        model.layer_outputs,
        max_chunk,
    )
    hosted = DrafterGraph(
        load_dflash(tiny_drafter("small"), checkpoint.config), device, CAPACITY, embedding, lm_head
    )
    direct.catch_up_rows(0, 1, n)
    hosted.catch_up(kept[:, :1].transpose(1, 0, 2), n)
    for a, b in zip(direct.keys + direct.values, hosted.keys + hosted.values, strict=True):
        np.testing.assert_array_equal(a.numpy()[:], b.numpy()[:])
