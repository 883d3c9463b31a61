#!/usr/bin/env python3
"""Build Lily's native module for arm64 macOS from Linux, against Apple's SDK, as far as it goes.

No machine here is a Mac, so this is how the build a Mac runs is verified: CMake configures the
project for Darwin (APPLE is true: the metal device, Objective-C++, the Apple-only flags), and
every native translation unit is compiled with exactly the command CMake generates, the sim's
pre-passed kernel sources included, with clang for `arm64-apple-macos14` against the SDK given.
Then the extension module is linked with ld64.lld, as far as the SDK's `.tbd` stubs allow.

    python tools/check_macos_build.py SDK_DIR [--build-dir DIR] [--jobs N]
    python tools/check_macos_build.py --layout-sdk XCODE_FRAMEWORKS_DIR SDK_DIR
    python tools/check_macos_build.py --mpp-headers HEADERS_DIR [SDK_DIR ...]

The second form lays out an SDK root from a checkout of hexops/xcode-frameworks (commit 8a1cfb3
holds the macOS 14.2 SDK's Frameworks, include and lib): docs/apple-silicon.md says how to get it.
Nothing of the SDK is ever committed to this project.

The third form checks the tensor-op kernels against a macOS 26 SDK's MetalPerformancePrimitives
headers (copy the framework's Headers folder from an SDK: MPPTensorOpsMatMul2d.h and __impl/):
every declaration the tensor-op kernels (metal/*_tensor_ops.metal) use must be there as the sim
emulates it (the table in csrc/sim/tensor_ops_declarations.py), and the headers' table of
float/half/bfloat
operand types must be the one the sim accepts. It reads declarations only: Apple's Metal compiler
does not run here, so whether the kernels compile is known on a Mac alone (the device compiles
them when it opens, and falls back to the simdgroup-matrix kernels if that fails).

Needs: clang >= 17 with lld and the LLVM binutils of the same version (Debian: clang-19, lld-19,
llvm-19), cmake, ninja, and nanobind importable by this Python (`pip install nanobind ninja`).
Exit status 0 when every translation unit compiles without error and without a warning from the
project's own files, and the link accounts for every symbol; 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "csrc" / "sim"))
import tensor_ops_declarations as tensor_ops  # noqa: E402

TARGET = "arm64-apple-macos14"
DEPLOYMENT_TARGET = "14.0"

# Names the module takes from libSystem that no Linux library exports under the same name
# (blocks runtime, libdispatch, Darwin's stdio and TLV plumbing). They cannot be checked here.
DARWIN_ONLY = {
    "_NSConcreteStackBlock": "libsystem_blocks",
    "__sincosf_stret": "libsystem_m (the compiler's fused sinf/cosf)",
    "__stderrp": "libsystem_c (stderr)",
    "_tlv_bootstrap": "dyld (thread_local variables)",
    "__isPlatformVersionAtLeast": "compiler-rt's libclang_rt.osx.a (@available(macOS 26.0, *))",
    "dispatch_async": "libdispatch",
    "dispatch_get_global_queue": "libdispatch",
}
DIAGNOSTIC = re.compile(
    r"^(?P<path>[^\s:][^:]*):(?P<line>\d+):(?P<col>\d+): "
    r"(?P<kind>error|warning|fatal error): (?P<text>.*)$"
)
DRIVER_WARNING = re.compile(r"^clang(?:\+\+)?(?:-\d+)?: warning: (?P<text>.*)$")
NM_UNDEFINED = re.compile(
    r"^\s*\(undefined\) (?:weak )?external (?P<name>\S+)(?: \((?P<origin>.*)\))?$"
)


# ---- the SDK ----------------------------------------------------------------------------------


def layout_sdk(frameworks_checkout: Path, sdk: Path) -> None:
    """Make an SDK root (usr/include, usr/lib, System/Library/Frameworks) from a checkout of
    hexops/xcode-frameworks, which keeps the three folders at its top level with every symlink
    realised as a copy."""
    for part in ("Frameworks", "include", "lib"):
        if not (frameworks_checkout / part).is_dir():
            sys.exit(f"{frameworks_checkout} has no {part}/: not an xcode-frameworks checkout")
    if sdk.exists():
        sys.exit(f"{sdk} exists; remove it or name another directory")
    shutil.copytree(frameworks_checkout / "include", sdk / "usr" / "include", symlinks=True)
    shutil.copytree(frameworks_checkout / "lib", sdk / "usr" / "lib", symlinks=True)
    shutil.copytree(
        frameworks_checkout / "Frameworks", sdk / "System" / "Library" / "Frameworks", symlinks=True
    )
    add_version_links(sdk)
    print(f"SDK laid out at {sdk}")


def add_version_links(sdk: Path) -> None:
    """The checkout keeps each framework's Versions/Current only, but a framework stub re-exports
    others by install name (Foundation re-exports .../CoreFoundation.framework/Versions/A/...),
    and the linker looks those up under the SDK: give each Versions/Current its real name too."""
    install_name = re.compile(r"install-name:\s*'?(/\S+?)'?\s*$", re.MULTILINE)
    for current in sdk.glob("System/Library/Frameworks/**/Versions/Current"):
        framework = current.parent.parent
        stub = current / (framework.name.removesuffix(".framework") + ".tbd")
        if not stub.is_file():
            continue
        found = install_name.search(stub.read_text(errors="replace"))
        version = re.search(r"/Versions/([^/]+)/", found.group(1)) if found else None
        if version and not (current.parent / version.group(1)).exists():
            (current.parent / version.group(1)).symlink_to("Current")


def check_sdk(sdk: Path) -> None:
    needed = [
        "usr/include/c++/v1/vector",
        "usr/include/AvailabilityMacros.h",
        "System/Library/Frameworks/Metal.framework/Headers/Metal.h",
        "System/Library/Frameworks/Metal.framework/Metal.tbd",
    ]
    missing = [p for p in needed if not (sdk / p).exists()]
    if missing:
        sys.exit(
            f"{sdk} is not a macOS SDK root (missing {', '.join(missing)}); "
            "see --layout-sdk and docs/apple-silicon.md"
        )


# ---- tools ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolchain:
    clang: str
    llvm_bin: Path  # nm, ar, ranlib, install-name-tool of the same LLVM
    ld64: str


def find_toolchain(clang_name: str | None) -> Toolchain:
    names = [clang_name] if clang_name else [f"clang++-{v}" for v in range(22, 16, -1)]
    for name in names:
        clang = shutil.which(name) if name else None
        if not clang:
            continue
        version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout
        major = re.search(r"clang version (\d+)", version)
        if not major or int(major.group(1)) < 17:
            continue
        llvm_bin = Path(os.path.realpath(clang)).parent
        ld64 = shutil.which(f"ld64.lld-{major.group(1)}") or shutil.which("ld64.lld")
        tools = ["llvm-nm", "llvm-ar", "llvm-ranlib", "llvm-install-name-tool"]
        absent = [t for t in tools if not (llvm_bin / t).exists()]
        if ld64 is None or absent:
            sys.exit(
                f"{clang} lacks {', '.join(absent + ([] if ld64 else ['ld64.lld']))} "
                f"(Debian: lld-{major.group(1)} llvm-{major.group(1)})"
            )
        return Toolchain(clang, llvm_bin, ld64)
    sys.exit("no clang >= 17 found (Debian: apt install clang-19 lld-19 llvm-19), or pass --clang")


def toolchain_file(tools: Toolchain, sdk: Path, path: Path) -> None:
    # -nostdinc++ and the SDK's own libc++ headers: otherwise clang prefers a libc++ installed
    # beside it on this machine over Apple's, and the check would test the wrong library.
    libcxx = f"-nostdinc++ -isystem {sdk}/usr/include/c++/v1"
    path.write_text(
        f"""set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
