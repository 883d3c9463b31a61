"""cmake/metal.cmake without Xcode's Metal toolchain: by default the build goes on (the metal
device compiles the kernels at first run); with LILY_REQUIRE_METALLIB=ON, as the macOS workflow
builds, it fails. Configured here on a stand-in project around the real file, with `xcrun`
absent from PATH, or present as a stand-in that reports a toolchain."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def compilers() -> dict[str, str]:
    for version in ("-19", "-20", "-18", "-17", ""):
        if shutil.which(f"clang++{version}") and shutil.which(f"clang{version}"):
            return {
                "CC": f"clang{version}",
                "CXX": f"clang++{version}",
                "OBJCXX": f"clang++{version}",
            }
    pytest.skip("no clang to configure an Objective-C++ project with")


def configure(
    tmp_path: Path, *, require: bool, xcrun: bool, versions: str | None = None
) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    source = tmp_path / "project"
    for directory in ("cmake", "metal", "csrc/metal"):
        (source / directory).mkdir(parents=True)
    shutil.copy(REPO / "cmake" / "metal.cmake", source / "cmake")
    (source / "metal" / "kernel.metal").write_text("")
    (source / "metal" / "newer.metal").write_text("")
    # The real list's format, with the stand-in's files.
    (source / "metal" / "msl_versions.txt").write_text(
        versions or "# comment\ndefault 3.1 14.0\nnewer.metal 4.0 26.0\n"
    )
    for device_source in ("metal_device.mm", "gpu_core_count.cpp"):
        (source / "csrc" / "metal" / device_source).write_text("")
    (source / "module.cpp").write_text("int x;\n")
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\n"
        "project(stand_in LANGUAGES CXX)\n"
        "add_library(_native MODULE module.cpp)\n"
        "include(cmake/metal.cmake)\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if xcrun:
        stand_in = bin_dir / "xcrun"
        stand_in.write_text("#!/bin/sh\nexit 0\n")
        stand_in.chmod(0o755)
    # PATH without any real xcrun: the compilers and cmake are found by absolute path.
    env = {**os.environ, **{k: shutil.which(v) for k, v in compilers().items()}}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    option = f"-DLILY_REQUIRE_METALLIB={'ON' if require else 'OFF'}"
    return subprocess.run(
        [cmake, "-S", str(source), "-B", str(tmp_path / "build"), option],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


@pytest.mark.skipif(shutil.which("xcrun") is not None, reason="a real Metal toolchain is here")
def test_without_a_toolchain_the_build_goes_on_by_default(tmp_path):
    result = configure(tmp_path, require=False, xcrun=False)
    assert result.returncode == 0, result.stderr
    assert "compile metal/*.metal at first run" in result.stdout


@pytest.mark.skipif(shutil.which("xcrun") is not None, reason="a real Metal toolchain is here")
def test_without_a_toolchain_a_required_metallib_fails_the_build(tmp_path):
    result = configure(tmp_path, require=True, xcrun=False)
    assert result.returncode != 0
    assert "LILY_REQUIRE_METALLIB is ON but lily.metallib cannot be built" in result.stderr


def test_with_a_toolchain_a_required_metallib_is_built(tmp_path):
    result = configure(tmp_path, require=True, xcrun=True)
    assert result.returncode == 0, result.stderr
    assert "building lily.metallib with xcrun metal at MSL 3.1" in result.stdout
    assert "(left to the device: newer.metal)" in result.stdout
    # The metallib's commands: the default-version file at MSL 3.1 for macOS 14, the file listed
    # at MSL 4.0 not at all.
    rules = "\n".join(
        path.read_text(errors="replace")
        for path in (tmp_path / "build").rglob("*")
        if path.is_file() and path.suffix in {".make", ".ninja", ""}
    )
    assert "-std=metal3.1 -mmacosx-version-min=14.0 -fno-fast-math" in rules
    assert "kernel.metal" in rules
    assert "newer.metal" not in rules


def test_an_unreadable_version_list_fails_the_build(tmp_path):
    result = configure(tmp_path, require=False, xcrun=True, versions="default 3.1\n")
    assert result.returncode != 0
    assert 'metal/msl_versions.txt: cannot read the line "default 3.1"' in result.stderr
