"""How the prefill GEMMs' operand type moves the engine's output: a study, not a benchmark.

The quantized GEMMs multiply half operands with fp32 sums; an input half's range does not bound
(the down projections' SwiGLU hidden state, the attention and GDN outputs) takes the range guard,
a power-of-two scale per row (metal/quantized_gemm.h). This prints:

- one GEMM of random MLX-quantized weights, in numpy against float64, with bfloat and half
  operands, for N(0, 1) inputs and for unbounded ones (rows scaled by 10^u, u in [-6, 6], some
  values 1e6): plain half overflows there, half with the guard keeps half's accuracy (fp32
  operands hold these float32 inputs and 4-bit weights exactly: an fp32 GEMM's error is its
  sums' rounding alone);
- the same unbounded GEMM run on the sim by the engine's kernel, with and without the guard;
- the sim engine's prefill (every GEMM half, guarded where the engine guards) on a small
  checkpoint (the demo unless given): the largest logit difference from the float64 reference
  at the prompt's last position, and whether the argmax agrees. The engine's tests hold prefill
  to 1e-2 of the reference.

Usage:
    python benchmarks/gemm_operands_study.py [demo|DIR] [--lengths 64 300]
"""

from __future__ import annotations

import argparse

import numpy as np

from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.checkpoint.quant import bf16_to_float32, round_to_bf16, unpack_codes
from lily.device import Graph, open_device
from lily.diagnostics.kernel_checks import random_quantized, reference_row_exponents
from lily.engine.engine import DeviceEngine
from lily.engine.reference import ReferenceModel
from lily.kernels.quant_weight import wrap_quant_weight
from lily.kernels.quantized_gemm import record_qgemm

IN_DIM, ROWS, TOKENS = 2048, 512, 64


def to_half(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return a.astype(np.float32).astype(np.float16).astype(np.float64)


def guarded_half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's rows staged as the guarded GEMM stages them (half of x * 2^-e) and the 2^e to
    multiply the results by."""
    scale = np.ldexp(1.0, reference_row_exponents(x).astype(np.int64))[:, None]
    return to_half(x / scale), scale


def unbounded_inputs(rng: np.random.Generator) -> np.ndarray:
    x = rng.normal(0, 1, (TOKENS, IN_DIM)) * 10.0 ** rng.uniform(-6, 6, (TOKENS, 1))
    x.flat[rng.integers(0, x.size, TOKENS // 4)] = 1e6
    return x.astype(np.float32)


def study_gemm():
    """Random 4-bit weights (the triple and its float64 dense matrix) and two inputs: N(0, 1)
    and unbounded."""
    rng = np.random.default_rng(0)
    triple = random_quantized(rng, ROWS, IN_DIM, 4)
    codes = unpack_codes(triple[0], 4).astype(np.float64)
    s, b = (np.repeat(bf16_to_float32(a).astype(np.float64), 64, axis=-1) for a in triple[1:])
    bounded = rng.normal(0, 1, (TOKENS, IN_DIM)).astype(np.float32)
    return triple, s * codes + b, bounded, unbounded_inputs(rng)


def gemm_study() -> None:
    _, w, bounded, unbounded = study_gemm()
    products = {
        "bfloat": lambda x: (
            round_to_bf16(x).astype(np.float64)
            @ round_to_bf16(w.astype(np.float32)).astype(np.float64).T
        ),
        "half": lambda x: to_half(x) @ to_half(w).T,
        "half, guarded": lambda x: (lambda h, e: e * (h @ to_half(w).T))(*guarded_half(x)),
    }
    for inputs, x in (("N(0, 1) inputs", bounded), ("unbounded inputs", unbounded)):
        exact = x.astype(np.float64) @ w.T
        # Relative to each row's RMS output: rows differ by up to 1e12 in scale.
        row_scale = np.sqrt(np.mean(exact**2, axis=1, keepdims=True))
        for name, product in products.items():
            with np.errstate(invalid="ignore", over="ignore"):
                error = np.abs(product(x) - exact) / row_scale
            if not np.all(np.isfinite(error)):
                bad = np.sum(~np.all(np.isfinite(error), axis=1))
                print(
                    f"one GEMM, {inputs:<16}, {name:<13} operands: {bad} of {TOKENS} rows "
                    "not finite (inf or NaN)"
                )
                continue
            print(
                f"one GEMM, {inputs:<16}, {name:<13} operands: RMS error "
                f"{np.sqrt(np.mean(error**2)):.1e}, largest {error.max():.1e} (relative to each "
                "row's RMS output)"
            )


def kernel_study() -> None:
    """The unbounded GEMM on the sim, by qgemm_4_64, unguarded and guarded."""
    device = open_device("sim")
    triple, w, _, x = study_gemm()
    exact = x.astype(np.float64) @ w.T
    row_scale = np.sqrt(np.mean(exact**2, axis=1, keepdims=True))
    weight = wrap_quant_weight(device, *triple)
    for guarded in (False, True):
        out = device.alloc(4 * TOKENS * ROWS)
        exponents = device.wrap(reference_row_exponents(x)) if guarded else None
        graph = Graph()
        record_qgemm(graph, device, device.wrap(x), [(weight, out)], TOKENS, exponents)
        device.run(graph)
        y = out.numpy().view(np.float32).reshape(TOKENS, ROWS).astype(np.float64)
        finite = np.all(np.isfinite(y), axis=1)
        error = np.abs(y[finite] - exact[finite]) / row_scale[finite]
        print(
            f"sim qgemm_4_64, unbounded inputs, {'guarded' if guarded else 'unguarded'}: "
            f"{np.sum(~finite)} of {TOKENS} rows not finite; the finite ones' largest error "
            f"{error.max():.1e} (relative to each row's RMS output)"
        )


def engine_study(checkpoint, lengths: list[int]) -> None:
    c = checkpoint.config
    longest = max(lengths)
    # float64, with the KV cache rounded to bf16 as the engine's is.
    reference = ReferenceModel(c, checkpoint.tensors, dtype=np.float64, bf16_kv_cache=True)
    engine = DeviceEngine(checkpoint, open_device("sim"), longest + 8, c.vocab_size, longest)
    for n in lengths:
        prompt = np.random.default_rng(n).integers(0, c.vocab_size, n).tolist()
        expected = reference.prefill(prompt)[0][-1]
        logits = engine.prompt_logits(prompt)
        worst = np.abs(logits - expected).max()
        same = int(np.argmax(logits)) == int(np.argmax(expected))
        print(
            f"prefill {n:5} tokens, half operands (guarded where unbounded): largest logit "
            f"difference {worst:.2e} from the float64 reference (logit spread "
            f"{np.ptp(expected):.1f}), argmax {'agrees' if same else 'differs'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="demo")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 300])
    args = parser.parse_args()
    gemm_study()
    kernel_study()
    engine_study(load_checkpoint(resolve_model(args.model)), args.lengths)


if __name__ == "__main__":
    main()
