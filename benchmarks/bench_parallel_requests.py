"""4 demo chat requests one after another against the same 4 at once (threads sharing a model
loaded with `parallel=4`: continuous batching, `lily.engine.scheduler`), on the sim. One run
each, both timed; prints the times, their ratio and whether every answer is the same. Each
request generates `--max-tokens` (48, as the README's first command asks of the demo). Both
models are loaded with `speculative="off"`, so that the two runs differ in batching alone (with
drafting on, a request that starts before the others arrive drafts alone first: `--lone`
measures that path).

With `--lone`: one request alone on a model loaded with `parallel=4` (where a lone request
drafts, then moves into a batch slot when another arrives), with `speculative="auto"` against
`"off"`, the two alternated `--rounds` times (the machine may be shared: alternating spreads
its load over both); prints each run's time and whether the answers are the same.

With `--overlap`: a long request (`--long-tokens`) streamed on a model loaded with
`parallel=2` and `--speculative`, joined after its first tokens by one short request
(`--short-tokens`); once the short one ends, the long one is alone in its batch slot. Timed with
the way back to drafting (`scheduler.REDRAFT_MIN_TOKENS` as shipped) and without it (the
threshold out of reach, so it stays batched), the two alternated `--rounds` times on one
loaded model; prints each run's time, the long answer's drafted and accepted tokens, how many
times it moved back, and whether the answers are the same.

The sim is a CPU: the ratio says how much work batching saves, not how fast a Mac is. The CPU
time the process spent is printed beside each wall time: on a machine other work shares, the
wall times stretch with its load (and the batched run's more, its threads handing tokens to
each other), the CPU times much less.

    python benchmarks/bench_parallel_requests.py [--max-tokens 48] [--parallel 4]
    python benchmarks/bench_parallel_requests.py --lone [--rounds 3] [--max-tokens 48]
    python benchmarks/bench_parallel_requests.py --overlap [--rounds 3] [--long-tokens 96]
        [--short-tokens 4] [--speculative ngram]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import lily
from lily.engine import scheduler
from lily.engine.batch import BatchedDecoder

PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What is a hash map?",
    "Say hello in French.",
    "Name a color.",
    "Explain recursion briefly.",
    "What is 2 + 2?",
    "Describe a cat.",
]


def lone_request(request: Callable[[lily.Lily, str], Any], parallel: int, rounds: int) -> None:
    """One request at a time on a batching model, drafting ("auto") against not ("off")."""
    prompt = PROMPTS[0]
    times: dict[str, list[float]] = {"auto": [], "off": []}
    drafts: list[tuple[int, int]] = []  # each "auto" run's (drafted, accepted)
    answers: dict[str, Any] = {}
    models = {
        mode: lily.load("demo", device="sim", parallel=parallel, speculative=mode) for mode in times
    }
    try:
        for llm in models.values():
            request(llm, "warm up")
        for _ in range(rounds):
            for mode, llm in models.items():
                start = time.perf_counter()
                answers[mode] = request(llm, prompt)
                times[mode].append(time.perf_counter() - start)
                stats = llm.chat.completions.last_stats
                if mode == "auto" and stats is not None:
                    drafts.append((stats.drafted_tokens, stats.accepted_drafts))
    finally:
        for llm in models.values():
            llm.close()
    print(f"one demo chat request alone on parallel={parallel}, {rounds} alternated rounds:")
    for mode, measured in times.items():
        runs = ", ".join(f"{t:.2f}" for t in measured)
        print(f"  speculative {mode}: {runs} s (best {min(measured):.2f} s)")
    print(f"  auto's (drafted, accepted) tokens per run: {drafts}")
    print(f"  same answer: {answers['auto'] == answers['off']}")


def overlap(long_tokens: int, short_tokens: int, speculative: str, rounds: int) -> None:
    """A long streamed request joined by a short one, with the way back to drafting and
    without, alternated on one model."""
    returns = [0]
    leave = BatchedDecoder.leave_to_engine

    def counted(self: BatchedDecoder, stream: int) -> None:
        returns[0] += 1
        leave(self, stream)

    BatchedDecoder.leave_to_engine = counted  # type: ignore[method-assign]
    shipped = scheduler.REDRAFT_MIN_TOKENS
    modes = {"way back": shipped, "stays batched": 1 << 30}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    runs: dict[str, list[tuple[int, int, int]]] = {mode: [] for mode in modes}
    answers: dict[str, set[str]] = {mode: set() for mode in modes}

    def ask(llm: lily.Lily, prompt: str, tokens: int, **more: Any) -> Any:
        messages = [{"role": "user", "content": prompt}]
        return llm.chat.completions.create(
            model="demo", messages=messages, max_tokens=tokens, temperature=0, **more
        )

    with lily.load("demo", device="sim", parallel=2, speculative=speculative) as llm:
        ask(llm, "warm up", 8)
        for _ in range(rounds):
            for mode, threshold in modes.items():
                scheduler.REDRAFT_MIN_TOKENS = threshold
                returns[0] = 0
                start = time.perf_counter()
                chunks = ask(llm, PROMPTS[5], long_tokens, stream=True)
                streamed = list(itertools.islice(chunks, 4))
                short = threading.Thread(target=ask, args=(llm, PROMPTS[6], short_tokens))
                short.start()
                streamed += list(chunks)
                short.join()
                times[mode].append(time.perf_counter() - start)
                text = "".join(
                    (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or "")
                    for chunk in streamed
                    for c in chunk.choices
                )
                answers[mode].add(text)
                stats = llm.chat.completions.last_stats  # the long one's: it ends last
                assert stats is not None
                runs[mode].append((stats.drafted_tokens, stats.accepted_drafts, returns[0]))
    scheduler.REDRAFT_MIN_TOKENS = shipped
    BatchedDecoder.leave_to_engine = leave  # type: ignore[method-assign]
    print(
        f"a {long_tokens}-token demo request joined by a {short_tokens}-token one, parallel=2, "
        f"speculative={speculative}, {rounds} alternated rounds on the sim:"
    )
    for mode, measured in times.items():
        listed = ", ".join(f"{t:.2f}" for t in measured)
        print(f"  {mode}: {listed} s (best {min(measured):.2f} s)")
        print(f"    (drafted, accepted, moves back) per run: {runs[mode]}")
    same = len(answers["way back"] | answers["stays batched"]) == 1
    print(f"  same long answer in every run: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--lone", action="store_true", help="one request, drafting vs not")
    parser.add_argument("--overlap", action="store_true", help="a long request joined by a short")
    parser.add_argument("--long-tokens", type=int, default=96)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--speculative", default="ngram")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.overlap:
        overlap(args.long_tokens, args.short_tokens, args.speculative, args.rounds)
        return
    prompts = PROMPTS[: args.parallel]

    def request(llm: lily.Lily, prompt: str) -> Any:
        answer = llm.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=args.max_tokens,
            temperature=0,
        )
        message = answer.choices[0].message
        return message.content, message.reasoning_content, answer.usage.completion_tokens

    if args.lone:
        lone_request(request, args.parallel, args.rounds)
        return

    with lily.load("demo", device="sim", speculative="off") as llm:
        request(llm, "warm up")
        start, cpu = time.perf_counter(), time.process_time()
        alone = [request(llm, p) for p in prompts]
        sequential = time.perf_counter() - start
        sequential_cpu = time.process_time() - cpu
    with lily.load("demo", device="sim", parallel=args.parallel, speculative="off") as llm:
        request(llm, "warm up")
        together: list[Any] = [None] * len(prompts)

        def ask(i: int) -> None:
            together[i] = request(llm, prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        start, cpu = time.perf_counter(), time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batched = time.perf_counter() - start
        batched_cpu = time.process_time() - cpu
    tokens = sum(a[2] for a in alone)
    print(f"{len(prompts)} demo chat requests, {tokens} tokens generated in all, on the sim:")
    print(
        f"  one after another (parallel=1, speculative off): {sequential:.2f} s "
        f"({sequential_cpu:.2f} s of CPU)"
    )
    print(
        f"  at once (parallel={args.parallel}, speculative off):      {batched:.2f} s "
        f"({batched_cpu:.2f} s of CPU)"
    )
    print(
        f"  ratio: {batched / sequential:.2f}x ({batched_cpu / sequential_cpu:.2f}x of CPU); "
        f"same answers: {together == alone}"
    )


if __name__ == "__main__":
    main()
