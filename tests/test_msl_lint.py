"""The MSL discipline of spec/devices.md, enforced over every kernel source.

Two passes: the token lint of msl_lint.py (rules 1-8), and a clang type-check that compiles each
kernel file with `device`/`constant`/`threadgroup` as distinct clang address spaces, so passing a
pointer to the wrong address space is a compile error as it is for Apple's compiler. Each pass
is also shown to fire on planted mistakes (tests/msl_lint_cases/), so a clean run means something.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from msl_lint import lint_paths, metal_files

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
KERNEL_DIR = ROOT / "metal"
CASES = TESTS / "msl_lint_cases"
LINT_RULES = [f"MSL{n}" for n in range(1, 9)]
EXPECT = re.compile(r"//\s*expect:\s*(MSL\d(?:\s+MSL\d)*)")

KERNEL_FILES = metal_files([KERNEL_DIR])
CASE_FILES = sorted(CASES.glob("*.metal"))


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
    lines = bad.stdout.splitlines()
    assert len(lines) == len(expected_violations(case))
    assert all(re.match(rf"^{re.escape(str(case))}:\d+: MSL1: ", line) for line in lines)

    clean = subprocess.run(
        [sys.executable, str(script), str(CASES / "clean_kernel.metal")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (clean.returncode, clean.stdout) == (0, "")
