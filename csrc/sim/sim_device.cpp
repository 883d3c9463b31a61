#include "sim_device.h"

#include "../host_mirror.h"

#include <sys/mman.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "check.h"

namespace lily_sim {

namespace {
// [0]: the plain kernel build, [1]: the checked build.
std::vector<KernelInfo>& registry(bool checked) {
  static std::vector<KernelInfo> kernels[2];
  return kernels[checked];
}
}  // namespace

void register_kernels(const KernelInfo* kernels, size_t count, bool checked) {
  registry(checked).insert(registry(checked).end(), kernels, kernels + count);
}

}  // namespace lily_sim

namespace lily {
namespace {

using lily_sim::CheckMode;

class SimBuffer : public Buffer {
 public:
  // Zero-filled, page-aligned memory from the kernel. `poisoned`: scratch memory of the checking
  // mode, filled with 0xFF (NaN) and tracked byte by byte until written.
  explicit SimBuffer(size_t bytes, bool poisoned = false) : size_(bytes), writable_(true) {
    if (poisoned) defined_ = std::make_unique<lily_sim::ByteBits>(bytes);
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = p;
    mapped_ = true;
    if (poisoned) std::memset(data_, 0xff, bytes);
  }
  SimBuffer(void* data, size_t bytes, bool writable, std::shared_ptr<void> owner)
      : data_(data), size_(bytes), writable_(writable), owner_(std::move(owner)) {}
  // Host memory mirrored as the metal device mirrors memory that is not a file mapping: the
  // kernels see a copy of it in memory of the sim's own (host_mirror.h).
  SimBuffer(std::unique_ptr<HostMirror> mirror, size_t bytes, bool writable) : SimBuffer(bytes) {
    writable_ = writable;
    mirror_ = std::move(mirror);
    std::memcpy(data_, mirror_->host(), bytes);
  }
  ~SimBuffer() override {
    if (mapped_) munmap(data_, size_);
  }
  void* data() override { return mirror_ ? mirror_->host() : data_; }
  void* device_data() override { return data_; }
  HostMirror* mirror() override { return mirror_.get(); }
  size_t size() const override { return size_; }
  bool writable() const override { return writable_; }
  void host_access() override { host_defined_ = true; }
  // Which bytes of scratch memory anything has written; null once all of them may have been.
  lily_sim::ByteBits* defined() { return host_defined_ ? nullptr : defined_.get(); }

 private:
  std::unique_ptr<lily_sim::ByteBits> defined_;
  std::atomic<bool> host_defined_{false};
  void* data_ = nullptr;
  size_t size_;
  bool writable_;
  bool mapped_ = false;
  std::shared_ptr<void> owner_;
  std::unique_ptr<HostMirror> mirror_;
};

class SimKernel : public Kernel {
 public:
  explicit SimKernel(const lily_sim::KernelInfo& info) : info_(info), name_(info.host_name) {}
  const std::string& name() const override { return name_; }
  // As a Metal pipeline reports it for a kernel that declares its maximum: the declared count.
  uint32_t max_threads_per_threadgroup() const override {
    return declared_max() ? declared_max() : lily_sim::kMaxThreadsPerThreadgroup;
  }
  uint32_t declared_max() const { return info_.max_total_threads_per_threadgroup; }
  const lily_sim::KernelInfo& info() const { return info_; }

