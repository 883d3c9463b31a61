"""Lily and mlx-lm side by side, by the benchmark contract of the reference engine.

The contract (product.md): batch 1, greedy, the synthetic prompt token i = ((i * 2654435761)
mod 2^32) mod vocab, a fresh process per arm, an exact-shape warm-up, one measured prefill (time
to the first token delivered with the next step submitted), exactly 64 measured decode steps.
Each (engine, context) arm runs in its own process: Lily's through `lily bench --json`, mlx-lm's
through this script's `--mlx-arm` mode, on the same checkpoint snapshot. A context that does not
fit in memory (Lily's preflight refuses it) is skipped for both engines, with the reason.

Writes, into --out: bench_vs_mlx.json (every arm), bench_vs_mlx.md (a table) and
bench_vs_mlx.svg (prefill and decode tok/s against context, both engines).

    python benchmarks/bench_vs_mlx.py                  # the real model, contexts 256..131072
    python benchmarks/bench_vs_mlx.py --model demo     # the tiny demo model (sim + mlx[cpu])

On Linux, Lily runs on the CPU simulator and mlx-lm on mlx's CPU backend: the numbers say
nothing about Apple GPUs, only that the harness works. On a Mac it is the headline measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

from lily.cli import BENCH_DECODE_STEPS, synthetic_prompt

CONTRACT_CONTEXTS = [256, 1024, 4096, 16384, 32768, 65536, 131072]
DEMO_CONTEXTS = [16, 64]
ENGINES = ("lily", "mlx-lm")


# --- the mlx-lm arm (run in its own process) --------------------------------------------------


def mlx_arm(model_dir: Path, context: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from lily.checkpoint.loader import load_checkpoint

    vocab = load_checkpoint(model_dir).config.vocab_size
    model, _ = load(str(model_dir))
    prompt = mx.array(synthetic_prompt(context, vocab))
    steps = BENCH_DECODE_STEPS + 1  # the prefill's token, then the measured decode steps
    for _ in generate_step(prompt, model, max_tokens=steps):  # the exact-shape warm-up
        pass
    start = time.perf_counter()
    tokens = generate_step(prompt, model, max_tokens=steps)
    next(tokens)
    first_token = time.perf_counter()
    decoded = sum(1 for _ in tokens)
    end = time.perf_counter()
    if decoded != BENCH_DECODE_STEPS:
        raise RuntimeError(f"decoded {decoded} steps instead of {BENCH_DECODE_STEPS}")
    prefill_s, decode_s = first_token - start, end - first_token
    return {
        "device": str(mx.default_device()),
        "context": context,
        "prefill_s": prefill_s,
        "prefill_tok_s": context / prefill_s,
        "decode_steps": decoded,
        "decode_s": decode_s,
        "decode_tok_s": decoded / decode_s,
    }


# --- running the arms -------------------------------------------------------------------------


def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def run_arm(engine: str, args: argparse.Namespace, model_dir: Path, context: int) -> dict:
    """One arm in a fresh process: its measurement, or {"error": ...}."""
    if engine == "lily":
        command = [sys.executable, "-m", "lily.cli", "bench", "--context", str(context), "--json"]
        command += ["--model", args.model or str(model_dir), "--device", args.device]
    else:
        command = [sys.executable, __file__, "--mlx-arm", str(model_dir), "--context", str(context)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    result = _last_json_line(done.stdout) if done.returncode == 0 else None
    if result is None:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        result = {"context": context, "error": lines[-1] if lines else f"exit {done.returncode}"}
    result["engine"] = engine
    result["wall_s"] = time.perf_counter() - started
    return result


def out_of_memory(arm: dict) -> bool:
    return "MemoryError" in arm.get("error", "") or "does not fit" in arm.get("error", "")


# --- reports ----------------------------------------------------------------------------------


def markdown(arms: list[dict], meta: dict) -> str:
    lines = [
        f"# Lily vs mlx-lm: {meta['model']}",
        "",
        f"{meta['machine']}; batch 1, greedy, synthetic prompt, {BENCH_DECODE_STEPS} decode "
        "steps, one process per arm. Lily on the "
        f"{meta['lily_device']} device, mlx-lm on {meta['mlx_device']}.",
        "",
        "| context | Lily prefill tok/s | mlx-lm prefill tok/s | Lily decode tok/s "
        "| mlx-lm decode tok/s | decode Lily / mlx-lm |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    by_context: dict[int, dict[str, dict]] = {}
    for arm in arms:
        by_context.setdefault(arm["context"], {})[arm["engine"]] = arm

    def cell(arm: dict | None, key: str) -> str:
        if arm is None:
            return ""
        if "error" in arm:
            return "skipped" if arm.get("skipped") else "failed"
        return f"{arm[key]:.1f}"

    notes = []
    for context in sorted(by_context):
        lily, mlx = by_context[context].get("lily"), by_context[context].get("mlx-lm")
        ratio = ""
        if lily and mlx and "error" not in lily and "error" not in mlx:
            ratio = f"{lily['decode_tok_s'] / mlx['decode_tok_s']:.2f}x"
        lines.append(
            f"| {context} | {cell(lily, 'prefill_tok_s')} | {cell(mlx, 'prefill_tok_s')} "
            f"| {cell(lily, 'decode_tok_s')} | {cell(mlx, 'decode_tok_s')} | {ratio} |"
        )
        for arm in (lily, mlx):
            if arm and "error" in arm:
                notes.append(f"- {arm['engine']} at {context}: {arm['error']}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def svg_plot(arms: list[dict], title: str) -> str:
    """Two panels, prefill and decode tok/s against context (log2 axis), one line per engine."""
    width, height, margin = 900, 380, 60
    top, bottom = 40, height - margin
    panel = (width - 3 * margin) / 2
    colours = {"lily": "#c2185b", "mlx-lm": "#1565c0"}
    ok = [a for a in arms if "error" not in a]
    contexts = sorted({a["context"] for a in ok}) or [1]
    x_lo, x_hi = math.log2(contexts[0]), math.log2(contexts[-1])
    x_span = (x_hi - x_lo) or 1.0
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
    ]
    for index, (key, label) in enumerate(
        [("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")]
    ):
        left = margin + index * (panel + margin)
        y_hi = max([a[key] for a in ok] or [1.0]) * 1.1

        def x_of(context: int, left: float = left) -> float:
            return left + (math.log2(context) - x_lo) / x_span * panel

        def y_of(value: float, y_hi: float = y_hi) -> float:
            return bottom - value / y_hi * (bottom - top)

        parts.append(
            f'<rect x="{left}" y="{top}" width="{panel}" height="{bottom - top}" '
            'fill="none" stroke="#888"/>'
        )
        parts.append(
            f'<text x="{left + panel / 2}" y="{top - 6}" text-anchor="middle">{label}</text>'
        )
        for context in contexts:
            parts.append(
                f'<text x="{x_of(context):.1f}" y="{bottom + 16}" text-anchor="middle">'
                f"{context}</text>"
            )
        for tick in range(5):
            value = y_hi * tick / 4
            parts.append(
                f'<text x="{left - 6}" y="{y_of(value) + 4:.1f}" text-anchor="end">'
                f"{value:.3g}</text>"
            )
        parts.append(
            f'<text x="{left + panel / 2}" y="{bottom + 34}" text-anchor="middle">'
            "context (tokens)</text>"
        )
        for engine, colour in colours.items():
            points = sorted((a["context"], a[key]) for a in ok if a["engine"] == engine)
            if not points:
                continue
            path = " ".join(f"{x_of(c):.1f},{y_of(v):.1f}" for c, v in points)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
            for c, v in points:
                parts.append(
                    f'<circle cx="{x_of(c):.1f}" cy="{y_of(v):.1f}" r="3" fill="{colour}"/>'
                )
    for i, (engine, colour) in enumerate(colours.items()):
        parts.append(
            f'<text x="{margin + i * 120}" y="{height - 8}" fill="{colour}">&#9632; {engine}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="'demo', a repo id or a directory")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--device", default="auto", help="Lily's device (auto, metal, sim)")
    parser.add_argument("--context", type=int, nargs="+", default=None, metavar="TOKENS")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--out", type=Path, default=Path("bench_vs_mlx"))
    parser.add_argument("--mlx-arm", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.mlx_arm is not None:
        (context,) = args.context
        print(json.dumps(mlx_arm(args.mlx_arm, context)), flush=True)
        return 0

    from lily.checkpoint.loader import resolve_model

    model_dir = resolve_model(args.model, args.revision)
    contexts = args.context or (DEMO_CONTEXTS if args.model == "demo" else CONTRACT_CONTEXTS)
    arms: list[dict] = []
    for context in contexts:
        skip_reason = None
        for engine in args.engines:
            if skip_reason:
                arm = {"engine": engine, "context": context, "error": skip_reason, "skipped": True}
            else:
                arm = run_arm(engine, args, model_dir, context)
                if out_of_memory(arm):
                    skip_reason = f"skipped: Lily's memory preflight refused {context} tokens"
            arms.append(arm)
            shown = arm.get("error") or (
                f"prefill {arm['prefill_tok_s']:.1f} tok/s, decode {arm['decode_tok_s']:.1f} tok/s"
            )
            print(f"{engine:7} context {context:6}: {shown}", flush=True)

    devices = {a["engine"]: a.get("device", "?") for a in arms if "error" not in a}
    meta = {
        "model": args.model or str(model_dir),
        "machine": f"{platform.system()} {platform.machine()} ({platform.platform()})",
        "lily_device": devices.get("lily", args.device),
        "mlx_device": devices.get("mlx-lm", "?"),
        "decode_steps": BENCH_DECODE_STEPS,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_vs_mlx.json").write_text(json.dumps({**meta, "arms": arms}, indent=2))
    table = markdown(arms, meta)
    (args.out / "bench_vs_mlx.md").write_text(table)
    (args.out / "bench_vs_mlx.svg").write_text(svg_plot(arms, f"Lily vs mlx-lm: {meta['model']}"))
    print()
    print(table)
    print(f"wrote {args.out}/bench_vs_mlx.json, .md and .svg")
    return 1 if any("error" in a and not a.get("skipped") for a in arms) else 0


if __name__ == "__main__":
    sys.exit(main())
