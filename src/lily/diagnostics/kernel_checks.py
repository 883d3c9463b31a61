"""Every kernel of metal/ run once against its float64 numpy reference: `lily doctor`'s table.

Each entry of CHECKS builds random inputs at one set of shapes (the real model's where they fit
in a few hundred MB), records the kernel's graph, and says how to compare its output with the
reference, with the error bounds of the kernel's test in tests/ (the reasoning behind each bound
is written there). Chained kernels are judged stage by stage on their own intermediate buffers.
The largest checks give the sim smaller shapes of their own. Adding a kernel to the table is one
KernelCheck entry.

The random MLX-quantized weights and the references both need (quantized GEMV and GEMM, SwiGLU
bound, expert sort, MoE combine, one GDN token) are shared with the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16, unpack_codes
from lily.device import Device, Graph
from lily.engine import reference

FLOAT32_EPS = float(np.finfo(np.float32).eps)


# --- references shared with the tests ------------------------------------------------------------


def random_quantized(
    rng: np.random.Generator, rows: int, in_dim: int, bits: int, experts: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random MLX-quantized triple: uniformly random codes, small scales, and biases near
    -scale * 2^(bits-1) as MLX's quantizer produces for zero-centred weights."""
    lead = () if experts is None else (experts,)
    words = rng.integers(0, 2**32, (*lead, rows, in_dim * bits // 32), dtype=np.uint32)
    scale = rng.uniform(0.002, 0.02, (*lead, rows, in_dim // 64)).astype(np.float32)
    bias = -scale * 2 ** (bits - 1) + rng.normal(0, 0.01, scale.shape).astype(np.float32)
    return words, float32_to_bf16(scale), float32_to_bf16(bias)


def reference_qgemv(
    weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """W x in float64, and for each row the magnitude the kernel's fp32 rounding scales with:
    sum over groups of |scale| * sum|code * x| + |bias| * sum|x| (the affine form it evaluates).
    Rows are done in blocks so the 248320-row lm_head never needs a dense float64 copy."""
    x = np.asarray(x, dtype=np.float64)
    groups = x.reshape(-1, 64)
    y = np.empty(weight.shape[0])
    magnitude = np.empty(weight.shape[0])
    for start in range(0, weight.shape[0], 8192):
        block = slice(start, start + 8192)
        codes = unpack_codes(weight[block], bits).astype(np.float64).reshape(-1, *groups.shape)
        s = bf16_to_float32(scales[block]).astype(np.float64)
        b = bf16_to_float32(biases[block]).astype(np.float64)
        code_dot = np.einsum("rgi,gi->rg", codes, groups)
        code_abs = np.einsum("rgi,gi->rg", codes, np.abs(groups))
        y[block] = (s * code_dot + b * groups.sum(axis=1)).sum(axis=1)
        magnitude[block] = (np.abs(s) * code_abs + np.abs(b) * np.abs(groups).sum(axis=1)).sum(
            axis=1
        )
    return y, magnitude


def qgemv_ulps(in_dim: int, bits: int) -> float:
    """The quantized GEMV's error bound in float32 ulps of its magnitude."""
    chunk = 128 // bits
    return chunk + 3 + in_dim / (32 * chunk) + 31


# The quantized GEMMs' range guard (metal/quantized_gemm.h): a row's largest |x| times 2^-e lies
# in [2^8, 2^9), |e| <= 64.
_ROW_TOP = 8
_ROW_EXPONENT_LIMIT = 64


def reference_row_exponents(x: np.ndarray) -> np.ndarray:
    """The range guard's exponent of each row of float32 x [rows, in_dim] (int32 [rows]), as
    qgemm_row_exponents finds it: from the row's largest |x| ignoring NaNs (as max does), 0
    when that is 0, an fp32 subnormal or inf."""
    largest = np.fmax.reduce(np.abs(np.asarray(x, dtype=np.float32)), axis=-1, initial=0.0)
    finite_normal = np.isfinite(largest) & (largest >= np.finfo(np.float32).tiny)
    # largest = f 2^binary with f in [0.5, 1)
    _, binary = np.frexp(np.where(finite_normal, largest, 1.0))
    exponents = np.clip(binary - 1 - _ROW_TOP, -_ROW_EXPONENT_LIMIT, _ROW_EXPONENT_LIMIT)
    return np.where(finite_normal, exponents, 0).astype(np.int32)


def reference_qgemm(
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    x: np.ndarray,
    exponents: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """x W^T in float64 ([..., rows] for x [..., in_dim]) with the operands rounded as the GEMMs
    round them, and the magnitude their fp32 sums' rounding scales with, |x| |W|^T: each weight
    dequantized by one fma in fp32 (scale * code + bias, rounded once) and then to half; x to
    half, row r first scaled by 2^-exponents[r] and its outputs by 2^exponents[r] when the
    range guard's exponents are given. Rows are done in blocks so that the largest projection
    never needs a whole dense float64 copy."""
    x = np.asarray(x, dtype=np.float32)
    if exponents is None:
        scale = np.ones((*x.shape[:-1], 1))
    else:
        scale = np.ldexp(1.0, np.asarray(exponents, dtype=np.int64))[..., None]
    # x * 2^-e is exact in float32 (|e| <= 64: no overflow; an underflow rounds to half's 0
    # either way), then one rounding to half.
    x = (x / scale).astype(np.float32).astype(np.float16).astype(np.float64)
    rows = weight.shape[0]
    y = np.empty((*x.shape[:-1], rows))
    magnitude = np.empty_like(y)
    for start in range(0, rows, 2048):
        block = slice(start, start + 2048)
        codes = unpack_codes(weight[block], bits).astype(np.float64)
        s = np.repeat(bf16_to_float32(scales[block]).astype(np.float64), 64, axis=-1)
        b = np.repeat(bf16_to_float32(biases[block]).astype(np.float64), 64, axis=-1)
        # scale * code + bias is exact in float64 (a bf16 times an 8-bit code, plus a bf16): the
        # fma's one rounding is the float32 cast.
        w = (s * codes + b).astype(np.float32).astype(np.float16).astype(np.float64)
        y[..., block] = scale * (x @ w.T)
        magnitude[..., block] = scale * (np.abs(x) @ np.abs(w).T)
    return y, magnitude


def qgemm_ulps(in_dim: int) -> float:
    """The quantized GEMMs' error bound in float32 ulps of their magnitude, against the
    reference that rounds the operands as they do (`reference_qgemm`): products of half
    operands are exact in fp32, the range guard's powers of two are exact, and each output sums
    in_dim products (in_dim roundings at most, in any order), with a few ulps to spare."""
    return in_dim + 8


def swiglu_bound(gate, gate_magnitude, up, up_magnitude, in_dim: int):
    """silu(g) u in float64 from the float64 projections g and u, and the bound on a fused or
    separate fp32 SwiGLU of GEMM outputs within qgemm_ulps of them: those errors propagated
    (|silu'| <= 1.1) plus 8 ulps of |silu(g) u| for the exp, the division and two products."""
    ulps = qgemm_ulps(in_dim) * FLOAT32_EPS
    dg, du = ulps * np.asarray(gate_magnitude), ulps * np.asarray(up_magnitude)
    expected = reference.silu(gate) * up
    bound = (
        1.1 * dg * (np.abs(up) + du)
        + np.abs(reference.silu(gate)) * du
        + 8 * FLOAT32_EPS * np.abs(expected)
    )
    return expected, bound


def reference_sort(ids: np.ndarray, experts: int):
    """(expert_offsets, row_index, slot_of) of a stable sort of ids [T, top_k] by expert."""
    order = np.argsort(ids.ravel(), kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(ids.ravel(), minlength=experts))])
    slot_of = np.empty_like(order)
    slot_of[order] = np.arange(order.size)
    return offsets, order // ids.shape[1], slot_of


def reference_combine(down, slot_of, weights, shared_logit, shared_down):
    """The MoE combine in float64, (out, the magnitude of its terms, the shared expert's term):
    out[t] = sum_k weights[t, k] down[slot_of[t, k]] + sigmoid(shared_logit[t]) shared_down[t]."""
    routed = np.einsum("tk,tkh->th", weights, down[slot_of])
    gate = reference.sigmoid(shared_logit)[:, None]
    magnitude = np.einsum("tk,tkh->th", np.abs(weights), np.abs(down[slot_of]))
    return routed + gate * shared_down, magnitude + gate * np.abs(shared_down), gate * shared_down


def reference_gdn_readout(
    state, qkv, a, b, *, a_log, dt_bias, num_key_heads, num_value_heads
) -> tuple[np.ndarray, np.ndarray]:
    """(readout S q [Hv, Dv], new state) of one Gated DeltaNet token in float64, composed from
    lily.engine.reference; dt_bias is bf16 bits."""
    from lily.kernels.gdn import KEY_HEAD_DIM, VALUE_HEAD_DIM

    f64 = np.float64
    key_total = num_key_heads * KEY_HEAD_DIM
    qkv = np.asarray(qkv, dtype=f64)
    q = qkv[:key_total].reshape(num_key_heads, KEY_HEAD_DIM)
    k = qkv[key_total : 2 * key_total].reshape(num_key_heads, KEY_HEAD_DIM)
    v = qkv[2 * key_total :].reshape(num_value_heads, VALUE_HEAD_DIM)
    q = reference.l2_normalize(q) * KEY_HEAD_DIM**-0.5
    k = reference.l2_normalize(k)
    g, beta = reference.gdn_gates(
        np.asarray(a, f64),
        np.asarray(b, f64),
        np.asarray(a_log, f64),
        bf16_to_float32(dt_bias).astype(f64),
    )
    return reference.gated_delta_step(np.asarray(state, f64), q, k, v, g, beta)


def reference_gdn_tokens(
    state, qkv, a, b, *, a_log, dt_bias, num_key_heads, num_value_heads, candidates
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """gdn_tokens in float64: (readouts [tokens, Hv*Dv], the state after the tokens before the
    last `candidates`, and those candidates' (keys [c, Hk, Dk] normalised, deltas [c, Hv, Dv],
    decays [c, Hv])): the recurrence token after token, each candidate's update
    S <- g S + delta k^T kept instead of applied to the state returned."""
    from lily.kernels.gdn import KEY_HEAD_DIM

    f64 = np.float64
    key_total = num_key_heads * KEY_HEAD_DIM
    state = np.asarray(state, f64)
    tokens = len(qkv)
    readouts, kept, keys, deltas, decays = [], state, [], [], []
    key_head = np.arange(num_value_heads) // (num_value_heads // num_key_heads)
    for t in range(tokens):
        if t == tokens - candidates:
            kept = state
        readout, new_state = reference_gdn_readout(
            state,
            qkv[t],
            a[t],
            b[t],
            a_log=a_log,
            dt_bias=dt_bias,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
        )
        readouts.append(readout.reshape(-1))
        if t >= tokens - candidates:
            k = np.asarray(qkv[t][key_total : 2 * key_total], f64).reshape(num_key_heads, -1)
            k = reference.l2_normalize(k)
            g, _ = reference.gdn_gates(
                np.asarray(a[t], f64),
                np.asarray(b[t], f64),
                np.asarray(a_log, f64),
                bf16_to_float32(dt_bias).astype(f64),
            )
            keys.append(k)
            decays.append(g)
            # S' = g S + delta k^T: delta is what the update adds along each head's key.
            deltas.append(
                np.einsum("hvk,hk->hv", new_state - g[:, None, None] * state, k[key_head])
            )
        state = new_state
    return np.stack(readouts), kept, (np.stack(keys), np.stack(deltas), np.stack(decays))


def reference_gdn_commit(state, keys, deltas, decays, kept: int) -> np.ndarray:
    """gdn_commit in float64: the first kept + 1 updates reference_gdn_tokens returns, applied to
    `state` [Hv, Dv, Dk] (S <- g S + delta k^T)."""
    state = np.asarray(state, np.float64)
    num_value_heads, num_key_heads = state.shape[0], keys.shape[1]
    key_head = np.arange(num_value_heads) // (num_value_heads // num_key_heads)
    for k, delta, g in zip(keys[: kept + 1], deltas[: kept + 1], decays[: kept + 1], strict=True):
        state = g[:, None, None] * state + delta[:, :, None] * k[key_head][:, None, :]
    return state


def reference_gdn_token(
    state, qkv, z, a, b, *, a_log, dt_bias, norm_weight, num_key_heads, num_value_heads, eps
) -> tuple[np.ndarray, np.ndarray]:
    """(out [Hv*Dv], new state) of one Gated DeltaNet token in float64: the readout through the
    gated RMSNorm; dt_bias and norm_weight are bf16 bits."""
    o, new_state = reference_gdn_readout(
        state,
        qkv,
        a,
        b,
        a_log=a_log,
        dt_bias=dt_bias,
        num_key_heads=num_key_heads,
        num_value_heads=num_value_heads,
    )
    return reference_gated_norm(o, z, norm_weight, eps), new_state


# attention_chunk against float64 attention over the same queries and cache, as (rtol, atol). Its
# operands are 2-byte (metal/attention.metal): Q rounded to half, K exact in it, the softmax
# weights P rounded to bfloat (up to 2^-8 of each), V exact in bfloat. A weight off by 2^-8 of
# itself moves the output by at most 2^-8 max|v - out| over the keys, ~2^-8 |v|; with |v| up to
# ~4.5 and outputs up to ~3 the errors measured stay under 2.3e-3, ~2x inside 2^-8 (1 + |out|).
# A formula error (a missed or extra key, a wrong rescale or head) moves an output by a whole
# weight times |v|, orders of magnitude more.
ATTENTION_CHUNK_TOLERANCE = (2.0**-8, 2.0**-8)


# gdn_chunk (then gdn_gated_norm) against the float64 recurrence, as (rtol, atol). Its products
# take half operands (metal/gdn.metal): q, k, P and X rounded by up to 2^-11 of themselves, the
# state, R and U by 2^-11 of their SIMD-group's largest |x|. The state then errs by about 2^-11
# of its entries whatever the length (the decay forgets older roundings as it forgets the
# tokens): on the sim, from 1 to 4,097 tokens, under 4.9e-4 for entries up to ~0.8 and under
# 5.6e-5 in readouts up to ~0.07, ~4x inside the bounds below (fp32 operands erred 1.5e-7 and
# 3e-8). The gated norm divides a readout by its head's RMS, so its outputs carry that error
# times |gain * silu(z)| / RMS: under 0.053 for outputs up to ~24 (the 4,097-token chunk).
GDN_CHUNK_STATE_TOLERANCE = (2.0**-9, 2.0**-9)
GDN_CHUNK_READOUT_TOLERANCE = (2.0**-9, 2.0**-12)
GDN_CHUNK_OUT_TOLERANCE = (2.0**-7, 2.0**-3)


def reference_gdn_chunkwise(
    state,
    qkv,
    a,
    b,
    *,
    a_log,
    dt_bias,
    num_key_heads: int,
    num_value_heads: int,
    sub_chunk: int,
    half_operands: reference.HalfOperands | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(readouts S q [T, Hv*Dv], final state) of T Gated DeltaNet tokens in float64 by the
    chunkwise algorithm gdn_chunk runs (reference.gated_delta_chunk), optionally with its
    operands rounded to half as the kernel rounds them. qkv [T, conv_dim], a, b [T, Hv];
    dt_bias is bf16 bits."""
    from lily.kernels.gdn import KEY_HEAD_DIM, VALUE_HEAD_DIM

    f64 = np.float64
    qkv = np.asarray(qkv, f64)
    tokens, key_total = qkv.shape[0], num_key_heads * KEY_HEAD_DIM
    heads = (tokens, num_key_heads, KEY_HEAD_DIM)
    q = reference.l2_normalize(qkv[:, :key_total].reshape(heads)) * KEY_HEAD_DIM**-0.5
    k = reference.l2_normalize(qkv[:, key_total : 2 * key_total].reshape(heads))
    v = qkv[:, 2 * key_total :].reshape(tokens, num_value_heads, VALUE_HEAD_DIM)
    dt_bias = bf16_to_float32(dt_bias).astype(f64)
    log_decay = reference.gdn_log_decay(np.asarray(a, f64), np.asarray(a_log, f64), dt_bias)
    beta = reference.sigmoid(np.asarray(b, f64))
    readout, state = reference.gated_delta_chunk(
        np.asarray(state, f64), q, k, v, log_decay, beta, sub_chunk, half_operands
    )
    return readout.reshape(tokens, -1), state


def reference_gated_norm(readout, z, norm_weight, eps: float) -> np.ndarray:
    """The GDN's gated RMSNorm [Hv*Dv] of a readout [Hv*Dv] in float64, per 128-wide head;
    norm_weight is bf16 bits."""
    from lily.kernels.gdn import VALUE_HEAD_DIM

    o = np.asarray(readout, np.float64).reshape(-1, VALUE_HEAD_DIM)
    z = np.asarray(z, np.float64).reshape(o.shape)
    weight = bf16_to_float32(norm_weight).astype(np.float64)
    return reference.gated_rms_norm(o, weight, z, eps).reshape(-1)


def gdn_out_proj_ulps(in_dim: int, bits: int) -> float:
    """gdn_out_proj's error bound in float32 ulps of its GEMV magnitude: the GEMV's, plus the
    relative error of each normed input: its head's sum of squares ((chunk - 1) sequential adds
    and log2(128 / chunk) shuffle adds, of positive terms) halved by the square root, the rsqrt
    (2), the three products (3) and silu = z * sigmoid(z) (exp 4, then 3 roundings). The add
    into the residual rounds once more, by an ulp of the result."""
    chunk = 128 // bits
    squares = chunk - 1 + np.log2(128 // chunk) + 1
    return qgemv_ulps(in_dim, bits) + squares / 2 + 2 + 3 + 7


# The vision tower's kernels (metal/vision.metal); tests/test_kernel_vision.py gives the reasoning.
VISION_GELU_SLOPE = 1.13  # the largest |d/dy gelu(y)| of both GELU forms


def vision_linear_bound(y, magnitude, k: int, gelu: bool):
    """vision_linear's bound around the float64 y = x W^T + b (before any GELU): the length-k
    fp32 sum and the bias within (k + 9) ulps of `magnitude` (sum |x w| + |b|); a GELU carries
    that with its slope and adds 8 ulps of |y| of its own."""
    sums = (k + 9) * FLOAT32_EPS * np.asarray(magnitude)
    return VISION_GELU_SLOPE * sums + 8 * FLOAT32_EPS * np.abs(y) if gelu else sums


def vision_attention_bound(q, k, v, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Bidirectional attention of one frame in float64, q/k/v [N, heads, head_dim], and the bound
    on vision_attention's output: the scores' (head_dim + 2) ulps of sum |q k| scale, doubled
    through the softmax, plus (2 N + 16) ulps of serial accumulation, all of the weighted mean of
    |v|."""
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    expected = np.einsum("hqk,khd->qhd", weights, v)
    weighted_v = np.einsum("hqk,khd->qhd", weights, np.abs(v))
    score_magnitude = np.einsum("qhd,khd->hqk", np.abs(q), np.abs(k)).max(-1).T[..., None]
    ulps = 2 * (q.shape[-1] + 2) * score_magnitude * scale + 2 * len(q) + 16
    return expected, ulps * FLOAT32_EPS * weighted_v


# --- comparing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """How far a kernel's output is from the reference: the largest absolute error, and the
    largest ratio of error to the allowed bound (<= 1 passes)."""

    max_error: float
    worst_ratio: float

    @property
    def passed(self) -> bool:
        return self.worst_ratio <= 1.0

    def merge(self, other: Comparison) -> Comparison:
        return Comparison(
            max(self.max_error, other.max_error), max(self.worst_ratio, other.worst_ratio)
        )


def compare(actual, expected, bound) -> Comparison:
    """|actual - expected| against `bound` elementwise (a bound of 0 means exactly equal)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), expected.shape)
    if actual.shape != expected.shape or not np.all(np.isfinite(actual)):
        return Comparison(float("inf"), float("inf"))
    error = np.abs(actual - expected)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(error == 0, 0.0, error / bound)
    return Comparison(float(error.max(initial=0.0)), float(ratio.max(initial=0.0)))


def compare_ulps(actual, expected, magnitude, ulps: float) -> Comparison:
    return compare(actual, expected, ulps * FLOAT32_EPS * np.asarray(magnitude, np.float64))


def compare_close(actual, expected, rtol: float, atol: float) -> Comparison:
    """numpy.testing.assert_allclose's criterion."""
    return compare(actual, expected, atol + rtol * np.abs(np.asarray(expected, np.float64)))


# --- the checks ----------------------------------------------------------------------------------


@dataclass
class Trial:
    """One kernel's graph, ready to run, and how to judge its output after one run."""

    graph: Graph
    verify: Callable[[], Comparison]
    bytes_moved: int = 0  # device memory one run reads and writes, for its bandwidth


Prepare = Callable[[Device, np.random.Generator], Trial]


@dataclass(frozen=True)
class KernelCheck:
    kernel: str  # the metal/ kernel(s) exercised
    shapes: str
    prepare: Prepare
    timed: bool = False  # large enough for its GPU time and bandwidth to mean something
    # The sim runs kernels thousands of times slower than a GPU: where these shapes would keep it
    # busy for minutes, it checks the same kernels at the smaller (shapes, prepare) given here.
    sim: tuple[str, Prepare] | None = None

    def on(self, device_name: str) -> KernelCheck:
        """The check as the `device_name` device runs it."""
        if device_name != "sim" or self.sim is None:
            return self
        return KernelCheck(self.kernel, *self.sim, timed=self.timed)


def floats(device: Device, count: int):
    return device.alloc(4 * count)


def read_floats(buffer, count: int) -> np.ndarray:
    return buffer.numpy()[: 4 * count].view(np.float32)


def _qgemv(rows: int, in_dim: int, bits: int, dtype: str, normed: bool = False):
    """The GEMV; `normed`: with the decode step's RMSNorm folded in (y = W rms_norm(x))."""
    from lily.kernels.norm import FoldedNorm
    from lily.kernels.quant_weight import wrap_quant_weight
    from lily.kernels.quantized import record_qgemv

    eps = 1e-6

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triple = random_quantized(rng, rows, in_dim, bits)
        x32 = rng.normal(0, 1, in_dim).astype(np.float32)
        x = float32_to_bf16(x32) if dtype == "bfloat16" else x32
        x64 = (bf16_to_float32(x) if dtype == "bfloat16" else x).astype(np.float64)
        gain = float32_to_bf16(1 + rng.normal(0, 0.2, in_dim).astype(np.float32))
        out = floats(device, rows)
        graph = Graph()
        weight = wrap_quant_weight(device, *triple)
        norm = FoldedNorm(device.wrap(gain), eps) if normed else None
        record_qgemv(graph, device, device.wrap(x), [(weight, out)], x_dtype=dtype, norm=norm)

        def verify() -> Comparison:
            if not normed:
                expected, magnitude = reference_qgemv(*triple, bits, x64)
                ulps = qgemv_ulps(in_dim, bits)
                return compare_ulps(read_floats(out, rows), expected, magnitude, ulps)
            inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64) + eps)
            gained = x64 * bf16_to_float32(gain).astype(np.float64)
            expected, magnitude = reference_qgemv(*triple, bits, gained)
            expected, magnitude = inv_rms * expected, inv_rms * magnitude
            # One ulp more for x * gain, and the inverse RMS's relative error (see the tests).
            ulps = qgemv_ulps(in_dim, bits) + 1 + (in_dim / 32 + 31) / 2 + 4
            return compare_ulps(read_floats(out, rows), expected, magnitude, ulps)

        moved = sum(a.nbytes for a in triple) + x.nbytes + 4 * rows
        return Trial(graph, verify, moved)

    return prepare


def _qgemv_embedded(rows: list[int], in_dim: int, bits: int, vocab: int, embed_bits: int):
    """The decode step's first GEMV: x the embedding row of a token, read from the quantized
    table by the GEMV, the input norm folded in, and the row also written to the residual."""
    from lily.kernels.embedding import EmbeddedInput
    from lily.kernels.norm import FoldedNorm
    from lily.kernels.quant_weight import wrap_quant_weight
    from lily.kernels.quantized import record_qgemv

    eps = 1e-6
    token = vocab - 2

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
        table = random_quantized(rng, vocab, in_dim, embed_bits)
        gain = float32_to_bf16(1 + rng.normal(0, 0.2, in_dim).astype(np.float32))
        outs = [floats(device, r) for r in rows]
        residual = floats(device, in_dim)
        embedded = EmbeddedInput(
            tokens=device.wrap(np.array([0, token], np.uint32)),
            position=device.wrap(np.array([1], np.uint32)),
            table=wrap_quant_weight(device, *table),
            residual=residual,
        )
        projections = [
            (wrap_quant_weight(device, *t), out) for t, out in zip(triples, outs, strict=True)
        ]
        graph = Graph()
        norm = FoldedNorm(device.wrap(gain), eps)
        record_qgemv(graph, device, embedded, projections, norm=norm)

        def verify() -> Comparison:
            words, scales, biases = (a[token] for a in table)
            codes = unpack_codes(words, embed_bits).astype(np.float64).reshape(-1, 64)
            s = bf16_to_float32(scales).astype(np.float64)[:, None]
            b = bf16_to_float32(biases).astype(np.float64)[:, None]
            row = (s * codes + b).ravel()
            result = compare_ulps(
                read_floats(residual, in_dim), row, (np.abs(s * codes) + np.abs(b)).ravel(), 2
            )
            # The kernel norms its fp32 row: the float64 one rounded once (a bf16 scale times
            # a code is exact in fp32). Bounds as for the folded norm above.
            x64 = row.astype(np.float32).astype(np.float64)
            inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64) + eps)
            gained = x64 * bf16_to_float32(gain).astype(np.float64)
            ulps = qgemv_ulps(in_dim, bits) + 1 + (in_dim / 32 + 31) / 2 + 4
            for triple, out, r in zip(triples, outs, rows, strict=True):
                expected, magnitude = reference_qgemv(*triple, bits, gained)
                result = result.merge(
                    compare_ulps(read_floats(out, r), inv_rms * expected, inv_rms * magnitude, ulps)
                )
            return result

        moved = sum(a.nbytes for t in triples for a in t) + 4 * (sum(rows) + in_dim)
        return Trial(graph, verify, moved)

    return prepare


