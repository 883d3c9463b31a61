// The Metal device (Apple silicon): the device interface of device.h implemented on Metal.
//
// Plain C++ on purpose: bindings.cpp includes this header, and only metal_device.mm sees
// Objective-C. Everything here except memory_preflight_message() is compiled on Apple platforms
// only; that function is pure arithmetic so that it can be checked anywhere.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "device.h"

namespace lily::metal {

// Where the kernels come from. A metallib built with Xcode's Metal toolchain when the wheel was
// built is used if `metallib_path` names an existing file; otherwise every `*.metal` file in
// `source_dir` is compiled when the device opens (quoted #includes resolve inside `source_dir`).
struct KernelSources {
  std::string metallib_path;
  std::string source_dir;
};

struct DeviceInfo {
  std::string name;                        // e.g. "Apple M2 Pro"
  std::string gpu_family;                  // highest known: "apple7", "apple8", "apple9" or "none"
  bool supported = false;                  // the kernels can run here (family, Metal 3, macOS)
  std::string unsupported_reason;          // why not, when !supported
  uint64_t recommended_working_set = 0;    // bytes; recommendedMaxWorkingSetSize
  uint64_t max_buffer_length = 0;          // bytes; largest single MTLBuffer
  uint64_t physical_memory = 0;            // bytes of RAM
  std::string os_version;                  // NSProcessInfo's operatingSystemVersionString
};

// Describes the system default Metal device. Throws std::runtime_error if there is none.
DeviceInfo device_info();

// Opens the system default device and loads the kernel library. Throws std::runtime_error with a
// clear message if the GPU or macOS is too old, or with the compiler's log if the kernels fail
// to compile.
std::shared_ptr<Device> open_device(const KernelSources& sources);

// Fails before anything is allocated when `bytes_needed` (everything the caller plans to keep
// on the GPU at once) exceeds what Metal recommends for this Mac. Throws std::runtime_error
// with the advice of memory_preflight_message().
void check_memory(uint64_t bytes_needed);

// GPU execution time (GPUEndTime - GPUStartTime) of the most recent graph `device` finished
// waiting for, in seconds. Throws std::invalid_argument if `device` is not a Metal device.
double last_gpu_seconds(const Device& device);

// Empty when `bytes_needed` fits in `recommended` bytes of GPU working set; otherwise a message
// saying by how much it does not, and either the `sysctl iogpu.wired_limit_mb` command that
// raises the limit (until the next reboot) or, when even that would leave macOS less than
// kSystemReserveMiB of RAM, that the run does not fit on this Mac.
inline constexpr uint64_t kMiB = 1024 * 1024;
inline constexpr uint64_t kSystemReserveMiB = 2048;  // RAM left to macOS and other apps
inline constexpr uint64_t kWiredMarginMiB = 1024;    // headroom above the caller's estimate

inline std::string memory_preflight_message(uint64_t bytes_needed, uint64_t recommended,
                                            uint64_t physical) {
  if (bytes_needed <= recommended) return {};
  auto gib = [](uint64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f GiB", double(bytes) / double(1024 * kMiB));
    return std::string(text);
  };
  std::string message = "this run needs " + gib(bytes_needed) +
                        " of GPU memory, but Metal recommends at most " + gib(recommended) +
                        " on this Mac (recommendedMaxWorkingSetSize). ";
  const uint64_t wired_mib = (bytes_needed + kMiB - 1) / kMiB + kWiredMarginMiB;
  const uint64_t physical_mib = physical / kMiB;
  if (physical_mib < kSystemReserveMiB || wired_mib > physical_mib - kSystemReserveMiB) {
    return message + "With " + gib(physical) +
           " of RAM it does not fit even with a raised limit: ask for less memory (for example "
           "a shorter maximum sequence length).";
  }
  return message + "Either ask for less memory (for example a shorter maximum sequence length), " +
         "or raise the GPU wired-memory limit until the next reboot with:\n  sudo sysctl " +
         "iogpu.wired_limit_mb=" + std::to_string(wired_mib);
}

}  // namespace lily::metal
