"""Load test for `lily serve`: many concurrent streaming clients on loopback.

Each client has its own prompt and seed. The script first asks every client's question alone,
one after the other (the sequential answers), then all at once as concurrent streams, and checks
that every concurrent client received exactly its sequential answer: a server that interleaved
two requests on the engine, or lost a stream, would fail that. It prints the wall time, the
generated tokens/s over the concurrent phase, time to first content and total latency
percentiles, and how many clients the queue limit turned away with 503.

By default it starts `lily serve --model demo --device sim` itself on a free port (the demo on
the CPU simulator: slow, keep --max-tokens small); `--url` points it at a running server instead.

    python benchmarks/load_test.py                       # 32 clients against the demo on the sim
    python benchmarks/load_test.py --url http://127.0.0.1:8000/v1 --model <served model id>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai


@dataclass
class Outcome:
    text: str = ""
    completion_tokens: int = 0
    first_content_s: float | None = None
    total_s: float = 0.0
    refused: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def spawned_server(args: argparse.Namespace) -> Iterator[str]:
    """`lily serve` in a child process; yields its /v1 URL once /health answers."""
    port = _free_port()
    command = [
        sys.executable, "-m", "lily.cli", "serve", "--model", args.model, "--device", args.device,
        "--port", str(port), "--queue-limit", str(args.queue_limit), "--log-level", "warning",
    ]  # fmt: skip
    if args.max_seq:
        command += ["--max-seq", str(args.max_seq)]
    env = {name: value for name, value in os.environ.items() if name != "LILY_API_KEY"}
    process = subprocess.Popen(command, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"lily serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit("lily serve did not answer /health within 120 s")
            try:
                httpx.get(f"http://127.0.0.1:{port}/health").raise_for_status()
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(30)


async def ask(
    client: openai.AsyncOpenAI, args: argparse.Namespace, prompt: str, seed: int
) -> Outcome:
    outcome = Outcome()
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        pieces = []
        async for chunk in stream:
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if outcome.first_content_s is None:
                        outcome.first_content_s = time.perf_counter() - start
                    pieces.append(choice.delta.content)
        outcome.text = "".join(pieces)
    except openai.APIStatusError as error:
        if error.status_code != 503:
            raise
        outcome.refused = True
    outcome.total_s = time.perf_counter() - start
    return outcome


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    cuts = statistics.quantiles(values, n=20, method="inclusive")
    return f"p50 {statistics.median(values):.2f} s, p95 {cuts[18]:.2f} s, max {max(values):.2f} s"


async def run(url: str, args: argparse.Namespace) -> bool:
    client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=3600)
    prompts = [(f"Client {i}: tell me about the number {i * 7 + 3}.", 1000 + i)
               for i in range(args.clients)]  # fmt: skip
    async with client:
        started = time.perf_counter()
        sequential = [await ask(client, args, prompt, seed) for prompt, seed in prompts]
        sequential_s = time.perf_counter() - started
        print(f"sequential: {args.clients} requests in {sequential_s:.1f} s", flush=True)

        started = time.perf_counter()
        concurrent = await asyncio.gather(*(ask(client, args, p, s) for p, s in prompts))
        wall = time.perf_counter() - started

    served = [(alone, together) for alone, together in zip(sequential, concurrent, strict=True)
              if not together.refused]  # fmt: skip
    matching = sum(alone.text == together.text for alone, together in served)
    tokens = sum(together.completion_tokens for _, together in served)
    refused = args.clients - len(served)
    print(f"concurrent: {args.clients} streaming clients, {len(served)} served, "
          f"{refused} refused with 503 (queue limit)")  # fmt: skip
    print(f"  wall time {wall:.1f} s, {tokens} tokens generated, {tokens / wall:.2f} tokens/s")
    first = [t.first_content_s for _, t in served if t.first_content_s is not None]
    print(f"  time to first content: {_percentiles(first)}")
    print(f"  latency: {_percentiles([t.total_s for _, t in served])}")
    print(f"  answers equal to the sequential run: {matching} of {len(served)}")
    return matching == len(served)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--url", default=None, help="a running server's /v1 URL")
    parser.add_argument("--api-key", default=os.environ.get("LILY_API_KEY") or "none")
    parser.add_argument("--model", default="demo", help="model to spawn / served model id")
    parser.add_argument("--device", default="sim")
    parser.add_argument("--max-seq", type=int, default=256)
    parser.add_argument("--queue-limit", type=int, default=64, help="for the spawned server")
    args = parser.parse_args()
    if args.url:
        ok = asyncio.run(run(args.url, args))
    else:
        with spawned_server(args) as url:
            ok = asyncio.run(run(url, args))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
