// The sim's executor: runs the threadgroups of a dispatch on a pool of OS threads, each
// threadgroup's simulated threads as fibers on one OS thread.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lily_sim_lane.h"

namespace lily_sim {

// Thrown inside the runtime (and by fail()); the executor turns it into lily::KernelError.
struct Failure {
  std::string message;
};

enum class LaneOrder { forward, reverse, random };

struct DispatchCheck;

// A simdgroup_matrix layout as a permutation of Apple's (Lane::matrix_lanes).
using MatrixLanes = std::array<uint8_t, kSimdWidth>;
constexpr MatrixLanes apple_matrix_lanes() {
  MatrixLanes lanes{};
  for (unsigned l = 0; l < kSimdWidth; ++l) lanes[l] = uint8_t(l);
  return lanes;
}
inline constexpr MatrixLanes kAppleMatrixLanes = apple_matrix_lanes();

struct PreparedDispatch {
  const KernelInfo* kernel = nullptr;
  void* buffers[kMaxBufferBindings] = {};  // unbound ones point at unbound_buffer(index)
  uint32_t threadgroup_bytes[kMaxThreadgroupBindings] = {};
  Ids3 threadgroups{1, 1, 1};
  Ids3 threads{1, 1, 1};
  DispatchCheck* check = nullptr;  // set in the count and check modes (check.h)
  const uint8_t* matrix_lanes = kAppleMatrixLanes.data();
};

// An address in a PROT_NONE region reserved for buffer index `index`; any access through it
// becomes a KernelError naming the index.
void* unbound_buffer(unsigned index);

// The running system's page size (sysconf), which every mprotect/madvise/munmap range of the sim
// is aligned to: 16 KiB on Apple silicon, so never assumed to be 4 KiB.
size_t page_size();

// The threadgroup memory limit of Apple GPUs.
static constexpr uint32_t kThreadgroupMemoryLimit = 32 * 1024;
static constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;

class Worker;

class Executor {
 public:
  Executor(LaneOrder order, uint64_t seed, unsigned workers);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs every threadgroup of the dispatch, on the calling thread and the helper threads;
  // throws lily::KernelError on the first failure. One thread calls run() for the executor's
  // lifetime (the device's queue thread): it becomes worker 0, with its own signal stack.
  void run(const PreparedDispatch& dispatch);
  unsigned workers() const { return unsigned(workers_.size()); }
  // The simdgroup-matrix products the last run() executed, by MatrixOperands.
  std::array<uint64_t, kMatrixOperandKinds> matrix_products() const;

 private:
  friend class Worker;
  void helper_loop(Worker& worker);
  void work(Worker& worker, const PreparedDispatch& dispatch);

  LaneOrder order_;
  uint64_t seed_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_;

  std::mutex mutex_;
  std::condition_variable start_, done_;
  uint64_t generation_ = 0;
  unsigned busy_ = 0;
  bool stopping_ = false;
  const PreparedDispatch* dispatch_ = nullptr;
  uint64_t group_count_ = 0;
  std::atomic<uint64_t> next_group_{0};
  std::atomic<bool> abort_{false};
  std::string error_;
};

}  // namespace lily_sim