 private:
  const lily_sim::KernelInfo& info_;
  std::string name_;
};

lily_sim::Ids3 ids(const Size3& s) { return {s.x, s.y, s.z}; }

// Turns a recorded dispatch into what the executor runs, checking what can be checked before
// any simulated thread starts.
lily_sim::PreparedDispatch prepare(const Dispatch& d) {
  auto* kernel = dynamic_cast<SimKernel*>(d.kernel.get());
  if (!kernel) throw std::invalid_argument("sim: dispatch of a kernel from another device");
  const std::string where = "kernel '" + kernel->name() + "': ";
  lily_sim::PreparedDispatch p;
  p.kernel = &kernel->info();
  p.threadgroups = ids(d.threadgroups);
  p.threads = ids(d.threads_per_threadgroup);
  if (d.threads_per_threadgroup.count() > lily_sim::kMaxThreadsPerThreadgroup)
    throw KernelError(where + "more than 1024 threads per threadgroup");
  // A GPU refuses (or, unchecked, misruns) a threadgroup larger than the pipeline allows, and a
  // kernel's [[max_total_threads_per_threadgroup(N)]] makes that N.
  if (kernel->declared_max() && d.threads_per_threadgroup.count() > kernel->declared_max())
    throw KernelError(where + std::to_string(d.threads_per_threadgroup.count()) +
                      " threads per threadgroup, more than its "
                      "[[max_total_threads_per_threadgroup(" +
                      std::to_string(kernel->declared_max()) + ")]] allows");
  for (unsigned i = 0; i < lily_sim::kMaxBufferBindings; ++i)
    p.buffers[i] = lily_sim::unbound_buffer(i);
  auto check_index = [&](uint32_t index, uint32_t limit) {
    if (index >= limit) throw KernelError(where + "binding index " + std::to_string(index) +
                                          " out of range");
  };
  for (const auto& b : d.buffers) {
    check_index(b.index, lily_sim::kMaxBufferBindings);
    if (b.offset > b.buffer->size())
      throw KernelError(where + "offset beyond the end of buffer " + std::to_string(b.index));
    if (b.length != kUnknownLength && b.length > b.buffer->size() - b.offset)
      throw KernelError(where + "length beyond the end of buffer " + std::to_string(b.index));
    p.buffers[b.index] = static_cast<char*>(b.buffer->device_data()) + b.offset;
  }
  for (const auto& b : d.bytes) {
    check_index(b.index, lily_sim::kMaxBufferBindings);
    p.buffers[b.index] = const_cast<uint8_t*>(b.bytes.data());
  }
  uint64_t total = 0;
  for (const auto& t : d.threadgroup_memory) {
    check_index(t.index, lily_sim::kMaxThreadgroupBindings);
    p.threadgroup_bytes[t.index] = t.bytes;
    total += (t.bytes + 15) / 16 * 16;
  }
  if (total > lily_sim::kThreadgroupMemoryLimit)
    throw KernelError(where + "threadgroup memory arguments of " + std::to_string(total) +
                      " bytes exceed the 32 KiB limit");
  return p;
}

// The check mode's windows: each binding of a dispatch is copied into pages of its own in one
// reserved address range, with unmapped guard pages between, and copied back where written.
class WindowArena {
 public:
  ~WindowArena() {
    if (base_) munmap(base_, reserved_);
  }
  // Lays the dispatch's bindings out in windows: fills `bindings[i].seen` and the dispatch's
  // address range, copies the bindings' bytes in.
  void open(lily_sim::DispatchCheck& check) {
    auto& bindings = check.bindings;
    // Bindings that overlap in host memory share a window, so that they stay aliases.
    std::vector<size_t> order(bindings.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return bindings[a].host < bindings[b].host;
    });
    struct Group {
      char* host;
      size_t bytes;
      std::vector<size_t> members;
    };
    std::vector<Group> groups;
    for (size_t i : order) {
      auto& b = bindings[i];
      Group* last = groups.empty() ? nullptr : &groups.back();
      if (last && !b.inline_bytes && b.host < last->host + last->bytes) {
        last->bytes = std::max(last->bytes, size_t(b.host + b.extent - last->host));
        last->members.push_back(i);
      } else {
        groups.push_back({b.host, b.extent, {i}});
      }
    }
    size_t needed = guard_;
    for (const Group& g : groups) needed += round_up(g.bytes + page_, page_) + guard_;
    reserve(needed);
    size_t cursor = guard_;
    for (const Group& g : groups) {
      char* start = base_ + cursor + (reinterpret_cast<uintptr_t>(g.host) & (page_ - 1));
      char* end = base_ + round_up(size_t(start - base_) + g.bytes, page_);
      if (end > base_ + cursor && mprotect(base_ + cursor, size_t(end - (base_ + cursor)),
                                           PROT_READ | PROT_WRITE) != 0)
        throw std::bad_alloc();
      if (g.bytes) std::memcpy(start, g.host, g.bytes);
      for (size_t i : g.members) bindings[i].seen = start + (bindings[i].host - g.host);
      cursor = size_t(end - base_) + guard_;
    }
    used_ = cursor;
    std::sort(bindings.begin(), bindings.end(),
              [](const auto& a, const auto& b) { return a.seen < b.seen; });
    check.lo = reinterpret_cast<uintptr_t>(base_);
    check.span = cursor;
  }
  // Copies what the kernel wrote back to the bindings' memory, and closes the windows.
  void close(lily_sim::DispatchCheck& check) {
    for (auto& b : check.bindings) {
      if (b.inline_bytes || !b.writable) continue;
      b.written.for_each_run([&](size_t offset, size_t length) {
        std::memcpy(b.host + offset, b.seen + offset, length);
        if (b.defined) b.defined->set(b.defined_offset + offset, length);
      });
    }
    if (used_) {
      mprotect(base_, used_, PROT_NONE);
      if (used_ > kKeepResident) madvise(base_, used_, MADV_DONTNEED);
      used_ = 0;
    }
  }

