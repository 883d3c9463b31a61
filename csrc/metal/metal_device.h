// The Metal device (Apple silicon): the device interface of device.h implemented on Metal.
//
// Plain C++ on purpose: bindings.cpp includes this header, and only metal_device.mm sees
// Objective-C. Everything here except the memory preflight (system_reserve_bytes() and
// memory_preflight_message()) is compiled on Apple platforms only; the preflight is pure
// arithmetic so that it can be checked anywhere.
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
  std::string gpu_family;                  // "apple7" (M1) .. "apple10" (M5), or "none"
  uint32_t gpu_core_count = 0;             // GPU cores from the I/O Registry; 0 if unknown
  bool supported = false;                  // the kernels can run here (family, Metal 3, macOS)
  std::string unsupported_reason;          // why not, when !supported
  uint64_t recommended_working_set = 0;    // bytes; recommendedMaxWorkingSetSize
  uint64_t max_buffer_length = 0;          // bytes; largest single MTLBuffer
  uint64_t physical_memory = 0;            // bytes of RAM
  std::string os_version;                  // NSProcessInfo's operatingSystemVersionString
};

// Describes the system default Metal device. Throws std::runtime_error if there is none.
DeviceInfo device_info();

// The GPU's core count, which Metal does not give (gpu_core_count.cpp); 0 when unknown.
uint32_t gpu_core_count();

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

// Empty when `bytes_needed` fits in `recommended` bytes of GPU working set; otherwise what to
// do, with numbers. recommendedMaxWorkingSetSize is only Apple's approximation of what the GPU
// can use without hurting performance, so the run is stopped early rather than left to thrash,
// and the message either gives the `sysctl iogpu.wired_limit_mb` value that lets it run (the
// need plus kWiredMarginMiB, until the next reboot) or, when that would leave macOS and other
// apps less than system_reserve_bytes(), says the run does not fit on this Mac.
// src/lily/preflight.py computes the same message (tests/test_preflight.py compares the two).
inline constexpr uint64_t kMiB = 1024 * 1024;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kWiredMarginMiB = 1024;  // headroom above the caller's estimate

// RAM left to macOS and other apps: 4 GiB, or an eighth of RAM on larger Macs (a 24 GiB Mac
// can wire at most 20 GiB, a 128 GiB one 112 GiB).
inline uint64_t system_reserve_bytes(uint64_t physical) {
  return physical / 8 > 4 * kGiB ? physical / 8 : 4 * kGiB;
}

inline std::string memory_preflight_message(uint64_t bytes_needed, uint64_t recommended,
                                            uint64_t physical) {
  if (bytes_needed <= recommended) return {};
  auto gib = [](uint64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f GiB", double(bytes) / double(kGiB));
    return std::string(text);
  };
  const std::string message = "this run needs " + gib(bytes_needed) +
                              " of GPU memory, but Metal recommends at most " + gib(recommended) +
                              " on this Mac (recommendedMaxWorkingSetSize). ";
  const uint64_t reserve = system_reserve_bytes(physical);
  const uint64_t safe_limit_mib = physical > reserve ? (physical - reserve) / kMiB : 0;
  const uint64_t wired_mib = (bytes_needed + kMiB - 1) / kMiB + kWiredMarginMiB;
  if (wired_mib > safe_limit_mib) {
    return message + "It does not fit even with a raised limit: of this Mac's " + gib(physical) +
           " of RAM, at most " + gib(safe_limit_mib * kMiB) + " can be wired safely (macOS and " +
           "other apps need " + gib(reserve) + "). Ask for less memory, for example a shorter " +
           "maximum sequence length (max_seq) or an int8 KV cache (kv_cache='int8').";
  }
  return message + "Ask for less memory (for example a shorter maximum sequence length, " +
         "max_seq, or an int8 KV cache, kv_cache='int8'), or let the GPU wire more until the " +
         "next reboot with:\n  sudo sysctl iogpu.wired_limit_mb=" + std::to_string(wired_mib) +
         "\nThat is the need plus " +
         std::to_string(kWiredMarginMiB) + " MiB of headroom, and leaves macOS and other apps " +
         gib(physical - wired_mib * kMiB) + " of the " + gib(physical) + " of RAM; " +
         "`sudo sysctl iogpu.wired_limit_mb=0` restores the default.";
}

}  // namespace lily::metal