def _gemm(m: int, n: int, k: int):
    from lily.kernels.gemm import record_gemm_nt

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        a = rng.normal(0, 1, (m, k)).astype(np.float32)
        b = rng.normal(0, 1, (n, k)).astype(np.float32)
        c = floats(device, m * n)
        graph = Graph()
        record_gemm_nt(graph, device, device.wrap(a), device.wrap(b), c, m, n, k, "float32")

        def verify() -> Comparison:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            magnitude = np.abs(a64) @ np.abs(b64).T
            return compare_ulps(read_floats(c, m * n).reshape(m, n), a64 @ b64.T, magnitude, k + 8)

        return Trial(graph, verify, a.nbytes + b.nbytes + 4 * m * n)

    return prepare


def _rms_norm(rows: int, dim: int):
    from lily.kernels.norm import record_rms_norm, threads_for

    eps = 1e-6

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        x = rng.normal(0, 3.0, (rows, dim)).astype(np.float32)
        gain = float32_to_bf16(rng.normal(1.0, 0.1, dim).astype(np.float32))
        out = floats(device, rows * dim)
        graph = Graph()
        record_rms_norm(graph, device, device.wrap(x), device.wrap(gain), out, rows, dim, eps)

        def verify() -> Comparison:
            expected = reference.rms_norm(
                x.astype(np.float64), bf16_to_float32(gain).astype(np.float64), eps
            )
            per_thread = -(-dim // threads_for(dim))
            actual = read_floats(out, rows * dim).reshape(rows, dim)
            return compare_ulps(actual, expected, np.abs(expected), (per_thread + 64) / 2 + 8)

        return Trial(graph, verify, 2 * x.nbytes + gain.nbytes)

    return prepare


def _embedding(vocab: int, dim: int, tokens: list[int]):
    from lily.kernels.embedding import record_embedding
    from lily.kernels.quant_weight import wrap_quant_weight

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triple = random_quantized(rng, vocab, dim, 4)
        ids = np.array(tokens, dtype=np.uint32)
        out = floats(device, len(ids) * dim)
        graph = Graph()
        weights = wrap_quant_weight(device, *triple)
        record_embedding(
            graph, device, device.wrap(ids), floats(device, 1), weights, out, token_count=len(ids)
        )

        def verify() -> Comparison:
            words, scales, biases = (a[ids] for a in triple)
            codes = unpack_codes(words, 4).astype(np.float64).reshape(len(ids), -1, 64)
            s = bf16_to_float32(scales).astype(np.float64)[..., None]
            b = bf16_to_float32(biases).astype(np.float64)[..., None]
            expected = (s * codes + b).reshape(len(ids), -1)
            magnitude = (np.abs(s * codes) + np.abs(b)).reshape(len(ids), -1)
            actual = read_floats(out, len(ids) * dim).reshape(len(ids), dim)
            return compare_ulps(actual, expected, magnitude, 2)

        return Trial(graph, verify)

    return prepare


def _conv1d(channels: int):
    from lily.kernels.conv1d import KERNEL_TAPS, record_conv1d_step

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        weight = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
        window = rng.normal(0, 1, (KERNEL_TAPS - 1, channels)).astype(np.float32)
        initial_window = window.copy()
        x = rng.normal(0, 1, channels).astype(np.float32)
        out = np.full(channels, np.nan, dtype=np.float32)
        graph = Graph()
        record_conv1d_step(
            graph,
            device,
            channels=channels,
            x=device.wrap(x),
            weight=device.wrap(weight),
            window=device.wrap(window),
            out=device.wrap(out),
        )

        def verify() -> Comparison:
            expected, expected_window = reference.causal_conv1d_step(
                initial_window.astype(np.float64),
                x.astype(np.float64),
                bf16_to_float32(weight)[:, :, 0].astype(np.float64),
            )
            return compare_close(out, expected, 1e-5, 1e-6).merge(
                compare(window, expected_window.astype(np.float32), 0)
            )

        return Trial(graph, verify)

    return prepare


def _gdn_inputs(
    rng: np.random.Generator, num_key_heads: int, num_value_heads: int, tokens: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """Random inputs of one GDN layer, per-token ones with the leading `tokens` axes, a random
    initial state and a NaN output."""
    from lily.kernels.gdn import KEY_HEAD_DIM, VALUE_HEAD_DIM

    key_total, value_total = num_key_heads * KEY_HEAD_DIM, num_value_heads * VALUE_HEAD_DIM
    f32 = np.float32
    return {
        "qkv": rng.normal(0, 1, (*tokens, 2 * key_total + value_total)).astype(f32),
        "z": rng.normal(0, 1.5, (*tokens, value_total)).astype(f32),
        "a": rng.normal(0, 1, (*tokens, num_value_heads)).astype(f32),
        "b": rng.normal(0, 1.5, (*tokens, num_value_heads)).astype(f32),
        "a_log": np.log(rng.uniform(0.1, 4, num_value_heads)).astype(f32),
        "dt_bias": float32_to_bf16(rng.normal(0, 0.5, num_value_heads).astype(f32)),
        "norm_weight": float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32)),
        "state": rng.normal(0, 0.3, (num_value_heads, VALUE_HEAD_DIM, KEY_HEAD_DIM)).astype(f32),
        "out": np.full((*tokens, value_total), np.nan, dtype=f32),
    }