 private:
  static constexpr size_t kKeepResident = size_t(64) << 20;
  static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

  // Windows start on the system's page (mprotect needs that) and keep their host address's
  // offset within it; the unmapped gap after each is at least 64 KiB, whatever the page size.
  const size_t page_ = lily_sim::page_size();
  const size_t guard_ = round_up(size_t(64) << 10, page_);

  void reserve(size_t bytes) {
    if (bytes <= reserved_) return;
    if (base_) munmap(base_, reserved_);
    reserved_ = std::max(round_up(bytes, page_), size_t(1) << 32);
    void* p = mmap(nullptr, reserved_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
      base_ = nullptr;
      reserved_ = 0;
      throw std::bad_alloc();
    }
    base_ = static_cast<char*>(p);
  }

  char* base_ = nullptr;
  size_t reserved_ = 0, used_ = 0;
};

// The bindings of a dispatch as the checking modes see them, and where the kernel finds them.
std::unique_ptr<lily_sim::DispatchCheck> check_bindings(const Dispatch& d, CheckMode mode,
                                                        lily_sim::PreparedDispatch& p,
                                                        WindowArena& arena) {
  auto check = std::make_unique<lily_sim::DispatchCheck>();
  check->mode = mode;
  for (const auto& b : d.buffers) {
    lily_sim::CheckedBinding c;
    c.index = b.index;
    c.writable = b.buffer->writable();
    c.host = static_cast<char*>(p.buffers[b.index]);
    c.extent = b.length != kUnknownLength ? b.length : b.buffer->extent_at(b.offset);
    if (auto* sim = dynamic_cast<SimBuffer*>(b.buffer.get())) {
      c.defined = sim->defined();
      c.defined_offset = b.offset;
    }
    c.read = lily_sim::ByteBits(c.extent);
    c.written = lily_sim::ByteBits(c.extent);
    check->bindings.push_back(std::move(c));
  }
  for (const auto& b : d.bytes) {
    lily_sim::CheckedBinding c;
    c.index = b.index;
    c.inline_bytes = true;
    c.writable = false;
    c.host = static_cast<char*>(p.buffers[b.index]);
    c.extent = b.bytes.size();
    c.read = lily_sim::ByteBits(c.extent);
    c.written = lily_sim::ByteBits(c.extent);
    check->bindings.push_back(std::move(c));
  }
  if (mode == CheckMode::check) {
    arena.open(*check);
  } else {
    uintptr_t lo = ~uintptr_t(0), hi = 0;
    for (auto& c : check->bindings) {
      c.seen = c.host;
      if (!c.extent) continue;
      lo = std::min(lo, reinterpret_cast<uintptr_t>(c.host));
      hi = std::max(hi, reinterpret_cast<uintptr_t>(c.host) + c.extent);
    }
    check->lo = lo;
    check->span = hi > lo ? hi - lo : 0;
  }
  for (const auto& c : check->bindings) p.buffers[c.index] = c.seen;
  p.check = check.get();
  return check;
}

DispatchTraffic traffic_of(const Dispatch& d, const lily_sim::DispatchCheck& check) {
  DispatchTraffic t{d.kernel->name(), {}};
  for (const auto& bound : d.buffers) {
    const auto& b = *std::find_if(check.bindings.begin(), check.bindings.end(), [&](const auto& c) {
      return !c.inline_bytes && c.index == bound.index;
    });
    t.bindings.push_back(
        {b.index, bound.buffer, bound.offset, b.extent, b.read.count(), b.written.count()});
  }
  std::sort(t.bindings.begin(), t.bindings.end(),
            [](const auto& a, const auto& b) { return a.index < b.index; });
  return t;
}

// What the dispatches of the current graph level read and wrote of each writable buffer (check
// mode). Dispatches between two barriers may run concurrently on a GPU, so one writing bytes
// another touches is a race only a barrier in the graph prevents.
class LevelAccesses {
 public:
  void clear() { buffers_.clear(); }

