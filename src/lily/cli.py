"""The `lily` command line: chat, generate, serve, bench, info.

Every command that runs a model takes the same model arguments (`--model`, `--revision`,
`--device`, `--max-seq`). Heavy imports (numpy, the native module, uvicorn) happen inside the
commands so that `lily --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from lily.api import DEFAULT_MAX_SEQ, DEVICES
from lily.chat.completions import AUTO_REASONING_BUDGET
from lily.engine.model_graph import MAX_DRAFT_TOKENS, PREFILL_CHUNKS
from lily.engine.prefix_cache import CacheOptions
from lily.engine.prefix_disk import DEFAULT_DISK_BYTES, DEFAULT_MIN_TOKENS
from lily.engine.speculative import DEFAULT_DRAFT_TOKENS, SPECULATIVE_MODES, check_speculative
from lily.kernels.attention import KV_CACHE_TYPES

if TYPE_CHECKING:
    from lily.api import Lily

# What a user can fix, reported as one line instead of a traceback: Lily raises a ValueError
# subclass for every bad argument, checkpoint, config, tokenizer or request, MemoryError for a
# model too big for the GPU, and files and the network fail with OSError. (LILY_DEBUG=1 shows
# the traceback.)
USER_ERRORS = (ValueError, MemoryError, OSError)
DEMO_NOTE = "[demo model: random weights, the text is meant to be nonsense]"
# The benchmark contract (product.md): exactly this many measured decode steps per arm.
BENCH_DECODE_STEPS = 64
BENCH_CONTEXTS_HELP = (
    "prompt lengths in tokens, one arm each (several run each in a fresh process); the contract "
    "uses 256..131072 on the real model, keep it small on the CPU simulator"
)


def _whole_number(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def _speculative_mode(text: str) -> str:
    try:
        check_speculative(text, DEFAULT_DRAFT_TOKENS)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2 (0 is greedy), got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line on stderr, with where to look, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default, except where there is none to show (the help of an option
    whose default is None says what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _add_model_arguments(parser: argparse.ArgumentParser, *, default_model: str | None) -> None:
    shown = default_model or "mlx-community/Qwen3.6-35B-A3B-4bit"
    parser.add_argument(
        "--model",
        default=default_model,
        help="a local checkpoint directory, a Hugging Face repo id, or 'demo' (a tiny model with "
        f"random weights that runs anywhere); default: {shown}",
    )
    parser.add_argument(
        "--revision", default=None, help="the repo revision to download (default: pinned)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto: metal on Apple silicon, the CPU simulator elsewhere; reference: the numpy "
        "model (slow, for checking)",
    )
    parser.add_argument(
        "--max-seq",
        type=_positive_int,
        default=None,
        help=f"context length in tokens (default: {DEFAULT_MAX_SEQ}, or the model's maximum if "
        "smaller)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=_positive_int,
        default=None,
        help="most prompt tokens per prefill pass (default: the longest of "
        f"{', '.join(map(str, PREFILL_CHUNKS))} that the memory allows)",
    )
    parser.add_argument(
        "--kv-cache",
        default="bf16",
        choices=KV_CACHE_TYPES,
        help="the KV cache's format: bf16, or int8 (codes with an fp16 scale per 32 dims: 53%% "
        "of the memory, a slightly less exact cache; not with --device reference)",
    )


def _add_speculative_arguments(
    parser: argparse.ArgumentParser, default: str = "auto", help: str | None = None
) -> None:
    parser.add_argument(
        "--speculative",
        default=default,
        type=_speculative_mode,
        metavar="{" + ",".join(SPECULATIVE_MODES) + "}",
        help=help
        or "speculative decoding, same output either way: auto (the checkpoint's MTP head, "
        "else prompt lookup, where it pays, and requests' predictions), mtp (the head always), "
        "ngram (prompt lookup always), dflash (the DFlash block drafter always), off",
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=DEFAULT_DRAFT_TOKENS,
        choices=range(1, MAX_DRAFT_TOKENS + 1),
        metavar=f"1..{MAX_DRAFT_TOKENS}",
        help="most drafted tokens one verify pass checks",
    )


def _load(
    args: argparse.Namespace, max_seq: int | None = None, cache_memory: int | None = None
) -> Lily:
    from lily.api import load

    llm = load(
        args.model,
        revision=args.revision,
        device=args.device,
        max_seq=max_seq or args.max_seq,
        prefill_chunk=args.prefill_chunk,
        cache_memory=cache_memory,
        speculative=getattr(args, "speculative", "off"),
        draft_tokens=getattr(args, "draft_tokens", DEFAULT_DRAFT_TOKENS),
        kv_cache=args.kv_cache,
    )
    if args.model == "demo":
        print(DEMO_NOTE, file=sys.stderr)
    return llm


# --- generate ---------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    with _load(args) as llm:
        start = time.perf_counter()
        # The prompt is echoed once it is fed: the progress line would overwrite it.
        echoed = False
        for piece in llm.stream(
            args.prompt, max_tokens=args.max_tokens, progress=_prefill_progress()
        ):
            if not echoed:
                print(args.prompt, end="", flush=True)
                echoed = True
            print(piece, end="", flush=True)
        if not echoed:
            print(args.prompt, end="", flush=True)
        elapsed = time.perf_counter() - start
        prompt_tokens, generated = llm.last_token_counts
        print()
        print(
            f"[{llm.device}: {prompt_tokens} prompt + {generated} generated tokens in "
            f"{elapsed:.2f} s, {generated / elapsed:.1f} generated tokens/s]",
            file=sys.stderr,
        )
    return 0


# --- chat -------------------------------------------------------------------------------------

CHAT_HELP = (
    "commands: /image PATH attaches an image to your next message, /reset forgets the "
    "conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops a reply"
)
# A line that is one word after a slash is a command, never a message ("/usr/bin is..." is one).
CHAT_COMMAND = re.compile(r"/[A-Za-z]+")


class PrefillProgress:
    """A `progress` callback that shows `[prompt: fed/total tokens]` on one line of `out` once
    feeding a prompt has taken `after` seconds (the simulator needs minutes for a few thousand
    tokens), and erases it when the prompt is fed."""

    def __init__(self, out: IO[str], *, after: float = 1.0):
        self.out = out
        self.after = after
        self.started = time.perf_counter()
        self.shown = False

    def __call__(self, fed: int, total: int) -> None:
        if fed >= total:
            if self.shown:
                self.out.write("\r\033[K")  # erase the line
                self.out.flush()
                self.shown = False
            return
        if time.perf_counter() - self.started >= self.after:
            self.out.write(f"\r[prompt: {fed}/{total} tokens]")
            self.out.flush()
            self.shown = True


def _prefill_progress() -> PrefillProgress | None:
    """A progress line on stderr, when it is a terminal."""
    return PrefillProgress(sys.stderr) if sys.stderr.isatty() else None


class ChatSession:
    """An interactive conversation: keeps the history, streams each reply to `out`.

    Ctrl-C (KeyboardInterrupt) while a reply streams closes the generation (the engine stops
    within one token) and keeps what was shown as the assistant's turn; the chat goes on.
    """

    def __init__(
        self,
        llm: Lily,
        out: IO[str],
        *,
        system: str | None = None,
        request: dict[str, Any] | None = None,
        images: Sequence[Path] = (),
    ):
        self.llm = llm
        self.out = out
        self.system = system
        self.request = request or {}
        self.history: list[dict[str, Any]] = []
        # Images attached to the next message (`--image`, `/image PATH`), as file URLs.
        self.images = [path.resolve().as_uri() for path in images]
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def handle(self, line: str) -> bool:
        """Acts on one line of input; False when the user asked to leave."""
        text = line.strip()
        if not text:
            return True
        if text in ("/exit", "/quit"):
            return False
        if text.startswith("/image ") or text == "/image":
            self.attach(Path(text[len("/image") :].strip()).expanduser())
            return True
        if text == "/reset":
            self.reset()
            self.out.write("[conversation forgotten]\n")
        elif text == "/help":
            self.out.write(CHAT_HELP + "\n")
        elif CHAT_COMMAND.fullmatch(text):
            self.out.write(f"[unknown command {text}; {CHAT_HELP}]\n")
        else:
            self.reply(text)
        return True

    def attach(self, path: Path) -> None:
        if not path.is_file():
            self.out.write(f"[no image file {str(path)!r}]\n")
            return
        self.images.append(path.resolve().as_uri())
        self.out.write(f"[image {path.name} goes with your next message]\n")

    def reply(self, text: str) -> None:
        content: Any = text
        if self.images:
            content = [
                *({"type": "image_url", "image_url": {"url": url}} for url in self.images),
                {"type": "text", "text": text},
            ]
            self.images = []
        self.history.append({"role": "user", "content": content})
        start = time.perf_counter()
        stream = self.llm.chat.completions.create(
            messages=self.history,
            stream=True,
            stream_options={"include_usage": True},
            progress=_prefill_progress(),
            **self.request,
        )
        answer: list[str] = []
        thinking = False
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    self.out.write("\n" + _reply_stats(chunk.usage, time.perf_counter() - start))
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                if delta.reasoning_content:
                    if not thinking:
                        self.out.write("[thinking] ")
                        thinking = True
                    self.out.write(delta.reasoning_content)
                if delta.content:
                    if thinking:
                        self.out.write("\n[answer] ")
                        thinking = False
                    answer.append(delta.content)
                    self.out.write(delta.content)
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        finally:
            stream.close()
            self.out.write("\n")
            self.out.flush()
        if answer:
            self.history.append({"role": "assistant", "content": "".join(answer)})
        else:
            # Stopped (or out of tokens) while still thinking: an empty assistant turn would
            # teach the model to answer nothing, so the exchange is left out of the history.
            self.history.pop()
            self.out.write("[no answer yet: this message is not kept in the conversation]\n")


def _reply_stats(usage: Any, elapsed: float) -> str:
    """Token counts, and the rate of generated tokens over the time the reply took."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return (
        f"[{usage.prompt_tokens} prompt ({cached} cached) + {usage.completion_tokens} generated "
        f"tokens in {elapsed:.2f} s: {usage.completion_tokens / elapsed:.1f} generated tokens/s]"
    )