set(CMAKE_OSX_ARCHITECTURES arm64)
set(CMAKE_OSX_DEPLOYMENT_TARGET {DEPLOYMENT_TARGET})
set(CMAKE_OSX_SYSROOT "{sdk}")
set(CMAKE_CXX_COMPILER "{tools.clang}")
set(CMAKE_OBJCXX_COMPILER "{tools.clang}")
set(CMAKE_CXX_COMPILER_TARGET {TARGET})
set(CMAKE_OBJCXX_COMPILER_TARGET {TARGET})
set(CMAKE_CXX_FLAGS_INIT "{libcxx}")
set(CMAKE_OBJCXX_FLAGS_INIT "{libcxx}")
# The SDK copy has no libSystem or libc++ stubs, so no test program links: compile-only checks.
set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
set(CMAKE_OBJCXX_COMPILER_WORKS TRUE)
set(CMAKE_LINKER_TYPE LLD)
set(CMAKE_NM "{tools.llvm_bin / "llvm-nm"}")
set(CMAKE_AR "{tools.llvm_bin / "llvm-ar"}")
set(CMAKE_RANLIB "{tools.llvm_bin / "llvm-ranlib"}")
set(CMAKE_INSTALL_NAME_TOOL "{tools.llvm_bin / "llvm-install-name-tool"}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
"""
    )


# ---- configure and compile --------------------------------------------------------------------


def run(cmd: list[str] | str, cwd: Path, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, shell=isinstance(cmd, str), **kw
    )


def configure(tools: Toolchain, sdk: Path, build: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    toolchain = build / "macos-toolchain.cmake"
    toolchain_file(tools, sdk, toolchain)
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    py = f"cpython-{sys.version_info.major}{sys.version_info.minor}-darwin"
    # What scikit-build-core passes on a Mac (pyproject.toml: Release), with the module named as
    # a Mac's CPython would name it.
    cmd = [
        "cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
        f"-DCMAKE_TOOLCHAIN_FILE={toolchain}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DSKBUILD_PROJECT_VERSION={version.group(1) if version else ''}",
        f"-DSKBUILD_SOABI={py}",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
    ]  # fmt: skip
    result = run(cmd, ROOT)
    if result.returncode != 0:
        sys.exit(f"CMake could not configure the macOS build:\n{result.stdout}\n{result.stderr}")
    print(f"configured for {TARGET} against {sdk.name} (CMake: APPLE, Release)")


@dataclass
class Unit:
    source: str
    command: str
    directory: Path
    own: bool  # the project's own file (or a sim kernel generated from one), not nanobind's
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def units(build: Path) -> list[Unit]:
    entries = json.loads((build / "compile_commands.json").read_text())
    found = []
    for entry in entries:
        source = Path(entry["file"])
        own = source.is_relative_to(ROOT) or source.is_relative_to(build / "sim_kernels")
        name = (
            str(source.relative_to(build))
            if source.is_relative_to(build)
            else (str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else source.name)
        )
        found.append(Unit(name, entry["command"], Path(entry["directory"]), own))
    return sorted(found, key=lambda u: (not u.own, u.source))


def generate_sim_sources(build: Path, all_units: list[Unit]) -> None:
    """Run the pre-pass (CMake's custom commands) for every generated kernel source."""
    generated = sorted(
        {u.source for u in all_units if u.source.startswith("sim_kernels/")}
        - {u.source for u in all_units if u.source.endswith("_checked.cpp")}
    )
    result = run(["ninja", "-k", "0", *generated], build)
    if result.returncode != 0:
        sys.exit(f"the sim pre-pass failed:\n{result.stdout}\n{result.stderr}")
    print(f"pre-passed {len(generated)} kernel files into C++")


def msl_check_against_sdk(tools: Toolchain, sdk: Path, build: Path) -> bool:
    """The pre-pass's MSL check (csrc/sim/msl_check.py, an address-space compile) again, with
    Apple's headers: on a Mac it runs with them, but here the build ran it with Linux's."""
    sys.path.insert(0, str(ROOT / "csrc" / "sim"))
    import msl_check  # the project's own module, on the path only from here

    target = ["-target", TARGET, "-isysroot", str(sdk)]
    target += ["-nostdinc++", "-isystem", f"{sdk}/usr/include/c++/v1"]
    msl_check.CHECK_FLAGS = [*msl_check.CHECK_FLAGS, *target]
    failed = 0
    sources = sorted((build / "sim_kernels").glob("*_metal.cpp"))
    for source in sources:
        errors = msl_check.check(source.read_text(), tools.clang, str(ROOT / "csrc/sim/include"))
        if errors:
            failed += 1
            print(f"  error   {source.name}: " + "; ".join(map(str, errors[:3])))
    print(
        f"\nthe pre-pass's MSL check with Apple's headers: {len(sources) - failed} of "
        f"{len(sources)} kernel files pass"
    )
    return failed == 0


def compile_unit(unit: Unit) -> Unit:
    result = run(unit.command, unit.directory)
    for line in result.stderr.splitlines():
        diag = DIAGNOSTIC.match(line)
        driver = DRIVER_WARNING.match(line)
        if diag and diag.group("kind") != "warning":
            unit.errors.append(line)
        elif diag:
            path = Path(unit.directory, diag.group("path")).resolve()
            if path.is_relative_to(ROOT) or "sim_kernels" in path.parts:
                unit.warnings.append(line)
        elif driver:
            unit.warnings.append(line)
    if result.returncode != 0 and not unit.errors:
        unit.errors.append(result.stderr.strip() or f"exit status {result.returncode}")
    return unit


def compile_all(all_units: list[Unit], jobs: int) -> bool:
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        done = list(pool.map(compile_unit, all_units))
    own = [u for u in done if u.own]
    groups = (
        ("Lily's translation units", own, " with no error and no warning"),
        ("nanobind's, built into the module", [u for u in done if not u.own], " with no error"),
    )
    for heading, group, criterion in groups:
        ok = sum(1 for u in group if not u.errors and not (u.own and u.warnings))
        print(f"\n{heading}: {ok} of {len(group)} compile{criterion}")
        for u in group:
            state = "error" if u.errors else ("warning" if u.own and u.warnings else "ok")
            print(f"  {state:7} {u.source}")
            for line in (u.errors + (u.warnings if u.own else []))[:8]:
                print(f"          {line}")
    return all(not u.errors for u in done) and all(not u.warnings for u in own)


# ---- link -------------------------------------------------------------------------------------


def link_steps(build: Path) -> tuple[str, str]:
    """The pre-link check and the link, as CMake wrote them for the module."""
    commands = run(["ninja", "-t", "commands", "_native"], build).stdout.splitlines()
    parts = [p.strip() for p in commands[-1].split(" && ")]
    steps = [p for p in parts if not p.startswith("cd ") and p != ":"]
    pre_link = next((p for p in steps if "check_sim_objects" in p), "")
    link = next(p for p in steps if "-bundle" in p or " -shared" in p)
    return pre_link, link


def exported_names(libraries: list[Path], nm: Path) -> set[str]:
    names: set[str] = set()
    for library in libraries:
        out = run([str(nm), "-D", "--defined-only", "--format=just-symbols", str(library)], ROOT)
        names |= {n.split("@")[0] for n in out.stdout.split()}
    return names


def linux_stand_ins(tools: Toolchain) -> list[Path]:
    """Linux's libc++ and C runtime: they export the C++ runtime's and the C library's names as
    Apple's libc++ and libSystem do, so they can vouch for names the SDK copy has no stub for."""
    found = []
    for name in ("libc++.so.1", "libc++abi.so.1", "libc.so.6", "libm.so.6", "libgcc_s.so.1"):
        out = run([tools.clang, f"-print-file-name={name}"], ROOT).stdout.strip()
        path = Path(out)
        if not path.is_absolute():
            for directory in (
                "/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu",
                "/lib/aarch64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
            ):
                if (Path(directory) / name).exists():
                    path = Path(directory) / name
                    break
        if path.is_absolute() and path.exists():
            found.append(path)
    return found


def link(tools: Toolchain, build: Path) -> bool:
    pre_link, command = link_steps(build)
    ok = True
    if pre_link:
        result = run(pre_link, build)
        verdict = "passes" if result.returncode == 0 else "FAILS"
        print(
            f"\npre-link check of the checked kernel objects (cmake/check_sim_objects.cmake): "
            f"{verdict}"
        )
        if result.returncode != 0:
            print(result.stdout + result.stderr)
            ok = False

    # CMake's own link, first: it can only stop at libc++ and libSystem, whose stubs the SDK copy
    # lacks. Anything else it reports is a real failure.
    exact = run(command + " -Wl,--error-limit=0", build)
    problems = [
        line for line in exact.stderr.splitlines()
        if line.startswith("ld64.lld: error:") and "undefined symbol" not in line
        and not re.search(r"library not found for -l(c\+\+|System)$", line)
    ]  # fmt: skip
    print(
        "\nlink as CMake wrote it: "
        + (
            "stops only at -lc++ and -lSystem (no stubs for them in this SDK copy)"
            if not problems
            else "FAILS:\n  " + "\n  ".join(problems)
        )
    )
    ok &= not problems

    # Then without the default libraries: the frameworks' and libobjc's stubs bind what they
    # export, and every other undefined name is left for dyld, to be accounted for below.
    module = re.search(r" -o (\S+)", command)
    assert module, command
    result = run(command + " -nostdlib -lobjc -Wl,-undefined,dynamic_lookup", build)
    if result.returncode != 0:
        print(f"link without the default libraries FAILS:\n{result.stderr}")
        return False
    output = build / module.group(1)
    print(f"linked {output.name} ({output.stat().st_size // 1024} KiB, Mach-O arm64 bundle)")

    nm = tools.llvm_bin / "llvm-nm"
    listing = run([str(nm), "-m", "-u", str(output)], build).stdout.splitlines()
    bound: dict[str, int] = {}
    looked_up: list[str] = []
    for line in listing:
        match = NM_UNDEFINED.match(line)
        if not match:
            continue
        origin = match.group("origin") or ""
        if origin.startswith("from "):
            library = origin.removeprefix("from ")
            bound[library] = bound.get(library, 0) + 1
        else:
            looked_up.append(match.group("name").removeprefix("_"))
    exports = run([str(nm), "-g", "--defined-only", "--format=just-symbols", str(output)], build)
    entry = "_PyInit__native" in exports.stdout.split()

    python_api = {
        n.strip().removeprefix("-U ").removeprefix("_")
        for n in python_symbol_list(build).read_text().splitlines()
        if n.strip()
    }
    stand_ins = exported_names(linux_stand_ins(tools), nm)
    python = [n for n in looked_up if n in python_api]
    runtime = [n for n in looked_up if n not in python_api and n in stand_ins]
    darwin = [n for n in looked_up if n in DARWIN_ONLY]
    unknown = [
        n for n in looked_up if n not in python_api and n not in stand_ins and n not in DARWIN_ONLY
    ]

    print(f"  module entry PyInit__native exported: {'yes' if entry else 'NO'}")
    stubs = ", ".join(f"{n} {library}" for library, n in sorted(bound.items()))
    print(f"  bound to the SDK's stubs: {stubs}")
    print(f"  Python C API, left to the interpreter (nanobind's -U list): {len(python)}")
    print(
        f"  C++ runtime and C library, not checkable against Apple's (no libc++/libSystem stubs "
        f"in this SDK copy); Linux's libc++/glibc export the same names: {len(runtime)}"
    )
    print(
        f"  Darwin-only libSystem names, unchecked: {len(darwin)} ("
        + ", ".join(f"{n}: {DARWIN_ONLY[n]}" for n in sorted(darwin))
        + ")"
    )
    if unknown:
        print(f"  UNACCOUNTED FOR (no stub, no stand-in exports them): {len(unknown)}")
        for name in sorted(unknown):
            print(f"    {name}")
    return ok and entry and not unknown


def python_symbol_list(build: Path) -> Path:
    """nanobind's list of Python C API names the module may leave undefined (`-U _Py...`)."""
    _, command = link_steps(build)
    found = re.search(r"-Wl,@(\S+darwin-ld-cpython\.sym)", command)
    if not found:
        sys.exit("the link command names no darwin-ld-cpython.sym: has nanobind changed?")
    return Path(found.group(1))


# ---- the tensor-op kernels against Apple's MetalPerformancePrimitives headers -----------------

# A row of the operand-type table in MPPTensorOpsMatMul2d.h's opening comment:
# `//  half       bfloat    float`.
TYPE_ROW = re.compile(r"^//\s+(\w+)\s+(\w+)\s+(\w+)\s*$", re.MULTILINE)
FLOAT_KINDS = {"float", "half", "bfloat"}


def header_text(headers: Path, name: str) -> str | None:
    found = sorted(headers.rglob(name))
    return found[0].read_text(errors="replace") if found else None


def check_mpp_headers(headers: Path) -> bool:
    """Print each declaration of the table with whether the headers under `headers` have it,
    then the operand-type table against the sim's; True when everything matches."""
    print(f"MetalPerformancePrimitives headers under {headers}:")
    texts: dict[str, str | None] = {}
    passed = True
    for declaration in tensor_ops.DECLARATIONS:
        if declaration.header not in texts:
            texts[declaration.header] = header_text(headers, declaration.header)
        text = texts[declaration.header]
        if text is None:
            found = f"MISSING ({declaration.header} not found)"
        else:
            flat = re.sub(r"\s+", " ", text)
            found = "ok" if re.search(declaration.pattern, flat) else "MISSING"
        passed &= found == "ok"
        print(f"  {found:<8} {declaration.header}: {declaration.what}")

    table_text = texts.get(tensor_ops.MATMUL2D_HEADER)
    if table_text is None:
        table_text = header_text(headers, tensor_ops.MATMUL2D_HEADER) or ""
    opening_comment = table_text.split("#ifndef", 1)[0]
    rows = {row for row in TYPE_ROW.findall(opening_comment) if set(row) <= FLOAT_KINDS}
    if rows == tensor_ops.OPERAND_TYPES:
        print(f"  ok       operand types: the sim accepts the headers' {len(rows)} float rows")
    else:
        passed = False
        for where, differing in (
            ("the headers", rows - tensor_ops.OPERAND_TYPES),
            ("the sim", tensor_ops.OPERAND_TYPES - rows),
        ):
            for a, b, c in sorted(differing):
                print(f"  DIFFERS  operand types: {a} x {b} -> {c} in {where} only")
    for a, b, c in tensor_ops.KERNEL_OPERAND_TYPES:
        if (a, b, c) not in rows:
            passed = False
            print(f"  MISSING  the kernels' operand types, {a} x {b} -> {c}")
    print(
        "  (declarations only: Apple's Metal compiler cannot run here, so whether the kernels "
        "compile is checked on a Mac, when the metal device opens)"
    )
    return passed


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sdk", type=Path, nargs="?", help="a macOS SDK root (usr/, System/)")
    parser.add_argument(
        "--layout-sdk",
        nargs=2,
        type=Path,
        metavar=("CHECKOUT", "SDK_DIR"),
        help="lay out an SDK root from a hexops/xcode-frameworks checkout",
    )
    parser.add_argument(
        "--mpp-headers",
        type=Path,
        metavar="HEADERS_DIR",
        help="check the tensor-op kernels' declarations against a macOS 26 SDK's "
        "MetalPerformancePrimitives headers (then build against SDK_DIR, if given)",
    )
    parser.add_argument("--build-dir", type=Path, help="default: a temporary directory")
    parser.add_argument("--clang", help="the clang++ to use (default: the newest clang++-N >= 17)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    if args.layout_sdk:
        layout_sdk(args.layout_sdk[0].resolve(), args.layout_sdk[1].resolve())
        return 0
    headers_passed = True
    if args.mpp_headers:
        if not args.mpp_headers.is_dir():
            sys.exit(f"{args.mpp_headers} is not a directory")
        headers_passed = check_mpp_headers(args.mpp_headers.resolve())
        print("\ntensor-op headers check: " + ("PASSED" if headers_passed else "FAILED"))
        if args.sdk is None:
            return 0 if headers_passed else 1
    if args.sdk is None:
        parser.error("give an SDK root (or --layout-sdk, or --mpp-headers)")
    sdk = args.sdk.resolve()
    check_sdk(sdk)
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found (pip install {tool})")
    tools = find_toolchain(args.clang)

    with tempfile.TemporaryDirectory(prefix="lily-macos-") as scratch:
        build = (args.build_dir or Path(scratch)).resolve()
        configure(tools, sdk, build)
        all_units = units(build)
        generate_sim_sources(build, all_units)
        compiled = compile_all(all_units, args.jobs)
        compiled &= msl_check_against_sdk(tools, sdk, build)
        linked = link(tools, build) if compiled else False
    print("\nmacOS build check: " + ("PASSED" if compiled and linked else "FAILED"))
    return 0 if compiled and linked and headers_passed else 1


if __name__ == "__main__":
    sys.exit(main())
