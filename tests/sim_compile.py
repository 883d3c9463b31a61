"""Compiling kernel sources the way the sim build does, for tests that check the compile itself:
the clang to use, the pre-pass that turns a .metal file into the C++ translation unit that
CMakeLists.txt compiles (it also runs the sim's MSL check, csrc/sim/msl_check.py), and the whole
compile of one file as the build runs it (syntax only: the flags that matter without code
generation)."""

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

sys.path.insert(0, str(SIM_DIR))
from msl_check import ClangError, clang_errors  # noqa: E402

# The operand types the sim's tensor-op emulation takes, for the tests that hold it to them.
from tensor_ops_declarations import OPERAND_TYPES  # noqa: E402, F401

# The flags of CMakeLists.txt's kernel compile that change what compiles.
KERNEL_FLAGS = [
    "-std=gnu++20",  # CMake's C++20 (with its default extensions)
    "-Wno-duplicate-decl-specifier",
    "-Xclang=-ffloat16-excess-precision=none",
    "-Xclang=-fbfloat16-excess-precision=none",
]


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


def shown(path: Path) -> str:
    """A path as the build passes it: relative to the repository root when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def cmake_list(name: str) -> list[str]:
    """The items of CMakeLists.txt's `set(<name> ...)`, its comments left out: the flag lists
    the build compiles with, for tests that must use the same."""
    text = re.sub(r"#[^\n]*", "", (ROOT / "CMakeLists.txt").read_text())
    match = re.search(rf"\bset\({name}\s([^)]*)\)", text)
    assert match, f"no set({name} ...) in CMakeLists.txt"
    return match.group(1).split()


def run_prepass(
    source: Path, translated: Path, compiler: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Pre-pass `source` as CMakeLists.txt does (from the repository root, on relative paths, so
    diagnostics name `metal/x.metal:line`), writing `translated`. `compiler` is the C++ compiler
    the pre-pass runs (the build's own: clang() unless given)."""
    command = [
        sys.executable,
        str(SIM_DIR / "prepass.py"),
        "--clang",
        compiler or clang(),
        "--include-dir",
        str(SIM_INCLUDE),
        "-I",
        shown(source.parent),
        "-I",
        shown(KERNEL_DIR),
        shown(source),
        str(translated),
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)


def prepass(source: Path, out_dir: Path, compiler: str | None = None) -> Path:
    """Pre-pass `source` (with `compiler`, as run_prepass) and return the C++ file it wrote."""
    translated = out_dir / (source.stem + ".cpp")
    result = run_prepass(source, translated, compiler)
    if result.returncode != 0:
        pytest.fail(f"the sim pre-pass failed on {source.name}:\n{result.stderr}")
    return translated


def sim_compile(source: Path, work_dir: Path) -> list[ClangError]:
    """The errors of the sim's compile of `source` ([] when it compiles), from the step that
    failed: the pre-pass with its MSL check, or the compile of its output."""
    translated = work_dir / (source.stem + ".cpp")
    result = run_prepass(source, translated)
    if result.returncode != 0:
        errors = clang_errors(result.stderr)
        if not errors:
            pytest.fail(f"the sim pre-pass failed on {source.name}:\n{result.stderr}")
        assert not translated.exists(), "a failed pre-pass must leave no translation behind"
        return errors
    command = [clang(), "-fsyntax-only", *KERNEL_FLAGS, "-I", str(SIM_INCLUDE)]
    result = subprocess.run(
        [*command, "-x", "c++", str(translated)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    errors = clang_errors(result.stderr)
    if result.returncode != 0 and not errors:
        pytest.fail(f"clang failed on {source.name} without a diagnostic:\n{result.stderr}")
    return errors
