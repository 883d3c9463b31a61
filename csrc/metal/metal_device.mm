// The Metal device: replays recorded graphs of the kernels in metal/*.metal on an Apple GPU.
//
// It knows buffers, kernels and graphs (device.h) and nothing else. No Mac was available when it
// was written: tests/objc_api_check.py checks every selector and class it names against Apple's
// public API, and .github/workflows/macos.yml compiles and runs it on macOS runners. Keep it
// small and plain so that a reader can check it line by line against Apple's documentation.
//
// Compiled with ARC (-fobjc-arc): Objective-C objects held in C++ members and containers are
// strong references, released by the C++ destructors.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <sys/sysctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "device.h"
#include "host_mirror.h"
#include "metal/metal_device.h"

// Residency sets and MTLMathMode exist from the macOS 15 SDK on, MTLGPUFamilyApple10 from the
// macOS 26 SDK on; older SDKs build without them.
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
#define LILY_MACOS_15_SDK 1
#else
#define LILY_MACOS_15_SDK 0
#endif
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 260000
#define LILY_MACOS_26_SDK 1
#else
#define LILY_MACOS_26_SDK 0
#endif

namespace fs = std::filesystem;

namespace lily::metal {
namespace {

// CPU and GPU share these pages on Apple silicon; hazards are tracked by Metal across command
// buffers, and inside one (concurrent) encoder by the explicit barriers between graph levels.
constexpr MTLResourceOptions kSharedStorage = MTLResourceStorageModeShared;
// setBytes:length:atIndex: is documented for data under 4 KB; larger blocks belong in buffers.
constexpr size_t kMaxInlineBytes = 4096;
// The kernels' simd_shuffle and simdgroup_matrix code assumes SIMD groups of 32 threads.
constexpr NSUInteger kSimdWidth = 32;

NSString* to_ns(const std::string& text) { return [NSString stringWithUTF8String:text.c_str()]; }

std::string to_std(NSString* text) {
  return text == nil ? std::string() : std::string(text.UTF8String);
}

std::string describe(NSError* error) {
  return error == nil ? std::string("no details from Metal") : to_std(error.localizedDescription);
}

// Apple documents that MTLCreateSystemDefaultDevice needs CoreGraphics linked on macOS, which
// cmake/metal.cmake does.
id<MTLDevice> default_device() {
  id<MTLDevice> device = MTLCreateSystemDefaultDevice();
  if (device == nil) {
    // Without a display (e.g. over ssh on some systems) there may be no "default" device.
    NSArray<id<MTLDevice>>* devices = MTLCopyAllDevices();
    if (devices.count > 0) device = [devices objectAtIndex:0];
  }
  if (device == nil) throw std::runtime_error("no Metal device found on this Mac");
  return device;
}

std::string gpu_family(id<MTLDevice> device) {
#if LILY_MACOS_26_SDK
  if (@available(macOS 26.0, *)) {
    if ([device supportsFamily:MTLGPUFamilyApple10]) return "apple10";
  }
#endif
  if ([device supportsFamily:MTLGPUFamilyApple9]) return "apple9";
  if ([device supportsFamily:MTLGPUFamilyApple8]) return "apple8";
  if ([device supportsFamily:MTLGPUFamilyApple7]) return "apple7";
  return "none";
}

// The kernels use simdgroup_matrix and bfloat (MSL 3.1): an Apple7-family GPU (M1 or later)
// with Metal 3, on macOS 14 or later. Empty when `device` qualifies.
std::string unsupported_reason(id<MTLDevice> device) {
  if (@available(macOS 14.0, *)) {
    if (![device supportsFamily:MTLGPUFamilyApple7] ||
        ![device supportsFamily:MTLGPUFamilyMetal3]) {
      return "the GPU \"" + to_std(device.name) +
             "\" is not in MTLGPUFamilyApple7 and MTLGPUFamilyMetal3 (Apple M1 or later), which "
             "the kernels need for simdgroup_matrix and bfloat";
    }
    return {};
  }
  return "the kernels need macOS 14 (Sonoma) or later for Metal Shading Language 3.1 (bfloat)";
}

// Keeps the device's buffers resident between command buffers (macOS 15 and later), so that
// gigabytes of mapped files are not made resident again for every graph. Without a residency
// set everything still works; Metal then makes each command buffer's buffers resident itself.
//
// Wired-memory policy: everything the device allocates or wraps joins the set, so all of it
// stays wired while the device is in use. New buffers are staged and committed once, before
// the next command buffer (loading adds many buffers; Apple asks for one commit after the
// changes). A removed buffer is committed at once, so that its memory is not held after Lily
// has let go of it. macOS may reclaim an idle set's residency, so, as llama.cpp does, a thread
// requests residency again every kKeepAliveTick while the device has run a graph within
// kKeepAliveWindow; after a longer pause the next submit requests it again, and meanwhile the
// set is left for macOS to page out.
#if LILY_MACOS_15_SDK
// Residency sets fail inside virtual machines such as GitHub's macOS runners (MLX skips them
// there for the same reason).
bool running_in_vm() {
  int present = 0;
  size_t size = sizeof present;
  return sysctlbyname("kern.hv_vmm_present", &present, &size, nullptr, 0) == 0 && present != 0;
}

constexpr std::chrono::milliseconds kKeepAliveTick{500};
constexpr std::chrono::seconds kKeepAliveWindow{180};

class Residency {
 public:
  Residency(id<MTLDevice> device, id<MTLCommandQueue> queue) {
    if (@available(macOS 15.0, *)) {
      if (running_in_vm()) return;
      MTLResidencySetDescriptor* descriptor = [[MTLResidencySetDescriptor alloc] init];
      descriptor.initialCapacity = 64;
      NSError* error = nil;
      id<MTLResidencySet> set = [device newResidencySetWithDescriptor:descriptor error:&error];
      if (set == nil) return;
      [queue addResidencySet:set];
      set_ = set;
      keeper_ = std::thread([this] { keep_alive(); });
    }
  }

