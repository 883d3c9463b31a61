"""Where the model graph looks up the token's embedding: the decode step has no embedding
dispatch (layer 0's first GEMV reads the row from the table, `qgemv_embedded_*`), whichever kind
of layer comes first; a prefill chunk keeps the lookup. The tiny models start with a Gated
DeltaNet layer, like the real one; an attention-first model is the small one with layers 0 and 3
(its first attention layer) swapped, and its decode step must still equal the reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.config import FULL_ATTENTION
from lily.checkpoint.loader import Checkpoint, load_checkpoint
from lily.device import open_device
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import MODEL, ModelGraph
from lily.engine.reference import ReferenceModel

# Against the reference with a bf16 KV cache like the engine's (without it, the cache's rounding
# alone moves this model's logits by about 1e-2, test_engine's whole tolerance); the engine is
# within about 2e-5 of it, a wrong or missing embedding row is off by whole units.
TOLERANCE = 1e-3


def with_layers_swapped(checkpoint: Checkpoint, a: int, b: int) -> Checkpoint:
    """The same tensors with layers `a` and `b` exchanged (names and layer types)."""
    prefixes = {
        f"{MODEL}layers.{a}.": f"{MODEL}layers.{b}.",
        f"{MODEL}layers.{b}.": f"{MODEL}layers.{a}.",
    }

    def renamed(name: str) -> str:
        for old, new in prefixes.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    types = list(checkpoint.config.layer_types)
    types[a], types[b] = types[b], types[a]
    return dataclasses.replace(
        checkpoint,
        config=dataclasses.replace(checkpoint.config, layer_types=tuple(types)),
        tensors={renamed(n): t for n, t in checkpoint.tensors.items()},
        locations={renamed(n): info for n, info in checkpoint.locations.items()},
        unaligned=frozenset(renamed(n) for n in checkpoint.unaligned),
    )


@pytest.fixture(scope="module")
def small():
    return load_checkpoint(tiny_checkpoint("small"))


@pytest.fixture(scope="module")
def attention_first(small):
    first_attention = small.config.full_attention_layers[0]
    swapped = with_layers_swapped(small, 0, first_attention)
    assert swapped.config.layer_types[0] == FULL_ATTENTION
    return swapped


@pytest.mark.parametrize("first_layer", ["gdn", "attention"])
def test_only_a_prefill_chunk_has_an_embedding_dispatch(small, attention_first, first_layer):
    checkpoint = small if first_layer == "gdn" else attention_first
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", execute=False), 64, c.vocab_size, max_chunk=4)
    decode = [r.kernel for r in model.decode.dispatches]
    assert decode[0] == "qgemv_embedded_4_4"
    assert not any(k.startswith("embedding") for k in decode)
    chunk = [r.kernel for r in model.graph(4, predicts=True).dispatches]
    assert chunk[0] == "embedding_4"
    assert "qgemv_embedded_4_4" not in chunk


def test_an_attention_first_decode_step_matches_the_reference(attention_first):
    c = attention_first.config
    tokens = np.random.default_rng(7).integers(0, c.vocab_size, 12).tolist()
    device = DeviceEngine(attention_first, open_device("sim"), len(tokens), c.vocab_size)
    try:
        actual = device.teacher_forced_logits(tokens)
    finally:
        device.close()
    reference = ReferenceModel(c, attention_first.tensors, bf16_kv_cache=True)
    expected, _ = reference.prefill(tokens)
    worst = np.abs(actual - expected).max()
    assert worst < TOLERANCE, f"largest logit difference {worst:.2e}"
