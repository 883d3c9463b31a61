"""Every sim translation unit compiles with the oldest clang Lily supports (issue 37).

cmake/compiler.cmake refuses clangs older than LILY_MIN_CLANG (17); this test holds the sources to
that promise, since CI otherwise builds with clang 19 only (Debian packages no clang-17). The
clang 17.0.6 is the one inside the `ziglang==0.12.0` wheel of the test extra, run as a plain clang
driver (`python -m ziglang clang --driver-mode=g++`) for the host's GNU target, so it compiles
against the system's libstdc++ and glibc as Debian's clang-17 would. (`zig c++` itself is not
used: it builds its compiler_rt and libc++ for every new flag set before compiling anything,
minutes on a fresh machine, and its -fsyntax-only always fails.)

What is compiled, each translation unit as CMakeLists.txt builds it on Linux:
- every metal/*.metal and tests/sim_kernels/*.metal file through the pre-pass, which runs with
  clang 17 too (its preprocessing and the MSL check, as a build configured with clang 17 does),
  then compiled twice: plain and as the checked build;
- the sim's runtime sources (csrc/sim/*.cpp) and, when nanobind is installed (the test extra
  pins it), the module's bindings.cpp against nanobind's and Python's headers.
The flags are the build's: the kernel, safety and checked-build lists are read from
CMakeLists.txt (cmake_list), with what CMake's Release configuration, C++20 and
nanobind_add_module add to every source of the module, and -mf16c where the host has F16C.
Each compile generates code (-c, to a throw-away object), so clang 17's back end lowers the
half/bfloat arithmetic and runs the checked build's ThreadSanitizer and coverage passes with
their -mllvm options; -Werror=unused-command-line-argument makes a flag that clang 17 accepts
but ignores an error, as CMake's flag probe does. Compiles run over two workers.

Not checked here: the link, nanobind's own library sources, the Apple-only flags and sources
(.mm, AppleClang 16: tools/check_macos_build.py and the macOS workflow), clang 17 against
libc++ (tests/test_libcxx_build.py uses the newest clang), and CMake's configure-time probes
run with clang 17 (tests/test_compiler_gate.py runs them with the newest clang).
"""

from __future__ import annotations

import platform
import re
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sim_compile import ROOT, SIM_DIR, SIM_INCLUDE, clang, cmake_list, prepass, shown

pytestmark = pytest.mark.skipif(
    sys.platform != "linux",
    reason="the ziglang clang stands in for a clang-17 package on Linux; Macs build with "
    "AppleClang, which CMake gates",
)

KERNEL_SOURCES = sorted((ROOT / "metal").glob("*.metal")) + sorted(
    (ROOT / "tests" / "sim_kernels").glob("*.metal")
)
RUNTIME_SOURCES = sorted(SIM_DIR.glob("*.cpp")) + [ROOT / "csrc" / "bindings.cpp"]
VARIANTS = ("plain", "checked")
WORKERS = 2


def min_clang() -> int:
    text = (ROOT / "cmake" / "compiler.cmake").read_text()
    return int(re.search(r"set\(LILY_MIN_CLANG (\d+)\)", text).group(1))


def host_has_f16c() -> bool:
    try:
        return " f16c" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def nanobind_include() -> list[str]:
    try:
        import nanobind
    except ImportError:
        return []
    return ["-I", nanobind.include_dir()]


# What CMake (Release, CXX_STANDARD 20 with extensions, a module library) and
# nanobind_add_module put on the command line of every source of the _native module.
MODULE_FLAGS = [
    '-DLILY_VERSION="0.1.0"',
    "-D_native_EXPORTS",
    "-I",
    str(ROOT / "csrc"),
    "-I",
    str(SIM_INCLUDE),
    "-I",
    sysconfig.get_paths()["include"],
    *nanobind_include(),
    "-O3",
    "-DNDEBUG",
    "-std=gnu++20",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-stack-protector",
    "-Os",
    "-ffunction-sections",
    "-fdata-sections",
]
# CMakeLists.txt's kernel flags on Linux: the kernel list, the safety list, -mf16c on an x86-64
# host that has F16C; the checked build adds its own list.
KERNEL_FLAGS = cmake_list("LILY_SIM_KERNEL_FLAGS") + cmake_list("LILY_SIM_SAFETY_FLAGS")
if platform.machine() in {"x86_64", "AMD64"} and host_has_f16c():
    KERNEL_FLAGS.append("-mf16c")
VARIANT_FLAGS = {
    "plain": KERNEL_FLAGS,
    "checked": KERNEL_FLAGS + cmake_list("LILY_SIM_CHECKED_FLAGS"),
}


