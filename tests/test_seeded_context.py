"""Decoding after a long context given rather than fed (lily.diagnostics.seeded_context): the
device engine resumes from a prefix its cache was handed, and its decode step at 8k and 32k
positions, in both KV formats, matches the float64 reference holding the same values.

The bound: with the context's values exact on both sides, the engine's logits differ from
float64 only by its fp32 arithmetic, measured at 5e-6 to 6e-5 on these checkpoints (the larger at
short contexts, where a few positions carry the attention output). TOLERANCE = 2e-4 leaves a
threefold margin; negating the values of one tile of 32 positions out of 8k moves the
reference's logits by about 3e-3, over ten times the bound, so a lost or misplaced tile of the
context fails the test (`test_the_bound_sees_one_tile_of_the_context`).
"""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.quant import round_to_bf16
from lily.diagnostics.seeded_context import encode_kv_rows, kv_row_values, seed_context
from lily.engine.engine import DeviceEngine, ReferenceEngine
from lily.engine.reference import ReferenceModel, dequantize_int8, quantize_int8
from lily.engine.sampling import SamplingParams
from lily.kernels.attention import row_bytes

TOLERANCE = 2e-4
NEW_TOKENS = [5, 17, 99]


@pytest.fixture(scope="module", params=["small", "wide"])
def checkpoint(request):
    return load_checkpoint(tiny_checkpoint(request.param))


def _reference(checkpoint, kv_cache: str) -> ReferenceModel:
    """The float64 reference whose cache rounds new rows as the engine's `kv_cache` does."""
    rounding = (
        {"bf16_kv_cache": True}
        if kv_cache == "bf16"
        else {"kv_int8_group": 32, "kv_int8_fp16_scales": True}
    )
    return ReferenceModel(checkpoint.config, checkpoint.tensors, np.float64, **rounding)


def _seeded_logits(checkpoint, kv_cache: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's and the float64 reference's logits for NEW_TOKENS after a seeded context."""
    c = checkpoint.config
    context = seed_context(c, length, kv_cache)
    max_seq = length + len(NEW_TOKENS) + 1
    engine = DeviceEngine(checkpoint, open_test_device(), max_seq, c.vocab_size, kv_cache=kv_cache)
    context.give_to(engine)
    actual = engine.teacher_forced_logits(context.tokens + NEW_TOKENS, reuse=True)
    expected, _ = _reference(checkpoint, kv_cache).prefill(NEW_TOKENS, context.reference_state())
    return actual, expected


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_rows_stand_for_the_formats_rounding(kv_cache: str) -> None:
    x = np.random.default_rng(0).standard_normal((3, 5, 256)).astype(np.float32) * 4
    x[0, 0, :32] = 0  # an all-zero int8 group
    rows = encode_kv_rows(x, kv_cache)
    assert rows.nbytes == 3 * 5 * row_bytes(kv_cache)
    if kv_cache == "bf16":
        expected = round_to_bf16(x)
    else:
        expected = dequantize_int8(*quantize_int8(x.astype(np.float64), 32, fp16_scales=True))
    np.testing.assert_array_equal(kv_row_values(rows, kv_cache), expected)


@pytest.mark.parametrize(
    ("kv_cache", "length"), [("bf16", 8193), ("int8", 8193), ("bf16", 32771), ("int8", 1)]
)
def test_decoding_after_a_seeded_context_matches_float64(checkpoint, kv_cache, length) -> None:
    """8,193 positions end one past a tile and a split; 32,771 lie past the point where the
    decode grid stops adding splits and lengthens them (kernels/attention.py, MAX_SPLITS)."""
    actual, expected = _seeded_logits(checkpoint, kv_cache, length)
    assert actual.shape == expected.shape == (len(NEW_TOKENS), checkpoint.config.vocab_size)
    assert np.abs(actual - expected).max() < TOLERANCE


def test_greedy_answers_after_8k_positions_match_the_bf16_cache_where_decided(checkpoint):
    """The same context values held in bf16 and in int8: greedy answers agree up to the bf16
    engine's first top-1/top-2 margin under 1e-2 (the margin of tests/test_engine_kv_int8.py,
    tenfold the int8 cache's steady effect on the logits)."""
    c = checkpoint.config
    greedy_top2 = SamplingParams(temperature=0.0, top_logprobs=2)
    steps, answers = 6, {}
    for kv_cache in ("bf16", "int8"):
        context = seed_context(c, 8192, kv_cache)
        engine = DeviceEngine(
            checkpoint, open_test_device(), 8192 + steps + 2, c.vocab_size, kv_cache=kv_cache
        )
        context.give_to(engine)
        prompt = [*context.tokens, NEW_TOKENS[0]]
        assert engine.cached_prefix_length(prompt) == 8192
        answers[kv_cache] = list(engine.generate(prompt, steps, sampling=greedy_top2))
    margins = [t.logprobs.top[0][1] - t.logprobs.top[1][1] for t in answers["bf16"]]
    undecided = [i for i, margin in enumerate(margins) if margin <= 1e-2]
    horizon = undecided[0] if undecided else steps
    assert horizon > 0, f"the first token is a near-tie ({margins[0]:.1e}); pick another seed"
    assert [t.id for t in answers["int8"][:horizon]] == [t.id for t in answers["bf16"][:horizon]]


def test_the_bound_sees_one_tile_of_the_context(checkpoint) -> None:
    c = checkpoint.config
    context = seed_context(c, 8193, "bf16")
    reference = _reference(checkpoint, "bf16")
    expected, _ = reference.prefill(NEW_TOKENS, context.reference_state())
    state = context.reference_state()
    layer = min(state.values)
    state.values[layer][:, 4096:4128] *= -1
    changed, _ = reference.prefill(NEW_TOKENS, state)
    assert np.abs(changed - expected).max() > 10 * TOLERANCE


@pytest.mark.parametrize("engine_kind", ["device", "reference"])
def test_teacher_forcing_resumes_after_a_cached_prefix(checkpoint, engine_kind: str) -> None:
    """With `reuse`, teacher forcing resumes from the prefix cache's snapshot and returns the
    rows after it: those of feeding everything, within the decode step's rounding. The device
    engine prefills one token per pass (the decode step's kernels), so that the snapshot holds
    what teacher forcing computes, not a chunk's half-operand rounding of it."""
    c = checkpoint.config
    tokens = np.random.default_rng(4).integers(0, c.vocab_size, 20).tolist()
    if engine_kind == "device":
        engine = DeviceEngine(checkpoint, open_test_device(), 32, c.vocab_size, 1)
    else:
        engine = ReferenceEngine(checkpoint, 32, c.vocab_size)
    full = engine.teacher_forced_logits(tokens)
    list(engine.generate(tokens[:16], 1, snapshot_at=12))
    assert engine.cached_prefix_length(tokens) == 12
    resumed = engine.teacher_forced_logits(tokens, reuse=True)
    assert resumed.shape == (8, c.vocab_size)
    assert np.abs(resumed - full[12:]).max() < 1e-3


def test_a_context_in_another_layout_is_refused(checkpoint) -> None:
    c = checkpoint.config
    engine = DeviceEngine(checkpoint, open_test_device(), 64, c.vocab_size, kv_cache="bf16")
    with pytest.raises(ValueError, match="not the engine's layout for 16 tokens"):
        seed_context(c, 16, "int8").give_to(engine)
