"""CMake's compiler gate and flag probe (cmake/compiler.cmake), run on their own.

The gate refuses compilers older than the sim needs (clang 17, AppleClang 16) with one line that
names the version needed; the probe that decides whether the sim's checked build is possible
fails when the compiler rejects any of its flags (it used to pass them all as one -D argument,
so it always passed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from sim_compile import cmake_list

REPO = Path(__file__).resolve().parent.parent
CMAKE = shutil.which("cmake")
pytestmark = pytest.mark.skipif(CMAKE is None, reason="no cmake")


def gate(tmp_path: Path, compiler_id: str, version: str) -> subprocess.CompletedProcess:
    script = tmp_path / "gate.cmake"
    script.write_text(
        f'include("{REPO / "cmake" / "compiler.cmake"}")\n'
        f'lily_require_compiler("{compiler_id}" "{version}" "/opt/bin/c++")\n'
        'message(STATUS "accepted")\n'
    )
    return subprocess.run([CMAKE, "-P", str(script)], capture_output=True, text=True, check=False)


def refusal(result: subprocess.CompletedProcess) -> str:
    """The message of a FATAL_ERROR: CMake's 'CMake Error at ...' header, then one line (then
    CMake's call stack, or the end)."""
    assert result.returncode != 0
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith("CMake Error at "))
    assert len(lines) == start + 2 or lines[start + 2].startswith("Call Stack"), lines
    return lines[start + 1]


@pytest.mark.parametrize(
    ("compiler_id", "version", "needed"),
    [
        ("AppleClang", "15.0.0.15000309", "Lily needs AppleClang 16 or later (Xcode 16 or its"),
        ("Clang", "16.0.6", "Lily needs clang 17 or later as the C++ compiler"),
        ("GNU", "12.2.0", "Lily needs clang 17 or later (on macOS: AppleClang 16, Xcode 16)"),
    ],
)
def test_too_old_or_other_compilers_are_refused_in_one_line(tmp_path, compiler_id, version, needed):
    line = refusal(gate(tmp_path, compiler_id, version))
    assert line.startswith(needed)
    assert f"found {'clang' if compiler_id == 'Clang' else compiler_id} {version}" in line


@pytest.mark.parametrize(
    ("compiler_id", "version"),
    [
        ("AppleClang", "16.0.0.16000026"),
        ("AppleClang", "17.0.0"),
        ("Clang", "17.0.6"),
        ("Clang", "19.1.7"),
    ],
)
def test_supported_compilers_pass(tmp_path, compiler_id, version):
    result = gate(tmp_path, compiler_id, version)
    assert result.returncode == 0, result.stderr
    assert "accepted" in result.stdout


def checked_flags() -> list[str]:
    """The checked build's flags as CMakeLists.txt lists them (Linux)."""
    return cmake_list("LILY_SIM_CHECKED_FLAGS")


def clang() -> str:
    for name in ("clang++-19", "clang++-20", "clang++-18", "clang++-17", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no clang++")


def configure(source: Path, build: Path, compiler: str) -> subprocess.CompletedProcess:
    """CMake's configure of `source` into `build` with `compiler` as the C++ compiler."""
    command = [CMAKE, "-S", str(source), "-B", str(build), f"-DCMAKE_CXX_COMPILER={compiler}"]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def probe(tmp_path: Path, cases: dict[str, list[str]]) -> dict[str, bool]:
    source = tmp_path / "project"
    source.mkdir()
    calls = "".join(
        f'lily_compiler_accepts({name} {" ".join(flags)})\nmessage(STATUS "{name}=${{{name}}}")\n'
        for name, flags in cases.items()
    )
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\n"
        "project(probe LANGUAGES CXX)\n"
        f'include("{REPO / "cmake" / "compiler.cmake"}")\n' + calls
    )
    result = configure(source, tmp_path / "build", clang())
    assert result.returncode == 0, result.stderr
    found = dict(re.findall(r"-- (\w+)=(\w*)", result.stdout))
    return {name: found[name] in {"1", "ON", "TRUE"} for name in cases}


def test_the_checked_build_probe_fails_on_a_flag_the_compiler_rejects(tmp_path):
    flags = checked_flags()
    assert "-fsanitize=thread" in flags and "-DLILY_SIM_CHECKED=1" in flags
    assert "-mllvm=-tsan-instrument-memintrinsics=1" in flags  # past the list's comment
    results = probe(
        tmp_path,
        {
            "REAL": flags,
            # The first flag is a -D, as in the real list: it must not swallow the others.
            "REJECTED": flags + ["-fno-such-flag-for-lily"],
            "REJECTED_MLLVM": flags[:1] + ["-mllvm=-no-such-llvm-option-for-lily=1"],
            "IGNORED": flags[:1] + ["-L/nonexistent-lily-dir"],
        },
    )
    assert results == {"REAL": True, "REJECTED": False, "REJECTED_MLLVM": False, "IGNORED": False}


old_clang = shutil.which("clang++-16")


@pytest.mark.skipif(old_clang is None, reason="no clang++-16 here to configure with")
def test_the_project_refuses_clang_16(tmp_path):
    line = refusal(configure(REPO, tmp_path / "build", old_clang))
    assert line.startswith("Lily needs clang 17 or later as the C++ compiler (Debian: clang-19); ")
    assert "found clang 16." in line