def _gdn(num_key_heads: int, num_value_heads: int):
    """The step's state and readout (the gated RMSNorm is gdn_out_proj's)."""
    from lily.kernels.gdn import record_gdn_step

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        inputs = _gdn_inputs(rng, num_key_heads, num_value_heads, ())
        initial_state = inputs["state"].copy()
        step_inputs = ("qkv", "a", "b", "a_log", "dt_bias", "state")
        graph = Graph()
        record_gdn_step(
            graph,
            device,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            readout=device.wrap(inputs["out"]),
            **{name: device.wrap(inputs[name]) for name in step_inputs},
        )

        def verify() -> Comparison:
            readout, state = reference_gdn_readout(
                initial_state,
                *(inputs[name] for name in ("qkv", "a", "b")),
                a_log=inputs["a_log"],
                dt_bias=inputs["dt_bias"],
                num_key_heads=num_key_heads,
                num_value_heads=num_value_heads,
            )
            return compare_close(inputs["state"], state, 1e-5, 1e-5).merge(
                compare_close(inputs["out"], readout.reshape(-1), 1e-5, 2e-7)
            )

        return Trial(graph, verify, 2 * initial_state.nbytes)

    return prepare


def _gdn_verify(num_key_heads: int, num_value_heads: int, tokens: int, kept: int):
    """A verify pass's gdn_tokens over `tokens` candidates, then gdn_commit of `kept` accepted
    drafts: the readouts and the state after the kept tokens, with the step's tolerances."""
    from lily.kernels.gdn import (
        VerifyUpdates,
        record_gdn_commit,
        record_gdn_tokens,
        verify_updates_bytes,
    )

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        inputs = _gdn_inputs(rng, num_key_heads, num_value_heads, (tokens,))
        initial_state = inputs["state"].copy()
        updates_bytes = verify_updates_bytes(num_key_heads, num_value_heads, tokens)
        updates = VerifyUpdates(
            device.wrap(np.zeros(updates_bytes // 4, np.float32)),
            num_key_heads,
            num_value_heads,
            tokens,
        )
        accepted = device.wrap(np.array([kept, 0], np.uint32))
        state = device.wrap(inputs["state"])
        step_inputs = ("qkv", "a", "b", "a_log", "dt_bias")
        graph = Graph()
        record_gdn_tokens(
            graph,
            device,
            state=state,
            readout=device.wrap(inputs["out"]),
            updates=updates,
            tokens=tokens,
            **{name: device.wrap(inputs[name]) for name in step_inputs},
        )
        graph.barrier()
        record_gdn_commit(graph, device, accepted=accepted, state=state, updates=updates)

        def verify() -> Comparison:
            readouts, _, parts = reference_gdn_tokens(
                initial_state,
                *(inputs[name] for name in ("qkv", "a", "b")),
                a_log=inputs["a_log"],
                dt_bias=inputs["dt_bias"],
                num_key_heads=num_key_heads,
                num_value_heads=num_value_heads,
                candidates=tokens,
            )
            expected_state = reference_gdn_commit(initial_state, *parts, kept)
            return compare_close(inputs["state"], expected_state, 1e-5, 1e-5).merge(
                compare_close(inputs["out"], readouts, 1e-5, 2e-7)
            )

        return Trial(graph, verify, 3 * initial_state.nbytes)

    return prepare


def _gdn_out_proj(rows: int, num_value_heads: int, bits: int):
    """The output projection of a random readout, its gated RMSNorm folded in, into a random
    residual."""
    from lily.kernels.gdn import VALUE_HEAD_DIM
    from lily.kernels.gdn_out_proj import record_gdn_out_proj
    from lily.kernels.norm import FoldedNorm
    from lily.kernels.quant_weight import wrap_quant_weight

    eps, in_dim = 1e-6, num_value_heads * VALUE_HEAD_DIM

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triple = random_quantized(rng, rows, in_dim, bits)
        f32 = np.float32
        readout = rng.normal(0, 0.5, in_dim).astype(f32)
        z = rng.normal(0, 1.5, in_dim).astype(f32)
        gain = float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32))
        residual = rng.normal(0, 1, rows).astype(f32)
        initial_residual = residual.copy()
        graph = Graph()
        record_gdn_out_proj(
            graph,
            device,
            readout=device.wrap(readout),
            z=device.wrap(z),
            norm=FoldedNorm(device.wrap(gain), eps),
            weight=wrap_quant_weight(device, *triple),
            residual=device.wrap(residual),
        )

        def verify() -> Comparison:
            x = reference_gated_norm(readout, z, gain, eps)
            y, magnitude = reference_qgemv(*triple, bits, x)
            expected = initial_residual + y
            bound = FLOAT32_EPS * (gdn_out_proj_ulps(in_dim, bits) * magnitude + np.abs(expected))
            return compare(residual, expected, bound)

        moved = sum(a.nbytes for a in triple) + readout.nbytes + z.nbytes + 2 * residual.nbytes
        return Trial(graph, verify, moved)

    return prepare


