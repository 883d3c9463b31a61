#include "sim_device.h"

#include <sys/mman.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace lily_sim {

namespace {
std::vector<KernelInfo>& registry() {
  static std::vector<KernelInfo> kernels;
  return kernels;
}
}  // namespace

void register_kernels(const KernelInfo* kernels, size_t count) {
  registry().insert(registry().end(), kernels, kernels + count);
}

}  // namespace lily_sim

namespace lily {
namespace {

class SimBuffer : public Buffer {
 public:
  // Zero-filled, page-aligned memory from the kernel.
  explicit SimBuffer(size_t bytes) : size_(bytes), writable_(true) {
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = p;
    mapped_ = true;
  }
  SimBuffer(void* data, size_t bytes, bool writable, std::shared_ptr<void> owner)
      : data_(data), size_(bytes), writable_(writable), owner_(std::move(owner)) {}
  ~SimBuffer() override {
    if (mapped_) munmap(data_, size_);
  }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  bool writable() const override { return writable_; }

 private:
  void* data_ = nullptr;
  size_t size_;
  bool writable_;
  bool mapped_ = false;
  std::shared_ptr<void> owner_;
};

class SimKernel : public Kernel {
 public:
  explicit SimKernel(const lily_sim::KernelInfo& info) : info_(info), name_(info.host_name) {}
  const std::string& name() const override { return name_; }
  uint32_t max_threads_per_threadgroup() const override {
    return lily_sim::kMaxThreadsPerThreadgroup;
  }
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
    p.buffers[b.index] = static_cast<char*>(b.buffer->data()) + b.offset;
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

class SimDevice : public Device {
 public:
  SimDevice(lily_sim::LaneOrder order, uint64_t seed, unsigned workers, bool execute)
      : executor_(order, seed, workers), execute_(execute), queue_([this] { serve(); }) {
    for (const auto& k : lily_sim::registry()) kernels_.emplace(k.host_name, &k);
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

  std::shared_ptr<Buffer> alloc(size_t bytes) override {
    return std::make_shared<SimBuffer>(bytes);
  }
  std::shared_ptr<Buffer> wrap(void* data, size_t bytes, bool writable,
                               std::shared_ptr<void> owner) override {
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
      queue_jobs_.push_back({ticket, graph});
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

 private:
  struct Job {
    uint64_t ticket;
    Graph graph;
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
        for (const auto& level : job.graph.levels())
          for (const auto& d : level) {
            auto prepared = prepare(d);
            if (execute_) executor_.run(prepared);
          }
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard lock(mutex_);
        if (!error.empty()) errors_[job.ticket] = error;
        completed_ = job.ticket;
        finished_.push_back(std::move(job.graph));
      }
      done_.notify_all();
    }
  }

  lily_sim::Executor executor_;
  // false: graphs are checked and retired but no kernel runs (to time the host side alone).
  const bool execute_;
  std::map<std::string, const lily_sim::KernelInfo*> kernels_;

  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<Job> queue_jobs_;
  std::vector<Graph> finished_;
  std::map<uint64_t, std::string> errors_;
  uint64_t submitted_ = 0, completed_ = 0;
  bool stopping_ = false;
  std::thread queue_;
};

}  // namespace

std::shared_ptr<Device> open_sim_device(lily_sim::LaneOrder order, uint64_t seed,
                                        unsigned workers, bool execute) {
  return std::make_shared<SimDevice>(order, seed, workers, execute);
}

}  // namespace lily
