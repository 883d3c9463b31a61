"""benchmarks/bench_vs_mlx.py: its reports, and the harness end to end on the demo model (Lily
on the sim, mlx-lm on mlx's CPU backend)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vs_mlx.py"
spec = importlib.util.spec_from_file_location("bench_vs_mlx", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def arm(engine, context, prefill, decode):
    return {
        "engine": engine,
        "context": context,
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
        "decode_steps": 64,
    }


ARMS = [
    arm("lily", 256, 1000.0, 190.0),
    arm("mlx-lm", 256, 900.0, 150.0),
    arm("lily", 4096, 5000.0, 170.0),
    arm("mlx-lm", 4096, 4000.0, 140.0),
    {"engine": "lily", "context": 131072, "error": "MemoryError: does not fit"},
    {"engine": "mlx-lm", "context": 131072, "error": "skipped: preflight", "skipped": True},
]
META = {"model": "m", "machine": "a Mac", "lily_device": "metal", "mlx_device": "gpu"}


def test_the_markdown_table_has_one_row_per_context_and_the_ratio():
    table = bench.markdown(ARMS, META)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "context" not in line]
    assert rows[0] == "| 256 | 1000.0 | 900.0 | 190.0 | 150.0 | 1.27x |"
    assert rows[1] == "| 4096 | 5000.0 | 4000.0 | 170.0 | 140.0 | 1.21x |"
    assert rows[2] == "| 131072 | failed | skipped | failed | skipped |  |"
    assert "- lily at 131072: MemoryError: does not fit" in table


def test_the_plot_is_svg_with_a_line_per_engine_and_panel():
    svg = bench.svg_plot(ARMS, "t")
    document = xml.dom.minidom.parseString(svg)
    lines = document.getElementsByTagName("polyline")
    assert len(lines) == 4  # (prefill, decode) x (lily, mlx-lm); failed arms are left out
    assert all(len(line.getAttribute("points").split()) == 2 for line in lines)


def test_the_prompt_is_the_contracts():
    # 2654435761 = 10689 * 248320 + 143281; 2 * 2654435761 - 2^32 = 4083 * 248320 + 13666
    assert bench.synthetic_prompt(3, 248320) == [0, 143281, 13666]


@pytest.mark.slow
def test_both_engines_run_end_to_end_on_the_demo_model(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "demo", "--context", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "bench_vs_mlx.json").read_text())
    assert {a["engine"] for a in report["arms"]} == {"lily", "mlx-lm"}
    for measured in report["arms"]:
        assert measured["decode_steps"] == 64 and measured["decode_tok_s"] > 0, measured
    assert report["lily_device"] == "sim"
    assert "| 8 |" in (tmp_path / "bench_vs_mlx.md").read_text()
    xml.dom.minidom.parse(str(tmp_path / "bench_vs_mlx.svg"))