def _attention(num_q: int, num_kv: int, context: int, fused: bool = False):
    """prepare (norms, RoPE, cache append at position context - 1), decode over the whole cache
    and combine with the output gate, chained in one graph; with `fused`, prepare and decode as
    the decode step runs them, in one dispatch (attention_decode_fused). The cache is full: the
    grid has the engine's splits for its capacity, all in use."""
    from lily.kernels.attention import (
        HEAD_DIM,
        decode_splits,
        partial_out_bytes,
        partial_stats_bytes,
        record_attention_combine,
        record_attention_decode,
        record_attention_decode_fused,
        record_attention_prepare,
    )

    eps, theta, rotary_dim, position = 1e-6, 1e7, 64, context - 1
    num_splits = decode_splits(context)

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        q_proj = rng.normal(0, 2, (num_q, 2, HEAD_DIM)).astype(np.float32)
        k_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
        v_proj = rng.normal(0, 2, (num_kv, HEAD_DIM)).astype(np.float32)
        q_norm = float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(np.float32))
        k_norm = float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(np.float32))
        shape = (num_kv, context, HEAD_DIM)
        k_cache = float32_to_bf16(rng.standard_normal(shape, dtype=np.float32))
        v_cache = float32_to_bf16(rng.standard_normal(shape, dtype=np.float32))
        queries = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
        out = np.full((num_q, HEAD_DIM), np.nan, dtype=np.float32)
        partial_out = device.alloc(partial_out_bytes(num_q, num_splits))
        partial_stats = device.alloc(partial_stats_bytes(num_q, num_splits))
        step = device.wrap(np.array([position, 0], dtype=np.uint32))
        bound = {name: device.wrap(a) for name, a in [("q_proj", q_proj), ("queries", queries)]}
        caches = {"k_cache": device.wrap(k_cache), "v_cache": device.wrap(v_cache)}
        graph = Graph()
        inputs = dict(
            q_proj=bound["q_proj"],
            k_proj=device.wrap(k_proj),
            v_proj=device.wrap(v_proj),
            q_norm=device.wrap(q_norm),
            k_norm=device.wrap(k_norm),
            step=step,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            capacity=context,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            norm_eps=eps,
            **caches,
        )
        if fused:
            record_attention_decode_fused(
                graph,
                device,
                **inputs,
                partial_out=partial_out,
                partial_stats=partial_stats,
                num_splits=num_splits,
            )
        else:
            record_attention_prepare(graph, device, **inputs, queries=bound["queries"])
            graph.barrier()
            record_attention_decode(
                graph,
                device,
                queries=bound["queries"],
                step=step,
                partial_out=partial_out,
                partial_stats=partial_stats,
                num_q_heads=num_q,
                num_kv_heads=num_kv,
                capacity=context,
                num_splits=num_splits,
                **caches,
            )
        graph.barrier()
        record_attention_combine(
            graph,
            device,
            partial_out=partial_out,
            partial_stats=partial_stats,
            q_proj=bound["q_proj"],
            step=step,
            out=device.wrap(out),
            num_q_heads=num_q,
            num_splits=num_splits,
        )

        def verify() -> Comparison:
            # The kernels' own cache row (bf16, checked by the attention tests) feeds the
            # reference, so this compares the attention itself.
            k = bf16_to_float32(k_cache).astype(np.float64)
            v = bf16_to_float32(v_cache).astype(np.float64)
            if fused:
                # No queries leave the fused kernel: the reference norms and rotates its own,
                # and the appended key row is checked against the reference's.
                def normed_rotated(x, gain):
                    gain64 = bf16_to_float32(gain).astype(np.float64)
                    normed = reference.rms_norm(x.astype(np.float64), gain64, eps)
                    return reference.apply_rope(normed[:, None, :], [position], rotary_dim, theta)

                q = normed_rotated(q_proj[:, 0], q_norm)
                rope = 1e-5 + 2 * position * 2.0**-24
                key = compare_close(
                    k[:, position], normed_rotated(k_proj, k_norm)[:, 0], 2.0**-8, rope
                )
            else:
                q = queries.astype(np.float64)[:, None, :]
            attended = reference.attention(q, k, v, HEAD_DIM**-0.5, [position])[:, 0]
            gate = reference.sigmoid(q_proj[:, 1].astype(np.float64))
            result = compare_close(out, attended * gate, 1e-4, 1e-5)
            return result.merge(key) if fused else result

        return Trial(graph, verify, 2 * k_cache.nbytes + q_proj.nbytes + out.nbytes)

    return prepare


