"""Every kernel of metal/ run once against its float64 numpy reference: `lily doctor`'s table.

Each entry of CHECKS builds random inputs at one set of shapes (the real model's where they fit
in a few hundred MB), records the kernel's graph, and says how to compare its output with the
reference, with the error bounds of the kernel's test in tests/ (the reasoning behind each bound
is written there). Adding a kernel to the table is one KernelCheck entry.

The random MLX-quantized weights and the quantized GEMV reference are shared with the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lily import reference
from lily.device import Device, Graph
from lily.quant import bf16_to_float32, float32_to_bf16, unpack_codes

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


@dataclass(frozen=True)
class KernelCheck:
    kernel: str  # the metal/ kernel(s) exercised
    shapes: str
    prepare: Callable[[Device, np.random.Generator], Trial]
    timed: bool = False  # large enough for its GPU time and bandwidth to mean something


def floats(device: Device, count: int):
    return device.alloc(4 * count)


def read_floats(buffer, count: int) -> np.ndarray:
    return buffer.numpy()[: 4 * count].view(np.float32)


def _qgemv(rows: int, in_dim: int, bits: int, dtype: str):
    from lily.kernels.quantized import record_qgemv, wrap_quant_weight

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        triple = random_quantized(rng, rows, in_dim, bits)
        x32 = rng.normal(0, 1, in_dim).astype(np.float32)
        x = float32_to_bf16(x32) if dtype == "bfloat16" else x32
        x64 = (bf16_to_float32(x) if dtype == "bfloat16" else x).astype(np.float64)
        out = floats(device, rows)
        graph = Graph()
        weight = wrap_quant_weight(device, *triple)
        record_qgemv(graph, device, device.wrap(x), [(weight, out)], x_dtype=dtype)

        def verify() -> Comparison:
            expected, magnitude = reference_qgemv(*triple, bits, x64)
            return compare_ulps(
                read_floats(out, rows), expected, magnitude, qgemv_ulps(in_dim, bits)
            )

        moved = sum(a.nbytes for a in triple) + x.nbytes + 4 * rows
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
    from lily.kernels.quantized import wrap_quant_weight

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


def _gdn(num_key_heads: int, num_value_heads: int):
    from lily.kernels.gdn import KEY_HEAD_DIM, VALUE_HEAD_DIM, record_gdn_step

    eps = 1e-6

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        key_total, value_total = num_key_heads * KEY_HEAD_DIM, num_value_heads * VALUE_HEAD_DIM
        f32 = np.float32
        inputs = {
            "qkv": rng.normal(0, 1, 2 * key_total + value_total).astype(f32),
            "z": rng.normal(0, 1.5, value_total).astype(f32),
            "a": rng.normal(0, 1, num_value_heads).astype(f32),
            "b": rng.normal(0, 1.5, num_value_heads).astype(f32),
            "a_log": np.log(rng.uniform(0.1, 4, num_value_heads)).astype(f32),
            "dt_bias": float32_to_bf16(rng.normal(0, 0.5, num_value_heads).astype(f32)),
            "norm_weight": float32_to_bf16(1 + rng.normal(0, 0.1, VALUE_HEAD_DIM).astype(f32)),
            "state": rng.normal(0, 0.3, (num_value_heads, VALUE_HEAD_DIM, KEY_HEAD_DIM)).astype(
                f32
            ),
            "out": np.full(value_total, np.nan, dtype=f32),
        }
        initial_state = inputs["state"].copy()
        graph = Graph()
        record_gdn_step(
            graph,
            device,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            norm_eps=eps,
            **{name: device.wrap(array) for name, array in inputs.items()},
        )

        def verify() -> Comparison:
            f64 = {name: array.astype(np.float64) for name, array in inputs.items()}
            q = f64["qkv"][:key_total].reshape(num_key_heads, KEY_HEAD_DIM)
            k = f64["qkv"][key_total : 2 * key_total].reshape(num_key_heads, KEY_HEAD_DIM)
            v = f64["qkv"][2 * key_total :].reshape(num_value_heads, VALUE_HEAD_DIM)
            q = reference.l2_normalize(q) * KEY_HEAD_DIM**-0.5
            k = reference.l2_normalize(k)
            g, beta = reference.gdn_gates(
                f64["a"], f64["b"], f64["a_log"], bf16_to_float32(inputs["dt_bias"])
            )
            o, state = reference.gated_delta_step(
                initial_state.astype(np.float64), q, k, v, g, beta
            )
            z = f64["z"].reshape(num_value_heads, VALUE_HEAD_DIM)
            weight = bf16_to_float32(inputs["norm_weight"]).astype(np.float64)
            expected = reference.gated_rms_norm(o, weight, z, eps).reshape(-1)
            return compare_close(inputs["state"], state, 1e-5, 1e-5).merge(
                compare_close(inputs["out"], expected, 1e-4, 2e-5)
            )

        return Trial(graph, verify, 2 * initial_state.nbytes)

    return prepare


def _attention(num_q: int, num_kv: int, context: int, num_splits: int = 32):
    """prepare (norms, RoPE, cache append at position context - 1), decode over the whole cache
    and combine with the output gate, chained in one graph as in a decode step."""
    from lily.kernels.attention import (
        HEAD_DIM,
        partial_out_bytes,
        partial_stats_bytes,
        record_attention_combine,
        record_attention_decode,
        record_attention_prepare,
    )

    eps, theta, rotary_dim, position = 1e-6, 1e7, 64, context - 1

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
        record_attention_prepare(
            graph,
            device,
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
            **bound,
            **caches,
        )
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
            out=device.wrap(out),
            num_q_heads=num_q,
            num_splits=num_splits,
        )

        def verify() -> Comparison:
            # The kernels' own cache row (bf16, checked by the attention tests) feeds the
            # reference, so this compares the attention itself.
            k = bf16_to_float32(k_cache).astype(np.float64)
            v = bf16_to_float32(v_cache).astype(np.float64)
            q = queries.astype(np.float64)[:, None, :]
            attended = reference.attention(q, k, v, HEAD_DIM**-0.5, [position])[:, 0]
            gate = reference.sigmoid(q_proj[:, 1].astype(np.float64))
            return compare_close(out, attended * gate, 1e-4, 1e-5)

        return Trial(graph, verify, 2 * k_cache.nbytes + q_proj.nbytes + out.nbytes)

    return prepare


def _moe(hidden: int, experts: int, top_k: int, expert_rows: int, shared_rows: int):
    """The whole MoE block: route, gate/up with SwiGLU, down with the shared expert."""
    from lily.kernels.moe import MoeScratch, MoeWeights, record_moe
    from lily.kernels.quantized import wrap_quant_weight

    def prepare(device: Device, rng: np.random.Generator) -> Trial:
        layer = {
            "router": random_quantized(rng, experts, hidden, 8),
            "shared_expert_gate": random_quantized(rng, 1, hidden, 8),
            "expert_gate": random_quantized(rng, expert_rows, hidden, 4, experts=experts),
            "expert_up": random_quantized(rng, expert_rows, hidden, 4, experts=experts),
            "expert_down": random_quantized(rng, hidden, expert_rows, 4, experts=experts),
            "shared_gate": random_quantized(rng, shared_rows, hidden, 4),
            "shared_up": random_quantized(rng, shared_rows, hidden, 4),
            "shared_down": random_quantized(rng, hidden, shared_rows, 4),
        }
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
    from lily.kernels.sampling import (
        SAMPLING_PARAMS_BYTES,
        logprob_ring_bytes,
        record_sample,
        write_sampling_params,
    )
    from lily.sampling import SamplingParams

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


CHECKS: list[KernelCheck] = [
    KernelCheck("quantized_gemv", "8192x2048 q4, fp32 x", _qgemv(8192, 2048, 4, "float32"), True),
    KernelCheck("quantized_gemv", "2048x4096 q4, bf16 x", _qgemv(2048, 4096, 4, "bfloat16"), True),
    KernelCheck("quantized_gemv", "256x2048 q8, fp32 x", _qgemv(256, 2048, 8, "float32")),
    KernelCheck("gemm_nt", "8x512x2048 fp32", _gemm(8, 512, 2048), True),
    KernelCheck("gemm_nt", "37x45x19 fp32", _gemm(37, 45, 19)),
    KernelCheck("rms_norm", "16x256", _rms_norm(16, 256)),
    KernelCheck("rms_norm", "1x9000", _rms_norm(1, 9000)),
    KernelCheck("embedding", "4096x2048 q4, 3 tokens", _embedding(4096, 2048, [7, 4095, 0])),
    KernelCheck("conv1d_step", "8192 channels", _conv1d(8192)),
    KernelCheck("gdn_step", "16 key, 32 value heads", _gdn(16, 32), True),
    KernelCheck(
        "attention prepare+decode+combine",
        "16 q, 2 kv heads, 4096 ctx",
        _attention(16, 2, 4096),
        True,
    ),
    KernelCheck(
        "moe (route, gate/up, down)", "64 experts top-8, 2048", _moe(2048, 64, 8, 512, 512), True
    ),
    KernelCheck("sample_token (greedy)", "vocab 248320", _greedy_sample(248320)),
    KernelCheck("step_advance", "capacity 4096", _step_advance(4096, 17)),
]
