"""Predicted Outputs on the sim: for a few chat requests, the time with a `prediction` equal to
the answer against the time without one, and how much of the prediction the drafting kept.

Each prompt is first answered without a prediction (that run also records the graphs); its
answer is then the prediction. The timed runs alternate without / with (`--runs` of each, the
order swapped every round so that a trend in the machine's load falls on both arms alike), on
one loaded model, and the medians are compared. Every run must give the first answer: drafting
never changes it. Per prompt it prints:

- appeared: OpenAI's `accepted_prediction_tokens` over the prediction's tokens (its tokens
  every character of which lined up with the answer);
- kept: the reply's tokens that came from accepted drafts, over the reply's tokens after the
  first (which the prompt's pass draws before anything can be drafted), and the drafts kept
  over the drafts made;
- verify passes and host waits (synchronous runs and waits for submitted work) of the last run
  with the prediction;
- the median seconds without and with, and their ratio; then the same for the CPU seconds the
  process spent (the sim's threads included), which a machine shared with other work
  disturbs less than the wall clock (the wall clock also counts the overlap of host and
  device that plain decoding's pipelining buys, the CPU seconds do not).

The sim runs the kernels on the CPU, where a verify pass costs its arithmetic (one of 4 drafts
about 2.75 decode steps, docs/benchmarks.md), so the ratio here says what the passes the
drafting saved are worth on this machine, not what they are worth on a Mac, where a pass of a
few tokens costs about a decode step (reading the weights).

Usage:
    python benchmarks/bench_prediction.py [--model demo] [--tokens 48] [--draft-tokens 4]
        [--speculative auto] [--runs 3] [--message TEXT ...]

The demo's random model writes bytes that are not UTF-8 (the answer shows them as U+FFFD, and
the prediction's text no longer holds them) and spells some text in other tokens than the
tokenizer would: "Write a poem about the sea." gets 48 tokens with 3 such bytes and 5 such
spellings ("-t" + "patch" where the tokenizer has "-" + "tp" + "atch"), "Hi" 2 bytes and one
spelling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

from bench_speculative import count_round_trips

import lily

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = (
    "Hi",
    "Write a poem about the sea.",
    "Explain recursion in one paragraph.",
    "def add(a, b):",
)


def timed(
    llm: lily.Lily, params: dict[str, Any], counts: Counter
) -> tuple[tuple[float, float], Any]:
    """((wall seconds, CPU seconds of this process), the response) of one request."""
    counts.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    response = llm.chat.completions.create(**params)
    return (time.perf_counter() - wall, time.process_time() - cpu), response


def compare(llm: lily.Lily, params: dict[str, Any], runs: int, counts: Counter) -> str:
    """One prompt's line: its answer taken as the prediction, `runs` timed runs without and
    with it, alternated."""
    answer = llm.chat.completions.create(**params).choices[0].message
    predicted = {**params, "prediction": {"type": "content", "content": answer.content}}
    seconds: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for run in range(runs):
        for arm in ("without", "with") if run % 2 == 0 else ("with", "without"):
            took, response = timed(llm, params if arm == "without" else predicted, counts)
            if response.choices[0].message != answer:
                raise SystemExit(f"the answer {arm} a prediction differs: {params['messages']}")
            seconds[arm].append(took)
            if arm == "with":
                last, waits = response, dict(counts)
                stats = llm.chat.completions.last_stats
    details = last.usage.completion_tokens_details
    appeared = details.accepted_prediction_tokens
    total = appeared + details.rejected_prediction_tokens
    after_first = last.usage.completion_tokens - 1
    (without, cpu_without), (with_, cpu_with) = (
        [statistics.median(run[i] for run in seconds[arm]) for i in (0, 1)]
        for arm in ("without", "with")
    )
    return (
        f"appeared {appeared}/{total} ({appeared / total:.0%}), kept "
        f"{stats.accepted_drafts}/{after_first} reply tokens "
        f"({stats.accepted_drafts / after_first:.0%}; {stats.accepted_drafts} of "
        f"{stats.drafted_tokens} drafts), {waits.get('verify passes', 0)} verify passes, "
        f"{waits.get('runs', 0)} host waits; without {without:.2f} s, with {with_:.2f} s: "
        f"{with_ / without:.2f}x (CPU {cpu_without:.2f} s, {cpu_with:.2f} s: "
        f"{cpu_with / cpu_without:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of each request")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--speculative", default="auto", choices=("auto", "mtp", "ngram"))
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each arm")
    parser.add_argument("--message", nargs="+", default=MESSAGES, help="the user messages")
    args = parser.parse_args()
    counts: Counter = Counter()
    count_round_trips(counts)
    with lily.load(
        args.model,
        device="sim",
        max_seq=512,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
    ) as llm:
        print(
            f"model {args.model} on the sim, speculative {args.speculative}, "
            f"{args.tokens} tokens, k = {args.draft_tokens}, medians of {args.runs} runs each"
        )
        for message in args.message:
            params = dict(
                messages=[{"role": "user", "content": message}],
                max_tokens=args.tokens,
                temperature=0,
                **NO_THINKING,
            )
            print(f"  {message!r}: {compare(llm, params, args.runs, counts)}", flush=True)


if __name__ == "__main__":
    main()