  // Throws KernelError if `d` writes bytes an earlier dispatch of the level touched, or reads
  // bytes one wrote; then adds d's accesses.
  void add(const Dispatch& d, const lily_sim::DispatchCheck& check) {
    struct Touched {
      const BufferBinding* bound;
      const lily_sim::CheckedBinding* binding;
      Access* access;
    };
    std::vector<Touched> touched;
    for (const auto& bound : d.buffers) {
      if (!bound.buffer->writable()) continue;
      const auto& b = *std::find_if(check.bindings.begin(), check.bindings.end(), [&](const auto& c) {
        return !c.inline_bytes && c.index == bound.index;
      });
      auto [it, fresh] = buffers_.try_emplace(bound.buffer.get());
      if (fresh) {
        it->second.read = lily_sim::ByteBits(bound.buffer->size());
        it->second.written = lily_sim::ByteBits(bound.buffer->size());
      }
      touched.push_back({&bound, &b, &it->second});
    }
    for (const Touched& t : touched) {
      conflict(d, t.binding->written, *t.bound, *t.access, true);
      conflict(d, t.binding->read, *t.bound, *t.access, false);
    }
    for (const Touched& t : touched) {
      const size_t base = t.bound->offset;
      t.binding->read.for_each_run([&](size_t o, size_t n) { t.access->read.set(base + o, n); });
      t.binding->written.for_each_run(
          [&](size_t o, size_t n) { t.access->written.set(base + o, n); });
      t.access->kernels.push_back(d.kernel->name());
    }
  }

 private:
  struct Access {
    lily_sim::ByteBits read, written;
    std::vector<std::string> kernels;
  };

  static void conflict(const Dispatch& d, const lily_sim::ByteBits& bits,
                       const BufferBinding& bound, const Access& earlier, bool writes) {
    bits.for_each_run([&](size_t offset, size_t n) {
      for (size_t i = offset; i < offset + n; ++i) {
        const size_t at = bound.offset + i;
        if (!earlier.written.test(at) && !(writes && earlier.read.test(at))) continue;
        std::string others;
        for (const auto& k : earlier.kernels) others += (others.empty() ? "'" : ", '") + k + "'";
        throw KernelError("kernel '" + d.kernel->name() + "': " + (writes ? "writes" : "reads") +
                          " byte offset " + std::to_string(i) + " of buffer " +
                          std::to_string(bound.index) + ", which an earlier dispatch of the same " +
                          "graph level (" + others + ") " +
                          (earlier.written.test(at) ? "wrote" : "read") +
                          ": dispatches between two barriers may run concurrently");
      }
    });
  }

