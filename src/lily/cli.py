"""The `lily` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from lily.api import DEVICES


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a local checkpoint directory, a Hugging Face repo id, or 'demo' (a tiny model with "
        "random weights); default: mlx-community/Qwen3.6-35B-A3B-4bit",
    )
    parser.add_argument("--revision", default=None, help="the repo revision to download")
    parser.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto: metal on Apple silicon, the CPU simulator elsewhere",
    )
    parser.add_argument("--max-seq", type=int, default=None, help="context length in tokens")


def _generate(args: argparse.Namespace) -> int:
    from lily.api import load

    llm = load(args.model, revision=args.revision, device=args.device, max_seq=args.max_seq)
    with llm:
        if args.model == "demo":
            print("[demo model: random weights, the text is meant to be nonsense]", file=sys.stderr)
        start = time.perf_counter()
        print(args.prompt, end="", flush=True)
        for piece in llm.stream(args.prompt, max_tokens=args.max_tokens):
            print(piece, end="", flush=True)
        elapsed = time.perf_counter() - start
        prompt_tokens, generated = llm.last_token_counts
        print()
        print(
            f"[{llm.device}: {prompt_tokens} prompt + {generated} generated tokens in "
            f"{elapsed:.2f} s, {(prompt_tokens + generated) / elapsed:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lily",
        description="Run Qwen3.6-35B-A3B through Lily's hand-written kernels.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a raw prompt (no chat template)")
    _add_model_arguments(generate)
    generate.add_argument("prompt", help="the text to continue")
    generate.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    generate.set_defaults(run=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