def _read_lines(prompt: str) -> Iterator[str]:
    """Input lines until end of input; Ctrl-C at the prompt only cancels that line."""
    while True:
        try:
            yield input(prompt)
        except EOFError:
            return
        except KeyboardInterrupt:
            print("\n" + CHAT_HELP, file=sys.stderr)


def _chat_request(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        request["temperature"] = args.temperature
    if args.seed is not None:
        request["seed"] = args.seed
    if args.no_thinking:
        request["reasoning_effort"] = "none"
    if args.reasoning_budget is not None:
        request["reasoning_budget"] = args.reasoning_budget
    return request


def _chat(args: argparse.Namespace) -> int:
    from lily.errors import RequestError

    with _load(args) as llm:
        session = ChatSession(
            llm, sys.stdout, system=args.system, request=_chat_request(args), images=args.image
        )
        print(f"[{llm.model_id} on {llm.device}; {CHAT_HELP}]", file=sys.stderr)
        prompt = "> " if sys.stdin.isatty() else ""
        for line in _read_lines(prompt):
            try:
                if not session.handle(line):
                    break
            except RequestError as exc:
                # E.g. the conversation outgrew the context: say so and let the user /reset.
                session.history.pop()
                print(f"[error: {exc.message}]", file=sys.stderr)
    return 0


# --- serve ------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from lily.chat.request_limits import RequestLimits
    from lily.server.api_key import APIKeyError
    from lily.server.app import PortInUseError, serve
    from lily.server.routes import ModelNames

    try:
        serve(
            args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            api_key_file=args.api_key_file,
            allowed_hosts=args.allowed_host,
            cors_origins=args.cors_origin,
            device=args.device,
            revision=args.revision,
            max_seq=args.max_seq,
            prefill_chunk=args.prefill_chunk,
            queue_limit=args.queue_limit,
            default_max_tokens=args.default_max_tokens,
            default_reasoning_budget=args.reasoning_budget,
            shutdown_grace=args.shutdown_grace,
            log_level=args.log_level,
            escape_special_tokens=args.escape_special_tokens,
            speculative=args.speculative,
            draft_tokens=args.draft_tokens,
            kv_cache=args.kv_cache,
            limits=RequestLimits(
                max_messages=args.max_messages,
                max_tools=args.max_tools,
                max_tool_calls=args.max_tool_calls,
                max_grammar_bytes=args.max_grammar_bytes,
                max_json_values=args.max_json_values,
            ),
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            model_names=ModelNames(tuple(args.served_model_name), strict=args.strict_model_id),
            open_model_list=args.open_model_list,
            open_metrics=args.open_metrics,
            fetch_images=args.fetch_images,
            max_body_bytes=args.max_body_bytes,
            parallel=args.parallel,
            cache=CacheOptions(
                args.cache_memory, args.cache_dir, args.cache_disk_size, args.cache_disk_min_tokens
            ),
        )
    except APIKeyError as exc:
        print(f"lily serve: error: {exc}", file=sys.stderr)
        return 2
    except PortInUseError as exc:
        print(f"lily serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _image_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no image file {text!r}")
    return path


def _reasoning_budget(text: str) -> int | str | None:
    if text.lower() == "none":
        return None
    if text.lower() == AUTO_REASONING_BUDGET:
        return AUTO_REASONING_BUDGET
    return _whole_number(text, 0)


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _byte_size(text: str) -> int:
    """A size in bytes: an integer, or a number with a unit (KB, MB, GB, TB; KiB, ..., TiB;
    K, M, G, T are binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 500MB)")
    number, unit, binary, suffix = match.groups()
    if unit and (binary or not suffix):
        scale = 1024 ** "kmgt".index(unit) * 1024
    else:
        scale = _BYTE_UNITS[unit]
    return int(float(number) * scale)


def _positive_byte_size(text: str) -> int:
    size = _byte_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def _cors_origin(text: str) -> str:
    from lily.server.http_guard import normalized_origin

    try:
        return normalized_origin(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _allowed_host(text: str) -> str:
    from lily.server.http_guard import ANY_HOST, host_name

    name = text if text == ANY_HOST else host_name(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name")
    return name


# --- bench ------------------------------------------------------------------------------------


def synthetic_prompt(length: int, vocab_size: int) -> list[int]:
    """The benchmark contract's prompt: token i = ((i * 2654435761) mod 2^32) mod vocab."""
    return [((i * 2654435761) % 2**32) % vocab_size for i in range(length)]


def measure(
    llm: Lily, context: int, progress: Callable[[str], None] = lambda stage: None
) -> dict[str, Any]:
    """One arm: an exact-shape warm-up, then one measured prefill (until the first token is
    delivered, with the next step already submitted) and exactly 64 measured greedy decode
    steps. No stop tokens: every step counts. `progress` hears of each stage as it starts
    (outside the measured spans). Under `llm.speculative` other than "off" the decode drafts
    as `Lily` generations do (the same `Lily.speculation`/`Lily.drafter`), still delivering
    exactly 64 tokens, and the arm adds the drafting's counts."""
    prompt = synthetic_prompt(context, llm.config.vocab_size)
    steps = BENCH_DECODE_STEPS + 1  # the prefill's token, then the measured decode steps
    progress(f"warm-up: prefill {context} tokens, {BENCH_DECODE_STEPS} decode steps")
    # The warm-up drafts too, so that the verify passes' shapes are warm as well; each run gets
    # a fresh speculation, so the counts are the measured run's alone.
    drafter = llm.drafter(llm.speculation())
    for _ in llm.engine.generate(prompt, steps, drafter=drafter):
        pass
    progress(f"measuring: prefill {context} tokens, {BENCH_DECODE_STEPS} decode steps")
    speculation = llm.speculation()
    drafter = llm.drafter(speculation)
    start = time.perf_counter()
    tokens = llm.engine.generate(prompt, steps, drafter=drafter)
    next(tokens)
    first_token = time.perf_counter()
    decoded = sum(1 for _ in tokens)
    end = time.perf_counter()
    if decoded != BENCH_DECODE_STEPS:
        raise RuntimeError(f"decoded {decoded} steps instead of {BENCH_DECODE_STEPS}")
    prefill_s, decode_s = first_token - start, end - first_token
    arm: dict[str, Any] = {
        "context": context,
        "prefill_s": prefill_s,
        "prefill_tok_s": context / prefill_s,
        "decode_steps": decoded,
        "decode_s": decode_s,
        "decode_tok_s": decoded / decode_s,
    }
    if llm.speculative == "off":
        return arm  # the contract's keys alone, as before speculative decoding existed
    total = speculation.total
    # A verify pass yields its accepted drafts plus one token of the model's.
    return {
        **arm,
        "speculative": llm.speculative,
        "draft_tokens": llm.draft_tokens,
        "verify_passes": total.passes,
        "drafted": total.drafted,
        "accepted": total.accepted,
        "acceptance_rate": total.accepted / total.drafted if total.drafted else None,
        "tokens_per_verify_pass": (
            (total.accepted + total.passes) / total.passes if total.passes else None
        ),
    }


def _print_arm(arm: dict[str, Any], device: str) -> None:
    line = (
        f"{device} context {arm['context']}: prefill {arm['prefill_tok_s']:.1f} tok/s "
        f"({arm['prefill_s']:.3f} s), decode {arm['decode_tok_s']:.1f} tok/s "
        f"({arm['decode_steps']} steps in {arm['decode_s']:.3f} s)"
    )
    if "speculative" in arm:
        rate, per_pass = arm["acceptance_rate"], arm["tokens_per_verify_pass"]
        line += (
            f"\n  speculative {arm['speculative']} (draft tokens {arm['draft_tokens']}): "
            f"{arm['decode_tok_s']:.1f} delivered tok/s, {arm['accepted']} of "
            f"{arm['drafted']} drafted tokens accepted"
            f" ({'n/a' if rate is None else f'{rate:.1%}'}), "
            f"{'n/a' if per_pass is None else f'{per_pass:.2f}'} tokens per verify pass "
            f"({arm['verify_passes']} passes)"
        )
    print(line, flush=True)


def _model_arguments_of(args: argparse.Namespace) -> list[str]:
    argv = ["--device", args.device, "--kv-cache", args.kv_cache]
    if args.prefill_chunk is not None:
        argv += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.revision is not None:
        argv += ["--revision", args.revision]
    return argv


def _bench(args: argparse.Namespace) -> int:
    if len(args.context) > 1:
        # The contract wants a fresh process per arm: nothing warm carries over between arms.
        for context in args.context:
            argv = ["bench", "--context", str(context), *_model_arguments_of(args)]
            argv += ["--speculative", args.speculative, "--draft-tokens", str(args.draft_tokens)]
            if args.json:
                argv.append("--json")
            done = subprocess.run([sys.executable, "-m", "lily.cli", *argv], check=False)
            if done.returncode != 0:
                return done.returncode
        return 0
    (context,) = args.context

    def progress(stage: str) -> None:
        # On stderr, so that stdout stays one result (one JSON object with --json) per arm.
        print(f"[bench context {context}: {stage}...]", file=sys.stderr, flush=True)

    progress("loading the model")
    max_seq = max(args.max_seq or 0, context + BENCH_DECODE_STEPS + 1)
    # No prefix cache: the measured prefill must not resume from the warm-up's states.
    with _load(args, max_seq=max_seq, cache_memory=0) as llm:
        arm = measure(llm, context, progress)
        if args.json:
            print(json.dumps({"device": llm.device, **arm}), flush=True)
        else:
            _print_arm(arm, llm.device)
    return 0


# --- info -------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _gpu_lines() -> list[str]:
    from lily import _native
    from lily.api import resolve_device

    lines = [f"device (auto):   {resolve_device('auto')}"]
    if not hasattr(_native, "metal_device_info"):
        lines.append("metal:           not in this build (Apple silicon and macOS only)")
        return lines
    try:
        info = _native.metal_device_info()
    except RuntimeError as exc:
        return [*lines, f"metal:           unavailable ({exc})"]
    cores = info.get("gpu_core_count", 0)
    core_text = f", {cores} cores" if cores else ""
    lines.append(f"gpu:             {info['name']}, family {info['gpu_family']}{core_text}")
    lines.append(f"macOS:           {info['os_version']}")
    if info.get("recommended_working_set"):
        lines.append(f"gpu working set: {_gib(info['recommended_working_set'])} recommended")
    if not info.get("supported", True):
        lines.append(f"metal:           cannot run Lily's kernels: {info['unsupported_reason']}")
    return lines


def _info(args: argparse.Namespace) -> int:
    from lily.checkpoint.demo import demo_status
    from lily.checkpoint.loader import default_checkpoint_status
    from lily.device import physical_memory
    from lily.diagnostics.preflight import kv_cache_summary
    from lily.version import __version__

    memory = physical_memory()
    lines = [
        f"lily:            {__version__}",
        f"python:          {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"memory:          {_gib(memory) if memory else 'unknown'}",
        *_gpu_lines(),
        f"checkpoint:      {default_checkpoint_status()}",
        f"                 {demo_status()}",
        f"kv cache:        {kv_cache_summary()} (--kv-cache)",
    ]
    print("\n".join(lines))
    return 0


# --- doctor -------------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    from lily.diagnostics import doctor

    return doctor.main(args.device, timing_runs=args.runs)


# --- the parser -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from lily.chat.request_limits import (
        DEFAULT_MAX_GRAMMAR_BYTES,
        DEFAULT_MAX_JSON_VALUES,
        DEFAULT_MAX_MESSAGES,
        DEFAULT_MAX_TOOL_CALLS,
        DEFAULT_MAX_TOOLS,
    )
    from lily.server.routes import (
        DEFAULT_BODY_TIMEOUT,
        DEFAULT_HEADER_TIMEOUT,
        DEFAULT_HOST,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_TOKENS,
        DEFAULT_PARALLEL,
        DEFAULT_PORT,
        DEFAULT_QUEUE_LIMIT,
        DEFAULT_SHUTDOWN_GRACE,
    )
    from lily.version import __version__

    parser = _Parser(
        prog="lily",
        description="Run Qwen3.6-35B-A3B through Lily's hand-written kernels. Try it anywhere "
        "with the tiny random-weight demo model: lily chat --model demo",
        epilog="Run `lily COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, run: Callable[[argparse.Namespace], int]) -> Any:
        sub = commands.add_parser(
            name, help=summary, description=summary, formatter_class=_HelpFormatter
        )
        sub.set_defaults(run=run)
        return sub

    chat = command(
        "chat",
        "talk with the model in the terminal (streaming; " + CHAT_HELP + ")",
        _chat,
    )
    _add_model_arguments(chat, default_model=None)
    _add_speculative_arguments(chat)
    chat.add_argument("--system", default=None, help="a system message that starts the chat")
    chat.add_argument(
        "--image",
        action="append",
        default=[],
        type=_image_file,
        metavar="PATH",
        help="an image file that goes with your first message (PNG, JPEG, WebP, GIF, ...); "
        "repeatable; /image PATH attaches one later",
    )
    chat.add_argument(
        "--max-tokens", type=_positive_int, default=1024, help="longest reply, in tokens"
    )
    chat.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        help="0 to 2, 0 is greedy (default: the model's generation_config.json, else 1)",
    )
    chat.add_argument(
        "--seed", type=int, default=None, help="makes sampling reproducible (default: random)"
    )
    chat.add_argument(
        "--no-thinking", action="store_true", help="answer without the <think> reasoning phase"
    )
    chat.add_argument(
        "--reasoning-budget",
        type=_non_negative_int,
        default=None,
        metavar="TOKENS",
        help="think for at most this many tokens, then answer (default: no limit)",
    )

    generate = command("generate", "complete a raw prompt (no chat template), greedily", _generate)
    _add_model_arguments(generate, default_model=None)
    _add_speculative_arguments(generate)
    generate.add_argument("prompt", help="the text to continue")
    generate.add_argument("--max-tokens", type=_positive_int, default=32, help="tokens to generate")

    serve = command(
        "serve",
        "serve the OpenAI chat-completions API (POST /v1/chat/completions, GET /v1/models, "
        "GET /health, GET /openapi.json), legacy completions with fill-in-the-middle "
        "(POST /v1/completions), Anthropic Messages (POST /v1/messages) and OpenAI Responses "
        "(POST /v1/responses)",
        _serve,
    )
    _add_model_arguments(serve, default_model=None)
    _add_speculative_arguments(serve)
    serve.add_argument(
        "--host", default=DEFAULT_HOST, help="address to listen on (default: loopback only)"
    )
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help="TCP port")
    serve.add_argument(
        "--parallel",
        type=_positive_int,
        default=DEFAULT_PARALLEL,
        metavar="N",
        help="requests decoded at once, in one pass over the weights per token (default: "
        f"{DEFAULT_PARALLEL}, fewer if memory is short; each holds a context's KV cache); a "
        "request alone drafts (the MTP head, prompt lookup or its prediction) until another "
        "arrives; 1 answers one at a time, each drafting to its end",
    )
    serve.add_argument(
        "--fetch-images",
        action="store_true",
        help="fetch http(s) image URLs that requests name (default: images come as data URLs "
        "only); clients can then make the server fetch any address it can reach",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest request body (413 above); images sent as data URLs count 4/3 of their size",
    )
    key = serve.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $LILY_API_KEY, or "
        "no key); other users of the machine see it in `ps`: prefer --api-key-file",
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        help="read the API key from this file (one line of UTF-8)",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        type=_allowed_host,
        metavar="NAME",
        help="also answer requests whose Host header names NAME (localhost, IP addresses and "
        "--host are always accepted; '*' accepts any); repeatable",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        type=_cors_origin,
        metavar="ORIGIN",
        help="let web pages of ORIGIN (e.g. http://localhost:3000) call the API from a browser; "
        "repeatable (default: no CORS)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another id for the served model, listed by GET /v1/models beside its own; repeatable",
    )
    serve.add_argument(
        "--strict-model-id",
        action="store_true",
        help="answer 404 to requests whose model is neither the served id nor a "
        "--served-model-name (default: any model name is answered by the served model)",
    )
    serve.add_argument(
        "--open-model-list",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /v1/models without the API key, as llama-server and LM Studio do: "
        "it tells a caller only the model's ids and context length (default: open)",
    )
    serve.add_argument(
        "--open-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /metrics (Prometheus) without the API key, as vLLM does: it tells a "
        "caller only counts and timings, never a request's content (default: open)",
    )
    serve.add_argument(
        "--queue-limit",
        type=_positive_int,
        default=DEFAULT_QUEUE_LIMIT,
        help="requests that may wait while one runs; more get 503 with Retry-After",
    )
    serve.add_argument(
        "--default-max-tokens",
        "--max-tokens-default",
        dest="default_max_tokens",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="TOKENS",
        help="longest completion of a request that sets no max_tokens (default: "
        f"{DEFAULT_MAX_TOKENS}; never more than the context leaves)",
    )
    serve.add_argument(
        "--reasoning-budget",
        type=_reasoning_budget,
        default=AUTO_REASONING_BUDGET,
        metavar="TOKENS",
        help="most tokens a request that sets no reasoning_budget thinks before its think "
        "block is closed: a number, 'auto' (half its completion limit, so that a small "
        "max_tokens still leaves room for the answer) or 'none' (default: auto)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long the running request may go on before it is stopped "
        f"(default: {DEFAULT_SHUTDOWN_GRACE:g})",
    )
    serve.add_argument(
        "--max-messages",
        type=_positive_int,
        default=DEFAULT_MAX_MESSAGES,
        help="most messages in a request; more get 400 before anything is rendered",
    )
    serve.add_argument(
        "--max-tools",
        type=_positive_int,
        default=DEFAULT_MAX_TOOLS,
        help="most tools in a request (400 above)",
    )
    serve.add_argument(
        "--max-tool-calls",
        type=_positive_int,
        default=DEFAULT_MAX_TOOL_CALLS,
        help="most tool calls in a request's messages, all added up (400 above)",
    )
    serve.add_argument(
        "--max-grammar-bytes",
        type=_positive_byte_size,
        default=DEFAULT_MAX_GRAMMAR_BYTES,
        metavar="BYTES",
        help="largest output grammar (response_format, forced tool calls) compiled for a "
        "request, JSON schemas included; larger ones get 400 unsupported_schema naming the "
        "field (default: 256KiB)",
    )
    serve.add_argument(
        "--max-json-values",
        type=_positive_int,
        default=DEFAULT_MAX_JSON_VALUES,
        help="most JSON values (objects, arrays, strings, numbers, ...) in a request body, all "
        "added up; more get 400 too_many_values before anything is rendered "
        f"(default: {DEFAULT_MAX_JSON_VALUES})",
    )
    serve.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help="a client that has not sent a request's headers within this time is disconnected "
        f"(default: {DEFAULT_HEADER_TIMEOUT:g})",
    )
    serve.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="a request body not received within this time after its headers gets 408 "
        f"(default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    serve.add_argument(
        "--escape-special-tokens",
        action="store_true",
        help="read control tokens such as <|im_end|> written in a request's text as plain "
        "text, so clients cannot forge chat turns (default: off, as transformers does)",
    )
    serve.add_argument(
        "--cache-memory",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="host memory for the prefix cache, e.g. 4GiB or 500MB (default: half the memory "
        "left after the weights and the KV cache, at most 8GiB; 0: no reuse)",
    )
    serve.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also keep the states of long prompt prefixes in DIR, for later runs (default: "
        "memory only)",
    )
    serve.add_argument(
        "--cache-disk-size",
        type=_byte_size,
        default=DEFAULT_DISK_BYTES,
        metavar="BYTES",
        help="most bytes kept in --cache-dir; the least recently used files go first "
        "(default: 16GiB)",
    )
    serve.add_argument(
        "--cache-disk-min-tokens",
        type=_positive_int,
        default=DEFAULT_MIN_TOKENS,
        metavar="TOKENS",
        help="shortest prefix written to --cache-dir",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="what the server logs",
    )

    bench = command(
        "bench",
        f"measure prefill and decode speed (greedy, synthetic prompt, warm-up, one prefill, "
        f"{BENCH_DECODE_STEPS} decode steps)",
        _bench,
    )
    _add_model_arguments(bench, default_model=None)
    bench.add_argument(
        "--context",
        type=_positive_int,
        nargs="+",
        default=[256],
        metavar="TOKENS",
        help=BENCH_CONTEXTS_HELP,
    )
    bench.add_argument("--json", action="store_true", help="one JSON object per arm")
    # Off by default: the contract's measurement is plain decode steps.
    _add_speculative_arguments(
        bench,
        default="off",
        help="draft during the measured decode (prompt lookup: ngram always, auto where it "
        "pays) and report the acceptance; off (default) is the contract's plain decode",
    )

    command("info", "show the device, GPU family, memory and which checkpoints are cached", _info)
    doctor = command(
        "doctor",
        "check every kernel on this machine's device against its numpy reference (and time the "
        "large ones on the GPU); exits 1 if one fails",
        _doctor,
    )
    doctor.add_argument(
        "--device", choices=("auto", "sim", "metal"), default="auto", help="the device to check"
    )
    doctor.add_argument(
        "--runs", type=_positive_int, default=10, help="timed runs per large kernel (GPU)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130  # what a shell reports for a command stopped by Ctrl-C
    except USER_ERRORS as exc:
        if os.environ.get("LILY_DEBUG"):
            raise
        print(f"lily {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
