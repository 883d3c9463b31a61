"""The sim pre-pass (csrc/sim/prepass.py) on kernel signatures Apple's compiler treats specially:
mixed dimensions of the position and size built-ins (refused, as Apple's compiler refuses them)
and [[max_total_threads_per_threadgroup(N)]] (registered as the kernel's limit)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM_DIR = ROOT / "csrc" / "sim"
sys.path.insert(0, str(SIM_DIR))
from prepass import Prepass, PrepassError  # noqa: E402


def translate(source: str) -> str:
    return Prepass(source, "case.metal").run()


def kernel(params: str, attributes: str = "[[kernel]]") -> str:
    return f"{attributes} void k(device uint* out [[buffer(0)]], {params}) {{ out[0] = 1; }}\n"


# The embedding and sampling kernels' signatures before they were fixed, and other mixes.
@pytest.mark.parametrize(
    "params",
    [
        "uint2 group [[threadgroup_position_in_grid]], uint threads [[threads_per_threadgroup]]",
        "uint i [[thread_position_in_grid]], uint3 grid [[threads_per_grid]]",
        "uint3 gid [[thread_position_in_grid]], uint2 groups [[threadgroups_per_grid]]",
        "ushort2 tid [[thread_position_in_threadgroup]], uint3 tg [[threadgroup_position_in_grid]]",
    ],
)
def test_position_and_size_builtins_of_mixed_dimensions_are_refused(params):
    with pytest.raises(PrepassError, match="same number of components"):
        translate(kernel(params))


@pytest.mark.parametrize(
    "params",
    [
        "ushort3 tid [[thread_position_in_threadgroup]], uint3 size [[threads_per_threadgroup]]",
        "uint gid [[thread_position_in_grid]], ushort size [[threads_per_grid]]",
        "uint2 tg [[threadgroup_position_in_grid]], ushort2 groups [[threadgroups_per_grid]]",
    ],
)
def test_paired_builtins_of_different_types_are_refused(params):
    with pytest.raises(PrepassError, match="same data type"):
        translate(kernel(params))


def test_position_builtins_must_be_uint_or_ushort():
    with pytest.raises(PrepassError, match="uint or ushort"):
        translate(kernel("int i [[thread_position_in_grid]]"))


@pytest.mark.parametrize(
    "params",
    [
        # Indices within a threadgroup or SIMD-group are scalars whatever the grid's dimension.
        "uint2 group [[threadgroup_position_in_grid]], uint2 threads [[threads_per_threadgroup]], "
        "uint thread_id [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]",
        "uint3 gid [[thread_position_in_grid]], ushort3 tid [[thread_position_in_threadgroup]], "
        "ushort3 size [[threads_per_threadgroup]], const uint3 groups [[threadgroups_per_grid]]",
        "uint group [[threadgroup_position_in_grid]], uint sgs [[simdgroups_per_threadgroup]]",
    ],
)
def test_consistent_builtins_are_accepted(params):
    assert "lily_entry_0" in translate(kernel(params))


def registered_limit(output: str, host_name: str) -> str:
    """The limit registered with a kernel's entry: its KernelInfo's last field."""
    entry = re.search(rf'\{{"{host_name}", &lily_entry_\d+, "[^"]*", ([^}}]*)\}}', output)
    assert entry, output
    return entry.group(1)


@pytest.mark.parametrize(
    "attributes",
    [
        "[[kernel, max_total_threads_per_threadgroup(kThreads)]]",
        "[[max_total_threads_per_threadgroup(kThreads)]] kernel",
        "[[max_total_threads_per_threadgroup(kThreads)]] [[kernel]]",
    ],
)
def test_max_total_threads_is_registered_in_every_spelling(attributes):
    source = (
        "namespace lily {\nconstant uint kThreads = 128;\n"
        + kernel("uint i [[thread_position_in_grid]]", attributes)
        + "}\n"
    )
    output = translate(source)
    assert "constexpr unsigned lily_max_threads_k = (kThreads);" in output
    assert registered_limit(output, "k") == "lily::lily_max_threads_k"


def test_kernels_without_a_declared_maximum_register_none():
    assert registered_limit(translate(kernel("uint i [[thread_position_in_grid]]")), "k") == "0"


def test_template_kernels_register_their_maximum_for_every_instantiation():
    source = (
        "template <typename T>\n"
        "[[kernel, max_total_threads_per_threadgroup(256)]] void t(device T* out [[buffer(0)]],\n"
        "    uint i [[thread_position_in_grid]]) { out[i] = T(0); }\n"
        'template [[host_name("t_float")]] [[kernel]] decltype(t<float>) t<float>;\n'
        'template [[host_name("t_half")]] [[kernel]] decltype(t<half>) t<half>;\n'
    )
    output = translate(source)
    assert registered_limit(output, "t_float") == "lily_max_threads_t"
    assert registered_limit(output, "t_half") == "lily_max_threads_t"


def test_max_total_threads_on_an_instantiation_is_refused():
    source = (
        "template <typename T>\n"
        "[[kernel]] void t(device T* out [[buffer(0)]]) { out[0] = T(0); }\n"
        'template [[host_name("t_float")]] [[kernel, max_total_threads_per_threadgroup(64)]]\n'
        "    decltype(t<float>) t<float>;\n"
    )
    with pytest.raises(PrepassError, match="kernel template's definition"):
        translate(source)


def test_the_attribute_keeps_line_numbers():
    body = kernel(
        "uint i [[thread_position_in_grid]]", "[[kernel, max_total_threads_per_threadgroup(64)]]"
    )
    output = translate(body + "void after();\n")
    kernel_file = output.split('# 1 "<lily-sim kernel wrappers>"')[0]
    line = next(i for i, text in enumerate(kernel_file.splitlines()) if "after()" in text)
    assert line == 5  # after the 4 lines put before the kernel file, and the kernel's line


def clang() -> str | None:
    for name in ("clang++-19", "clang++-20", "clang++-18", "clang++-17", "clang++"):
        if shutil.which(name):
            return name
    return None


@pytest.mark.parametrize(("count", "accepted"), [(1024, True), (0, False), (2048, False)])
def test_a_maximum_outside_1_to_1024_does_not_compile(tmp_path, count, accepted):
    compiler = clang()
    if compiler is None:
        pytest.skip("no clang++ to compile the sim's kernels")
    attributes = f"[[kernel, max_total_threads_per_threadgroup({count})]]"
    translated = tmp_path / "case.cpp"
    translated.write_text(translate(kernel("uint i [[thread_position_in_grid]]", attributes)))
    result = subprocess.run(
        [
            compiler,
            "-std=c++20",
            "-fsyntax-only",
            "-I",
            str(SIM_DIR / "include"),
            "-x",
            "c++",
            str(translated),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode == 0) == accepted, result.stderr
    if not accepted:
        assert "max_total_threads_per_threadgroup must be 1 to 1024" in result.stderr
