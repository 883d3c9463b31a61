"""The Metal memory preflight: its arithmetic and advice, in Python and in the device header.

`lily.diagnostics.preflight` and `csrc/metal/metal_device.h` (compiled here as plain C++, as
bindings.cpp
does on a Mac) must give the same message for every case; the expectations below are worked
out by hand from the policy (4 GiB or an eighth of RAM left to macOS, 1 GiB of headroom).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

from lily.diagnostics.preflight import GIB, MIB, WiredPlan, preflight_message, system_reserve

REPO = Path(__file__).resolve().parent.parent
WIRED_MARGIN = 1024 * MIB

# (needed, recommended, physical) in bytes: Macs of 16 to 192 GiB, needs around each limit.
CASES = [
    (needed, recommended, physical)
    for physical_gib, recommended_gib in [(16, 10.7), (24, 16), (32, 21.3), (64, 48), (192, 144)]
    for physical in [physical_gib * GIB]
    for recommended in [int(recommended_gib * GIB)]
    for needed in sorted(
        {
            recommended // 2,
            recommended,
            recommended + 1,
            physical - system_reserve(physical) - WIRED_MARGIN - MIB,
            physical - system_reserve(physical) - WIRED_MARGIN,
            physical - system_reserve(physical) - WIRED_MARGIN + 1,
            physical + GIB,
        }
    )
    if needed > 0
]

PROGRAM = r"""
#include "metal/metal_device.h"
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  for (int i = 1; i + 2 < argc; i += 3) {
    const std::string message = lily::metal::memory_preflight_message(
        std::strtoull(argv[i], nullptr, 10), std::strtoull(argv[i + 1], nullptr, 10),
        std::strtoull(argv[i + 2], nullptr, 10));
    std::printf("%s\n@@@\n", message.c_str());
  }
}
"""


@pytest.fixture(scope="module")
def header_messages(tmp_path_factory) -> list[str]:
    compiler = shutil.which("clang++-19") or shutil.which("clang++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler on PATH (the build needs one anyway)")
    work = tmp_path_factory.mktemp("preflight")
    (work / "main.cpp").write_text(PROGRAM)
    binary = work / "preflight"
    subprocess.run(
        [compiler, "-std=c++20", "-I", str(REPO / "csrc"), str(work / "main.cpp"), "-o", binary],
        check=True,
    )
    args = [str(v) for case in CASES for v in case]
    out = subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout
    return [m.removesuffix("\n") for m in out.split("@@@\n")[:-1]]


def test_python_and_the_device_header_agree(header_messages):
    assert len(header_messages) == len(CASES)
    for case, message in zip(CASES, header_messages, strict=True):
        assert preflight_message(*case) == message, case


def test_within_the_recommended_working_set_nothing_is_said():
    assert preflight_message(16 * GIB, 16 * GIB, 24 * GIB) == ""
    assert WiredPlan(16 * GIB, 16 * GIB, 24 * GIB).fits


def test_a_24_gib_mac_can_wire_20_gib_but_not_22():
    assert system_reserve(24 * GIB) == 4 * GIB
    fits = preflight_message(18 * GIB, 16 * GIB, 24 * GIB)
    assert "sudo sysctl iogpu.wired_limit_mb=19456\n" in fits  # 18 GiB + 1 GiB of headroom
    assert "leaves macOS and other apps 5.0 GiB of the 24.0 GiB of RAM" in fits
    assert "iogpu.wired_limit_mb=0` restores the default" in fits
    refused = preflight_message(21 * GIB, 16 * GIB, 24 * GIB)
    assert "does not fit even with a raised limit" in refused
    assert "at most 20.0 GiB can be wired safely (macOS and other apps need 4.0 GiB)" in refused
    assert "sysctl" not in refused


def test_the_reserve_grows_with_ram():
    assert system_reserve(16 * GIB) == 4 * GIB
    assert system_reserve(32 * GIB) == 4 * GIB
    assert system_reserve(64 * GIB) == 8 * GIB
    assert system_reserve(128 * GIB) == 16 * GIB
    plan = WiredPlan(100 * GIB, 96 * GIB, 128 * GIB)
    assert plan.safe_limit_mib == 112 * 1024
    assert plan.wired_limit_mib == 101 * 1024
    assert plan.raisable


def test_the_suggested_limit_rounds_the_need_up_to_whole_mib():
    plan = WiredPlan(17 * GIB + 1, 16 * GIB, 24 * GIB)
    assert plan.wired_limit_mib == 17 * 1024 + 1 + 1024
    assert f"iogpu.wired_limit_mb={plan.wired_limit_mib}\n" in preflight_message(
        17 * GIB + 1, 16 * GIB, 24 * GIB
    )


@pytest.mark.parametrize(
    ("needed", "physical"), list(itertools.product([20 * GIB, 40 * GIB], [8 * GIB, 24 * GIB]))
)
def test_advice_never_suggests_wiring_more_than_the_safe_limit(needed, physical):
    message = preflight_message(needed, 4 * GIB, physical)
    if "wired_limit_mb=" in message:
        limit_mib = int(message.split("wired_limit_mb=")[1].split()[0])
        assert limit_mib * MIB <= physical - system_reserve(physical)