  std::map<const Buffer*, Access> buffers_;
};

class SimDevice : public Device {
 public:
  SimDevice(lily_sim::LaneOrder order, uint64_t seed, unsigned workers, bool execute,
            CheckMode mode, bool tensor_ops, const lily_sim::MatrixLanes& matrix_lanes,
            bool mirror_wrapped)
      : executor_(order, seed, workers), execute_(execute), mode_(mode), tensor_ops_(tensor_ops),
        mirror_wrapped_(mirror_wrapped), matrix_lanes_(matrix_lanes),
        queue_([this] { serve(); }) {
    const auto& kernels = lily_sim::registry(mode != CheckMode::off);
    for (const auto& k : kernels) kernels_.emplace(k.host_name, &k);
  }
  ~SimDevice() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    queue_.join();
  }

  std::string name() const override { return "sim"; }

  // A Mac picks its path in csrc/metal/metal_device.mm (load_tensor_ops); the sim says which
  // Mac it stands for.
  GemmPath gemm_path() const override {
    if (tensor_ops_) {
      return {true, "the sim was opened with tensor_ops: the Metal 4 tensor-op kernels, on the "
                    "sim's emulation of matmul2d, as a Mac with macOS 26.2 or later and an "
                    "Apple10-family GPU (M5) runs them"};
    }
    return {false, "the sim runs the simdgroup-matrix kernels unless opened with tensor_ops, as "
                   "a Mac does before macOS 26.2 or without an Apple10-family GPU (M5)"};
  }

  std::shared_ptr<Buffer> alloc(size_t bytes) override {
    return std::make_shared<SimBuffer>(bytes);
  }
  std::shared_ptr<Buffer> alloc_scratch(size_t bytes) override {
    return std::make_shared<SimBuffer>(bytes, mode_ == CheckMode::check);
  }
  std::shared_ptr<Buffer> wrap(void* data, size_t bytes, bool writable,
                               std::shared_ptr<void> owner, bool file_mapped) override {
    if (mirror_wrapped_ && !file_mapped) {
      auto mirror = std::make_unique<HostMirror>(data, bytes, writable, std::move(owner));
      return std::make_shared<SimBuffer>(std::move(mirror), bytes, writable);
    }
    return std::make_shared<SimBuffer>(data, bytes, writable, std::move(owner));
  }

  std::shared_ptr<Kernel> kernel(const std::string& host_name) override {
    auto it = kernels_.find(host_name);
    if (it == kernels_.end()) throw std::invalid_argument("unknown kernel '" + host_name + "'");
    return std::make_shared<SimKernel>(*it->second);
  }
  std::vector<std::string> kernel_names() const override {
    std::vector<std::string> names;
    for (const auto& [name, _] : kernels_) names.push_back(name);
    return names;
  }

  uint64_t submit(const Graph& graph) override {
    std::vector<Graph> finished;
    uint64_t ticket;
    {
      std::lock_guard lock(mutex_);
      ticket = ++submitted_;
      queue_jobs_.push_back({ticket, graph, graph.mirrored()});
      for (const auto& buffer : queue_jobs_.back().mirrored)
        buffer->mirror()->submitted(buffer->device_data());
      finished.swap(finished_);
    }
    work_.notify_one();
    return ticket;  // `finished` graphs (and the buffers they hold) are released here
  }

