"""A checkpoint loaded without its aligned copy (no disk room for it): the device binds the
aligned tensors in place and copies the unaligned ones, and the engine computes exactly what it
computes on the aligned copy."""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.device_weights import DeviceWeights
from lily.engine.engine import DeviceEngine

MAX_SEQ = 48


@pytest.fixture(scope="module")
def device():
    return open_test_device()


@pytest.fixture(scope="module")
def unaligned():
    return load_checkpoint(tiny_checkpoint("small", aligned=False))


def test_every_tensor_reaches_the_device_with_its_bytes(device, unaligned, capsys):
    weights = DeviceWeights(unaligned, device)
    assert "not 16-byte aligned: copying them into device memory" in capsys.readouterr().err
    for name, info in unaligned.locations.items():
        buffer, offset = weights.tensor(name)
        if name in unaligned.unaligned:
            assert offset == 0 and buffer.size == info.nbytes
        else:
            assert offset == info.offset and offset % 16 == 0
        got = buffer.numpy()[offset : offset + info.nbytes]
        expected = unaligned.shards[info.shard].buffer[info.offset : info.offset + info.nbytes]
        np.testing.assert_array_equal(got, expected)
    # Bound twice, copied once.
    name = next(iter(unaligned.unaligned))
    assert weights.tensor(name)[0] is weights.tensor(name)[0]


def test_a_shard_is_wrapped_only_for_tensors_bound_in_place(device, unaligned):
    weights = DeviceWeights(unaligned, device)
    for name in unaligned.unaligned:
        weights.tensor(name)
    assert weights._shards == {}


def test_the_engine_computes_the_same_on_copies_as_on_the_aligned_checkpoint(device, unaligned):
    aligned = load_checkpoint(tiny_checkpoint("small"))
    assert aligned.unaligned == frozenset()
    vocab = aligned.config.vocab_size
    prompt = np.random.default_rng(3).integers(0, vocab, 17).tolist()
    results = []
    for checkpoint in (aligned, unaligned):
        engine = DeviceEngine(checkpoint, device, MAX_SEQ, vocab)
        try:
            tokens = [t.id for t in engine.generate(prompt, 12)]
            results.append((tokens, engine.teacher_forced_logits(prompt + tokens)))
        finally:
            engine.close()
    (tokens_a, logits_a), (tokens_u, logits_u) = results
    assert tokens_u == tokens_a
    np.testing.assert_array_equal(logits_u, logits_a)