def _random_moe_layer(
    rng: np.random.Generator, hidden: int, experts: int, expert_rows: int, shared_rows: int
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The quantized weights of one MoE layer, named as MoeWeights' fields (8-bit gates)."""
    return {
        "router": random_quantized(rng, experts, hidden, 8),
        "shared_expert_gate": random_quantized(rng, 1, hidden, 8),
        "expert_gate": random_quantized(rng, expert_rows, hidden, 4, experts=experts),
        "expert_up": random_quantized(rng, expert_rows, hidden, 4, experts=experts),
        "expert_down": random_quantized(rng, hidden, expert_rows, 4, experts=experts),
        "shared_gate": random_quantized(rng, shared_rows, hidden, 4),
        "shared_up": random_quantized(rng, shared_rows, hidden, 4),
        "shared_down": random_quantized(rng, hidden, shared_rows, 4),
    }


def _moe(hidden: int, experts: int, top_k: int, expert_rows: int, shared_rows: int):
    """The whole MoE block: route, gate/up with SwiGLU, down with the shared expert."""
    from lily.kernels.moe import MoeScratch, MoeWeights, record_moe
    from lily.kernels.quant_weight import wrap_quant_weight

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        layer = _random_moe_layer(rng, hidden, experts, expert_rows, shared_rows)
        x = rng.normal(0, 1, hidden).astype(np.float32)
        scratch = MoeScratch.allocate(device, experts, top_k, expert_rows, shared_rows)
        out = floats(device, hidden)
        weights = MoeWeights(**{n: wrap_quant_weight(device, *t) for n, t in layer.items()})
        graph = Graph()
        record_moe(graph, device, device.wrap(x), weights, top_k, scratch, out)

        def expert(name: str, e):
            return layer[name] if e is None else tuple(a[e] for a in layer[name])

        def verify() -> Comparison:
            # Stage by stage on the kernels' own intermediate buffers, with the MoE tests' bounds.
            x64 = x.astype(np.float64)
            logits = read_floats(scratch.logits, experts + 1)
            result = Comparison(0.0, 0.0)
            for start, name in ((0, "router"), (experts, "shared_expert_gate")):
                expected, magnitude = reference_qgemv(*layer[name], 8, x64)
                result = result.merge(
                    compare_ulps(
                        logits[start : start + len(expected)],
                        expected,
                        magnitude,
                        qgemv_ulps(hidden, 8),
                    )
                )
            ids = scratch.expert_ids.numpy()[: 4 * top_k].view(np.uint32)
            route_weights = read_floats(scratch.expert_weights, top_k)
            expected_ids, expected_weights = reference.moe_route(
                logits[:experts].astype(np.float64), top_k, True
            )
            result = result.merge(compare(ids, expected_ids, 0)).merge(
                compare_ulps(route_weights, expected_weights, expected_weights, 16 + experts / 8)
            )
            total = top_k * expert_rows + shared_rows
            h_kernel = read_floats(scratch.hidden, total)
            ulps = qgemv_ulps(hidden, 4) * FLOAT32_EPS
            slots = [(int(e), "expert", expert_rows) for e in ids] + [(None, "shared", shared_rows)]
            start = 0
            for e, kind, rows in slots:
                g, g_mag = reference_qgemv(*expert(f"{kind}_gate", e), 4, x64)
                u, u_mag = reference_qgemv(*expert(f"{kind}_up", e), 4, x64)
                h = reference.silu(g) * u
                dg, du = ulps * g_mag, ulps * u_mag
                bound = 1.1 * dg * np.abs(u) + np.abs(reference.silu(g)) * du + dg * du
                bound += 8 * FLOAT32_EPS * np.abs(h)
                result = result.merge(compare(h_kernel[start : start + rows], h, bound))
                start += rows
            chunk = 32
            chunks_per_lane = -(-top_k * expert_rows // (32 * chunk)) + -(
                -shared_rows // (32 * chunk)
            )
            down_ulps = (chunk + 5 + chunks_per_lane + 31) * FLOAT32_EPS
            h64 = h_kernel.astype(np.float64)
            expected = np.zeros(hidden)
            magnitude = np.zeros(hidden)
            for slot, e in enumerate(ids):
                inputs = h64[slot * expert_rows : (slot + 1) * expert_rows]
                y, mag = reference_qgemv(*expert("expert_down", int(e)), 4, inputs)
                expected += float(route_weights[slot]) * y
                magnitude += abs(float(route_weights[slot])) * mag
            gate = float(reference.sigmoid(np.float64(logits[experts])))
            y, mag = reference_qgemv(*layer["shared_down"], 4, h64[top_k * expert_rows :])
            expected += gate * y
            magnitude += gate * mag
            bound = down_ulps * magnitude + 4 * FLOAT32_EPS * gate * np.abs(y)
            return result.merge(compare(read_floats(out, hidden), expected, bound))

        moved = sum(a.nbytes for t in layer.values() for a in t if a.ndim < 3)
        moved += sum(a[:top_k].nbytes for n, t in layer.items() for a in t if a.ndim == 3)
        return Trial(graph, verify, moved + x.nbytes + 4 * hidden)

    return prepare


def _greedy_sample(vocab: int):
    from lily.engine.sampling import SamplingParams
    from lily.kernels.sampling import (
        SAMPLING_PARAMS_BYTES,
        LogitAdjustments,
        logprob_ring_bytes,
        record_sample,
        sample_partials_bytes,
        token_mask_bytes,
        write_sampling_params,
    )

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        logits = rng.normal(0, 1, vocab).astype(np.float32)
        logits[rng.choice(vocab, 3, replace=False)] = 9.0  # ties go to the lowest id
        params = device.alloc(SAMPLING_PARAMS_BYTES)
        write_sampling_params(params, SamplingParams(temperature=0.0, seed=0))
        predicted = device.alloc(4)
        graph = Graph()
        record_sample(
            graph,
            device,
            logits=device.wrap(logits),
            vocab=vocab,
            params=params,
            position=device.wrap(np.zeros(3, dtype=np.uint32)),
            predicted=predicted,
            logprob_ring=device.alloc(logprob_ring_bytes(1)),
            ring_slots=1,
            token_mask=device.alloc(token_mask_bytes(vocab)),
            adjustments=LogitAdjustments.allocate(device, vocab),
            partials=device.scratch(sample_partials_bytes(vocab)),
        )

        def verify() -> Comparison:
            token = int(predicted.numpy()[:4].view(np.uint32)[0])
            return compare(token, int(np.argmax(logits)), 0)

        return Trial(graph, verify, logits.nbytes)

    return prepare


def _step_advance(capacity: int, prompt: int):
    from lily.kernels.step import record_step_advance

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        history = rng.integers(0, 248320, capacity, dtype=np.uint32)
        step = np.array([prompt - 1, prompt, 0], dtype=np.uint32)
        predicted = np.array([12345], dtype=np.uint32)
        initial = history.copy()
        graph = Graph()
        record_step_advance(
            graph, device, device.wrap(step), device.wrap(history), device.wrap(predicted), capacity
        )

        def verify() -> Comparison:
            # Past the prompt the predicted token is taken and appended to the history.
            expected_history = initial.copy()
            expected_history[prompt] = predicted[0]
            return compare(step, [prompt, prompt, predicted[0]], 0).merge(
                compare(history, expected_history, 0)
            )

        return Trial(graph, verify)

    return prepare


# --- the vision tower's kernels -------------------------------------------------------------------


def _vision_position_and_norm(grid_thw: tuple[int, int, int], side: int, dim: int):
    """vision_position_embedding, then vision_layer_norm over its rows (each judged alone)."""
    from lily.engine import vision_reference as vision
    from lily.kernels.norm import threads_for
    from lily.kernels.vision import record_layer_norm, record_position_embedding

    eps = 1e-6
    rows = int(np.prod(grid_thw))

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        table = float32_to_bf16(rng.normal(0, 1, (side * side, dim)).astype(np.float32))
        weight = float32_to_bf16(rng.normal(1, 0.5, dim).astype(np.float32))
        bias = float32_to_bf16(rng.normal(0, 0.5, dim).astype(np.float32))
        positions, normed = floats(device, rows * dim), floats(device, rows * dim)
        graph = Graph()
        record_position_embedding(
            graph, device, device.wrap(table), positions, grid_thw, 2, side, dim
        )
        graph.barrier()
        record_layer_norm(
            graph, device, positions, device.wrap(weight), device.wrap(bias), normed, rows, dim,
            eps,
        )  # fmt: skip

        def verify() -> Comparison:
            table64 = bf16_to_float32(table).astype(np.float64)
            expected = vision.interpolated_position_embedding(table64, grid_thw, 2)
            # Each value is within (4 (side - 1) + 8) ulps of its four corners' magnitudes,
            # at most 4 max |table|.
            bound = (4 * (side - 1) + 8) * FLOAT32_EPS * 4 * np.abs(table64).max()
            result = compare(read_floats(positions, rows * dim).reshape(rows, dim), expected, bound)
            x = read_floats(positions, rows * dim).reshape(rows, dim).astype(np.float64)
            w64, b64 = (bf16_to_float32(t).astype(np.float64) for t in (weight, bias))
            mean = x.mean(axis=-1, keepdims=True)
            std = np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
            magnitude = np.abs(w64) * (np.abs(x - mean) + np.abs(x).mean(-1, keepdims=True)) / std
            per_thread = -(-dim // threads_for(dim))
            norm = compare_ulps(
                read_floats(normed, rows * dim).reshape(rows, dim),
                vision.layer_norm(x, w64, b64, eps),
                magnitude + np.abs(b64),
                per_thread + 64 + 16,
            )
            return result.merge(norm)

        return Trial(graph, verify, table.nbytes + 12 * rows * dim)

    return prepare


def _vision_linear(m: int, n: int, k: int):
    """vision_linear with the blocks' tanh GELU as its epilogue."""
    from lily.engine import vision_reference as vision
    from lily.kernels.vision import Epilogue, record_linear

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        x = rng.normal(0, 1, (m, k)).astype(np.float32)
        weight = float32_to_bf16(rng.normal(0, 1 / np.sqrt(k), (n, k)).astype(np.float32))
        bias = float32_to_bf16(rng.normal(0, 0.5, n).astype(np.float32))
        out = floats(device, m * n)
        graph = Graph()
        record_linear(
            graph, device, device.wrap(x), device.wrap(weight), device.wrap(bias), out, m, n, k,
            Epilogue.GELU_TANH,
        )  # fmt: skip

        def verify() -> Comparison:
            x64 = x.astype(np.float64)
            w64, b64 = (bf16_to_float32(t).astype(np.float64) for t in (weight, bias))
            y = vision.linear(x64, w64, b64)
            magnitude = np.abs(x64) @ np.abs(w64).T + np.abs(b64)
            bound = vision_linear_bound(y, magnitude, k, gelu=True)
            return compare(read_floats(out, m * n).reshape(m, n), vision.gelu_tanh(y), bound)

        return Trial(graph, verify, x.nbytes + weight.nbytes + 4 * m * n)

    return prepare


def _vision_attention(grid_thw: tuple[int, int, int], heads: int, head_dim: int):
    """vision_rotary on the fused qkv rows, then vision_attention over them."""
    from lily.engine import vision_reference as vision
    from lily.kernels.vision import record_attention, record_rotary, rotary_tables

    t, h, w = grid_thw
    rows, width = t * h * w, heads * head_dim

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        qkv = rng.normal(0, 1, (rows, 3, heads, head_dim)).astype(np.float32)
        angles = vision.rotary_angles(grid_thw, 2, head_dim, 10_000.0)
        cos, sin = rotary_tables(angles)
        rotated = device.wrap(qkv.copy())
        out = floats(device, rows * width)
        graph = Graph()
        record_rotary(graph, device, rotated, device.wrap(cos), device.wrap(sin), rows, heads,
                      head_dim)  # fmt: skip
        graph.barrier()
        record_attention(graph, device, rotated, out, t, h * w, heads, head_dim)

        def verify() -> Comparison:
            q, k, v = (qkv[:, i].astype(np.float64) for i in range(3))
            q, k = vision.apply_rotary(q, angles), vision.apply_rotary(k, angles)
            actual = read_floats(out, rows * width).reshape(rows, heads, head_dim)
            result = Comparison(0.0, 0.0)
            frame = h * w
            for start in range(0, rows, frame):
                span = slice(start, start + frame)
                expected, bound = vision_attention_bound(
                    q[span], k[span], v[span], 1 / np.sqrt(head_dim)
                )
                # The rotation's 4 ulps of |q| and |k| move the scores within their bound's
                # doubling; the output is judged on the exactly rotated q and k.
                result = result.merge(compare(actual[span], expected, 2 * bound))
            return result

        return Trial(graph, verify, qkv.nbytes * (1 + h * w // 32) + 4 * rows * width)

    return prepare


# --- batched prefill's kernels -------------------------------------------------------------------


def _qgemm(tokens: int, in_dim: int, rows: list[int], bits: int):
    """Up to four projections sharing one input in one dispatch, as prefill's in_proj or router."""
    from lily.kernels.quant_weight import wrap_quant_weight
    from lily.kernels.quantized_gemm import record_qgemm

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triples = [random_quantized(rng, r, in_dim, bits) for r in rows]
        x = rng.normal(0, 1, (tokens, in_dim)).astype(np.float32)
        outs = [floats(device, tokens * r) for r in rows]
        projections = [
            (wrap_quant_weight(device, *t), out) for t, out in zip(triples, outs, strict=True)
        ]
        graph = Graph()
        record_qgemm(graph, device, device.wrap(x), projections, tokens)

        def verify() -> Comparison:
            result = Comparison(0.0, 0.0)
            for triple, r, out in zip(triples, rows, outs, strict=True):
                expected, magnitude = reference_qgemm(*triple, bits, x)
                actual = read_floats(out, tokens * r).reshape(tokens, r)
                result = result.merge(compare_ulps(actual, expected, magnitude, qgemm_ulps(in_dim)))
            return result

        moved = sum(a.nbytes for t in triples for a in t) + x.nbytes + 4 * tokens * sum(rows)
        return Trial(graph, verify, moved)

    return prepare


def _random_choices(rng: np.random.Generator, tokens: int, top_k: int, experts: int):
    """top_k distinct experts per token, uniformly at random, as routing picks them."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]


def _compare_experts(
    layer, bits: int, x, offsets, row_index, hidden_rows, exponents, down_rows, stride: int = 1
) -> Comparison:
    """The grouped GEMMs over assignments sorted by expert, expert by expert: gate|up with SwiGLU
    from the rows of x the assignments gather, the range guard's exponents of the kernel's own
    hidden rows (exactly), down from those rows with those exponents. Only every `stride`-th
    output column is checked (odd, so each tile and lane position still is), which keeps the
    float64 dequantization of 256 experts short."""
    hidden, expert_rows = x.shape[1], hidden_rows.shape[1]
    result = compare(exponents, reference_row_exponents(hidden_rows), 0)
    for e in np.flatnonzero(np.diff(offsets)):
        mine = slice(int(offsets[e]), int(offsets[e + 1]))

        def expert(name: str, e=e):
            return tuple(a[e, ::stride] for a in layer[name])

        gathered = x[row_index[mine]]
        gate, gate_magnitude = reference_qgemm(*expert("expert_gate"), bits, gathered)
        up, up_magnitude = reference_qgemm(*expert("expert_up"), bits, gathered)
        expected, bound = swiglu_bound(gate, gate_magnitude, up, up_magnitude, hidden)
        result = result.merge(compare(hidden_rows[mine, ::stride], expected, bound))
        expected, magnitude = reference_qgemm(
            *expert("expert_down"), bits, hidden_rows[mine], exponents[mine]
        )
        result = result.merge(
            compare_ulps(down_rows[mine, ::stride], expected, magnitude, qgemm_ulps(expert_rows))
        )
    return result


def _qgemm_grouped(
    tokens: int, experts: int, top_k: int, hidden: int, expert_rows: int, bits: int, stride: int = 1
):
    """The routed experts of a chunk as the MoE block runs them: gate|up with SwiGLU over the
    tokens gathered in expert order, the range guard's exponents of the sorted hidden rows, then
    down over those rows; every `stride`-th output column checked."""
    from lily.kernels.quant_weight import wrap_quant_weight
    from lily.kernels.quantized_gemm import record_qgemm_grouped, record_qgemm_row_exponents

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        layer = {
            "expert_gate": random_quantized(rng, expert_rows, hidden, bits, experts),
            "expert_up": random_quantized(rng, expert_rows, hidden, bits, experts),
            "expert_down": random_quantized(rng, hidden, expert_rows, bits, experts),
        }
        x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
        choices = _random_choices(rng, tokens, top_k, experts)
        offsets, row_index, _ = reference_sort(choices, experts)
        assignments = tokens * top_k
        expert_hidden = floats(device, assignments * expert_rows)
        exponents = device.alloc(4 * assignments)  # int32
        out = floats(device, assignments * hidden)
        w = {name: wrap_quant_weight(device, *t) for name, t in layer.items()}
        offsets_buffer = device.wrap(offsets.astype(np.uint32))
        graph = Graph()
        record_qgemm_grouped(
            graph,
            device,
            device.wrap(x),
            [w["expert_gate"], w["expert_up"]],
            expert_hidden,
            offsets_buffer,
            device.wrap(row_index.astype(np.uint32)),
            assignments,
        )
        graph.barrier()
        record_qgemm_row_exponents(
            graph, device, expert_hidden, assignments, expert_rows, exponents
        )
        graph.barrier()
        record_qgemm_grouped(
            graph,
            device,
            expert_hidden,
            [w["expert_down"]],
            out,
            offsets_buffer,
            None,
            assignments,
            x_exponents=exponents,
        )

        def verify() -> Comparison:
            hidden_rows = read_floats(expert_hidden, assignments * expert_rows)
            down_rows = read_floats(out, assignments * hidden)
            return _compare_experts(
                layer,
                bits,
                x,
                offsets,
                row_index,
                hidden_rows.reshape(assignments, expert_rows),
                exponents.numpy()[: 4 * assignments].view(np.int32),
                down_rows.reshape(assignments, hidden),
                stride,
            )

        used = len(np.unique(choices))
        moved = sum(a[0].nbytes * used for t in layer.values() for a in t)
        moved += x.nbytes + 4 * assignments * (2 * expert_rows + hidden)
        return Trial(graph, verify, moved)

    return prepare


def _moe_chunk(tokens: int, hidden: int, experts: int, top_k: int, expert_rows: int, shared: int):
    """The MoE block of a chunk, judged stage by stage on the kernels' own intermediate buffers:
    router and shared-expert gate logits, routing, the counting sort, the grouped expert GEMMs,
    the shared expert, and the combine."""
    from lily.kernels.moe import MoeWeights
    from lily.kernels.moe_chunk import MoeChunkScratch, record_moe_chunk
    from lily.kernels.quant_weight import wrap_quant_weight

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        layer = _random_moe_layer(rng, hidden, experts, expert_rows, shared)
        x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
        s = MoeChunkScratch.allocate(device, experts, top_k, expert_rows, shared, hidden, tokens)
        out = floats(device, tokens * hidden)
        weights = MoeWeights(**{n: wrap_quant_weight(device, *t) for n, t in layer.items()})
        graph = Graph()
        record_moe_chunk(graph, device, device.wrap(x), weights, top_k, s, out, tokens)

        def read(buffer, *shape: int, dtype=np.float32) -> np.ndarray:
            return buffer.numpy()[: 4 * int(np.prod(shape))].view(dtype).reshape(shape)

        def verify() -> Comparison:
            assignments = tokens * top_k
            logits, shared_logit = (
                read(s.logits, tokens, experts),
                read(s.shared_gate_logit, tokens),
            )
            result = Comparison(0.0, 0.0)
            for actual, name in ((logits, "router"), (shared_logit[:, None], "shared_expert_gate")):
                expected, magnitude = reference_qgemm(*layer[name], 8, x)
                result = result.merge(compare_ulps(actual, expected, magnitude, qgemm_ulps(hidden)))
            ids = read(s.expert_ids, tokens, top_k, dtype=np.uint32)
            route_weights = read(s.expert_weights, tokens, top_k)
            expected_ids, expected_weights = reference.moe_route(
                logits.astype(np.float64), top_k, True
            )
            result = result.merge(compare(ids, expected_ids, 0)).merge(
                compare_ulps(route_weights, expected_weights, expected_weights, 16 + experts / 8)
            )
            # The sort of the kernel's own routing, exactly numpy's stable sort.
            offsets, row_index, slot_of = reference_sort(ids, experts)
            for buffer, expected in (
                (read(s.expert_offsets, experts + 1, dtype=np.uint32), offsets),
                (read(s.row_index, assignments, dtype=np.uint32), row_index),
                (read(s.slot_of, tokens, top_k, dtype=np.uint32), slot_of.reshape(tokens, top_k)),
            ):
                result = result.merge(compare(buffer, expected, 0))
            down_rows = read(s.expert_down, assignments, hidden)
            result = result.merge(
                _compare_experts(
                    layer,
                    4,
                    x,
                    offsets,
                    row_index,
                    read(s.expert_hidden, assignments, expert_rows),
                    read(s.expert_exponents, assignments, dtype=np.int32),
                    down_rows,
                )
            )
            gate, gate_magnitude = reference_qgemm(*layer["shared_gate"], 4, x)
            up, up_magnitude = reference_qgemm(*layer["shared_up"], 4, x)
            expected, bound = swiglu_bound(gate, gate_magnitude, up, up_magnitude, hidden)
            shared_hidden = read(s.shared_hidden, tokens, shared)
            shared_down = read(s.shared_down, tokens, hidden)
            shared_exponents = read(s.shared_exponents, tokens, dtype=np.int32)
            expected_down, magnitude = reference_qgemm(
                *layer["shared_down"], 4, shared_hidden, shared_exponents
            )
            result = result.merge(compare(shared_hidden, expected, bound)).merge(
                compare(shared_exponents, reference_row_exponents(shared_hidden), 0)
            )
            result = result.merge(
                compare_ulps(shared_down, expected_down, magnitude, qgemm_ulps(shared))
            )
            # The combine of the kernels' own expert outputs: top_k + 1 products added in order.
            f64 = np.float64
            expected, magnitude, shared_term = reference_combine(
                down_rows.astype(f64),
                slot_of.reshape(tokens, top_k),
                route_weights.astype(f64),
                shared_logit.astype(f64),
                shared_down.astype(f64),
            )
            bound = (top_k + 2) * FLOAT32_EPS * magnitude + 4 * FLOAT32_EPS * np.abs(shared_term)
            return result.merge(compare(read(out, tokens, hidden), expected, bound))

        # All the weights (at 8 tokens per expert or more nearly every expert is chosen), x and out.
        moved = sum(a.nbytes for t in layer.values() for a in t) + 2 * x.nbytes
        return Trial(graph, verify, moved)

    return prepare


def _conv1d_inputs(rng: np.random.Generator, channels: int, tokens: int):
    """A conv1d check's bf16 taps, window and x, and an output buffer of NaNs."""
    from lily.kernels.conv1d import KERNEL_TAPS

    weight = float32_to_bf16(rng.normal(0, 0.5, (channels, KERNEL_TAPS, 1)).astype(np.float32))
    window = rng.normal(0, 1, (KERNEL_TAPS - 1, channels)).astype(np.float32)
    x = rng.normal(0, 1, (tokens, channels)).astype(np.float32)
    out = np.full((tokens, channels), np.nan, dtype=np.float32)
    return weight, window, x, out


def _conv1d_steps(weight: np.ndarray, window: np.ndarray, x: np.ndarray):
    """The float64 reference: x's outputs token by token from `window`, and the window after."""
    taps = bf16_to_float32(weight)[:, :, 0].astype(np.float64)
    expected_window = window.astype(np.float64)
    expected = np.empty(x.shape)
    for t in range(len(x)):
        expected[t], expected_window = reference.causal_conv1d_step(
            expected_window, x[t].astype(np.float64), taps
        )
    return expected, expected_window


def _conv1d_chunk(channels: int, tokens: int):
    """Against `tokens` float64 steps with the step's tolerance: the chunk kernel does the step
    kernel's arithmetic for every output."""
    from lily.kernels.conv1d import record_conv1d_chunk

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        weight, window, x, out = _conv1d_inputs(rng, channels, tokens)
        initial_window = window.copy()
        graph = Graph()
        record_conv1d_chunk(
            graph,
            device,
            channels=channels,
            tokens=tokens,
            x=device.wrap(x),
            weight=device.wrap(weight),
            window=device.wrap(window),
            out=device.wrap(out),
        )

        def verify() -> Comparison:
            expected, expected_window = _conv1d_steps(weight, initial_window, x)
            return compare_close(out, expected, 1e-5, 1e-6).merge(
                compare(window, expected_window.astype(np.float32), 0)
            )

        return Trial(graph, verify, 2 * x.nbytes + weight.nbytes)

    return prepare


def _conv1d_verify(channels: int, tokens: int, kept: int):
    """A verify pass's conv1d_chunk (its tail) over `tokens` candidates, then conv1d_commit of
    `kept` accepted drafts: the outputs, and the window after the kept tokens exactly."""
    from lily.kernels.conv1d import (
        KERNEL_TAPS,
        record_conv1d_chunk,
        record_conv1d_commit,
        tail_bytes,
    )

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        weight, window, x, out = _conv1d_inputs(rng, channels, tokens)
        initial_window = window.copy()
        tail = device.wrap(np.zeros(tail_bytes(channels, tokens) // 4, np.float32))
        window_buffer = device.wrap(window)
        graph = Graph()
        record_conv1d_chunk(
            graph,
            device,
            channels=channels,
            tokens=tokens,
            x=device.wrap(x),
            weight=device.wrap(weight),
            window=window_buffer,
            out=device.wrap(out),
            tail=tail,
            candidates=tokens,
        )
        graph.barrier()
        record_conv1d_commit(
            graph,
            device,
            accepted=device.wrap(np.array([kept, 0], np.uint32)),
            tail=tail,
            window=window_buffer,
            channels=channels,
            candidates=tokens,
        )

        def verify() -> Comparison:
            expected, _ = _conv1d_steps(weight, initial_window, x)
            # The window after the waiting token and the kept drafts: their last 3 rows.
            kept_rows = np.concatenate([initial_window, x[: kept + 1]])[-(KERNEL_TAPS - 1) :]
            return compare_close(out, expected, 1e-5, 1e-6).merge(compare(window, kept_rows, 0))

        return Trial(graph, verify, 2 * x.nbytes + weight.nbytes)

    return prepare


def _gdn_chunk(num_key_heads: int, num_value_heads: int, tokens: int):
    """The chunk kernel then the gated norm, chained as in prefill, against the float64
    recurrence token after token, with the chunk tests' tolerances."""
    from lily.kernels.gdn import record_gdn_chunk, record_gdn_gated_norm

    eps = 1e-6

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        inputs = _gdn_inputs(rng, num_key_heads, num_value_heads, (tokens,))
        initial_state = inputs["state"].copy()
        buffers = {name: device.wrap(array) for name, array in inputs.items()}
        heads = dict(num_key_heads=num_key_heads, num_value_heads=num_value_heads)
        graph = Graph()
        record_gdn_chunk(
            graph,
            device,
            tokens=tokens,
            readout=buffers["out"],
            **heads,
            **{name: buffers[name] for name in ("qkv", "a", "b", "a_log", "dt_bias", "state")},
        )
        graph.barrier()
        record_gdn_gated_norm(
            graph,
            device,
            x=buffers["out"],
            z=buffers["z"],
            norm_weight=buffers["norm_weight"],
            tokens=tokens,
            num_value_heads=num_value_heads,
            norm_eps=eps,
        )

        def verify() -> Comparison:
            state = initial_state
            expected = np.empty(inputs["out"].shape)
            for t in range(tokens):
                expected[t], state = reference_gdn_token(
                    state,
                    *(inputs[name][t] for name in ("qkv", "z", "a", "b")),
                    **{name: inputs[name] for name in ("a_log", "dt_bias", "norm_weight")},
                    **heads,
                    eps=eps,
                )
            return compare_close(inputs["state"], state, *GDN_CHUNK_STATE_TOLERANCE).merge(
                compare_close(inputs["out"], expected, *GDN_CHUNK_OUT_TOLERANCE)
            )

        moved = sum(a.nbytes for a in inputs.values()) + initial_state.nbytes
        return Trial(graph, verify, moved)

    return prepare


def _attention_chunk(num_q: int, num_kv: int, tokens: int, position: int, multi_query=False):
    """prepare over `tokens` tokens from `position` (norms, RoPE, cache append), then the causal
    chunk kernel with the output gate, chained in one graph as in prefill; with `multi_query`,
    multi-query decode attention and the combine instead, as in a verify pass."""
    from lily.kernels.attention import (
        HEAD_DIM,
        chunk_attention_on_tensor_ops,
        decode_splits,
        packed_queries_bytes,
        partial_out_bytes,
        partial_stats_bytes,
        record_attention_chunk,
        record_attention_combine,
        record_attention_decode_tokens,
        record_attention_prepare,
    )

    eps, theta, rotary_dim, capacity = 1e-6, 1e7, 64, position + tokens

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        f32 = np.float32
        q_proj = rng.normal(0, 2, (tokens, num_q, 2, HEAD_DIM)).astype(f32)
        k_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(f32)
        v_proj = rng.normal(0, 2, (tokens, num_kv, HEAD_DIM)).astype(f32)
        q_norm = float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(f32))
        k_norm = float32_to_bf16(1 + rng.normal(0, 0.1, HEAD_DIM).astype(f32))
        # Earlier chunks' keys and values; this chunk's rows are overwritten by prepare.
        shape = (num_kv, capacity, HEAD_DIM)
        k_cache = float32_to_bf16(rng.standard_normal(shape, dtype=f32))
        v_cache = float32_to_bf16(rng.standard_normal(shape, dtype=f32))
        queries = np.full((tokens, num_q, HEAD_DIM), np.nan, dtype=f32)
        out = np.full((tokens, num_q * HEAD_DIM), np.nan, dtype=f32)
        bound = {
            name: device.wrap(a)
            for name, a in [
                ("q_proj", q_proj),
                ("queries", queries),
                ("k_cache", k_cache),
                ("v_cache", v_cache),
                ("step", np.array([position, 0], dtype=np.uint32)),
            ]
        }
        heads = {"num_q_heads": num_q, "num_kv_heads": num_kv, "capacity": capacity}
        graph = Graph()
        record_attention_prepare(
            graph,
            device,
            k_proj=device.wrap(k_proj),
            v_proj=device.wrap(v_proj),
            q_norm=device.wrap(q_norm),
            k_norm=device.wrap(k_norm),
            rotary_dim=rotary_dim,
            rope_theta=theta,
            norm_eps=eps,
            tokens=tokens,
            **bound,
            **heads,
        )
        graph.barrier()
        if multi_query:
            num_splits = decode_splits(capacity)
            partials = dict(
                partial_out=device.alloc(partial_out_bytes(num_q, num_splits, tokens)),
                partial_stats=device.alloc(partial_stats_bytes(num_q, num_splits, tokens)),
                num_splits=num_splits,
            )
            record_attention_decode_tokens(
                graph,
                device,
                queries=bound["queries"],
                k_cache=bound["k_cache"],
                v_cache=bound["v_cache"],
                step=bound["step"],
                tokens=tokens,
                **partials,
                **heads,
            )
            graph.barrier()
            record_attention_combine(
                graph,
                device,
                q_proj=bound["q_proj"],
                step=bound["step"],
                out=device.wrap(out),
                num_q_heads=num_q,
                tokens=tokens,
                **partials,
            )
        else:
            # On tensor ops (an M5), the tensor-op kernel with its packed queries.
            packed = (
                device.alloc(packed_queries_bytes(num_q, num_kv, tokens))
                if chunk_attention_on_tensor_ops(device)
                else None
            )
            record_attention_chunk(
                graph,
                device,
                out=device.wrap(out),
                tokens=tokens,
                packed_queries=packed,
                **bound,
                **heads,
            )

        def verify() -> Comparison:
            f64 = np.float64
            positions = position + np.arange(tokens)
            # The attention tests' bounds: fp32 RoPE angles lose up to position * 2^-24 radians,
            # the bf16 cache rounds once more.
            rope = 1e-5 + 2 * (capacity - 1) * 2.0**-24

            def normed_rotated(x, gain):  # [T, H, D] -> [H, T, D]
                normed = reference.rms_norm(x.astype(f64), bf16_to_float32(gain).astype(f64), eps)
                return reference.apply_rope(normed.transpose(1, 0, 2), positions, rotary_dim, theta)

            chunk = slice(position, capacity)
            q = queries.astype(f64).transpose(1, 0, 2)
            k = bf16_to_float32(k_cache).astype(f64)
            v = bf16_to_float32(v_cache).astype(f64)
            result = compare_close(q, normed_rotated(q_proj[:, :, 0], q_norm), 1e-5, rope)
            result = result.merge(
                compare_close(k[:, chunk], normed_rotated(k_proj, k_norm), 2.0**-8, rope)
            ).merge(compare(v_cache[:, chunk], float32_to_bf16(v_proj).transpose(1, 0, 2), 0))
            # The attention itself, over the kernels' own queries and cache.
            attended = reference.attention(q, k, v, HEAD_DIM**-0.5, positions).transpose(1, 0, 2)
            gated = attended * reference.sigmoid(q_proj[:, :, 1].astype(f64))
            # Multi-query decode attention keeps the decode kernels' fp32 operands.
            rtol, atol = (1e-4, 1e-5) if multi_query else ATTENTION_CHUNK_TOLERANCE
            return result.merge(compare_close(out, gated.reshape(tokens, -1), rtol, atol))

        moved = 2 * k_cache.nbytes + q_proj.nbytes + k_proj.nbytes + v_proj.nbytes
        return Trial(graph, verify, moved + queries.nbytes + out.nbytes)

    return prepare


CHECKS: list[KernelCheck] = [
    KernelCheck("quantized_gemv", "8192x2048 q4, fp32 x", _qgemv(8192, 2048, 4, "float32"), True),
    KernelCheck("quantized_gemv", "2048x4096 q4, bf16 x", _qgemv(2048, 4096, 4, "bfloat16"), True),
    KernelCheck("quantized_gemv", "256x2048 q8, fp32 x", _qgemv(256, 2048, 8, "float32")),
    KernelCheck(
        "quantized_gemv, folded norm", "4096x2048 q4", _qgemv(4096, 2048, 4, "float32", True)
    ),
    KernelCheck(
        "quantized_gemv, embedded input + folded norm",
        "2048 -> 4096+512+512 q4, q8 table",
        _qgemv_embedded([4096, 512, 512], 2048, 4, 4096, 8),
    ),
    KernelCheck("gemm_nt", "8x512x2048 fp32", _gemm(8, 512, 2048), True),
    KernelCheck("gemm_nt", "37x45x19 fp32", _gemm(37, 45, 19)),
    KernelCheck("rms_norm", "16x256", _rms_norm(16, 256)),
    KernelCheck("rms_norm", "1x9000", _rms_norm(1, 9000)),
    KernelCheck("embedding", "4096x2048 q4, 3 tokens", _embedding(4096, 2048, [7, 4095, 0])),
    KernelCheck("conv1d_step", "8192 channels", _conv1d(8192)),
    KernelCheck("gdn_step", "16 key, 32 value heads", _gdn(16, 32), True),
    KernelCheck("gdn_out_proj", "2048x4096 q4", _gdn_out_proj(2048, 32, 4), True),
    KernelCheck(
        "attention prepare+decode+combine",
        "16 q, 2 kv heads, 4096 ctx",
        _attention(16, 2, 4096),
        True,
    ),
    KernelCheck(
        "attention_decode_fused+combine",
        "16 q, 2 kv heads, 300 ctx",
        _attention(16, 2, 300, fused=True),
        True,
    ),
    KernelCheck(
        "moe (route, gate/up, down)", "64 experts top-8, 2048", _moe(2048, 64, 8, 512, 512), True
    ),
    KernelCheck("sample_slices + sample_token (greedy)", "vocab 248320", _greedy_sample(248320)),
    KernelCheck("step_advance", "capacity 4096", _step_advance(4096, 17)),
    KernelCheck(
        "qgemm_4 (in_proj qkv, z, a, b)",
        "T=512, 2048 -> 8192+4096+32+32 q4",
        _qgemm(512, 2048, [8192, 4096, 32, 32], 4),
        True,
        sim=("T=40, 2048 -> 200+72+32+32 q4", _qgemm(40, 2048, [200, 72, 32, 32], 4)),
    ),
    KernelCheck(
        "qgemm_8 (router, shared gate)", "T=45, 2048 -> 256+1 q8", _qgemm(45, 2048, [256, 1], 8)
    ),
    KernelCheck(
        "qgemm_grouped_swiglu_4 + qgemm_grouped_4",
        "256 experts top-8, T=512, 2048 -> 512 -> 2048 q4",
        _qgemm_grouped(512, 256, 8, 2048, 512, 4, stride=7),
        True,
        sim=(
            "256 experts top-8, T=16, 256 -> 64 -> 256 q4",
            _qgemm_grouped(16, 256, 8, 256, 64, 4),
        ),
    ),
    KernelCheck(
        "qgemm_grouped_swiglu_8 + qgemm_grouped_8",
        "4 experts top-3, T=64, 192 -> 128 -> 192 q8",
        _qgemm_grouped(64, 4, 3, 192, 128, 8),
    ),
    KernelCheck(
        "moe_chunk (gates, route, sort, experts, combine)",
        "64 experts top-8, T=64, 2048, expert and shared 512",
        _moe_chunk(64, 2048, 64, 8, 512, 512),
        True,
        sim=(
            "64 experts top-8, T=64, 256, expert 64, shared 128",
            _moe_chunk(64, 256, 64, 8, 64, 128),
        ),
    ),
    KernelCheck("conv1d_chunk", "8192 channels, T=64", _conv1d_chunk(8192, 64)),
    KernelCheck(
        "conv1d_chunk (tail) + conv1d_commit",
        "8192 channels, T=5, 2 kept",
        _conv1d_verify(8192, 5, 2),
    ),
    KernelCheck(
        "gdn_tokens + gdn_commit",
        "16 key, 32 value heads, T=5, 2 kept",
        _gdn_verify(16, 32, 5, 2),
        True,
    ),
    KernelCheck("gdn_chunk", "16 key, 32 value heads, T=64", _gdn_chunk(16, 32, 64), True),
    KernelCheck(
        "attention prepare+chunk",
        "16 q, 2 kv heads, T=64 from position 300",
        _attention_chunk(16, 2, 64, 300),
    ),
    KernelCheck(
        "vision_position_embedding + vision_layer_norm",
        "48x48 grid to 64x48 patches, 1152 wide",
        _vision_position_and_norm((1, 64, 48), 48, 1152),
        sim=("8x8 grid to 6x10 patches, 64 wide", _vision_position_and_norm((1, 6, 10), 8, 64)),
    ),
    KernelCheck(
        "vision_linear (tanh GELU)",
        "1024x4304x1152",
        _vision_linear(1024, 4304, 1152),
        True,
        sim=("37x96x64", _vision_linear(37, 96, 64)),
    ),
    KernelCheck(
        "vision_rotary + vision_attention",
        "16 heads of 72, 32x32 patches",
        _vision_attention((1, 32, 32), 16, 72),
        True,
        sim=("4 heads of 16, 2 frames of 6x10 patches", _vision_attention((2, 6, 10), 4, 16)),
    ),
    KernelCheck(
        "attention prepare+decode_tokens+combine",
        "16 q, 2 kv heads, T=5 from position 4000",
        _attention_chunk(16, 2, 5, 4000, multi_query=True),
        True,
    ),
]
