// The sim's checking modes: what the load/store hooks of the checked kernel build do.
//
// Every .metal file is compiled twice (CMakeLists.txt): the plain build, and the checked build
// with LILY_SIM_CHECKED and clang's -fsanitize-coverage=trace-loads,trace-stores, which calls
// __sanitizer_cov_loadN / __sanitizer_cov_storeN (defined in check.cpp) before every load and
// store the optimised kernel code still makes, whatever pointer it goes through: casts, struct
// members, inline helpers, simdgroup_load/store. Atomics report themselves (atomic_access).
// The memset / memcpy / memmove the compiler forms (from loops, for struct copies) are no loads
// or stores to those hooks: the checked build turns each into a call of the checked
// __tsan_memset / __tsan_memcpy / __tsan_memmove in check.cpp (CMakeLists.txt), and a pre-link
// step (cmake/check_sim_objects.cmake) refuses objects that could reach memory another way.
//
// A hook classifies the address with two range compares: the worker's threadgroup memory, the
// dispatch's device bindings, or anything else (fiber stacks, constants), which it ignores.
//
// - count: bindings are used in place; the hooks record per binding which bytes were read and
//   written (distinct bytes per dispatch, Device.traffic()).
// - check: each binding is copied into a window of its own in a reserved arena, with unmapped
//   guard space around it, so an access is attributed to the binding its pointer came from and
//   anything past the binding's extent is an error naming the buffer index and offset. Written
//   bytes are copied back after the dispatch. On top of counting, it reports writes to
//   read-only buffers, reads of scratch memory nothing has written, and for threadgroup memory
//   reads of bytes never written, accesses outside every threadgroup variable, and races
//   between SIMD-groups (per byte, the last writer and reader with their barrier epoch).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lily_sim_lane.h"

namespace lily_sim {

enum class CheckMode : uint8_t { off, count, check };

// One bit per byte of a range, in chunks allocated on first touch; set from several threads.
class ByteBits {
 public:
  explicit ByteBits(size_t bytes = 0);
  ByteBits(ByteBits&& other) noexcept { *this = std::move(other); }
  ByteBits& operator=(ByteBits&& other) noexcept;
  ~ByteBits();

  void set(size_t offset, size_t n);
  bool test(size_t offset) const;
  size_t count() const;
  // Calls f(offset, length) for every maximal run of set bits, in order.
  template <class F>
  void for_each_run(F f) const;

 private:
  static constexpr unsigned kChunkShift = 20;  // bytes covered by one chunk: 1 MiB
  static constexpr size_t kChunkBytes = size_t(1) << kChunkShift;
  void release();
  uint64_t* chunk(size_t index);
  const uint64_t* chunk_if_any(size_t index) const {
    return chunks_[index].load(std::memory_order_acquire);
  }
  size_t chunk_words() const;

  size_t bytes_ = 0;
  std::unique_ptr<std::atomic<uint64_t*>[]> chunks_;
  size_t chunk_count_ = 0;
};

template <class F>
void ByteBits::for_each_run(F f) const {
  const size_t words = chunk_words();
  size_t run_start = 0, run_length = 0;
  for (size_t c = 0; c < chunk_count_; ++c) {
    const uint64_t* bits = chunk_if_any(c);
    if (!bits) continue;
    for (size_t w = 0; w < words; ++w) {
      uint64_t word = bits[w];
      const size_t base = (c << kChunkShift) + w * 64;
      while (word) {
        const unsigned first = unsigned(__builtin_ctzll(word));
        const uint64_t from_first = word >> first;
        const unsigned length = from_first == ~uint64_t(0) ? 64 - first
                                                           : unsigned(__builtin_ctzll(~from_first));
        const size_t start = base + first;
        if (run_length && run_start + run_length == start) {
          run_length += length;
        } else {
          if (run_length) f(run_start, run_length);
          run_start = start;
          run_length = length;
        }
        word = first + length >= 64 ? 0 : word & (~uint64_t(0) << (first + length));
      }
    }
  }
  if (run_length) f(run_start, run_length);
}

// A device binding of a dispatch as the hooks see it.
struct CheckedBinding {
  uint32_t index = 0;
  bool inline_bytes = false;  // a setBytes block rather than a buffer
  bool writable = true;
  char* host = nullptr;  // where the bytes live
  char* seen = nullptr;  // what the kernel was given: `host` (count) or a window (check)
  size_t extent = 0;     // bytes the binding may touch, from `seen`
  ByteBits read, written;
  // Scratch memory: which bytes of the buffer anything has written (null: all of them).
  ByteBits* defined = nullptr;
  size_t defined_offset = 0;  // of `host` in the buffer
};

struct DispatchCheck {
  CheckMode mode = CheckMode::off;
  std::vector<CheckedBinding> bindings;  // check: ascending `seen`, windows do not overlap
  uintptr_t lo = 0, span = 0;            // addresses the hooks look up in the bindings
};

// Per worker: what the checker knows about each byte of threadgroup memory.
class ThreadgroupShadow {
 public:
  explicit ThreadgroupShadow(size_t bytes);
  // A new threadgroup: every byte is undeclared and unwritten again.
  void begin_threadgroup();
  void barrier() { ++epoch_; }
  // A threadgroup variable (name and shape) or [[threadgroup(n)]] argument (name null) placed
  // at `offset`; its bytes become declared and unwritten.
  void declare(uint32_t offset, uint32_t bytes, const char* name, const ArrayShape* shape,
               unsigned argument_index);
  // Checks and records an access of `thread` to [offset, offset + n); returns an error message,
  // or empty. Atomics (`atomic`) do not race with each other.
  std::string access(uint32_t offset, uint32_t n, bool reads, bool writes, bool atomic,
                     uint32_t thread);

 private:
  struct Entry {
    uint32_t declared;  // epoch of the threadgroup's start when declared (stale: undeclared)
    uint32_t written;   // epoch of the last write (older than the threadgroup: never written)
    uint32_t read;      // epoch of the last read
    uint16_t writer, reader;
    uint16_t other_reader;  // with kOtherReader: a reader in another simdgroup than `reader`
    uint8_t flags;
  };
  struct Region {
    uint32_t offset, bytes;
    const char* name;
    const ArrayShape* shape;
    unsigned argument_index;
  };
  std::string where(uint32_t offset) const;
  std::string outside(uint32_t offset) const;

  std::vector<Entry> entries_;
  std::vector<Region> regions_;
  uint32_t epoch_ = 0, first_epoch_ = 0;
};

// What the hooks of the lane running on this OS thread check against; null outside checked
// dispatches and outside lanes.
struct CheckContext {
  DispatchCheck* dispatch = nullptr;
  ThreadgroupShadow* shadow = nullptr;  // null in count mode
  uintptr_t threadgroup_lo = 0, threadgroup_span = 0;
};
extern thread_local constinit CheckContext* check_context LILY_SIM_FAST_TLS;

// Abandons the running lane with a KernelError (runtime.cpp); never unwinds the kernel frames.
[[noreturn]] void abandon_lane(std::string message);

}  // namespace lily_sim
