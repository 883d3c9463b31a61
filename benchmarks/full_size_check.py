"""One-off check at the real model's dims: run the full-size synthetic checkpoint through the sim
engine for a few tokens and compare with the numpy reference model. Slow (seconds per token on
both sides), so not part of the test suite. With `--prefill`, the tokens go through the engine
as one batched prefill chunk and the last position's logits are compared; otherwise each token
goes through the decode step (teacher-forced) and every position is compared.

The engine keeps its KV cache in bf16, the reference in float32, and 40 layers of random
weights amplify any rounding. So the reference runs three times: as is; with its cache rounded to
bf16 like the engine's; and that again in float64, the yardstick. The engine agrees when its
distance to the float64 reference is of the order of the float32 reference's own. With
`--kv-cache int8` the engine keeps an int8 cache and the second and third references round
theirs through int8 groups of 32 (`kv_int8_group=32`) instead of bf16.

Usage:
    python benchmarks/make_synthetic_checkpoint.py SYNTH_DIR   # once, ~19.5 GB
    python benchmarks/full_size_check.py SYNTH_DIR [--tokens 4]
    python benchmarks/full_size_check.py SYNTH_DIR --prefill --tokens 64 [--kv-cache int8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.engine import DeviceEngine
from lily.engine.reference import ReferenceModel

# The engine may be this many times further from float64 than the float32 reference is.
NOISE_FACTOR = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--tokens", type=int, default=4, help="tokens fed")
    parser.add_argument("--prefill", action="store_true", help="feed them as one prefill chunk")
    parser.add_argument("--kv-cache", choices=("bf16", "int8"), default="bf16")
    args = parser.parse_args()
    rounded = {"bf16_kv_cache": True} if args.kv_cache == "bf16" else {"kv_int8_group": 32}

    checkpoint = load_checkpoint(args.directory, level="strict")
    config = checkpoint.config
    tokens = [(i * 2654435761) % 2**32 % config.vocab_size for i in range(args.tokens)]
    max_seq = args.tokens + 1

    start = time.perf_counter()
    expected, _ = ReferenceModel(config, checkpoint.tensors).prefill(tokens)
    reference_seconds = time.perf_counter() - start
    bf16_cache, _ = ReferenceModel(config, checkpoint.tensors, **rounded).prefill(tokens)
    exact, _ = ReferenceModel(config, checkpoint.tensors, np.float64, **rounded).prefill(tokens)

    sim = DeviceEngine(
        checkpoint,
        open_device("sim"),
        max_seq,
        config.vocab_size,
        len(tokens),
        kv_cache=args.kv_cache,
    )
    start = time.perf_counter()
    if args.prefill:
        actual = sim.prompt_logits(tokens)[None]
        expected, bf16_cache, exact = expected[-1:], bf16_cache[-1:], exact[-1:]
    else:
        actual = sim.teacher_forced_logits(tokens)
    sim_seconds = time.perf_counter() - start

    print(f"tokens            {tokens}")
    print(f"reference         {reference_seconds / len(tokens):.1f} s/token")
    print(f"sim               {sim_seconds / len(tokens):.1f} s/token")
    print(f"logit scale       {np.abs(expected).max():.3f} (max |logit|)")
    for name, reference in (
        ("float32, fp32 KV", expected),
        (f"float32, {args.kv_cache} KV", bf16_cache),
        (f"float64, {args.kv_cache} KV", exact),
    ):
        difference = np.abs(actual - reference).max(-1)
        same_argmax = (actual.argmax(-1) == reference.argmax(-1)).tolist()
        print(f"sim vs reference ({name}): max |difference| per token {difference}, ", end="")
        print(f"same argmax {same_argmax}")
    noise = np.abs(bf16_cache - exact).max()
    error = np.abs(actual - exact).max()
    print(f"float32 reference vs float64: {noise:.2e}; sim vs float64: {error:.2e}")
    verdict = "agree" if error <= NOISE_FACTOR * noise else "DISAGREE"
    print(f"verdict: {verdict} (sim within {NOISE_FACTOR}x of float32's own rounding noise)")


if __name__ == "__main__":
    main()
