"""One-off check at the real model's dims: run the full-size synthetic checkpoint through the sim
engine for a few tokens and compare with the numpy reference model. Slow (seconds per token on
both sides), so not part of the test suite. Four ways to feed the tokens:

- by default each token goes through the decode step (teacher-forced) and every position is
  compared;
- `--prefill`: the tokens go through the engine as one batched prefill chunk and the last
  position's logits are compared;
- `--context N`: the decode step after a context of N positions that is given rather than fed
  (`lily.diagnostics.seeded_context`: random KV rows in the cache's format and random GDN state,
  handed to the engine's prefix cache and to the reference alike), then the tokens teacher-forced
  after it; feeding 8k tokens would take the sim days;
- `--verify K`: the tokens are a prompt; after it, one speculative verify pass over the first
  generated token and K drafts (arbitrary tokens: the pass's K + 1 rows of logits are computed
  whether they are accepted or not), compared row by row.

The engine keeps its KV cache in bf16, the reference in float32, and 40 layers of random
weights amplify any rounding. So the reference runs three times: as is; with its cache rounded to
bf16 like the engine's; and that again in float64, the yardstick. The engine agrees when its
distance to the float64 reference is of the order of the float32 reference's own. With
`--kv-cache int8` the engine keeps an int8 cache and the second and third references round
theirs through int8 groups of 32 with fp16 scales, as the engine's cache does, instead of bf16.
(A seeded context holds the cache's values on every side; only the rows appended after it
differ between the first reference and the others.)

Usage:
    python benchmarks/make_synthetic_checkpoint.py SYNTH_DIR   # once, ~19.5 GB
    python benchmarks/full_size_check.py SYNTH_DIR [--tokens 4]
    python benchmarks/full_size_check.py SYNTH_DIR --prefill --tokens 64 [--kv-cache int8]
    python benchmarks/full_size_check.py SYNTH_DIR --context 8192 --tokens 2 [--kv-cache int8]
    python benchmarks/full_size_check.py SYNTH_DIR --verify 4 --tokens 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.diagnostics.seeded_context import seed_context
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import kv_cache_bytes_per_token
from lily.engine.prefix_cache import PrefixCache
from lily.engine.reference import ReferenceModel, ReferenceState

# The engine may be this many times further from float64 than the float32 reference is.
NOISE_FACTOR = 2.0


class _OneDraft:
    """Drafts `drafts` once, after the first generated token, then nothing."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.exhausted = False

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        self.exhausted = True
        return self.drafts[:limit]

    def verified(self, drafted: Sequence[int], accepted: int) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--tokens", type=int, default=4, help="tokens fed")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prefill", action="store_true", help="feed them as one prefill chunk")
    mode.add_argument("--context", type=int, default=0, help="after a seeded context this long")
    mode.add_argument("--verify", type=int, default=0, help="a verify pass of this many drafts")
    parser.add_argument("--kv-cache", choices=("bf16", "int8"), default="bf16")
    args = parser.parse_args()
    rounded = (
        {"bf16_kv_cache": True}
        if args.kv_cache == "bf16"
        else {"kv_int8_group": 32, "kv_int8_fp16_scales": True}
    )

    checkpoint = load_checkpoint(args.directory, level="strict")
    config = checkpoint.config
    tokens = [(i * 2654435761) % 2**32 % config.vocab_size for i in range(args.tokens)]
    context = seed_context(config, args.context, args.kv_cache) if args.context else None
    max_seq = args.context + args.tokens + args.verify + 2
    references = {
        "float32, fp32 KV": ReferenceModel(config, checkpoint.tensors),
        f"float32, {args.kv_cache} KV": ReferenceModel(config, checkpoint.tensors, **rounded),
        f"float64, {args.kv_cache} KV": ReferenceModel(
            config, checkpoint.tensors, np.float64, **rounded
        ),
    }

    # A seeded context must fit the prefix cache, whatever the default budget leaves beside
    # 19.5 GB of weights on this machine.
    cache = PrefixCache(1 << 40, kv_cache_bytes_per_token(config, args.kv_cache))
    sim = DeviceEngine(
        checkpoint,
        open_device("sim"),
        max_seq,
        config.vocab_size,
        max(len(tokens), args.verify + 1),
        prefix_cache=cache,
        kv_cache=args.kv_cache,
    )
    start = time.perf_counter()
    fed = tokens
    if args.prefill:
        actual = sim.prompt_logits(tokens)[None]
    elif context is not None:
        context.give_to(sim)
        actual = sim.teacher_forced_logits(context.tokens + tokens, reuse=True)
    elif args.verify:
        drafts = [(t * 7 + 3) % config.vocab_size for t in range(args.verify)]
        stream = sim.generate(tokens, args.verify + 2, drafter=_OneDraft(drafts))
        first_token = next(stream).id  # from the prefill; the next comes from the verify pass
        next(stream)
        stream.close()
        actual = sim._model.verify_logits_view(args.verify + 1).copy()
        fed = [*tokens, first_token, *drafts]
    else:
        actual = sim.teacher_forced_logits(tokens)
    sim_seconds = time.perf_counter() - start
    rows = slice(len(tokens) - 1, None) if args.prefill else slice(len(fed) - len(actual), None)

    expected = {}
    reference_seconds = 0.0
    for name, reference in references.items():
        state: ReferenceState | None = None
        if context is not None:
            state = context.reference_state(reference.dtype)
        start = time.perf_counter()
        expected[name] = reference.prefill(fed, state)[0][rows]
        reference_seconds = reference_seconds or (time.perf_counter() - start) / len(fed)

    print(f"tokens            {fed}")
    if context is not None:
        print(f"after a seeded context of {args.context} positions ({args.kv_cache} KV)")
    print(f"reference         {reference_seconds:.1f} s/token (float32)")
    print(f"sim               {sim_seconds / len(actual):.1f} s per compared row")
    plain, rounded_32, exact = expected.values()
    print(f"logit scale       {np.abs(plain).max():.3f} (max |logit|)")
    for name, reference in expected.items():
        difference = np.abs(actual - reference).max(-1)
        same_argmax = (actual.argmax(-1) == reference.argmax(-1)).tolist()
        print(f"sim vs reference ({name}): max |difference| per row {difference}, ", end="")
        print(f"same argmax {same_argmax}")
    noise = np.abs(rounded_32 - exact).max()
    error = np.abs(actual - exact).max()
    print(f"float32 reference vs float64: {noise:.2e}; sim vs float64: {error:.2e}")
    verdict = "agree" if error <= NOISE_FACTOR * noise else "DISAGREE"
    print(f"verdict: {verdict} (sim within {NOISE_FACTOR}x of float32's own rounding noise)")


if __name__ == "__main__":
    main()