@pytest.fixture(scope="module")
def clang17(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-file driver for the wheel's clang, usable wherever the build takes a compiler path
    (the pre-pass's --clang)."""
    try:
        import ziglang
    except ImportError:
        pytest.fail("ziglang is missing: pip install '.[test]' (it pins ziglang==0.12.0)")
    zig_lib = Path(ziglang.__file__).parent / "lib"  # clang's own headers are in its include/
    driver = tmp_path_factory.mktemp("clang17") / "clang++"
    command = [sys.executable, "-m", "ziglang", "clang", "--driver-mode=g++"]
    command += [f"--target={platform.machine()}-linux-gnu", "-resource-dir", str(zig_lib)]
    driver.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
    driver.chmod(0o755)
    version = subprocess.run([driver, "--version"], capture_output=True, text=True).stdout
    major = re.search(r"clang version (\d+)\.", version)
    assert major and int(major.group(1)) == min_clang(), (
        f"the test extra's ziglang must carry clang {min_clang()} (cmake/compiler.cmake's "
        f"minimum); it has:\n{version}"
    )
    return str(driver)


def compile_errors(compiler: str, source: Path, flags: list[str], out_dir: Path) -> str:
    """clang's diagnostics when compiling `source` fails, or ''."""
    obj = out_dir / (source.name + ".o")
    command = [compiler, *MODULE_FLAGS, *flags, "-Werror=unused-command-line-argument"]
    result = subprocess.run(
        [*command, "-c", str(source), "-o", str(obj)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    obj.unlink(missing_ok=True)
    if result.returncode == 0:
        return ""
    return result.stderr or f"exit status {result.returncode}"


@pytest.fixture(scope="module")
def results(clang17: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every translation unit compiled with clang 17, two at a time: id -> errors ('' if none)."""
    work = tmp_path_factory.mktemp("oldest_clang")

    def kernel(source: Path) -> dict[str, str]:
        out_dir = work / re.sub(r"[/.]", "_", shown(source))
        out_dir.mkdir()
        try:
            translated = prepass(source, out_dir, clang17)
        except pytest.fail.Exception as failure:  # the pre-pass itself failed under clang 17
            return {f"{shown(source)}[{variant}]": str(failure) for variant in VARIANTS}
        return {
            f"{shown(source)}[{variant}]": compile_errors(
                clang17, translated, VARIANT_FLAGS[variant], out_dir
            )
            for variant in VARIANTS
        }

    def runtime(source: Path) -> dict[str, str]:
        return {shown(source): compile_errors(clang17, source, [], work)}

    with ThreadPoolExecutor(WORKERS) as pool:
        jobs = [pool.submit(kernel, source) for source in KERNEL_SOURCES]
        if nanobind_include():
            jobs += [pool.submit(runtime, source) for source in RUNTIME_SOURCES]
        else:
            jobs += [pool.submit(runtime, s) for s in RUNTIME_SOURCES if s.name != "bindings.cpp"]
        found: dict[str, str] = {}
        for job in jobs:
            found.update(job.result())
    return found


@pytest.mark.parametrize(
    "unit",
    [f"{shown(s)}[{v}]" for s in KERNEL_SOURCES for v in VARIANTS],
)
def test_kernel_translation_unit_compiles_with_clang_17(results: dict[str, str], unit: str):
    assert not results[unit], f"{unit} with clang 17:\n{results[unit]}"


@pytest.mark.parametrize("source", RUNTIME_SOURCES, ids=shown)
def test_module_source_compiles_with_clang_17(results: dict[str, str], source: Path):
    if shown(source) not in results:
        pytest.skip("nanobind is not installed (the test extra pins it)")
    assert not results[shown(source)], f"{shown(source)} with clang 17:\n{results[shown(source)]}"


def test_an_injected_error_fails(clang17: str, tmp_path: Path):
    """The check can fail: a kernel translation unit with one broken line does not compile."""
    translated = prepass(ROOT / "metal" / "copy.metal", tmp_path, clang17)
    translated.write_text(translated.read_text() + "\nstatic int lily_injected = ;\n")
    errors = compile_errors(clang17, translated, VARIANT_FLAGS["plain"], tmp_path)
    assert "error: expected expression" in errors


def test_what_only_newer_clangs_accept_fails(clang17: str, tmp_path: Path):
    """The compiler really is the oldest: a builtin that clang 19 has and clang 17 lacks fails
    here, and compiles with the newest clang (the build's) when that is 19 or later; so does an
    -mllvm option clang 17 does not know."""
    case = tmp_path / "newer.cpp"
    case.write_text("unsigned bits(unsigned x) { return __builtin_popcountg(x); }\n")
    errors = compile_errors(clang17, case, KERNEL_FLAGS, tmp_path)
    assert "use of undeclared identifier '__builtin_popcountg'" in errors
    newest = subprocess.run([clang(), "--version"], capture_output=True, text=True).stdout
    if int(re.search(r"clang version (\d+)", newest).group(1)) >= 19:
        assert compile_errors(clang(), case, KERNEL_FLAGS, tmp_path) == ""
    unknown = compile_errors(clang17, case, ["-mllvm=-no-such-option-for-lily=1"], tmp_path)
    assert "Unknown command line argument '-no-such-option-for-lily=1'" in unknown


def test_a_flag_clang_17_ignores_fails(clang17: str, tmp_path: Path):
    """A flag that clang accepts and ignores is an error, as in CMake's probe."""
    case = tmp_path / "plain.cpp"
    case.write_text("int one() { return 1; }\n")
    assert compile_errors(clang17, case, [], tmp_path) == ""
    ignored = compile_errors(clang17, case, ["-L/nonexistent-lily-dir"], tmp_path)
    assert "argument unused during compilation: '-L/nonexistent-lily-dir'" in ignored
