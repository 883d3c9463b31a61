"""Compiling kernel sources the way the sim build does, for tests that check the compile itself:
the clang to use and the pre-pass that turns a .metal file into the C++ translation unit that
CMakeLists.txt compiles."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "metal"
SIM_DIR = ROOT / "csrc" / "sim"
SIM_INCLUDE = SIM_DIR / "include"
OLDEST_CLANG = 17  # the sim's half/bfloat flags need it (spec/devices.md)


@functools.cache
def clang() -> str:
    """The C++ compiler the sim builds with: $LILY_CLANG, or the newest clang++ >= 17."""
    candidates = [os.environ.get("LILY_CLANG", "")]
    candidates += [f"clang++-{v}" for v in range(22, OLDEST_CLANG - 1, -1)] + ["clang++"]
    for candidate in filter(None, candidates):
        path = shutil.which(candidate)
        if path is None:
            continue
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        major = re.search(r"clang version (\d+)", version)
        if major and int(major.group(1)) >= OLDEST_CLANG:
            return path
    pytest.fail(
        f"no clang++ >= {OLDEST_CLANG} found (set LILY_CLANG); Debian: apt install clang-19"
    )


def prepass(source: Path, out_dir: Path) -> Path:
    """Pre-pass `source` as CMakeLists.txt does (from the repository root, on relative paths, so
    diagnostics name `metal/x.metal:line`) and return the C++ file it wrote."""
    translated = out_dir / (source.stem + ".cpp")
    command = [
        sys.executable,
        str(SIM_DIR / "prepass.py"),
        "--clang",
        clang(),
        "--include-dir",
        str(SIM_INCLUDE),
        "-I",
        str(source.parent.relative_to(ROOT)),
        "-I",
        str(KERNEL_DIR.relative_to(ROOT)),
        str(source.relative_to(ROOT)),
        str(translated),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if result.returncode != 0:
        pytest.fail(f"the sim pre-pass failed on {source.name}:\n{result.stderr}")
    return translated