  void wait(uint64_t ticket) override {
    std::vector<Graph> finished;
    std::string error;
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return completed_ >= std::min(ticket, submitted_); });
      finished.swap(finished_);
      auto it = errors_.begin();
      if (it != errors_.end() && it->first <= ticket) {
        error = std::move(it->second);
        errors_.erase(it);
      }
    }
    if (!error.empty()) throw KernelError(error);
  }

  std::vector<DispatchTraffic> take_traffic() override {
    std::lock_guard lock(mutex_);
    return std::exchange(traffic_, {});
  }

  std::optional<std::vector<KernelMatrixProducts>> take_matrix_products() override {
    std::lock_guard lock(mutex_);
    std::vector<KernelMatrixProducts> out;
    for (const auto& [kernel, products] : std::exchange(products_, {}))
      out.push_back({kernel, products});
    return out;
  }

 private:
  struct Job {
    uint64_t ticket;
    Graph graph;
    std::vector<std::shared_ptr<Buffer>> mirrored;  // host memory the device mirrors
  };

  // The queue thread: runs graphs in submission order. It never releases a Graph itself, since
  // buffers wrapping Python objects must be released where the interpreter can be entered.
  void serve() {
    while (true) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        work_.wait(lock, [&] { return stopping_ || !queue_jobs_.empty(); });
        if (queue_jobs_.empty()) return;
        job = std::move(queue_jobs_.front());
        queue_jobs_.pop_front();
      }
      std::string error;
      try {
        for (const auto& level : job.graph.levels()) {
          level_.clear();
          for (const auto& d : level) {
            auto prepared = prepare(d);
            prepared.matrix_lanes = matrix_lanes_.data();
            if (execute_) run(d, prepared);
          }
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard lock(mutex_);
        if (!error.empty()) errors_[job.ticket] = error;
        for (const auto& buffer : job.mirrored)
          buffer->mirror()->finished(buffer->device_data());
        job.mirrored.clear();
        completed_ = job.ticket;
        finished_.push_back(std::move(job.graph));
      }
      done_.notify_all();
    }
  }

  void run(const Dispatch& d, lily_sim::PreparedDispatch& prepared) {
    execute(d, prepared);
    const auto counted = executor_.matrix_products();
    if (std::all_of(counted.begin(), counted.end(), [](uint64_t n) { return n == 0; })) return;
    std::lock_guard lock(mutex_);
    MatrixProducts& total = products_[d.kernel->name()];
    using lily_sim::MatrixOperands;
    total.fp32 += counted[size_t(MatrixOperands::fp32)];
    total.half += counted[size_t(MatrixOperands::half)];
    total.bfloat += counted[size_t(MatrixOperands::bfloat)];
    total.tensor_op += counted[size_t(MatrixOperands::tensor_op)];
  }

  void execute(const Dispatch& d, lily_sim::PreparedDispatch& prepared) {
    if (mode_ == CheckMode::off) return executor_.run(prepared);
    auto check = check_bindings(d, mode_, prepared, arena_);
    try {
      executor_.run(prepared);
    } catch (...) {
      if (mode_ == CheckMode::check) arena_.close(*check);
      throw;
    }
    if (mode_ == CheckMode::check) {
      arena_.close(*check);
      level_.add(d, *check);
    }
    auto traffic = traffic_of(d, *check);
    std::lock_guard lock(mutex_);
    traffic_.push_back(std::move(traffic));
  }

  lily_sim::Executor executor_;
  // false: graphs are checked and retired but no kernel runs (to time the host side alone).
  const bool execute_;
  const CheckMode mode_;
  WindowArena arena_;     // used by the queue thread only
  LevelAccesses level_;  // likewise
  std::vector<DispatchTraffic> traffic_;
  // By kernel name, so that a long-running engine's counts stay bounded.
  std::map<std::string, MatrixProducts> products_;
  std::map<std::string, const lily_sim::KernelInfo*> kernels_;

  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<Job> queue_jobs_;
  std::vector<Graph> finished_;
  std::map<uint64_t, std::string> errors_;
  uint64_t submitted_ = 0, completed_ = 0;
  bool stopping_ = false;
  bool tensor_ops_;
  const bool mirror_wrapped_;
  const lily_sim::MatrixLanes matrix_lanes_;
  std::thread queue_;
};

}  // namespace

std::shared_ptr<Device> open_sim_device(lily_sim::LaneOrder order, uint64_t seed,
                                        unsigned workers, bool execute, CheckMode mode,
                                        bool tensor_ops, const lily_sim::MatrixLanes& matrix_lanes,
                                        bool mirror_wrapped) {
  if (mode != CheckMode::off && lily_sim::registry(true).empty())
    throw std::invalid_argument("this build of the sim has no checked kernels "
                                "(LILY_SIM_CHECKED_KERNELS was off or unsupported)");
  return std::make_shared<SimDevice>(order, seed, workers, execute, mode, tensor_ops,
                                     matrix_lanes, mirror_wrapped);
}

}  // namespace lily
