// The seam between the engine and the GPU.
//
// Python records a Graph of dispatches once (kernel, buffer bindings with byte offsets, small
// inline parameter blocks, threadgroup memory sizes, grid and threadgroup size, barriers) and a
// Device replays it. Two devices implement this interface: the sim (the .metal kernels compiled as
// C++ and run on CPU fibers) and metal (Objective-C++, Apple silicon). Nothing engine-specific
// belongs here: no model dims, no layer logic.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace lily {

// Raised for anything a kernel did wrong at run time (sim diagnostics, Metal command-buffer
// errors). The message names the kernel and, where known, the threadgroup.
class KernelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Memory both the host and the device address. On Apple silicon it is MTLStorageModeShared, so
// data() is the same bytes the GPU reads; on the sim it is plain host memory.
class HostMirror;  // host_mirror.h

class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
  virtual bool writable() const = 0;
  // The host is given the memory (a numpy view): from now on it may have written any byte.
  virtual void host_access() {}
  // The bytes kernels bind: data() itself, except for wrapped host memory the device mirrors
  // (Device::wrap), where data() is the host's memory and this the device's copy of it.
  virtual void* device_data() { return data(); }
  virtual HostMirror* mirror() { return nullptr; }

  // Tensors inside the buffer (a checkpoint shard's), [offset, offset + bytes): a binding at an
  // offset inside one may touch the rest of that tensor only. Only the sim's checking mode uses
  // them.
  void add_region(size_t offset, size_t bytes) { regions_.push_back({offset, bytes}); }
  // Bytes a binding at `offset` may touch: to the end of the region it starts in, or else of the
  // buffer.
  size_t extent_at(size_t offset) const {
    for (const Region& r : regions_)
      if (offset >= r.offset && offset < r.offset + r.bytes) return r.offset + r.bytes - offset;
    return size() - std::min(offset, size());
  }

 private:
  struct Region {
    size_t offset, bytes;
  };
  std::vector<Region> regions_;
};

// A compiled kernel, looked up once by its [[host_name]].
class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual const std::string& name() const = 0;
  virtual uint32_t max_threads_per_threadgroup() const = 0;
};

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
  uint64_t count() const { return uint64_t(x) * y * z; }
};

// No length recorded: the binding extends to Buffer::extent_at(offset).
inline constexpr size_t kUnknownLength = ~size_t(0);

struct BufferBinding {
  uint32_t index;
  std::shared_ptr<Buffer> buffer;
  size_t offset;
  size_t length = kUnknownLength;  // bytes the kernel may touch, when the graph knows them
};

// Small constant parameters copied into the command stream ([[buffer(n)]] via setBytes).
struct BytesBinding {
  uint32_t index;
  std::vector<uint8_t> bytes;
};

// Threadgroup memory passed as a kernel argument ([[threadgroup(n)]]).
struct ThreadgroupBinding {
  uint32_t index;
  uint32_t bytes;
};

struct Dispatch {
  std::shared_ptr<Kernel> kernel;
  std::vector<BufferBinding> buffers;
  std::vector<BytesBinding> bytes;
  std::vector<ThreadgroupBinding> threadgroup_memory;
  Size3 threadgroups;             // grid size, in threadgroups
  Size3 threads_per_threadgroup;
};

// Dispatches in recording order, cut into levels by barriers: the dispatches of one level may run
// concurrently; a level sees every write of the levels before it. A command-buffer boundary is a
// barrier after which the metal device starts a new command buffer: macOS's GPU watchdog limits
// how long one command buffer may run, so a long pass is split (the sim treats it as a barrier).
class Graph {
 public:
  void dispatch(Dispatch d) {
    for (const auto& binding : d.buffers) {
      if (binding.buffer->mirror() != nullptr &&
          std::find(mirrored_.begin(), mirrored_.end(), binding.buffer) == mirrored_.end()) {
        mirrored_.push_back(binding.buffer);
      }
    }
    if (levels_.empty()) levels_.emplace_back();
    levels_.back().push_back(std::move(d));
  }
  void barrier() {
    if (!levels_.empty() && !levels_.back().empty()) levels_.emplace_back();
  }
  void end_command_buffer() {
    barrier();
    if (!levels_.empty() && levels_.back().empty() &&
        (buffer_starts_.empty() || buffer_starts_.back() != levels_.size() - 1)) {
      buffer_starts_.push_back(levels_.size() - 1);
    }
  }
  const std::vector<std::vector<Dispatch>>& levels() const { return levels_; }
  // The buffers over host memory a device mirrors (host_mirror.h) that the graph binds, each
  // once: gathered while recording, so that a submit does not walk every binding.
  const std::vector<std::shared_ptr<Buffer>>& mirrored() const { return mirrored_; }
  // Whether the level starts a new command buffer (level 0 always starts the first one).
  bool starts_command_buffer(size_t level) const {
    return std::find(buffer_starts_.begin(), buffer_starts_.end(), level) !=
           buffer_starts_.end();
  }
  size_t command_buffer_count() const {
    size_t n = levels_.empty() ? 0 : 1;
    for (size_t start : buffer_starts_) n += start > 0 && !levels_[start].empty();
    return n;
  }
  size_t dispatch_count() const {
    size_t n = 0;
    for (const auto& l : levels_) n += l.size();
    return n;
  }
  size_t barrier_count() const {
    size_t n = 0;
    for (const auto& l : levels_) n += !l.empty();
    return n == 0 ? 0 : n - 1;
  }

