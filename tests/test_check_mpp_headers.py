"""tools/check_macos_build.py --mpp-headers, on headers that lack what the tensor-op kernels use
(Apple's own headers are never committed: docs/apple-silicon.md says how the check is run on a
copy of them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from sim_compile import OPERAND_TYPES, ROOT

spec = importlib.util.spec_from_file_location(
    "check_macos_build", ROOT / "tools" / "check_macos_build.py"
)
check_macos_build = importlib.util.module_from_spec(spec)
# dataclasses look their module up in sys.modules while the class body runs.
sys.modules[spec.name] = check_macos_build
spec.loader.exec_module(check_macos_build)


def test_no_headers_fail_every_declaration(tmp_path: Path, capsys) -> None:
    assert not check_macos_build.check_mpp_headers(tmp_path)
    printed = capsys.readouterr().out
    declarations = check_macos_build.tensor_ops.DECLARATIONS
    assert printed.count("MISSING (") == len(declarations)


def test_an_operand_table_without_bfloat_differs(tmp_path: Path, capsys) -> None:
    """macOS 26.0's table had half x half only, among the float types."""
    table = ["//  A          B         C", "//  half       half      half"]
    table.append("//  half       half      float")
    (tmp_path / "MPPTensorOpsMatMul2d.h").write_text("\n".join(table) + "\n#ifndef X\n")
    assert not check_macos_build.check_mpp_headers(tmp_path)
    printed = capsys.readouterr().out
    only_in_sim = OPERAND_TYPES - {("half", "half", "half"), ("half", "half", "float")}
    assert printed.count("in the sim only") == len(only_in_sim)
    assert "bfloat x half -> float in the sim only" in printed
