"""The numpy reference model against mlx-lm, which nobody on this project wrote.

Per-operation functions are checked against MLX's own ops (and mlx-lm's gated-delta code); the
whole model is checked on two tiny random checkpoints against mlx-lm run in float32.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine import reference as ref
from lily.engine.reference import ReferenceModel

TOLERANCE = 1e-3  # issue 2's acceptance bound on logits


def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


# ---------------------------------------------------------------------------------------------
# Per-operation math
# ---------------------------------------------------------------------------------------------


def test_activations_match_mlx() -> None:
    x = np.linspace(-30, 30, 601, dtype=np.float32)
    np.testing.assert_allclose(ref.silu(x), as_np(nn.silu(mx.array(x))), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref.sigmoid(x), as_np(mx.sigmoid(mx.array(x))), atol=1e-7)
    expected_softplus = as_np(nn.softplus(mx.array(x)))
    np.testing.assert_allclose(ref.softplus(x), expected_softplus, rtol=1e-6, atol=1e-7)
    assert np.isfinite(ref.softplus(np.array([1e4], np.float32))).all()


def test_norms_match_mlx() -> None:
    x = rng().normal(0, 3, (5, 128)).astype(np.float32)
    w = rng().normal(1, 0.1, 128).astype(np.float32)
    z = rng().normal(0, 1, (5, 128)).astype(np.float32)
    expected = as_np(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-6))
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6), expected, rtol=1e-5, atol=1e-6)
    gated = expected * as_np(nn.silu(mx.array(z)))
    np.testing.assert_allclose(ref.gated_rms_norm(x, w, z, 1e-6), gated, rtol=1e-5, atol=1e-6)


def test_l2_normalize_matches_mlx_lm_qk_normalisation() -> None:
    q = rng().normal(0, 1, (1, 1, 2, 128)).astype(np.float32)
    k = rng().normal(0, 0.01, (1, 1, 2, 128)).astype(np.float32)  # small: eps matters
    mlx_q, mlx_k = normalize_qk(mx.array(q), mx.array(k), inv_scale=128**-0.5, eps=1e-6)
    np.testing.assert_allclose(ref.l2_normalize(q) * 128**-0.5, as_np(mlx_q), rtol=1e-5)
    np.testing.assert_allclose(ref.l2_normalize(k), as_np(mlx_k), rtol=1e-5)


def test_causal_conv1d_steps_match_mlx_convolution() -> None:
    channels, kernel, steps = 48, 4, 7
    x = rng().normal(0, 1, (steps, channels)).astype(np.float32)
    weight = rng().normal(0, 0.5, (channels, kernel)).astype(np.float32)
    # mlx-lm: depthwise conv over [zeros(K-1) ; x] with weight [C, K, 1], then SiLU.
    padded = mx.array(np.concatenate([np.zeros((kernel - 1, channels), np.float32), x])[None])
    expected = as_np(nn.silu(mx.conv1d(padded, mx.array(weight[:, :, None]), groups=channels)))[0]
    window = np.zeros((kernel - 1, channels), np.float32)
    for t in range(steps):
        y, window = ref.causal_conv1d_step(window, x[t], weight)
        np.testing.assert_allclose(y, expected[t], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(window, x[-(kernel - 1) :])


def test_gdn_gates_match_mlx_lm() -> None:
    a, b = rng().normal(0, 2, (2, 8)).astype(np.float32)
    A_log = np.log(rng().uniform(0.1, 4, 8)).astype(np.float32)
    dt_bias = rng().normal(0, 0.5, 8).astype(np.float32)
    g, beta = ref.gdn_gates(a, b, A_log, dt_bias)
    expected_g = as_np(compute_g(mx.array(A_log), mx.array(a), mx.array(dt_bias)))
    np.testing.assert_allclose(g, expected_g, rtol=1e-5)
    np.testing.assert_allclose(beta, as_np(mx.sigmoid(mx.array(b))), rtol=1e-6)


def test_gated_delta_steps_match_mlx_lm_recurrence() -> None:
    steps, hk, hv, dk, dv = 6, 2, 4, 16, 8
    r = rng()
    q = r.normal(0, 0.3, (steps, hk, dk)).astype(np.float32)
    k = ref.l2_normalize(r.normal(0, 1, (steps, hk, dk)).astype(np.float32))
    v = r.normal(0, 1, (steps, hv, dv)).astype(np.float32)
    g = r.uniform(0.5, 1, (steps, hv)).astype(np.float32)
    beta = r.uniform(0, 1, (steps, hv)).astype(np.float32)
    state0 = r.normal(0, 0.1, (hv, dv, dk)).astype(np.float32)
    expected_y, expected_state = gated_delta_ops(
        *(mx.array(t[None]) for t in (q, k, v, g, beta, state0))
    )
    state = state0
    for t in range(steps):
        o, state = ref.gated_delta_step(state, q[t], k[t], v[t], g[t], beta[t])
        np.testing.assert_allclose(o, as_np(expected_y)[0, t], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, as_np(expected_state)[0], rtol=1e-5, atol=1e-6)


def test_rope_matches_mlx_on_the_rotary_dims_only() -> None:
    x = rng().normal(0, 1, (3, 5, 256)).astype(np.float32)
    offset = 11
    expected = mx.fast.rope(
        mx.array(x[None]), 64, traditional=False, base=1e7, scale=1.0, offset=offset
    )
    ours = ref.apply_rope(x, offset + np.arange(5), 64, 1e7)
    np.testing.assert_allclose(ours, as_np(expected)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ours[..., 64:], x[..., 64:])


def test_attention_matches_mlx_causal_sdpa_with_grouped_heads() -> None:
    r = rng()
    q = r.normal(0, 1, (4, 3, 32)).astype(np.float32)  # the last 3 of 9 positions
    k = r.normal(0, 1, (2, 9, 32)).astype(np.float32)
    v = r.normal(0, 1, (2, 9, 32)).astype(np.float32)
    expected = mx.fast.scaled_dot_product_attention(
        *(mx.array(t[None]) for t in (q, k, v)), scale=0.3, mask="causal"
    )
    ours = ref.attention(q, k, v, 0.3, np.arange(6, 9))
    np.testing.assert_allclose(ours, as_np(expected)[0], rtol=1e-5, atol=1e-6)


def test_moe_route_ties_go_to_the_lowest_expert_and_weights_renormalise() -> None:
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], np.float32)
    ids, weights = ref.moe_route(logits, 2, normalize=True)
    np.testing.assert_array_equal(ids, [[1, 3]])
    np.testing.assert_allclose(weights, [[0.5, 0.5]])
    _, raw = ref.moe_route(logits, 2, normalize=False)
    probs = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(raw, probs[:, [1, 3]], rtol=1e-6)


def test_moe_route_picks_the_largest_logits() -> None:
    logits = rng().normal(0, 1, (10, 32)).astype(np.float32)
    ids, weights = ref.moe_route(logits, 8, normalize=True)
    top = np.argsort(-logits, axis=-1)[:, :8]
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(top, -1))
    expected = np.exp(np.take_along_axis(logits, ids, -1))
    np.testing.assert_allclose(weights, expected / expected.sum(-1, keepdims=True), rtol=1e-5)


def test_operations_compute_in_float64_when_given_float64() -> None:
    x = rng().normal(0, 1, (2, 4, 64))
    assert ref.rms_norm(x, np.ones(64), 1e-6).dtype == np.float64
    assert ref.apply_rope(x, np.arange(4), 32, 1e7).dtype == np.float64
    assert ref.attention(x, x, x, 0.125, np.arange(4)).dtype == np.float64
    o, state = ref.gated_delta_step(np.zeros((2, 64, 64)), x[:, 0], x[:, 1], x[:, 2], *x[0, :2, :2])
    assert o.dtype == state.dtype == np.float64


# ---------------------------------------------------------------------------------------------
# The whole model against mlx-lm
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_model(tiny_name: str) -> ReferenceModel:
    checkpoint = load_checkpoint(tiny_checkpoint(tiny_name), level="family")
    return ReferenceModel(checkpoint.config, checkpoint.tensors)


def test_teacher_forced_logits_match_mlx_lm(
    reference_model: ReferenceModel, mlx_outputs: dict[str, np.ndarray]
) -> None:
    prompt = mlx_outputs["prompt"]
    assert len(prompt) >= 30 and len(mlx_outputs["decode_tokens"]) >= 16
    logits, state = reference_model.prefill(prompt.tolist())
    np.testing.assert_allclose(logits, mlx_outputs["prompt_logits"], rtol=0, atol=TOLERANCE)
    decoded = zip(mlx_outputs["decode_tokens"], mlx_outputs["decode_logits"], strict=True)
    for token, expected in decoded:
        step = reference_model.decode(int(token), state)
        np.testing.assert_allclose(step, expected, rtol=0, atol=TOLERANCE)


def test_greedy_tokens_match_mlx_lm_where_the_margin_is_clear(
    reference_model: ReferenceModel, mlx_outputs: dict[str, np.ndarray]
) -> None:
    expected = mlx_outputs["decode_tokens"]
    ours = reference_model.generate_greedy(mlx_outputs["prompt"].tolist(), len(expected))
    # The logits mlx-lm took each greedy token from.
    deciding = np.concatenate(
        [mlx_outputs["prompt_logits"][-1:], mlx_outputs["decode_logits"][:-1]]
    )
    top_two = np.sort(deciding, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > TOLERANCE
    # Past the first too-close call the two sequences may legitimately part ways.
    n_checked = len(expected) if clear.all() else int(np.argmin(clear))
    assert n_checked >= 8, "fixture too degenerate to compare greedy tokens"
    assert ours[:n_checked] == expected[:n_checked].tolist()


def test_prefill_then_decode_equals_step_by_step(tiny_name: str) -> None:
    checkpoint = load_checkpoint(tiny_checkpoint(tiny_name), level="family")
    model = ReferenceModel(checkpoint.config, checkpoint.tensors, dtype=np.float64)
    tokens = list(range(3, 3 + 24))
    whole, _ = model.prefill(tokens)
    assert whole.dtype == np.float64
    chunked, state = model.prefill(tokens[:10])
    more, state = model.prefill(tokens[10:17], state)
    stepped = [model.decode(t, state) for t in tokens[17:]]
    np.testing.assert_allclose(np.concatenate([chunked, more, stepped]), whole, atol=1e-10)
    one_by_one = model.new_state()
    singles = [model.decode(t, one_by_one) for t in tokens]
    np.testing.assert_allclose(np.stack(singles), whole, atol=1e-10)
    assert state.position == one_by_one.position == len(tokens)


def test_chunkwise_gdn_calls_equal_the_recurrence(tiny_name: str) -> None:
    """A reference that runs calls of several tokens through the chunkwise Gated DeltaNet (as
    the engine's prefill does; here without rounding, sub-chunks cut mid-call) gives the
    recurrence's logits and state. With gdn_chunk's half operands it does not (how far is the
    kernel's business: tests/test_kernel_gdn.py holds the rounding to the kernel's)."""
    checkpoint = load_checkpoint(tiny_checkpoint(tiny_name), level="family")
    config, tensors = checkpoint.config, checkpoint.tensors
    tokens = list(range(3, 3 + 24))
    recurrence, steps = ReferenceModel(config, tensors, np.float64).prefill(tokens)
    exact = ReferenceModel(config, tensors, np.float64, chunks=ref.ChunkRounding(5, None))
    chunked, state = exact.prefill(tokens[:17])
    more, state = exact.prefill(tokens[17:], state)
    np.testing.assert_allclose(np.concatenate([chunked, more]), recurrence, rtol=0, atol=1e-10)
    for layer, expected in steps.recurrent.items():
        np.testing.assert_allclose(state.recurrent[layer], expected, rtol=0, atol=1e-12)

    half = ref.ChunkRounding(16, ref.HalfOperands(8))
    rounded, _ = ReferenceModel(config, tensors, np.float64, chunks=half).prefill(tokens)
    assert np.abs(rounded - recurrence).max() > 1e-6


def test_chunkwise_gdn_in_float32_survives_strong_decays() -> None:
    """Decays of e^-30 per token (random checkpoints have them): e^(Gamma_i - Gamma_j) for j > i
    would overflow float32; the chunkwise form only uses j <= i, and equals the recurrence."""
    rng = np.random.default_rng(5)
    tokens, heads, dim = 9, 2, 8
    q = ref.l2_normalize(rng.normal(size=(tokens, heads, dim))) * dim**-0.5
    k = ref.l2_normalize(rng.normal(size=(tokens, heads, dim)))
    v = rng.normal(size=(tokens, heads, dim))
    log_decay = -rng.uniform(0, 30, (tokens, heads))
    beta = rng.uniform(0, 1, (tokens, heads))
    state = rng.normal(size=(heads, dim, dim))
    expected = []
    stepped = state.copy()
    for t in range(tokens):
        o, stepped = ref.gated_delta_step(stepped, q[t], k[t], v[t], np.exp(log_decay[t]), beta[t])
        expected.append(o)
    f32 = [x.astype(np.float32) for x in (state, q, k, v, log_decay, beta)]
    out, final = ref.gated_delta_chunk(*f32, sub_chunk=16)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.stack(expected), rtol=0, atol=1e-5)
    np.testing.assert_allclose(final, stepped, rtol=0, atol=1e-5)


@pytest.mark.parametrize("guarded", [False, True], ids=["normed", "range-guarded"])
def test_half_operand_gemm_rounds_as_the_kernels_reference_does(guarded: bool) -> None:
    """The reference model's half-operand GEMM (ChunkRounding) rounds what
    kernel_checks.reference_qgemm, which the GEMM kernels are tested against, rounds: the same
    products up to float64's own rounding. A range-guarded input may leave half's range."""
    from lily.checkpoint.quant import dequantize, quantize
    from lily.diagnostics.kernel_checks import reference_qgemm, reference_row_exponents

    rng = np.random.default_rng(7)
    weight, scales, biases = quantize(rng.normal(0, 0.05, (96, 256)).astype(np.float32), 4, 64)
    x = rng.normal(0, 1, (5, 256)).astype(np.float32)
    exponents = None
    if guarded:
        x *= np.array([1.0, 1e6, 3e-3, 70000.0, 1.0], np.float32)[:, None]
        exponents = reference_row_exponents(x)
    expected, _ = reference_qgemm(weight, scales, biases, 4, x, exponents)
    w = dequantize(weight, scales, biases, 4, 64, np.float64)
    got = ref.half_operand_gemm(x.astype(np.float64), w, guarded)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert np.abs(got - x.astype(np.float64) @ w.T).max() > 0


def test_float32_and_float64_agree(reference_model: ReferenceModel) -> None:
    wide = ReferenceModel(reference_model.config, reference_model.tensors, dtype=np.float64)
    tokens = [5, 77, 3, 901, 42, 42, 7, 100]
    narrow_logits, _ = reference_model.prefill(tokens)
    wide_logits, _ = wide.prefill(tokens)
    assert narrow_logits.dtype == np.float32
    np.testing.assert_allclose(narrow_logits, wide_logits, atol=1e-4)


def test_greedy_generation_stops_at_a_stop_token(reference_model: ReferenceModel) -> None:
    prompt = [11, 12, 13]
    free = reference_model.generate_greedy(prompt, 6)
    stopped = reference_model.generate_greedy(prompt, 6, stop_token_ids={free[2]})
    assert stopped == free[: free.index(free[2]) + 1]
