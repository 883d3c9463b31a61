"""A checkpoint that produces NaN logits: both engines refuse to emit a token from them with
`NonFiniteLogitsError`, and the device engine serves the next request as if nothing happened.

The broken checkpoint is the tiny "small" model with one embedding row's scales set to NaN, so
exactly the sequences that contain that token go wrong (the NaN spreads through the recurrent
state and the KV cache to every later logit), and every other sequence is untouched.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine, ReferenceEngine
from lily.engine.sampling import SamplingParams
from lily.errors import NonFiniteLogitsError

MAX_SEQ = 48
EMBED_SCALES = "language_model.model.embed_tokens.scales"
BF16_NAN = 0x7FC0
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, seed=7, top_logprobs=2)


def _poisoned_copy(tmp_path, token: int):
    """A copy of the tiny checkpoint whose embedding row `token` dequantizes to NaN."""
    directory = tmp_path / f"nan-row-{token}"
    shutil.copytree(tiny_checkpoint("small"), directory)
    info = load_checkpoint(directory).locations[EMBED_SCALES]
    assert info.dtype == "BF16"
    scales = np.memmap(info.shard, np.uint16, "r+", info.offset, info.shape)
    scales[token] = BF16_NAN
    scales.flush()
    del scales
    return load_checkpoint(directory)


def _device_engine(checkpoint) -> DeviceEngine:
    device = open_test_device()
    return DeviceEngine(checkpoint, device, MAX_SEQ, checkpoint.config.vocab_size)


def _prompt(seed: int, avoid: int) -> list[int]:
    tokens = np.random.default_rng(seed).integers(0, 960, 12).tolist()
    return [t for t in tokens if t != avoid]


def _tokens(engine, prompt, steps, sampling=GREEDY) -> list[int]:
    return [t.id for t in engine.generate(prompt, steps, sampling=sampling)]


@pytest.fixture(scope="module")
def good_tokens():
    """Greedy continuation of a prompt on the intact checkpoint (the poisoned row is picked
    from it, so the prompt itself never touches the poisoned row)."""
    engine = _device_engine(load_checkpoint(tiny_checkpoint("small")))
    prompt = np.random.default_rng(1).integers(0, 960, 12).tolist()
    return prompt, _tokens(engine, prompt, 6)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_nan_in_the_prompt_is_refused_and_the_engine_serves_the_next_request(tmp_path, sampling):
    bad = 500
    engine = _device_engine(_poisoned_copy(tmp_path, bad))
    clean = _prompt(seed=2, avoid=bad)
    before = _tokens(engine, clean, 5, sampling)
    assert bad not in before
    poisoned = clean[:4] + [bad] + clean[4:]
    with pytest.raises(NonFiniteLogitsError, match="NaN or \\+inf logits at position"):
        _tokens(engine, poisoned, 5, sampling)
    assert _tokens(engine, clean, 5, sampling) == before


def test_a_nan_reached_while_decoding_stops_after_the_tokens_before_it(tmp_path, good_tokens):
    prompt, good = good_tokens
    bad = good[2]
    assert bad not in prompt and bad not in good[:2], "pick another prompt seed"
    engine = _device_engine(_poisoned_copy(tmp_path, bad))
    produced = []
    with pytest.raises(NonFiniteLogitsError) as error:
        for token in engine.generate(prompt, 6):
            produced.append(token.id)
    # good[2] is drawn from finite logits; the step that feeds it back is the broken one.
    assert produced == good[:3]
    assert error.value.position == len(prompt) + 3
    assert _tokens(engine, prompt[:6], 3)  # still serving


def test_the_reference_engine_refuses_the_same_logits(tmp_path):
    bad = 500
    checkpoint = _poisoned_copy(tmp_path, bad)
    reference = ReferenceEngine(checkpoint, MAX_SEQ, checkpoint.config.vocab_size)
    clean = _prompt(seed=2, avoid=bad)
    with np.errstate(invalid="ignore", over="ignore"), pytest.raises(NonFiniteLogitsError):
        _tokens(reference, clean[:4] + [bad] + clean[4:], 3)
    assert len(_tokens(reference, clean, 3)) == 3
