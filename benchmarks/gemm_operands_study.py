"""How the prefill GEMMs' operand type moves the engine's output: a study, not a benchmark.

The quantized GEMMs can multiply fp32 operands (what the engine runs) or, at 4 bits, operands
rounded to bfloat or half (`operands="bfloat16"` or `"float16"` in lily.kernels.quantized_gemm).
This runs the sim engine's prefill with each on a small checkpoint (the demo unless given) and
prints the largest logit difference from the float64 reference at the prompt's last position, and
whether the argmax agrees, for a few prompt lengths. With 2-byte operands every 4-bit GEMM of the
chunk (GDN and attention projections, the shared expert, the routed experts) rounds its inputs
and weights; the 8-bit router and shared-expert gate stay fp32, and the lm_head is a GEMV. The
engine's tests hold prefill to 1e-2 of the reference. (Half overflows past 65504; these small
random models do not get there, the real one may: see metal/quantized_gemm.h.)

It also prints, per operand type, the relative error of one GEMM of random N(0, 1) inputs and
MLX-quantized weights against float64.

Usage:
    python benchmarks/gemm_operands_study.py [demo|DIR] [--lengths 64 300]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

import lily.engine.model_graph as model_graph
import lily.kernels.moe_chunk as moe_chunk
import lily.kernels.quantized_gemm as quantized_gemm
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.checkpoint.quant import bf16_to_float32, round_to_bf16, unpack_codes
from lily.device import open_device
from lily.diagnostics.kernel_checks import random_quantized
from lily.engine.engine import DeviceEngine
from lily.engine.reference import ReferenceModel


def with_operands(record, weight_of, operands: str):
    """`record` with `operands` whenever its weights are 4-bit."""

    @functools.wraps(record)
    def wrapped(*args, **kwargs):
        if weight_of(args).bits == 4:
            kwargs["operands"] = operands
        return record(*args, **kwargs)

    return wrapped


def use_operands(operands: str) -> None:
    """Makes the engine's prefill GEMMs take `operands` from now on (the originals are kept in
    lily.kernels.quantized_gemm, which this leaves alone)."""
    dense = with_operands(quantized_gemm.record_qgemm, lambda a: a[3][0][0], operands)
    grouped = with_operands(quantized_gemm.record_qgemm_grouped, lambda a: a[3][0], operands)
    model_graph.record_qgemm = dense
    moe_chunk.record_qgemm = dense
    moe_chunk.record_qgemm_grouped = grouped


def engine_study(checkpoint, lengths: list[int]) -> None:
    c = checkpoint.config
    longest = max(lengths)
    # float64, with the KV cache rounded to bf16 as the engine's is.
    reference = ReferenceModel(c, checkpoint.tensors, dtype=np.float64, bf16_kv_cache=True)
    prompts = {n: np.random.default_rng(n).integers(0, c.vocab_size, n).tolist() for n in lengths}
    expected = {n: reference.prefill(p)[0][-1] for n, p in prompts.items()}
    for operands in quantized_gemm.OPERANDS:
        use_operands(operands)
        engine = DeviceEngine(checkpoint, open_device("sim"), longest + 8, c.vocab_size, longest)
        for n, prompt in prompts.items():
            logits = engine.prompt_logits(prompt)
            worst = np.abs(logits - expected[n]).max()
            same = int(np.argmax(logits)) == int(np.argmax(expected[n]))
            print(
                f"prefill {n:5} tokens, {operands:<8} operands: largest logit difference "
                f"{worst:.2e} from the float64 reference (logit spread "
                f"{np.ptp(expected[n]):.1f}), argmax {'agrees' if same else 'differs'}"
            )


def gemm_study(in_dim: int = 2048, rows: int = 512, tokens: int = 64) -> None:
    rng = np.random.default_rng(0)
    weight, scales, biases = random_quantized(rng, rows, in_dim, 4)
    codes = unpack_codes(weight, 4).astype(np.float64)
    s = np.repeat(bf16_to_float32(scales).astype(np.float64), 64, axis=-1)
    b = np.repeat(bf16_to_float32(biases).astype(np.float64), 64, axis=-1)
    w = s * codes + b
    x = rng.normal(0, 1, (tokens, in_dim))
    exact = x @ w.T
    scale = np.sqrt(np.mean(exact**2))
    rounding = {
        "fp32": lambda a: a.astype(np.float32).astype(np.float64),
        "half": lambda a: a.astype(np.float16).astype(np.float64),
        "bfloat": lambda a: round_to_bf16(a.astype(np.float32)).astype(np.float64),
    }
    for name, round_ in rounding.items():
        error = np.abs(round_(x) @ round_(w).T - exact)
        print(
            f"one GEMM ({tokens}x{in_dim} by {rows} 4-bit rows), {name:<6} operands: RMS error "
            f"{np.sqrt(np.mean(error**2)) / scale:.1e}, largest {error.max() / scale:.1e} "
            f"(relative to the outputs' RMS)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="demo")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 300])
    args = parser.parse_args()
    gemm_study()
    engine_study(load_checkpoint(resolve_model(args.model)), args.lengths)


if __name__ == "__main__":
    main()
