"""The MSL discipline of spec/devices.md, enforced over every kernel source.

Two passes: the token lint of msl_lint.py (rules 1-8), and a clang type-check that compiles each
kernel file with `device`/`constant`/`threadgroup` as distinct clang address spaces, so passing a
pointer to the wrong address space is a compile error as it is for Apple's compiler (whole-struct
copies across address spaces, legal MSL that clang C++ rejects, are the one class of error it
ignores). Each pass is also shown to fire on planted mistakes (tests/msl_lint_cases/), so a clean
run means something.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from msl_lint import lint_paths, metal_files

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
KERNEL_DIR = ROOT / "metal"
SIM_DIR = ROOT / "csrc" / "sim"
CASES = TESTS / "msl_lint_cases"
LINT_RULES = [f"MSL{n}" for n in range(1, 9)]
EXPECT = re.compile(r"//\s*expect:\s*(MSL\d(?:\s+MSL\d)*)")
EXPECT_CLANG_ERROR = re.compile(r"//\s*expect-clang:\s*error")
OLDEST_CLANG = 17  # the sim's half/bfloat flags need it (spec/devices.md)

KERNEL_FILES = metal_files([KERNEL_DIR])
CASE_FILES = sorted(CASES.glob("*.metal"))
# The clean cases double as a check that what the lint accepts compiles.
TYPE_CHECKED = [p for p in KERNEL_FILES if p.suffix == ".metal"] + sorted(
    CASES.glob("clean_*.metal")
)


def expected_violations(path: Path) -> set[tuple[int, str]]:
    """The (line, rule) pairs a case file announces with `// expect: MSLn` comments."""
    expected = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = EXPECT.search(line)
        if match:
            expected |= {(number, rule) for rule in match.group(1).split()}
    return expected


def test_kernel_sources_exist() -> None:
    assert any(p.suffix == ".metal" for p in KERNEL_FILES), f"no kernels found in {KERNEL_DIR}"


def test_kernels_follow_the_msl_discipline() -> None:
    violations = lint_paths([KERNEL_DIR])
    assert not violations, "MSL lint violations:\n" + "\n".join(map(str, violations))


@pytest.mark.parametrize("case", CASE_FILES, ids=lambda p: p.stem)
def test_lint_finds_exactly_the_planted_violations(case: Path) -> None:
    found = {(v.line, v.rule) for v in lint_paths([case])}
    expected = expected_violations(case)
    assert found == expected, (
        f"missed: {sorted(expected - found)}, unexpected: {sorted(found - expected)}"
    )


@pytest.mark.parametrize("rule", LINT_RULES)
def test_every_rule_has_a_planted_violation(rule: str) -> None:
    cases = [c for c in CASE_FILES if c.stem.startswith(rule.lower() + "_")]
    assert cases, f"no case file for {rule}"
    assert any(r == rule for c in cases for _, r in expected_violations(c))


def test_lint_runs_as_a_script() -> None:
    script = TESTS / "msl_lint.py"
    case = CASES / "msl1_unqualified_pointers.metal"
    bad = subprocess.run(
        [sys.executable, str(script), str(case)], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 1
    printed = [
        re.match(rf"^{re.escape(str(case))}:(\d+): (MSL\d): ", line)
        for line in bad.stdout.splitlines()
    ]
    assert all(printed), bad.stdout
    assert {(int(m.group(1)), m.group(2)) for m in printed} == expected_violations(case)

    clean = subprocess.run(
        [sys.executable, str(script), str(CASES / "clean_kernel.metal")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (clean.returncode, clean.stdout) == (0, "")


# ---------------------------------------------------------------------------------------------
# The clang address-space pass: the sim's pre-pass, then a syntax-only compile with the sim's
# MSL header in its LILY_ADDRESS_SPACE_CHECK mode (device/constant/threadgroup = clang address
# spaces 1/2/3, thread = the default one).


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


@dataclass(frozen=True)
class ClangError:
    path: str
    line: int
    message: str
    notes: tuple[str, ...]

    def __str__(self) -> str:
        return "\n    ".join([f"{self.path}:{self.line}: {self.message}", *self.notes])


DIAGNOSTIC = re.compile(r"^(\S+?):(\d+):\d+: (fatal error|error|warning|note): (.*)$")
# MSL copies whole structs between address spaces (`Params q = p;`, `out[i] = Entry{...};`);
# clang C++ has no copy constructor or assignment across address spaces and says so in these
# two ways. They are not pointer mismatches, and any other type error in such a statement still
# fails the regular sim build, so the pass ignores them.
STRUCT_COPY = re.compile(
    r"no viable conversion from '(?:const )?"
    r"(?:device|constant|threadgroup|__attribute__\(\(address_space\(\d\)\)\)) [^'*&]*'"
)
STRUCT_ASSIGNMENT_NOTE = re.compile(r"implicit (?:copy|move) assignment operator\) not viable")


def clang_errors(stderr: str) -> list[ClangError]:
    """The errors of a clang run, each with the notes that follow it."""
    errors: list[ClangError] = []
    for line in stderr.splitlines():
        match = DIAGNOSTIC.match(line)
        if not match:
            continue
        path, number, kind, message = match.groups()
        if kind == "note" and errors:
            last = errors[-1]
            errors[-1] = ClangError(last.path, last.line, last.message, (*last.notes, message))
        elif kind != "note" and kind != "warning":
            errors.append(ClangError(path, int(number), message, ()))
    return errors


def is_struct_copy(error: ClangError) -> bool:
    if STRUCT_COPY.search(error.message):
        return True
    return (
        error.message == "no viable overloaded '='"
        and bool(error.notes)
        and all(STRUCT_ASSIGNMENT_NOTE.search(note) for note in error.notes)
    )


def address_space_errors(source: Path, work_dir: Path) -> list[ClangError]:
    """Pre-pass `source` as the sim build does, type-check it with distinct address spaces, and
    return the errors that are about address spaces.

    Both run from the repository root on relative paths, so messages name `metal/x.metal:line`."""
    translated = work_dir / (source.stem + ".cpp")
    prepass = [
        sys.executable,
        str(SIM_DIR / "prepass.py"),
        "--clang",
        clang(),
        "--include-dir",
        str(SIM_DIR / "include"),
        "-I",
        str(source.parent.relative_to(ROOT)),
        "-I",
        str(KERNEL_DIR.relative_to(ROOT)),
        str(source.relative_to(ROOT)),
        str(translated),
    ]
    result = subprocess.run(prepass, capture_output=True, text=True, check=False, cwd=ROOT)
    if result.returncode != 0:
        pytest.fail(f"the sim pre-pass failed on {source.name}:\n{result.stderr}")
    compile_ = [
        clang(),
        "-fsyntax-only",
        "-std=c++20",
        "-DLILY_ADDRESS_SPACE_CHECK",
        "-Wno-unknown-attributes",
        "-ferror-limit=0",  # ignored struct-copy errors must not crowd out the rest
        "-I",
        str(SIM_DIR / "include"),
        "-x",
        "c++",
        str(translated),
    ]
    result = subprocess.run(compile_, capture_output=True, text=True, check=False, cwd=ROOT)
    errors = clang_errors(result.stderr)
    if result.returncode != 0 and not errors:
        pytest.fail(f"clang failed on {source.name} without a diagnostic:\n{result.stderr}")
    return [error for error in errors if not is_struct_copy(error)]


@pytest.mark.parametrize("source", TYPE_CHECKED, ids=lambda p: p.name)
def test_kernels_pass_the_address_space_check(source: Path, tmp_path: Path) -> None:
    errors = address_space_errors(source, tmp_path)
    assert not errors, f"address-space check of {source.name}:\n" + "\n".join(map(str, errors))


def test_address_space_check_catches_mismatches(tmp_path: Path) -> None:
    case = CASES / "address_space_mismatch.metal"
    lines = case.read_text().splitlines()
    expected = {n for n, line in enumerate(lines, start=1) if EXPECT_CLANG_ERROR.search(line)}
    assert expected, "the case plants no mismatch"

    errors = address_space_errors(case, tmp_path)
    assert all(Path(error.path).name == case.name for error in errors), errors
    assert {error.line for error in errors} == expected, "\n".join(map(str, errors))
