"""How much an int8 KV cache moves the model's logits, on the tiny checkpoints at long context:
the float64 reference run with its cached keys and values kept exactly (float64), rounded to
bf16 (as the engine's cache holds them today), or rounded through int8 codes with one scale per
row of 256 dims or per group of 64 or 32 dims (`ReferenceModel(kv_int8_group=...)`). It prints,
per checkpoint and prompt length, the error of the cached K and V themselves and, over the
prompt's last positions, each position's largest logit difference from the exact run (median,
90th percentile, max, and how many jump: a rounding can flip a near-tied routing choice of the
MoE, which moves that position's logits discontinuously), and where the argmax changed, next to
bf16's.

Usage:
    python benchmarks/kv_int8_study.py [--tokens 1000] [--last 128] [--checkpoints small wide]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import TINY_SPECS, tiny_checkpoint  # noqa: E402

from lily.checkpoint import load_checkpoint  # noqa: E402
from lily.engine.reference import ReferenceModel  # noqa: E402

VARIANTS = {
    "bf16": dict(bf16_kv_cache=True),
    "int8 per row (256)": dict(kv_int8_group=256),
    "int8 per 64": dict(kv_int8_group=64),
    "int8 per 32": dict(kv_int8_group=32),
}
CHUNK = 512
# A position's logits moving this much is a jump (a flipped near-tied routing choice of the MoE),
# not the steady effect of the rounding.
JUMP = 0.05


def run(model: ReferenceModel, tokens: np.ndarray, last: int):
    state = model.new_state()
    logits = []
    for start in range(0, len(tokens), CHUNK):
        out, state = model.prefill(tokens[start : start + CHUNK], state)
        logits.append(out)
    return np.concatenate(logits)[-last:], state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000])
    parser.add_argument("--last", type=int, default=128, help="positions compared")
    parser.add_argument("--checkpoints", nargs="+", default=list(TINY_SPECS), choices=TINY_SPECS)
    args = parser.parse_args()
    for name in args.checkpoints:
        checkpoint = load_checkpoint(tiny_checkpoint(name))
        config, tensors = checkpoint.config, checkpoint.tensors
        for n in args.tokens:
            rng = np.random.default_rng(n)
            tokens = rng.integers(0, config.vocab_size - 64, n)
            began = time.perf_counter()
            exact, exact_state = run(ReferenceModel(config, tensors, np.float64), tokens, args.last)
            print(
                f"{name}, {n} tokens (exact run {time.perf_counter() - began:.0f} s): "
                f"logits spread {exact.std():.3f}"
            )
            for label, options in VARIANTS.items():
                model = ReferenceModel(config, tensors, np.float64, **options)
                logits, state = run(model, tokens, args.last)
                kv_errors = []
                for layer, keys in state.keys.items():
                    for got, want in (
                        (keys, exact_state.keys[layer]),
                        (state.values[layer], exact_state.values[layer]),
                    ):
                        kv_errors.append(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
                per_position = np.abs(logits - exact).max(axis=1)
                top = np.argsort(exact, axis=1)[:, -2:]
                rows = np.arange(len(exact))
                margin = exact[rows, top[:, 1]] - exact[rows, top[:, 0]]
                changed = np.argmax(logits, axis=1) != top[:, 1]
                print(
                    f"  {label:<20} KV rel. RMS error {max(kv_errors):.2e} | per position max "
                    f"|logit diff|: median {np.median(per_position):.2e}, 90% "
                    f"{np.quantile(per_position, 0.9):.2e}, max {per_position.max():.2e}, "
                    f"{np.sum(per_position > JUMP)} over {JUMP} | argmax changed at "
                    f"{changed.sum()}/{len(exact)} (their top-1/top-2 margins: "
                    f"{np.round(margin[changed], 4).tolist()})"
                )


if __name__ == "__main__":
    main()
