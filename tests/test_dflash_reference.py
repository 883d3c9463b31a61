"""The numpy reference of the DFlash drafter (lily.engine.dflash_reference): YaRN against its
formula worked by hand, the block's mask (non-causal, windowed, causal) against independent
checks, the target's residual rows, and the drafter's passes on the tiny random drafter."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tiny_models import tiny_checkpoint, tiny_drafter

from lily.checkpoint.dflash import YarnRope, load_dflash
from lily.checkpoint.loader import load_checkpoint
from lily.engine.dflash_reference import (
    DFlashReference,
    apply_yarn_rope,
    block_attention,
    greedy_with_drafts,
    yarn_attention_factor,
    yarn_inverse_frequencies,
)
from lily.engine.reference import ReferenceModel, apply_rope, attention, rms_norm

REAL_ROPE = YarnRope(
    theta=1e7, factor=64, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1
)


def test_yarn_frequencies_follow_the_formula_worked_by_hand():
    # d = 128, theta = 1e7, L = 4096: the pair turning 32 times over L sits at
    # 128 ln(4096 / (64 pi)) / (2 ln 1e7) = 11.97 (low = 11), the one turning once at
    # 128 ln(4096 / (2 pi)) / (2 ln 1e7) = 25.73 (high = 26).
    inv = yarn_inverse_frequencies(128, REAL_ROPE)
    plain = 1e7 ** (-np.arange(64) * 2 / 128)
    np.testing.assert_allclose(inv[:12], plain[:12], rtol=1e-12)  # share 0 up to i = low
    np.testing.assert_allclose(inv[26:], plain[26:] / 64, rtol=1e-12)
    share = (18 - 11) / (26 - 11)
    assert inv[18] == pytest.approx(plain[18] * (1 - share) + plain[18] / 64 * share, rel=1e-12)
    assert yarn_attention_factor(64) == pytest.approx(1 + 0.1 * math.log(64))
    assert yarn_attention_factor(1) == 1


def test_yarn_at_factor_1_is_plain_rope_on_every_dim():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 128))
    positions = np.array([0, 3, 17, 1000, 70000])
    plain = apply_rope(x, positions, 128, 1e7)
    np.testing.assert_allclose(
        apply_yarn_rope(x, positions, YarnRope(theta=1e7)), plain, rtol=1e-10, atol=1e-12
    )


def test_yarn_rope_scales_and_keeps_relative_positions():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 1, 128)), rng.normal(size=(1, 1, 128))

    def score(query_position: int, key_position: int) -> float:
        qr = apply_yarn_rope(q, np.array([query_position]), REAL_ROPE)
        kr = apply_yarn_rope(k, np.array([key_position]), REAL_ROPE)
        return float(np.sum(qr * kr))

    # Scores depend on the distance only, and at distance 0 are q.k times the factor squared.
    assert score(107, 100) == pytest.approx(score(7, 0), rel=1e-9)
    factor = yarn_attention_factor(64)
    assert score(5, 5) == pytest.approx(float(np.sum(q * k)) * factor**2, rel=1e-9)


def random_block(context: int, block: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(4, block, 16))
    k = rng.normal(size=(2, context + block, 16))
    v = rng.normal(size=(2, context + block, 16))
    return q, k, v


def test_causal_block_attention_is_ordinary_causal_attention():
    q, k, v = random_block(6, 5)
    causal = block_attention(q, k, v, 0.25, 6, causal=True, window=None)
    np.testing.assert_allclose(causal, attention(q, k, v, 0.25, 6 + np.arange(5)), rtol=1e-12)


def test_non_causal_block_attention_sees_the_whole_block():
    q, k, v = random_block(6, 5)
    full = block_attention(q, k, v, 0.25, 6, causal=False, window=None)
    # Every query sees every key: ordinary attention with all queries at the last position.
    np.testing.assert_allclose(full, attention(q, k, v, 0.25, np.full(5, 10)), rtol=1e-12)
    # Permuting the block's rows (queries with their own keys and values) permutes the output.
    order = np.array([3, 0, 4, 1, 2])
    keys_order = np.concatenate([np.arange(6), 6 + order])
    permuted = block_attention(
        q[:, order], k[:, keys_order], v[:, keys_order], 0.25, 6, causal=False, window=None
    )
    np.testing.assert_allclose(permuted, full[:, order], rtol=1e-12)
    # Row 0 reads the last block row: changing that row's value changes row 0.
    v2 = v.copy()
    v2[:, -1] += 1
    changed = block_attention(q, k, v2, 0.25, 6, causal=False, window=None)
    assert not np.allclose(changed[:, 0], full[:, 0])


def test_a_window_hides_context_keys_that_far_behind():
    q, k, v = random_block(10, 3)
    windowed = block_attention(q, k, v, 0.25, 10, causal=True, window=4)
    # Query i at position 10 + i sees context keys 10 + i - 3 .. 9 and block keys 10 .. 10 + i.
    for i in range(3):
        seen = [j for j in range(10) if 10 + i - j < 4] + list(range(10, 11 + i))
        expected = attention(
            q[:, i : i + 1], k[:, seen], v[:, seen], 0.25, np.array([len(seen) - 1])
        )
        np.testing.assert_allclose(windowed[:, i : i + 1], expected, rtol=1e-12)


@pytest.fixture(scope="module")
def models():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    target = ReferenceModel(checkpoint.config, checkpoint.tensors, np.float64)
    drafter = DFlashReference(load_dflash(tiny_drafter("small"), checkpoint.config), target)
    return target, drafter


PROMPT = [5, 17, 300, 2, 99, 41, 7, 250, 12, 600, 3, 77]


def test_layer_outputs_are_the_residual_before_the_final_norm(models):
    target, _ = models
    last = target.config.num_hidden_layers - 1
    outputs = {1: None, last: None}
    hidden = target.hidden_states(PROMPT, target.new_state(), layer_outputs=outputs)
    norm = target._float("language_model.model.norm.weight")
    np.testing.assert_allclose(rms_norm(outputs[last], norm, 1e-6), hidden, rtol=1e-12)
    assert outputs[1].shape == hidden.shape and not np.allclose(outputs[1], outputs[last])


def test_catch_up_in_pieces_equals_catch_up_at_once(models):
    target, drafter = models
    outputs = drafter.target_layers()
    target.hidden_states(PROMPT, target.new_state(), layer_outputs=outputs)
    features = drafter.features(outputs)
    assert features.shape == (len(PROMPT), 3 * 128)
    whole, pieces = drafter.new_cache(), drafter.new_cache()
    drafter.catch_up(features, whole)
    drafter.catch_up(features[:5], pieces)
    drafter.catch_up(features[5:], pieces)
    assert whole.length == pieces.length == len(PROMPT)
    for a, b in zip(whole.keys + whole.values, pieces.keys + pieces.values, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)  # GEMM row order in fp64
    # The block pass reads the cache and leaves it as it was; its rows are not causal.
    logits = drafter.block_logits(PROMPT[-1], 4, whole)
    assert logits.shape == (4, target.config.vocab_size) and whole.length == len(PROMPT)
    assert drafter.draft(PROMPT[-1], 4, whole) == [int(t) for t in np.argmax(logits, -1)]


def test_drafts_see_the_context(models):
    target, drafter = models
    outputs = drafter.target_layers()
    target.hidden_states(PROMPT, target.new_state(), layer_outputs=outputs)
    cache, other = drafter.new_cache(), drafter.new_cache()
    features = drafter.features(outputs)
    drafter.catch_up(features, cache)
    drafter.catch_up(features[::-1].copy(), other)
    assert not np.allclose(drafter.block_logits(7, 3, cache), drafter.block_logits(7, 3, other))


class CraftedDrafter(DFlashReference):
    """Drafts the plain greedy answer, the drafts at block rows `wrong` (1-based) off by one."""

    def __init__(self, base: DFlashReference, answer: list[int], wrong: set[int]) -> None:
        super().__init__(load_dflash(tiny_drafter("small"), base.target.config), base.target)
        self.answer, self.wrong = answer, wrong

    def draft(self, newest: int, n: int, cache) -> list[int]:
        done = cache.length - len(PROMPT) + 1  # tokens generated so far: the cache lags one
        right = self.answer[done : done + n]
        return [t + 1 if row + 1 in self.wrong else t for row, t in enumerate(right)]


# 10 tokens: the first from the prompt's pass, then passes of 3 drafts (the last pass has room
# for one draft only).
@pytest.mark.parametrize(
    ("wrong", "kept"),
    [(set(), [3, 3, 1]), ({1, 2, 3}, [0] * 9), ({2}, [1, 1, 1, 1, 1])],
)
def test_greedy_output_with_drafts_equals_plain_greedy(models, wrong, kept):
    target, drafter = models
    plain = target.generate_greedy(PROMPT, 10)
    crafted = CraftedDrafter(drafter, plain, wrong)
    tokens, kept_per_pass = greedy_with_drafts(target, crafted, PROMPT, 10, draft_tokens=3)
    assert tokens == plain
    assert kept_per_pass == kept


def test_the_random_drafter_s_drafts_change_nothing(models):
    target, drafter = models
    tokens, _ = greedy_with_drafts(target, drafter, PROMPT, 6, draft_tokens=4)
    assert tokens == target.generate_greedy(PROMPT, 6)