 private:
  std::vector<std::vector<Dispatch>> levels_;
  std::vector<size_t> buffer_starts_;  // levels after a command-buffer boundary
  std::vector<std::shared_ptr<Buffer>> mirrored_;
};

// What one dispatch read and wrote of each buffer binding: distinct bytes (the sim's counting and
// checking modes).
struct BindingTraffic {
  uint32_t index;
  std::shared_ptr<Buffer> buffer;
  size_t offset;
  size_t extent;  // bytes the binding could touch
  size_t read, written;
};
struct DispatchTraffic {
  std::string kernel;
  std::vector<BindingTraffic> bindings;
};

// The 8x8x8 simdgroup-matrix products one kernel's dispatches executed, by the operand type
// that sets their rate (the sim's counting; tensor_op: Metal 4 tensor-op matmuls, in 8x8x8 units).
struct MatrixProducts {
  uint64_t fp32 = 0, half = 0, bfloat = 0, tensor_op = 0;
};
struct KernelMatrixProducts {
  std::string kernel;
  MatrixProducts products;
};

// Which kernels the prefill GEMMs run on a device: the Metal 4 tensor-op ones
// (metal/quantized_gemm_tensor_ops.metal) or the simdgroup-matrix ones, and why.
struct GemmPath {
  bool tensor_ops = false;
  std::string reason;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;

  // Zero-initialised device memory.
  virtual std::shared_ptr<Buffer> alloc(size_t bytes) = 0;
  // Memory whose contents are undefined until a kernel (or the host) writes them. Zeroed like
  // alloc() except on the checking sim, which poisons it and reports reads of unwritten bytes.
  virtual std::shared_ptr<Buffer> alloc_scratch(size_t bytes) { return alloc(bytes); }
  // Host memory (numpy arrays, the checkpoint's memory maps). `owner` is held as long as the
  // buffer lives so the memory cannot go away under the device. `file_mapped`: the memory lies
  // in a memory-mapped file, a page-aligned VM allocation, which the metal device wraps in
  // place; other memory (malloc'd arrays) it mirrors, copying it in at each submit of a graph
  // that binds it and back after the graph has finished (host_mirror.h). The sim uses all host
  // memory in place unless opened to mirror it as the metal device does.
  virtual std::shared_ptr<Buffer> wrap(void* data, size_t bytes, bool writable,
                                       std::shared_ptr<void> owner, bool file_mapped) = 0;

  // Throws std::invalid_argument naming the kernel if it does not exist.
  virtual std::shared_ptr<Kernel> kernel(const std::string& host_name) = 0;
  virtual std::vector<std::string> kernel_names() const = 0;

  // Starts executing a graph and returns a ticket; graphs run in submission order.
  virtual uint64_t submit(const Graph& graph) = 0;
  // Blocks until the graph of `ticket` (and every earlier one) has finished; rethrows its error.
  virtual void wait(uint64_t ticket) = 0;
  void run(const Graph& graph) { wait(submit(graph)); }

  // The traffic of every dispatch run since the last call, in order; empty on devices that do
  // not count.
  virtual std::vector<DispatchTraffic> take_traffic() { return {}; }
  // The matrix products of every kernel that ran one since the last call, by kernel name; none
  // (rather than zeros) on devices that cannot count them: a GPU does not report them.
  virtual std::optional<std::vector<KernelMatrixProducts>> take_matrix_products() {
    return std::nullopt;
  }
  virtual GemmPath gemm_path() const = 0;
};

}  // namespace lily
