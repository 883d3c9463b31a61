"""The reference model's int8 KV rounding (engine/reference.py quantize_int8 / dequantize_int8,
`ReferenceModel(kv_int8_group=...)`): the numpy definition an int8 KV cache is checked against,
and the model that benchmarks/kv_int8_study.py uses to choose its scales."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.reference import ReferenceModel, dequantize_int8, quantize_int8


def test_codes_and_scales_of_a_hand_made_group() -> None:
    codes, scales = quantize_int8(np.array([0.5, -1.27, 0.015, 0.0, 2.54, 0.0, 0.0, 0.0]), 4)
    np.testing.assert_allclose(scales, [0.01, 0.02])
    # 0.015 / 0.01 = 1.5 rounds to even.
    assert codes.tolist() == [50, -127, 2, 0, 127, 0, 0, 0]
    np.testing.assert_allclose(dequantize_int8(codes, scales), [0.5, -1.27, 0.02, 0, 2.54, 0, 0, 0])


def test_all_zero_groups_stay_zero() -> None:
    codes, scales = quantize_int8(np.zeros((2, 64)), 32)
    assert np.all(codes == 0) and np.all(scales == 0)
    assert np.all(dequantize_int8(codes, scales) == 0)


@pytest.mark.parametrize("group", [256, 64, 32])
def test_round_trip_is_within_half_a_step(group: int) -> None:
    rng = np.random.default_rng(group)
    # Keys of real models have outlier dims; give some rows one.
    x = rng.standard_normal((3, 50, 256))
    x[:, ::7, 5] *= 40
    codes, scales = quantize_int8(x, group)
    assert codes.dtype == np.int8 and scales.shape == (3, 50, 256 // group)
    assert np.abs(codes).max() == 127
    grouped = np.abs(x).reshape(3, 50, -1, group).max(axis=-1)
    np.testing.assert_allclose(scales * 127, grouped)
    step = np.repeat(scales, group, axis=-1)
    assert np.all(np.abs(dequantize_int8(codes, scales) - x) <= step / 2 * (1 + 1e-12))


def test_a_group_must_divide_the_row() -> None:
    with pytest.raises(ValueError, match="groups of 48"):
        quantize_int8(np.ones(256), 48)


def test_int8_and_bf16_rounding_are_exclusive() -> None:
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    with pytest.raises(ValueError, match="not both"):
        ReferenceModel(checkpoint.config, checkpoint.tensors, bf16_kv_cache=True, kv_int8_group=32)


def test_an_int8_cache_moves_the_logits_a_little() -> None:
    """40 prompt tokens on the small checkpoint: the cache's rounding reaches the logits (so the
    option is applied), typically by less than 2e-2 per position (logits of spread 1). Single
    positions can jump further when the rounding flips a near-tied routing choice of the MoE
    (0.17 and 0.32 here), so the bound is on the median position."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    tokens = np.random.default_rng(40).integers(0, checkpoint.config.vocab_size - 64, 40)

    def logits(**options) -> np.ndarray:
        model = ReferenceModel(checkpoint.config, checkpoint.tensors, np.float64, **options)
        return model.prefill(tokens)[0]

    exact = logits()
    for group in (256, 32):
        per_position = np.abs(logits(kv_int8_group=group) - exact).max(axis=1)
        assert 1e-4 < np.median(per_position) < 2e-2, (group, per_position)


def test_fp16_scales_are_rounded_before_the_codes_are_taken() -> None:
    """The engine's int8 cache stores fp16 scales: fp16(0.01) = 0.0100021, against which -0.635
    is -63.49 steps (-63), where the exact scale 0.01 gives -63.5, a tie rounded to even (-64)."""
    x = np.array([1.27, -0.635, 0.3, 0.0])
    exact_codes, _ = quantize_int8(x, 4)
    codes, scales = quantize_int8(x, 4, fp16_scales=True)
    assert exact_codes.tolist() == [127, -64, 30, 0]
    assert codes.tolist() == [127, -63, 30, 0]
    assert scales.dtype == x.dtype and scales[0] == np.float16(0.01)
