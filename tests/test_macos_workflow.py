"""The macOS workflow against the build it checks: it requires the metallib through the option
cmake/metal.cmake defines, and compiles each kernel with the flags the metallib is built with.
(actionlint runs on it in tests/test_metal_api_check.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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


def msl_versions() -> dict[str, tuple[str, str]]:
    """metal/msl_versions.txt, the list cmake/metal.cmake builds lily.metallib from: file name
    (or "default") -> (MSL version, minimum macOS)."""
    versions = {}
    for line in (REPO / "metal" / "msl_versions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, msl, macos = line.split()
            versions[name] = (msl, macos)
    return versions


def test_the_build_reads_the_list():
    assert "metal/msl_versions.txt" in METAL_CMAKE
    flags = re.search(r"set\(lily_metallib_flags\s+([^)]*)\)", METAL_CMAKE).group(1).split()
    assert flags[:2] == [
        "-std=metal${lily_msl_default}",
        "-mmacosx-version-min=${lily_msl_default_macos}",
    ]
    versions = msl_versions()
    assert versions["default"] == ("3.1", "14.0")
    assert versions["quantized_gemm_tensor_ops.metal"] == ("4.0", "26.0")
    assert versions["attention_tensor_ops.metal"] == ("4.0", "26.0")
    for name in versions:
        assert name == "default" or (REPO / "metal" / name).is_file(), name


def test_the_device_compiles_at_the_listed_versions():
    # The run-time compile (no metallib) and the tensor-op library use the same versions.
    source = (REPO / "csrc" / "metal" / "metal_device.mm").read_text()
    versions = msl_versions()
    major, minor = versions["default"][0].split(".")
    assert f"options.languageVersion = MTLLanguageVersion{major}_{minor};" in source
    # The device takes every *_tensor_ops.metal as a tensor-op source; each is listed at 4.0.
    assert 'ends_with("_tensor_ops.metal")' in source
    tensor_ops = {p.name for p in (REPO / "metal").glob("*_tensor_ops.metal")}
    assert len(tensor_ops) == 2
    for name in tensor_ops:
        major, minor = versions[name][0].split(".")
        assert f"compile_source(device, file, kLanguageVersion{major}_{minor})" in source
    assert set(versions) == {"default", *tensor_ops}


def run_kernel_loop(
    tmp_path: Path, known_versions: set[str], failing: str = ""
) -> tuple[list[list[str]], str, int]:
    """Runs the workflow's kernel loop with a stand-in xcrun that records its arguments, refuses
    an -std=metalX.Y outside `known_versions` as an old compiler does, and reports an error in
    the kernel file `failing`."""
    work = tmp_path / "checkout"
    shutil.copytree(REPO / "metal", work / "metal")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    xcrun = bin_dir / "xcrun"
    xcrun.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{calls}"\n'
        'for arg in "$@"; do case "$arg" in -std=metal*)\n'
        f'  case " {" ".join(sorted(known_versions))} " in *" ${{arg#-std=metal}} "*) ;; '
        "*) echo \"error: invalid value '${arg#-std=}' in '$arg'\" >&2; exit 1;; esac;;\n"
        "esac; done\n"
        f'case "$*" in *"metal/{failing or "-none-"} "*)\n'
        f'  echo "metal/{failing}:3:1: error: unknown type name" >&2; exit 1;; esac\n'
        "exit 0\n"
    )
    xcrun.chmod(0o755)
    temp = tmp_path / "runner"
    temp.mkdir()
    script = step("Compile each kernel")["run"].replace("${{ matrix.os }}", "macos-test")
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "RUNNER_TEMP": str(temp),
        "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
    }
    # As GitHub runs a step's script: bash --noprofile --norc -eo pipefail.
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line.split() for line in lines], result.stdout, result.returncode


def test_the_kernel_loop_compiles_each_file_at_its_listed_version(tmp_path):
    calls, out, status = run_kernel_loop(tmp_path, {"3.1", "4.0"})
    assert status == 0, out
    versions = msl_versions()
    kernels = sorted(p.name for p in (REPO / "metal").glob("*.metal"))
    compiled = {}
    for args in calls:
        source = args[-3]
        if source.startswith("metal/"):
            assert "-Wall" in args and "-fno-fast-math" in args
            compiled[source.removeprefix("metal/")] = args
    assert sorted(compiled) == kernels
    for name, args in compiled.items():
        msl, macos = versions.get(name, versions["default"])
        assert f"-std=metal{msl}" in args, (name, args)
        assert f"-mmacosx-version-min={macos}" in args, (name, args)
    assert "metal/quantized_gemm_tensor_ops.metal: compiled at MSL 4.0" in out


def test_a_compiler_without_msl_4_skips_that_file_only(tmp_path):
    calls, out, status = run_kernel_loop(tmp_path, {"3.1"})
    assert status == 0, out
    assert (
        "metal/quantized_gemm_tensor_ops.metal: skipped (this compiler does not take MSL 4.0" in out
    )
    assert "metal/quantized_gemm.metal: compiled at MSL 3.1" in out
    assert not any(args[-3] == "metal/quantized_gemm_tensor_ops.metal" for args in calls)


def test_a_file_that_does_not_compile_fails_the_step(tmp_path):
    calls, out, status = run_kernel_loop(tmp_path, {"3.1", "4.0"}, failing="rms_norm.metal")
    assert status == 1, out
    assert "metal/rms_norm.metal: FAILED at MSL 3.1" in out
    assert "::error file=metal/rms_norm.metal,line=3,col=1::unknown type name" in out
    # The loop goes on: every file is still compiled and reported.
    assert "metal/quantized_gemm_tensor_ops.metal: compiled at MSL 4.0" in out
