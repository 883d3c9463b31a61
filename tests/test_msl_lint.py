"""The MSL discipline of spec/devices.md, enforced over every kernel source.

Two passes: the token lint of msl_lint.py (rules 1-8), and the sim's own compile, whose pre-pass
type-checks each kernel file with `device`/`constant`/`threadgroup` as distinct clang address
spaces (csrc/sim/msl_check.py), so passing a pointer to the wrong address space fails the sim's
build as it fails Apple's compiler. Here every kernel source (and the lint's clean cases) is shown
to pass that compile, and each pass to fire on planted mistakes (tests/msl_lint_cases/), so a
clean run means something; tests/test_sim_mutants.py plants one violation per MSL rule the sim's
compile enforces.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from msl_lint import lint_paths, metal_files
from sim_compile import sim_compile

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
KERNEL_DIR = ROOT / "metal"
CASES = TESTS / "msl_lint_cases"
LINT_RULES = [f"MSL{n}" for n in range(1, 9)]
EXPECT = re.compile(r"//\s*expect:\s*(MSL\d(?:\s+MSL\d)*)")
EXPECT_CLANG_ERROR = re.compile(r"//\s*expect-clang:\s*error")

KERNEL_FILES = metal_files([KERNEL_DIR])
CASE_FILES = sorted(CASES.glob("*.metal"))
# The clean cases double as a check that what the lint accepts compiles; the test-only kernels
# are built into the module too.
TYPE_CHECKED = (
    [p for p in KERNEL_FILES if p.suffix == ".metal"]
    + sorted(CASES.glob("clean_*.metal"))
    + sorted((TESTS / "sim_kernels").glob("*.metal"))
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
# The sim's compile as the build runs it: its pre-pass type-checks every kernel file with MSL's
# address spaces (csrc/sim/msl_check.py), then the file compiles as C++.


@pytest.mark.parametrize("source", TYPE_CHECKED, ids=lambda p: p.name)
def test_kernels_pass_the_sim_msl_check(source: Path, tmp_path: Path) -> None:
    errors = sim_compile(source, tmp_path)
    assert not errors, f"the sim's compile of {source.name}:\n" + "\n".join(map(str, errors))


def test_address_space_check_catches_mismatches(tmp_path: Path) -> None:
    case = CASES / "address_space_mismatch.metal"
    lines = case.read_text().splitlines()
    expected = {n for n, line in enumerate(lines, start=1) if EXPECT_CLANG_ERROR.search(line)}
    assert expected, "the case plants no mismatch"

    errors = sim_compile(case, tmp_path)
    assert all(Path(error.path).name == case.name for error in errors), errors
    assert {error.line for error in errors} == expected, "\n".join(map(str, errors))
