"""The macOS workflow against the build it checks: it requires the metallib through the option
cmake/metal.cmake defines, and compiles each kernel with the flags the metallib is built with.
(actionlint runs on it in tests/test_metal_api_check.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "macos.yml"
METAL_CMAKE = (REPO / "cmake" / "metal.cmake").read_text()


def job() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]["metal"]


def step(name_start: str) -> dict:
    return next(s for s in job()["steps"] if s.get("name", "").startswith(name_start))


def test_every_build_requires_the_metallib():
    assert re.search(r"option\(LILY_REQUIRE_METALLIB\b", METAL_CMAKE)
    # Job-wide, so both installs (the README's and the test extra's) build it.
    assert job()["env"]["CMAKE_ARGS"] == "-DLILY_REQUIRE_METALLIB=ON"
    assert "CMAKE_ARGS" not in str([s.get("env") for s in job()["steps"]])
    check = step("Metal device")["run"]
    assert 'metallib = Path(lily.__file__).parent / "lily.metallib"' in check
    assert "sys.exit(" in check


def test_each_kernel_is_compiled_with_the_metallib_flags():
    flags = re.search(r"set\(lily_metallib_flags ([^)]*)\)", METAL_CMAKE).group(1).split()
    assert "-std=metal3.1" in flags
    run = step("Compile each kernel")["run"]
    assert "for source in metal/*.metal" in run
    command = " ".join(run.split("\\\n"))
    assert re.search(r"xcrun -sdk macosx metal " + r"\s+".join(map(re.escape, flags)), command)
    assert 'exit "$failed"' in run