  ~Residency() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (keeper_.joinable()) keeper_.join();
  }

  void add(id<MTLBuffer> buffer) {
    if (@available(macOS 15.0, *)) {
      std::lock_guard<std::mutex> lock(mutex_);
      id<MTLResidencySet> set = set_;
      if (set == nil) return;
      [set addAllocation:buffer];
      staged_ = true;
      unrequested_ = true;
    }
  }

  void remove(id<MTLBuffer> buffer) {
    if (@available(macOS 15.0, *)) {
      std::lock_guard<std::mutex> lock(mutex_);
      id<MTLResidencySet> set = set_;
      if (set == nil) return;
      [set removeAllocation:buffer];
      [set commit];
      staged_ = false;
    }
  }

  // Called before each command buffer is committed.
  void before_submit() {
    if (@available(macOS 15.0, *)) {
      std::lock_guard<std::mutex> lock(mutex_);
      id<MTLResidencySet> set = set_;
      if (set == nil) return;
      const auto now = std::chrono::steady_clock::now();
      if (staged_) [set commit];
      if (unrequested_ || now - last_submit_ > kKeepAliveWindow) [set requestResidency];
      staged_ = unrequested_ = false;
      last_submit_ = now;
    }
  }

 private:
  void keep_alive() {
    if (@available(macOS 15.0, *)) {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!wake_.wait_for(lock, kKeepAliveTick, [this] { return stopping_; })) {
        if (std::chrono::steady_clock::now() - last_submit_ > kKeepAliveWindow) continue;
        id<MTLResidencySet> set = set_;
        [set requestResidency];
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  id set_ = nil;  // an id<MTLResidencySet>, untyped because the type needs macOS 15 at run time
  bool staged_ = false;       // additions not committed yet
  bool unrequested_ = false;  // additions committed, or not, but not yet requested resident
  bool stopping_ = false;
  std::chrono::steady_clock::time_point last_submit_{};
  std::thread keeper_;
};
#else
class Residency {
 public:
  Residency(id<MTLDevice>, id<MTLCommandQueue>) {}
  void add(id<MTLBuffer>) {}
  void remove(id<MTLBuffer>) {}
  void before_submit() {}
};
#endif

// A buffer is a window onto an MTLBuffer: no-copy buffers must cover whole pages, so the
// window of a wrapped region may start `offset_` bytes into its MTLBuffer. Wrapped host memory
// is kept alive by the MTLBuffer's deallocator (see MetalDevice::wrap), not by this object:
// Metal may hold the MTLBuffer longer than Lily does.
class MetalBuffer final : public Buffer {
 public:
  MetalBuffer(id<MTLBuffer> buffer, size_t offset, size_t size, bool writable,
              std::shared_ptr<Residency> residency, std::unique_ptr<HostMirror> mirror = nullptr)
      : buffer_(buffer),
        offset_(offset),
        size_(size),
        writable_(writable),
        residency_(std::move(residency)),
        mirror_(std::move(mirror)) {
    residency_->add(buffer_);
  }
  ~MetalBuffer() override { residency_->remove(buffer_); }

  void* data() override { return mirror_ ? mirror_->host() : device_data(); }
  void* device_data() override { return static_cast<uint8_t*>([buffer_ contents]) + offset_; }
  HostMirror* mirror() override { return mirror_.get(); }
  size_t size() const override { return size_; }
  bool writable() const override { return writable_; }

  id<MTLBuffer> metal_buffer() const { return buffer_; }
  size_t offset() const { return offset_; }

 private:
  id<MTLBuffer> buffer_;
  size_t offset_;
  size_t size_;
  bool writable_;
  std::shared_ptr<Residency> residency_;
  std::unique_ptr<HostMirror> mirror_;
};

class MetalKernel final : public Kernel {
 public:
  MetalKernel(std::string name, id<MTLComputePipelineState> pipeline)
      : name_(std::move(name)), pipeline_(pipeline) {}

  const std::string& name() const override { return name_; }
  uint32_t max_threads_per_threadgroup() const override {
    return uint32_t(pipeline_.maxTotalThreadsPerThreadgroup);
  }
  id<MTLComputePipelineState> pipeline() const { return pipeline_; }

 private:
  std::string name_;
  id<MTLComputePipelineState> pipeline_;
};

// The path inside `#include "path"`, or empty for any other line (system includes stay).
std::string quoted_include(const std::string& line) {
  const size_t hash = line.find_first_not_of(" \t");
  if (hash == std::string::npos || line[hash] != '#') return {};
  const size_t word = line.find_first_not_of(" \t", hash + 1);
  if (word == std::string::npos || line.compare(word, 7, "include") != 0) return {};
  const size_t open = line.find('"', word + 7);
  const size_t close = open == std::string::npos ? open : line.find('"', open + 1);
  return close == std::string::npos ? std::string() : line.substr(open + 1, close - open - 1);
}

bool is_pragma_once(const std::string& line) {
  return line.find("#pragma once") != std::string::npos;
}

// newLibraryWithSource compiles one string and has no include path, so quoted #includes are
// inlined here (each file once, like #pragma once), with #line markers so that the compiler's
// messages name the real file and line.
void append_with_includes(const fs::path& file, std::set<fs::path>& seen, std::string& out) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("cannot read kernel source " + file.string());
  out += "#line 1 \"" + file.filename().string() + "\"\n";
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string header = quoted_include(line);
    if (header.empty()) {
      out += is_pragma_once(line) ? std::string() : line;
      out += '\n';
      continue;
    }
    const fs::path path = fs::weakly_canonical(file.parent_path() / header);
    if (seen.insert(path).second) append_with_includes(path, seen, out);
    out += "#line " + std::to_string(number + 1) + " \"" + file.filename().string() + "\"\n";
  }
}

// Metal 4's tensor ops (MSL 4.0) run on Apple10-family GPUs (M5). Lily uses them from macOS 26.2:
// the release MPPTensorOpsAvailability.h names for them and MLX requires, and the one whose
// MetalPerformancePrimitives headers the kernels were checked against (the OS compiles them with
// its own headers; macOS 26.0's differ, e.g. their operand table has no bfloat). The SDKs this
// builds against may predate both symbols, so they are spelled by value (MTLLanguageVersion is
// major << 16 | minor; MTLGPUFamilyAppleN is 1000 + N) and only used behind @available; with a
// macOS 26 SDK the values are checked against Apple's.
constexpr MTLLanguageVersion kLanguageVersion4_0 = static_cast<MTLLanguageVersion>(4 << 16);
constexpr MTLGPUFamily kGPUFamilyApple10 = static_cast<MTLGPUFamily>(1010);
#if LILY_MACOS_26_SDK
static_assert(kLanguageVersion4_0 == MTLLanguageVersion4_0, "MSL 4.0's enum value");
static_assert(kGPUFamilyApple10 == MTLGPUFamilyApple10, "the Apple10 family's enum value");
#endif
// The .metal files of `dir`, sorted: the tensor-op kernels (every `*_tensor_ops.metal`, each
// compiled on its own at MSL 4.0, never into lily.metallib: all or none run), or the others.
std::vector<fs::path> metal_sources(const std::string& dir, bool tensor_ops) {
  std::vector<fs::path> files;
  if (fs::is_directory(dir)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
      const fs::path& file = entry.path();
      const bool tensor_op_file = file.filename().string().ends_with("_tensor_ops.metal");
      if (file.extension() == ".metal" && tensor_op_file == tensor_ops) files.push_back(file);
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// `version`: the MSL version to compile at; the default (0) is the kernels' MSL 3.1.
id<MTLLibrary> compile_source(id<MTLDevice> device, const fs::path& file,
                              MTLLanguageVersion version = MTLLanguageVersion(0)) {
  std::set<fs::path> seen;
  std::string source;
  append_with_includes(file, seen, source);
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  if (@available(macOS 14.0, *)) options.languageVersion = MTLLanguageVersion3_1;
  if (version != MTLLanguageVersion(0)) options.languageVersion = version;
  // No fast math: the sim computes IEEE results and the tests compare the two devices. From
  // macOS 15, mathMode alone leaves the math functions (exp, log, ...) at their default, which
  // Apple documents as fast; fastMathEnabled = NO, as `metal -fno-fast-math` for lily.metallib,
  // sets both.
#if LILY_MACOS_15_SDK
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
  } else {
    options.fastMathEnabled = NO;
  }
#else
  options.fastMathEnabled = NO;
#endif
  NSError* error = nil;
  id<MTLLibrary> library = [device newLibraryWithSource:to_ns(source) options:options error:&error];
  if (library == nil) {
    throw std::runtime_error("Metal could not compile " + file.filename().string() + ":\n" +
                             describe(error));
  }
  return library;
}

// The prebuilt metallib when there is one, else one library per .metal source file.
std::vector<id<MTLLibrary>> load_libraries(id<MTLDevice> device, const KernelSources& sources) {
  if (!sources.metallib_path.empty() && fs::exists(sources.metallib_path)) {
    NSError* error = nil;
    NSURL* url = [NSURL fileURLWithPath:to_ns(sources.metallib_path)];
    id<MTLLibrary> library = [device newLibraryWithURL:url error:&error];
    if (library == nil) {
      throw std::runtime_error("Metal could not load " + sources.metallib_path + ": " +
                               describe(error));
    }
    return {library};
  }
  const std::vector<fs::path> files = metal_sources(sources.source_dir, false);
  if (files.empty()) {
    throw std::runtime_error("no metallib at \"" + sources.metallib_path +
                             "\" and no .metal sources in \"" + sources.source_dir + "\"");
  }
  std::vector<id<MTLLibrary>> libraries;
  for (const fs::path& file : files) libraries.push_back(compile_source(device, file));
  return libraries;
}

// The tensor-op libraries, when this Mac can run them, and which matrix path that makes.
struct TensorOps {
  std::vector<id<MTLLibrary>> libraries;
  GemmPath path;
};

TensorOps load_tensor_ops(id<MTLDevice> device, const KernelSources& sources) {
  const char* fallback = "; the simdgroup-matrix kernels run instead";
  if (@available(macOS 26.2, *)) {
    if (![device supportsFamily:kGPUFamilyApple10]) {
      return {{}, {false, "Metal 4 tensor ops need an Apple10-family GPU (M5 or later), and \"" +
                              to_std(device.name) + "\" is not one" + fallback}};
    }
    const std::vector<fs::path> files = metal_sources(sources.source_dir, true);
    if (files.empty()) {
      return {{}, {false, "no tensor-op kernel sources in \"" + sources.source_dir + "\"" +
                              fallback}};
    }
    std::vector<id<MTLLibrary>> libraries;
    for (const fs::path& file : files) {
      id<MTLLibrary> library = nil;
      try {
        library = compile_source(device, file, kLanguageVersion4_0);
      } catch (const std::runtime_error& e) {
        return {{}, {false, std::string(e.what()) + fallback}};
      }
      // A library that compiles may still fail to give pipelines (cooperative tensors are new):
      // build them now, while the simdgroup kernels can still take over.
      for (NSString* function_name in library.functionNames) {
        NSError* error = nil;
        id<MTLFunction> function = [library newFunctionWithName:function_name];
        if ([device newComputePipelineStateWithFunction:function error:&error] == nil) {
          return {{}, {false, "Metal could not build a pipeline for \"" + to_std(function_name) +
                                  "\": " + describe(error) + fallback}};
        }
      }
      libraries.push_back(library);
    }
    return {libraries,
            {true, "macOS 26.2 or later and an Apple10-family GPU: the tensor-op kernels run "
                   "(matmul2d, compiled at MSL 4.0 when the device opens)"}};
  }
  return {{}, {false, "Metal 4 tensor ops need macOS 26.2 or later, and this Mac runs " +
                          to_std([NSProcessInfo processInfo].operatingSystemVersionString) +
                          fallback}};
}

// What went wrong in a failed command buffer. After any of these the device refuses new work
// (see MetalDevice::wait): Metal may ignore a faulting process's later submissions.
std::string command_buffer_failure(NSError* error) {
  if (error == nil) return "the command buffer failed and Metal gave no error";
  if (![error.domain isEqualToString:MTLCommandBufferErrorDomain]) {
    return "Metal error " + to_std(error.domain) + " " + std::to_string(long(error.code)) + ": " +
           describe(error);
  }
  switch (static_cast<MTLCommandBufferError>(error.code)) {
    case MTLCommandBufferErrorTimeout:
      return "GPU timeout (a kernel ran too long or never finished): " + describe(error);
    case MTLCommandBufferErrorPageFault:
      return "GPU page fault (a kernel read or wrote outside its buffers): " + describe(error);
    case MTLCommandBufferErrorOutOfMemory:
      return "out of GPU memory: " + describe(error);
    case MTLCommandBufferErrorAccessRevoked:
      return "macOS revoked this process's GPU access after too many GPU faults or hangs "
             "(AccessRevoked: submissions ignored); restart the Python process: " +
             describe(error);
    case MTLCommandBufferErrorNotPermitted:
      return "this process may not use the GPU (NotPermitted): " + describe(error);
    case MTLCommandBufferErrorInvalidResource:
      return "a buffer of the graph was freed before it ran (InvalidResource): " + describe(error);
    case MTLCommandBufferErrorDeviceRemoved:
      return "the GPU was removed (DeviceRemoved): " + describe(error);
    default:
      return "command buffer error " + std::to_string(long(error.code)) + ": " + describe(error);
  }
}

class MetalDevice final : public Device {
 public:
  MetalDevice(id<MTLDevice> device, std::vector<id<MTLLibrary>> libraries, GemmPath gemm_path)
      : device_(device),
        gemm_path_(std::move(gemm_path)),
        queue_([device newCommandQueue]),
        residency_(std::make_shared<Residency>(device, queue_)) {
    for (id<MTLLibrary> library : libraries) {
      for (NSString* function in library.functionNames) {
        if (!libraries_.emplace(to_std(function), library).second) {
          throw std::runtime_error("two kernel libraries define \"" + to_std(function) + "\"");
        }
      }
    }
  }

  ~MetalDevice() override {
    @autoreleasepool {
      for (const InFlight& job : in_flight_) {
        for (id<MTLCommandBuffer> commands : job.commands) [commands waitUntilCompleted];
      }
    }
  }

  std::string name() const override { return "metal"; }

  GemmPath gemm_path() const override { return gemm_path_; }

  std::shared_ptr<Buffer> alloc(size_t bytes) override {
    check_length(bytes);
    id<MTLBuffer> buffer = [device_ newBufferWithLength:std::max<size_t>(bytes, 1)
                                                options:kSharedStorage];
    if (buffer == nil) {
      throw std::runtime_error("Metal could not allocate " + std::to_string(bytes) + " bytes");
    }
    std::memset([buffer contents], 0, bytes);
    return std::make_shared<MetalBuffer>(buffer, 0, bytes, true, residency_);
  }

  std::shared_ptr<Buffer> wrap(void* data, size_t bytes, bool writable,
                               std::shared_ptr<void> owner, bool file_mapped) override {
    // Apple documents newBufferWithBytesNoCopy for "a page-aligned pointer" and a length "that
    // results in a page-aligned region of memory" of an existing allocation: whole pages of a VM
    // allocation. A memory-mapped file is one (wrapped in place, widened to whole pages, each
    // holding a byte of the region); malloc'd memory is not, so it is mirrored in a buffer of
    // Metal's own, copied in at submit and back after the graph finished (host_mirror.h).
    if (!file_mapped) {
      check_length(bytes);
      id<MTLBuffer> buffer = [device_ newBufferWithBytes:data
                                                  length:std::max<size_t>(bytes, 1)
                                                 options:kSharedStorage];
      if (buffer == nil) throw std::runtime_error("Metal could not copy host memory");
      auto mirror = std::make_unique<HostMirror>(data, bytes, writable, std::move(owner));
      return std::make_shared<MetalBuffer>(buffer, 0, bytes, writable, residency_,
                                           std::move(mirror));
    }
    const uintptr_t page = uintptr_t(getpagesize());
    const uintptr_t begin = uintptr_t(data);
    const uintptr_t first_page = begin & ~(page - 1);
    const uintptr_t end_page = (begin + std::max<size_t>(bytes, 1) + page - 1) & ~(page - 1);
    check_length(end_page - first_page);
    // The map's owner is released when Metal frees the MTLBuffer, maybe after Lily's last
    // reference (a command buffer or the residency set holding it), on any thread; releasing a
    // Python owner needs the GIL, so it goes to a dispatch queue. If Metal fails to create the
    // buffer, the owner is deliberately leaked: Apple does not say whether the deallocator runs.
    auto* held = new std::shared_ptr<void>(std::move(owner));
    void (^release_owner)(void*, NSUInteger) = ^(void*, NSUInteger) {
      dispatch_async(dispatch_get_global_queue(QOS_CLASS_UTILITY, 0), ^{
        delete held;
      });
    };
    id<MTLBuffer> buffer = [device_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(first_page)
                                                      length:end_page - first_page
                                                     options:kSharedStorage
                                                 deallocator:release_owner];
    if (buffer == nil) {
      throw std::runtime_error("Metal could not wrap " + std::to_string(bytes) +
                               " bytes of a memory-mapped file");
    }
    return std::make_shared<MetalBuffer>(buffer, begin - first_page, bytes, writable,
                                         residency_);
  }

  std::shared_ptr<Kernel> kernel(const std::string& host_name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto cached = kernels_.find(host_name); cached != kernels_.end()) return cached->second;
    const auto library = libraries_.find(host_name);
    if (library == libraries_.end()) {
      throw std::invalid_argument("no kernel named \"" + host_name + "\"");
    }
    NSError* error = nil;
    id<MTLComputePipelineState> pipeline = nil;
    @autoreleasepool {
      id<MTLFunction> function = [library->second newFunctionWithName:to_ns(host_name)];
      pipeline = [device_ newComputePipelineStateWithFunction:function error:&error];
    }
    if (pipeline == nil) {
      throw std::runtime_error("Metal could not build a pipeline for \"" + host_name + "\": " +
                               describe(error));
    }
    if (pipeline.threadExecutionWidth != kSimdWidth) {
      throw std::runtime_error(
          "\"" + host_name + "\" runs " + std::to_string(uint64_t(pipeline.threadExecutionWidth)) +
          " threads per SIMD group on this GPU; Lily's kernels are written for " +
          std::to_string(uint64_t(kSimdWidth)));
    }
    auto created = std::make_shared<MetalKernel>(host_name, pipeline);
    kernels_.emplace(host_name, created);
    return created;
  }

  std::vector<std::string> kernel_names() const override {
    std::vector<std::string> names;
    for (const auto& entry : libraries_) names.push_back(entry.first);
    return names;
  }

  // A command buffer per stretch of the graph between its command-buffer boundaries (one for
  // most graphs), one concurrent compute encoder in each: the dispatches of a level may overlap
  // on the GPU, and a buffer barrier separates consecutive levels. Command buffers of one queue
  // run in commit order, so a boundary orders the levels around it as a barrier does. Nothing
  // is committed unless the whole graph encoded.
  uint64_t submit(const Graph& graph) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!fault_.empty()) {
      throw KernelError("the metal device stopped after a GPU fault (" + fault_ +
                        "); open a new device");
    }
    InFlight job;
    std::string problem;
    @autoreleasepool {
      id<MTLCommandBuffer> commands = [queue_ commandBuffer];
      id<MTLComputeCommandEncoder> encoder =
          [commands computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
      for (size_t level = 0; level < graph.levels().size() && problem.empty(); ++level) {
        const auto& dispatches = graph.levels()[level];
        if (level > 0 && graph.starts_command_buffer(level) && !dispatches.empty()) {
          [encoder endEncoding];
          job.commands.push_back(commands);
          commands = [queue_ commandBuffer];
          encoder = [commands computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
        } else if (level > 0) {
          [encoder memoryBarrierWithScope:MTLBarrierScopeBuffers];
        }
        for (const Dispatch& dispatch : dispatches) {
          problem = encode(encoder, dispatch, job);
          if (!problem.empty()) break;
        }
      }
      [encoder endEncoding];
      job.commands.push_back(commands);
      if (problem.empty()) {
        job.mirrored = graph.mirrored();
        for (const auto& buffer : job.mirrored) buffer->mirror()->submitted(buffer->device_data());
        residency_->before_submit();
        for (id<MTLCommandBuffer> part : job.commands) [part commit];
      } else {
        job.commands.clear();
      }
    }
    if (!problem.empty()) throw std::invalid_argument(problem);
    job.ticket = ++last_ticket_;
    in_flight_.push_back(std::move(job));
    return last_ticket_;
  }

  void wait(uint64_t ticket) override {
    // Declared before the lock so that the finished graphs' buffers are released after it: a
    // wrapped buffer's owner may need Python's GIL, which a thread blocked in submit() holds.
    std::vector<InFlight> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    if (ticket == 0 || ticket > last_ticket_) {
      throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
    }
    std::string failure;
    while (!in_flight_.empty() && in_flight_.front().ticket <= ticket) {
      finished.push_back(std::move(in_flight_.front()));
      in_flight_.pop_front();
      const InFlight& job = finished.back();
      @autoreleasepool {
        double gpu_seconds = 0;
        bool failed = false;
        for (id<MTLCommandBuffer> commands : job.commands) {
          [commands waitUntilCompleted];
          if (commands.status == MTLCommandBufferStatusError) {
            failed = true;
            if (failure.empty()) {
              failure = command_buffer_failure(commands.error) + describe_kernels(job);
            }
          } else {
            gpu_seconds += commands.GPUEndTime - commands.GPUStartTime;
          }
        }
        if (!failed) last_gpu_seconds_ = gpu_seconds;
      }
      for (const auto& buffer : job.mirrored) buffer->mirror()->finished(buffer->device_data());
    }
    if (!failure.empty()) {
      if (fault_.empty()) fault_ = failure;
      throw KernelError(failure);
    }
  }

  double last_gpu_seconds() const { return last_gpu_seconds_; }

 private:
  // A submitted graph: its command buffers, plus the buffers and kernels it uses, held until it
  // has been waited for. Declared after them, the command buffers are released first.
  struct InFlight {
    uint64_t ticket = 0;
    std::vector<std::shared_ptr<Buffer>> buffers;
    std::vector<std::shared_ptr<Kernel>> kernels;
    std::vector<std::shared_ptr<Buffer>> mirrored;  // host memory mirrored (host_mirror.h)
    std::vector<id<MTLCommandBuffer>> commands;
  };

  void check_length(size_t bytes) const {
    if (bytes > device_.maxBufferLength) {
      throw std::runtime_error("a buffer of " + std::to_string(bytes) +
                               " bytes exceeds this GPU's maxBufferLength of " +
                               std::to_string(uint64_t(device_.maxBufferLength)));
    }
  }

  // Encodes one dispatch; returns what is wrong with it instead, if anything.
  std::string encode(id<MTLComputeCommandEncoder> encoder, const Dispatch& dispatch,
                     InFlight& job) {
    auto* kernel = dynamic_cast<MetalKernel*>(dispatch.kernel.get());
    if (kernel == nullptr) return "a dispatch's kernel does not come from the metal device";
    const std::string& name = kernel->name();
    if (dispatch.threadgroups.count() == 0) return {};  // an empty grid has nothing to run
    if (dispatch.threads_per_threadgroup.count() > kernel->max_threads_per_threadgroup()) {
      return name + ": " + std::to_string(dispatch.threads_per_threadgroup.count()) +
             " threads per threadgroup, but on this GPU its pipeline allows at most " +
             std::to_string(kernel->max_threads_per_threadgroup()) +
             " (maxTotalThreadsPerThreadgroup, which depends on the kernel's register use); "
             "its launcher must size threadgroups from Kernel.max_threads_per_threadgroup";
    }
    [encoder setComputePipelineState:kernel->pipeline()];
    for (const BufferBinding& binding : dispatch.buffers) {
      auto* buffer = dynamic_cast<MetalBuffer*>(binding.buffer.get());
      if (buffer == nullptr) {
        return name + ": buffer " + std::to_string(binding.index) +
               " does not come from the metal device";
      }
      if (binding.offset > buffer->size()) {
        return name + ": offset " + std::to_string(binding.offset) + " is past the end of buffer " +
               std::to_string(binding.index);
      }
      [encoder setBuffer:buffer->metal_buffer()
                  offset:buffer->offset() + binding.offset
                 atIndex:binding.index];
      job.buffers.push_back(binding.buffer);
    }
    for (const BytesBinding& binding : dispatch.bytes) {
      if (binding.bytes.empty() || binding.bytes.size() > kMaxInlineBytes) {
        return name + ": inline parameters at index " + std::to_string(binding.index) +
               " must be 1 to " + std::to_string(kMaxInlineBytes) + " bytes";
      }
      [encoder setBytes:binding.bytes.data() length:binding.bytes.size() atIndex:binding.index];
    }
    NSUInteger threadgroup_bytes = [kernel->pipeline() staticThreadgroupMemoryLength];
    for (const ThreadgroupBinding& binding : dispatch.threadgroup_memory) {
      // Metal wants threadgroup memory lengths in multiples of 16 bytes.
      const NSUInteger length = (NSUInteger(binding.bytes) + 15) & ~NSUInteger(15);
      threadgroup_bytes += length;
      [encoder setThreadgroupMemoryLength:length atIndex:binding.index];
    }
    if (threadgroup_bytes > device_.maxThreadgroupMemoryLength) {
      return name + ": " + std::to_string(threadgroup_bytes) +
             " bytes of threadgroup memory, the GPU allows " +
             std::to_string(uint64_t(device_.maxThreadgroupMemoryLength));
    }
    const Size3& groups = dispatch.threadgroups;
    const Size3& threads = dispatch.threads_per_threadgroup;
    [encoder dispatchThreadgroups:MTLSizeMake(groups.x, groups.y, groups.z)
            threadsPerThreadgroup:MTLSizeMake(threads.x, threads.y, threads.z)];
    job.kernels.push_back(dispatch.kernel);
    return {};
  }

  // Metal does not say which dispatch of a command buffer failed; name the graph's kernels.
  static std::string describe_kernels(const InFlight& job) {
    std::vector<std::string> names;
    for (const auto& kernel : job.kernels) {
      if (std::find(names.begin(), names.end(), kernel->name()) == names.end()) {
        names.push_back(kernel->name());
      }
    }
    std::string text = " (in a graph of " + std::to_string(job.kernels.size()) + " dispatches of";
    for (size_t i = 0; i < names.size() && i < 8; ++i) text += " " + names[i];
    return text + (names.size() > 8 ? " ...)" : ")");
  }

  id<MTLDevice> device_;
  GemmPath gemm_path_;
  id<MTLCommandQueue> queue_;
  std::shared_ptr<Residency> residency_;
  std::map<std::string, id<MTLLibrary>> libraries_;  // kernel host name -> library defining it

  std::mutex mutex_;  // Python may release the GIL while a graph runs
  std::map<std::string, std::shared_ptr<MetalKernel>> kernels_;
  std::deque<InFlight> in_flight_;
  uint64_t last_ticket_ = 0;
  double last_gpu_seconds_ = 0;
  std::string fault_;  // the first failed command buffer's error; no work is accepted after it
};

}  // namespace

