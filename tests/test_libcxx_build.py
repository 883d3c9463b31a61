"""The sim's sources compile against libc++, the C++ library of every Mac.

On macOS the sim kernels are compiled too (`pip install .` builds them beside the metal device),
against Apple's libc++, whose headers declare more than libstdc++ does (`float exp(float)` and
its kin in the global namespace, for one): a kernel calling `exp(x)` after `using namespace
metal` was ambiguous there and the package did not build on any Mac. Linux's libc++ declares the
same, so compiling every kernel translation unit (plain and checked, as CMakeLists.txt builds
them) and the sim's runtime sources against it here catches that class of failure without
Apple's SDK. tools/check_macos_build.py does the whole build against the real SDK.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sim_compile import KERNEL_FLAGS, ROOT, SIM_DIR, SIM_INCLUDE, clang, prepass

KERNEL_SOURCES = sorted((ROOT / "metal").glob("*.metal")) + sorted(
    (ROOT / "tests" / "sim_kernels").glob("*.metal")
)
RUNTIME_SOURCES = sorted(SIM_DIR.glob("*.cpp"))
VARIANTS = {"plain": [], "checked": ["-DLILY_SIM_CHECKED=1"]}


def libcxx_errors(source: Path, *flags: str) -> str:
    command = [clang(), "-std=gnu++20", "-stdlib=libc++", "-fsyntax-only", "-I", str(SIM_INCLUDE)]
    result = subprocess.run(
        [*command, *flags, str(source)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    if "'cmath' file not found" in result.stderr or "'vector' file not found" in result.stderr:
        pytest.fail("libc++'s headers are missing: install libc++-19-dev (Debian), as .ci/run does")
    return result.stderr if result.returncode != 0 else ""


@pytest.mark.parametrize("source", KERNEL_SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kernel_translation_units_compile_against_libcxx(source: Path, tmp_path: Path) -> None:
    translated = prepass(source, tmp_path)
    for variant, flags in VARIANTS.items():
        errors = libcxx_errors(translated, *KERNEL_FLAGS, *flags)
        assert not errors, f"{source.name} ({variant} build) against libc++:\n{errors}"


@pytest.mark.parametrize("source", RUNTIME_SOURCES, ids=lambda p: p.name)
def test_sim_runtime_compiles_against_libcxx(source: Path) -> None:
    errors = libcxx_errors(source, "-I", str(ROOT / "csrc"))
    assert not errors, f"{source.name} against libc++:\n{errors}"


def test_an_ambiguous_math_call_fails_against_libcxx(tmp_path: Path) -> None:
    """The check can fail: a float overload declared beside libc++'s global one, as the sim's
    header once did, is reported as the ambiguity Apple's SDK reports."""
    case = tmp_path / "ambiguous.cpp"
    case.write_text(
        "#include <cmath>\n"
        "namespace metal { inline float exp(float x) { return std::exp(x); } }\n"
        "using namespace metal;\n"
        "float f(float x) { return exp(x); }\n"
    )
    assert "call to 'exp' is ambiguous" in libcxx_errors(case)
