"""Each MSL rule that C++ does not enforce by itself, and the sim's compile does, has a mutant
kernel in tests/sim_mutants/ that breaks it once. The sim's compile, run as the build runs it
(sim_compile.py), must reject the mutant with the announced error at the mutated line, and accept
the same file with that one line replaced by its legal version: so the rejection is the rule's,
not a typo's.

A mutant announces itself with two comments right above the mutated line:
    // legal: <the line that follows the rule>
    // rejected: <a regular expression the compile error must match>
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from sim_compile import ClangError, sim_compile

MUTANTS_DIR = Path(__file__).resolve().parent / "sim_mutants"
MUTANTS = sorted(MUTANTS_DIR.glob("*.metal"))
LEGAL = re.compile(r"^(\s*)//\s*legal:\s*(.*\S)\s*$")
REJECTED = re.compile(r"^\s*//\s*rejected:\s*(.*\S)\s*$")

# The rules of issue 24 (item 4), each with its mutant: a mutant removed fails here.
RULES = {
    "a device pointer is no threadgroup pointer": "device_to_threadgroup_pointer",
    "a device element does not bind to a thread reference": "device_to_thread_reference",
    "a device pointer is no thread pointer": "device_to_thread_pointer",
    "constant memory is read-only": "constant_written",
    "no cast between address spaces": "address_space_cast",
    "no double": "double",
    "simdgroup_load reads device or threadgroup memory": "simdgroup_load_thread_memory",
    "simdgroup_load reads the matrix's element type": "simdgroup_load_element_type",
    "simdgroup_store writes the matrix's element type": "simdgroup_store_element_type",
    "simdgroup matrices are float, half or bfloat": "simdgroup_matrix_integer",
    "collectives exchange no structs": "collective_struct",
    "collectives exchange no bool": "collective_bool",
    "bitwise collectives take integers": "collective_bitwise_float",
}


@dataclass(frozen=True)
class Mutant:
    path: Path
    line: int  # 1-based, the mutated line
    rejected: re.Pattern[str]
    legal: str  # the mutated line's legal version, indented as it

    @staticmethod
    def read(path: Path) -> Mutant:
        lines = path.read_text().splitlines()
        marks = [
            (n, LEGAL.match(lines[n - 3]), REJECTED.match(lines[n - 2]))
            for n in range(3, len(lines) + 1)
        ]
        found = [(n, legal, rejected) for n, legal, rejected in marks if legal and rejected]
        assert len(found) == 1, f"{path.name}: want one `// legal:` + `// rejected:` pair"
        n, legal, rejected = found[0]
        return Mutant(path, n, re.compile(rejected.group(1)), legal.group(1) + legal.group(2))

    def at_mutated_line(self, error: ClangError) -> bool:
        """Whether the error is at the mutated line, or comes from an instantiation there."""
        places = [(error.path, error.line)] + [(note.path, note.line) for note in error.notes]
        return any(Path(p).name == self.path.name and n == self.line for p, n in places)


def test_every_rule_has_a_mutant() -> None:
    stems = {path.stem for path in MUTANTS}
    missing = {rule: stem for rule, stem in RULES.items() if stem not in stems}
    assert not missing, f"no mutant for: {missing}"
    assert stems == set(RULES.values()), f"mutants without a rule: {stems - set(RULES.values())}"


@pytest.mark.parametrize("path", MUTANTS, ids=lambda p: p.stem)
def test_the_sim_compile_rejects_the_mutant(path: Path, tmp_path: Path) -> None:
    mutant = Mutant.read(path)
    errors = sim_compile(path, tmp_path)
    assert errors, f"{path.name} compiled: the sim's compile lets the rule pass"
    assert any(
        mutant.rejected.search(error.message) and mutant.at_mutated_line(error) for error in errors
    ), f"no error matching {mutant.rejected.pattern!r} at line {mutant.line}:\n" + "\n".join(
        map(str, errors)
    )


@pytest.mark.parametrize("path", MUTANTS, ids=lambda p: p.stem)
def test_the_legal_version_compiles(path: Path, tmp_path: Path) -> None:
    mutant = Mutant.read(path)
    lines = path.read_text().splitlines()
    lines[mutant.line - 1] = mutant.legal
    legal = tmp_path / "legal" / path.name
    legal.parent.mkdir()
    legal.write_text("\n".join(lines) + "\n")
    errors = sim_compile(legal, tmp_path)
    assert not errors, f"the legal version of {path.name}:\n" + "\n".join(map(str, errors))