DeviceInfo device_info() {
  DeviceInfo info;
  @autoreleasepool {
    id<MTLDevice> device = default_device();
    info.name = to_std(device.name);
    info.gpu_family = gpu_family(device);
    info.gpu_core_count = gpu_core_count();
    info.unsupported_reason = unsupported_reason(device);
    info.supported = info.unsupported_reason.empty();
    info.recommended_working_set = device.recommendedMaxWorkingSetSize;
    info.max_buffer_length = device.maxBufferLength;
    info.physical_memory = [NSProcessInfo processInfo].physicalMemory;
    info.os_version = to_std([NSProcessInfo processInfo].operatingSystemVersionString);
  }
  return info;
}

std::shared_ptr<Device> open_device(const KernelSources& sources) {
  @autoreleasepool {
    id<MTLDevice> device = default_device();
    const std::string reason = unsupported_reason(device);
    if (!reason.empty()) throw std::runtime_error("the metal device cannot run here: " + reason);
    std::vector<id<MTLLibrary>> libraries = load_libraries(device, sources);
    TensorOps tensor_ops = load_tensor_ops(device, sources);
    libraries.insert(libraries.end(), tensor_ops.libraries.begin(), tensor_ops.libraries.end());
    return std::make_shared<MetalDevice>(device, std::move(libraries), std::move(tensor_ops.path));
  }
}

void check_memory(uint64_t bytes_needed) {
  const DeviceInfo info = device_info();
  const std::string advice =
      memory_preflight_message(bytes_needed, info.recommended_working_set, info.physical_memory);
  if (!advice.empty()) throw std::runtime_error(advice);
}

double last_gpu_seconds(const Device& device) {
  const auto* metal = dynamic_cast<const MetalDevice*>(&device);
  if (metal == nullptr) {
    throw std::invalid_argument("GPU timestamps exist only on the metal device");
  }
  return metal->last_gpu_seconds();
}

}  // namespace lily::metal
