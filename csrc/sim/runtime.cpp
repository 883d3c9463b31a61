// The sim's fiber runtime.
//
// Scheduling. A worker runs one threadgroup at a time. Lanes start in the configured lane order
// (forward, reverse or seeded random) and each runs until it returns or reaches a collective; a
// kernel without collectives therefore runs its lanes to completion one after another on one
// reused stack. When no lane can run, the worker resolves: a simdgroup whose live lanes all wait
// at the same simd collective gets its results computed and runs on; otherwise every live lane
// must wait at the same threadgroup barrier, which then opens. Anything else (lanes at different
// call sites, a barrier some lanes of a simdgroup returned before) is divergent control flow and
// fails the dispatch.
//
// Interleavings. Under the forward lane order all simdgroups advance in step, one collective
// each per round. Under reverse, each simdgroup in turn (the last first) runs all the way to the
// next threadgroup barrier before the next one starts; under random, a randomly chosen simdgroup
// advances by one collective at a time. Ordering bugs between SIMD-groups (a missing barrier
// between writing a tile and reading it in another SIMD-group) then change the answer.
//
// Faults. Every fiber stack sits above a PROT_NONE guard page, and unbound buffer indices point
// into PROT_NONE regions. A SIGSEGV/SIGBUS handler running on a per-worker alternate signal stack
// recognises a fault raised while a lane runs, records what it was (stack overflow, unbound
// buffer n, other bad address), unblocks the signal and switches straight back to the worker's
// scheduler context, abandoning the faulting fiber; the dispatch then fails with a KernelError.
// Faults that are not ours are handed to the previously installed handler.
#include "runtime.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "../device.h"
#include "check.h"
#include "fiber.h"

namespace lily_sim {

constinit thread_local Lane* current_lane LILY_SIM_FAST_TLS = nullptr;

namespace {

constexpr size_t kStackSize = 64 * 1024;
constexpr size_t kStackColours = 64;
constexpr size_t kAltStackSize = 64 * 1024;
constexpr unsigned kMaxThreadgroupVariables = 64;
constexpr size_t kUnboundRegion = size_t(64) << 20;
constexpr unsigned char kPoison = 0xff;  // NaN in every floating type, -1 in integers
// Threadgroup memory of a worker: the 32 KiB limit plus, in check mode, a red zone after every
// threadgroup argument and variable, so one element past the end is outside every variable.
constexpr size_t kThreadgroupMemoryBytes = 64 * 1024;
constexpr uint32_t kRedZone = 64;

enum class LaneState : uint8_t { not_started, runnable, waiting_simd, waiting_barrier, exited };

struct LaneSlot {
  Lane lane;  // first: current_lane points here
  FiberContext context;
  LaneState state;
  int32_t stack = -1;
  CallSite site;
  CollectiveOp op;
  const void* in;
  void* out;
};

enum class Fault : int { none, stack_overflow, unbound_buffer, bad_address, check };

// Fiber stack slots: a guard page, then the stack. Pages are 4 KiB on x86-64 Linux but 16 KiB
// on Apple silicon (and 64 KiB on some arm64 Linux), and mprotect refuses ranges that do not
// start on a page: both sizes come from the running system.
struct StackLayout {
  size_t guard;  // one page
  size_t stack;  // kStackSize, rounded up to whole pages
  size_t slot;
};

const StackLayout& stack_layout() {
  static const StackLayout layout = [] {
    const size_t page = page_size();
    const size_t stack = (kStackSize + page - 1) / page * page;
    return StackLayout{page, stack, page + stack};
  }();
  return layout;
}

char* unbound_base() {
  static char* base = [] {
    void* p = mmap(nullptr, kUnboundRegion * kMaxBufferBindings, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("sim: cannot reserve unbound-buffer pages");
    return static_cast<char*>(p);
  }();
  return base;
}

std::string lane_list(const std::vector<uint32_t>& lanes) {
  std::string out;
  for (size_t i = 0; i < lanes.size();) {
    size_t j = i;
    while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(lanes[i]);
    if (j > i) out += "-" + std::to_string(lanes[j]);
    i = j + 1;
  }
  return out;
}

std::string describe(const CallSite& s) {
  return std::string(s.what) + " at " + s.file + ":" + std::to_string(s.line);
}

bool same_site(const CallSite& a, const CallSite& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0) &&
         (a.what == b.what || std::strcmp(a.what, b.what) == 0);
}

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

size_t page_size() {
  static const size_t page = [] {
    const long reported = sysconf(_SC_PAGESIZE);
    if (reported <= 0 || (reported & (reported - 1)) != 0)
      throw std::runtime_error("sim: the system reports no usable page size");
    return size_t(reported);
  }();
  return page;
}

void* unbound_buffer(unsigned index) {
  return unbound_base() + index * kUnboundRegion + kUnboundRegion / 2;
}

class Worker {
 public:
  Worker() {
    lanes_.resize(kMaxThreadsPerThreadgroup);
    deferred_.resize(kMaxThreadsPerThreadgroup / kSimdWidth);
    order_.reserve(kMaxThreadsPerThreadgroup);
    void* stacks = mmap(nullptr, stack_layout().slot * kMaxThreadsPerThreadgroup, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) throw std::runtime_error("sim: cannot reserve fiber stacks");
    stacks_ = static_cast<char*>(stacks);
    memory_ = static_cast<unsigned char*>(std::aligned_alloc(64, kThreadgroupMemoryBytes));
    alt_stack_.resize(kAltStackSize);
  }
  ~Worker() {
    munmap(stacks_, stack_layout().slot * kMaxThreadsPerThreadgroup);
    std::free(memory_);
  }

  // Called on the worker's OS thread before it runs anything.
  void attach() {
    stack_t ss{};
    ss.ss_sp = alt_stack_.data();
    ss.ss_size = alt_stack_.size();
    sigaltstack(&ss, nullptr);
  }

  void run_threadgroup(const PreparedDispatch& d, uint64_t group, LaneOrder order, uint64_t seed);

  // Fault handling, read by the signal handler on this thread.
  volatile sig_atomic_t in_lane = 0;
  volatile Fault fault = Fault::none;
  volatile uintptr_t fault_address = 0;
  FiberContext scheduler;

  bool owns_guard(uintptr_t a) const {
    const StackLayout& layout = stack_layout();
    auto base = reinterpret_cast<uintptr_t>(stacks_);
    if (a < base || a >= base + layout.slot * prepared_stacks_) return false;
    return (a - base) % layout.slot < layout.guard;
  }

  void* threadgroup_variable(unsigned slot, size_t bytes, size_t align, const char* name,
                             const ArrayShape* shape);
  // Products this worker's simdgroups computed in the current dispatch, by MatrixOperands.
  uint64_t matrix_products[kMatrixOperandKinds] = {};
  std::string failure;        // set by a lane that threw Failure
  std::string fault_message;  // Fault::check: what the checker found

 private:
  void prepare_stacks(uint32_t count);
  void start_lane(LaneSlot& s);
  void run_lane(LaneSlot& s);
  void resolve();
  bool resolve_simdgroup(uint32_t base);
  void resolve_barrier();
  bool step_simdgroup(uint32_t simdgroup);
  void run_in_step();
  void run_simdgroups_in_turn();
  void run_simdgroups_at_random(uint64_t& state);
  uint32_t place(uint32_t bytes, size_t align);
  [[noreturn]] void barrier_failure(uint32_t base, uint32_t end, const LaneSlot& barrier);
  [[noreturn]] void throw_fault();
  static void lane_main(void* arg);

  std::vector<LaneSlot> lanes_;
  std::vector<DeferredMatrixOps> deferred_;  // by simdgroup
  std::vector<uint32_t> order_;
  std::vector<std::vector<uint32_t>> simdgroup_order_;  // order_ split by simdgroup
  std::vector<int32_t> free_stacks_;
  char* stacks_ = nullptr;
  uint32_t prepared_stacks_ = 0;
  std::vector<char> alt_stack_;

  const PreparedDispatch* dispatch_ = nullptr;
  uint32_t lane_count_ = 0;
  uint32_t live_ = 0;
  unsigned char* memory_ = nullptr;
  uint32_t memory_used_ = 0;  // what counts against the 32 KiB limit
  uint32_t placed_ = 0;       // end of the last allocation in memory_, red zones included
  uint32_t red_zone_ = 0;
  uint32_t argument_bytes_ = 0;
  CheckContext check_;
  bool checking_ = false;
  std::unique_ptr<ThreadgroupShadow> shadow_;
  int32_t variable_offset_[kMaxThreadgroupVariables];
  void* threadgroup_args_[kMaxThreadgroupBindings] = {};
};

namespace {
thread_local Worker* this_worker LILY_SIM_FAST_TLS = nullptr;
}

void Worker::prepare_stacks(uint32_t count) {
  const StackLayout& layout = stack_layout();
  for (; prepared_stacks_ < count; ++prepared_stacks_) {
    char* slot = stacks_ + prepared_stacks_ * layout.slot;
    if (mprotect(slot + layout.guard, layout.stack, PROT_READ | PROT_WRITE) != 0)
      throw std::runtime_error("sim: cannot map a fiber stack");
    free_stacks_.push_back(int32_t(prepared_stacks_));
  }
}

void Worker::lane_main(void* arg) {
  auto& s = *static_cast<LaneSlot*>(arg);
  auto& w = *static_cast<Worker*>(s.lane.group);
  try {
    w.dispatch_->kernel->entry(s.lane);
  } catch (const Failure& f) {
    w.failure = f.message;
  } catch (const std::exception& e) {
    w.failure = e.what();
  }
  s.state = LaneState::exited;
  fiber_switch(s.context, w.scheduler);
  __builtin_trap();  // an exited fiber is never resumed
}

void Worker::start_lane(LaneSlot& s) {
  s.stack = free_stacks_.back();
  free_stacks_.pop_back();
  const StackLayout& layout = stack_layout();
  char* stack = stacks_ + size_t(s.stack) * layout.slot + layout.guard;
  // Stack tops a whole number of pages apart would all fall in the same few cache sets, and every
  // collective touches every lane's top of stack: start each lane's a different cache line in.
  const size_t colour = size_t(s.stack) % kStackColours * 64;
  fiber_prepare(s.context, stack, kStackSize - colour, &Worker::lane_main, &s);
}

void Worker::run_lane(LaneSlot& s) {
  if (s.state == LaneState::not_started) start_lane(s);
  s.state = LaneState::runnable;
  current_lane = &s.lane;
  check_context = checking_ ? &check_ : nullptr;
  in_lane = 1;
  fiber_switch(scheduler, s.context);
  in_lane = 0;
  check_context = nullptr;
  if (fault != Fault::none) throw_fault();
  if (s.state == LaneState::exited) {
    free_stacks_.push_back(s.stack);
    s.stack = -1;
    --live_;
    if (!failure.empty()) throw Failure{failure};
  }
}

void Worker::throw_fault() {
  std::string what;
  switch (fault) {
    case Fault::stack_overflow:
      what = "fiber stack overflow (" + std::to_string(kStackSize / 1024) +
             " KiB per simulated thread): unbounded recursion or large local arrays";
      break;
    case Fault::unbound_buffer: {
      auto index = (fault_address - reinterpret_cast<uintptr_t>(unbound_base())) / kUnboundRegion;
      what = "access to buffer index " + std::to_string(index) + ", which is not bound";
      break;
    }
    case Fault::check:
      what = fault_message;
      break;
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%#lx", static_cast<unsigned long>(fault_address));
      what = std::string("invalid memory access at address ") + buf;
    }
  }
  throw Failure{what};
}

// Where the next threadgroup allocation goes in memory_ (after a red zone in check mode), poisoned.
uint32_t Worker::place(uint32_t bytes, size_t align) {
  const size_t offset = (placed_ + red_zone_ + align - 1) / align * align;
  if (offset + bytes > kThreadgroupMemoryBytes)  // only red zones of huge alignments get here
    throw Failure{"threadgroup variables need more than the sim's " +
                  std::to_string(kThreadgroupMemoryBytes) + " bytes with their red zones"};
  std::memset(memory_ + offset, kPoison, bytes);
  placed_ = uint32_t(offset + bytes);
  return uint32_t(offset);
}

void* Worker::threadgroup_variable(unsigned slot, size_t bytes, size_t align, const char* name,
                                   const ArrayShape* shape) {
  if (slot >= kMaxThreadgroupVariables)
    throw Failure{"more than " + std::to_string(kMaxThreadgroupVariables) +
                  " threadgroup variables in one kernel"};
  if (variable_offset_[slot] < 0) {
    align = std::max<size_t>(align, 16);  // covers `alignas(16) threadgroup ...` declarations
    const size_t end = (memory_used_ + align - 1) / align * align + bytes;
    if (end > kThreadgroupMemoryLimit)
      throw Failure{"threadgroup memory of " + std::to_string(end) + " bytes (arguments " +
                    std::to_string(argument_bytes_) + ") exceeds the 32 KiB limit"};
    memory_used_ = uint32_t(end);
    const uint32_t offset = place(uint32_t(bytes), align);
    if (check_.shadow) check_.shadow->declare(offset, uint32_t(bytes), name, shape, 0);
    variable_offset_[slot] = int32_t(offset);
  }
  return memory_ + variable_offset_[slot];
}

void Worker::run_threadgroup(const PreparedDispatch& d, uint64_t group, LaneOrder order,
                             uint64_t seed) {
  dispatch_ = &d;
  const CheckMode mode = d.check ? d.check->mode : CheckMode::off;
  checking_ = mode != CheckMode::off;
  red_zone_ = mode == CheckMode::check ? kRedZone : 0;
  check_ = CheckContext{};
  if (checking_) {
    check_.dispatch = d.check;
    check_.threadgroup_lo = reinterpret_cast<uintptr_t>(memory_);
    if (mode == CheckMode::check) {
      if (!shadow_) shadow_ = std::make_unique<ThreadgroupShadow>(kThreadgroupMemoryBytes);
      shadow_->begin_threadgroup();
      check_.shadow = shadow_.get();
      check_.threadgroup_span = kThreadgroupMemoryBytes;
    }
  }
  const Ids3 tg{uint32_t(group % d.threadgroups.x),
                uint32_t(group / d.threadgroups.x % d.threadgroups.y),
                uint32_t(group / (uint64_t(d.threadgroups.x) * d.threadgroups.y))};
  const uint32_t n = d.threads.x * d.threads.y * d.threads.z;
  lane_count_ = live_ = n;
  prepare_stacks(std::min(n, kMaxThreadsPerThreadgroup));

  // Threadgroup memory: arguments first, then kernel-body variables as lanes declare them.
  memory_used_ = placed_ = 0;
  for (unsigned i = 0; i < kMaxThreadgroupBindings; ++i) {
    threadgroup_args_[i] = nullptr;
    if (!d.threadgroup_bytes[i]) continue;
    const uint32_t offset = place(d.threadgroup_bytes[i], 16);
    threadgroup_args_[i] = memory_ + offset;
    if (check_.shadow) check_.shadow->declare(offset, d.threadgroup_bytes[i], nullptr, nullptr, i);
    memory_used_ += (d.threadgroup_bytes[i] + 15) / 16 * 16;
  }
  argument_bytes_ = memory_used_;
  std::fill(std::begin(variable_offset_), std::end(variable_offset_), -1);
  failure.clear();

  const uint32_t simdgroups = (n + kSimdWidth - 1) / kSimdWidth;
  for (uint32_t i = 0; i < n; ++i) {
    LaneSlot& s = lanes_[i];
    Lane& l = s.lane;
    l.thread_position_in_threadgroup = {i % d.threads.x, i / d.threads.x % d.threads.y,
                                        i / (d.threads.x * d.threads.y)};
    l.threadgroup_position_in_grid = tg;
    l.thread_position_in_grid = {tg.x * d.threads.x + l.thread_position_in_threadgroup.x,
                                 tg.y * d.threads.y + l.thread_position_in_threadgroup.y,
                                 tg.z * d.threads.z + l.thread_position_in_threadgroup.z};
    l.threads_per_threadgroup = d.threads;
    l.threadgroups_per_grid = d.threadgroups;
    l.threads_per_grid = {d.threadgroups.x * d.threads.x, d.threadgroups.y * d.threads.y,
                          d.threadgroups.z * d.threads.z};
    l.thread_index_in_threadgroup = i;
    l.simdgroup_index_in_threadgroup = i / kSimdWidth;
    l.thread_index_in_simdgroup = i % kSimdWidth;
    l.simdgroups_per_threadgroup = simdgroups;
    l.buffers = d.buffers;
    l.threadgroup_args = threadgroup_args_;
    l.group = this;
    l.deferred = &deferred_[i / kSimdWidth];
    l.deferred->count[i % kSimdWidth] = 0;
    l.matrix_lanes = d.matrix_lanes;
    s.state = LaneState::not_started;
  }

  order_.resize(n);
  for (uint32_t i = 0; i < n; ++i) order_[i] = order == LaneOrder::reverse ? n - 1 - i : i;
  uint64_t state = seed * 0x2545f4914f6cdd1dull + group;
  if (order == LaneOrder::random)
    for (uint32_t i = n; i > 1; --i) std::swap(order_[i - 1], order_[splitmix(state) % i]);
  simdgroup_order_.resize(std::max<size_t>(simdgroup_order_.size(), simdgroups));
  for (uint32_t g = 0; g < simdgroups; ++g) simdgroup_order_[g].clear();
  for (uint32_t i : order_) simdgroup_order_[i / kSimdWidth].push_back(i);

  try {
    switch (order) {
      case LaneOrder::forward:
        run_in_step();
        break;
      case LaneOrder::reverse:
        run_simdgroups_in_turn();
        break;
      case LaneOrder::random:
        run_simdgroups_at_random(state);
        break;
    }
  } catch (...) {
    // Abandon the suspended fibers: their stacks are simply reused.
    free_stacks_.clear();
    for (uint32_t i = 0; i < prepared_stacks_; ++i) free_stacks_.push_back(int32_t(i));
    fault = Fault::none;
    throw;
  }
}

// All simdgroups advance together: every runnable lane runs to its next collective, then every
// simdgroup whose lanes have gathered completes its collective (or the barrier opens).
void Worker::run_in_step() {
  while (true) {
    for (uint32_t i : order_) {
      LaneSlot& s = lanes_[i];
      if (s.state == LaneState::not_started || s.state == LaneState::runnable) run_lane(s);
    }
    if (live_ == 0) return;
    resolve();
  }
}

// Each simdgroup, the last first, runs alone until it waits at a threadgroup barrier or returns.
void Worker::run_simdgroups_in_turn() {
  const uint32_t simdgroups = (lane_count_ + kSimdWidth - 1) / kSimdWidth;
  while (live_) {
    for (uint32_t g = simdgroups; g-- > 0;)
      while (step_simdgroup(g)) {
      }
    if (live_) resolve_barrier();
  }
}

// A randomly chosen simdgroup advances by one collective at a time.
void Worker::run_simdgroups_at_random(uint64_t& state) {
  const uint32_t simdgroups = (lane_count_ + kSimdWidth - 1) / kSimdWidth;
  std::vector<uint32_t> moving;
  while (live_) {
    moving.clear();
    for (uint32_t g = 0; g < simdgroups; ++g) moving.push_back(g);
    while (!moving.empty()) {
      const size_t pick = splitmix(state) % moving.size();
      if (!step_simdgroup(moving[pick])) {
        moving[pick] = moving.back();
        moving.pop_back();
      }
    }
    if (live_) resolve_barrier();
  }
}

// Runs the simdgroup's runnable lanes to their next collective, then completes the collective
// if they have all gathered. False if the simdgroup could not move (it waits at a barrier, or
// has returned).
bool Worker::step_simdgroup(uint32_t simdgroup) {
  bool moved = false;
  for (uint32_t i : simdgroup_order_[simdgroup]) {
    LaneSlot& s = lanes_[i];
    if (s.state == LaneState::not_started || s.state == LaneState::runnable) {
      run_lane(s);
      moved = true;
    }
  }
  return resolve_simdgroup(simdgroup * kSimdWidth) || moved;
}

void Worker::resolve() {
  bool progressed = false;
  for (uint32_t base = 0; base < lane_count_; base += kSimdWidth)
    progressed |= resolve_simdgroup(base);
  if (!progressed) resolve_barrier();
}

// Completes the simd collective the live lanes of simdgroup [base, base + 32) wait at, if they
// all do; lanes at different collectives are divergent control flow.
bool Worker::resolve_simdgroup(uint32_t base) {
  const uint32_t end = std::min(lane_count_, base + kSimdWidth);
  LaneSlot* first = nullptr;
  for (uint32_t i = base; i < end; ++i) {
    const LaneState state = lanes_[i].state;
    if (state == LaneState::waiting_barrier || state == LaneState::runnable ||
        state == LaneState::not_started)
      return false;
    if (state == LaneState::waiting_simd && !first) first = &lanes_[i];
  }
  if (!first) return false;
  CollectiveSlots slots{};
  std::vector<uint32_t> elsewhere;
  for (uint32_t i = base; i < end; ++i) {
    LaneSlot& s = lanes_[i];
    if (s.state != LaneState::waiting_simd) continue;
    if (!same_site(s.site, first->site) || s.op != first->op) {
      elsewhere.push_back(i);
      continue;
    }
    slots.in[i - base] = s.in;
    slots.out[i - base] = s.out;
    slots.active_mask |= 1u << (i - base);
  }
  if (!elsewhere.empty()) {
    throw Failure{"collectives in divergent control flow in simdgroup " +
                  std::to_string(base / kSimdWidth) + ": " + describe(first->site) +
                  " waits for lanes " + lane_list(elsewhere) + ", which are at " +
                  describe(lanes_[elsewhere[0]].site)};
  }
  first->op(slots);
  for (uint32_t i = base; i < end; ++i)
    if (lanes_[i].state == LaneState::waiting_simd) lanes_[i].state = LaneState::runnable;
  return true;
}

// No simd collective can complete: every live lane must be at one threadgroup barrier.
void Worker::resolve_barrier() {
  const uint32_t n = lane_count_;
  const LaneSlot* barrier = nullptr;
  for (uint32_t i = 0; i < n && !barrier; ++i)
    if (lanes_[i].state == LaneState::waiting_barrier) barrier = &lanes_[i];
  for (uint32_t base = 0; base < n; base += kSimdWidth) {
    const uint32_t end = std::min(n, base + kSimdWidth);
    uint32_t exited = 0, at_barrier = 0, elsewhere = 0;
    for (uint32_t i = base; i < end; ++i) {
      const LaneSlot& s = lanes_[i];
      if (s.state == LaneState::exited)
        ++exited;
      else if (s.state == LaneState::waiting_barrier && same_site(s.site, barrier->site))
        ++at_barrier;
      else
        ++elsewhere;
    }
    if (elsewhere || (at_barrier && exited)) barrier_failure(base, end, *barrier);
  }
  for (uint32_t i = 0; i < n; ++i)
    if (lanes_[i].state == LaneState::waiting_barrier) lanes_[i].state = LaneState::runnable;
  if (check_.shadow) check_.shadow->barrier();
}

// Explains why the lanes of simdgroup [base, end) cannot pass `barrier` (the slow path).
void Worker::barrier_failure(uint32_t base, uint32_t end, const LaneSlot& barrier) {
  std::vector<uint32_t> exited, at_barrier, at_other_barrier, at_simd;
  for (uint32_t i = base; i < end; ++i) {
    const LaneSlot& s = lanes_[i];
    if (s.state == LaneState::exited)
      exited.push_back(i);
    else if (s.state == LaneState::waiting_simd)
      at_simd.push_back(i);
    else if (same_site(s.site, barrier.site))
      at_barrier.push_back(i);
    else
      at_other_barrier.push_back(i);
  }
  const std::string simdgroup = std::to_string(base / kSimdWidth);
  if (!at_simd.empty()) {
    throw Failure{"divergent control flow in simdgroup " + simdgroup + ": lanes " +
                  lane_list(at_simd) + " wait at " + describe(lanes_[at_simd[0]].site) +
                  " while other lanes wait at " + describe(barrier.site)};
  }
  if (!at_other_barrier.empty()) {
    throw Failure{"threadgroup barriers in divergent control flow: lane " +
                  std::to_string(&barrier - lanes_.data()) + " waits at " +
                  describe(barrier.site) + ", lanes " + lane_list(at_other_barrier) + " at " +
                  describe(lanes_[at_other_barrier[0]].site)};
  }
  throw Failure{describe(barrier.site) + " in divergent control flow: lanes " +
                lane_list(at_barrier) + " of simdgroup " + simdgroup + " wait there but lanes " +
                lane_list(exited) + " returned"};
}

// ---- the calls kernels make --------------------------------------------------------------------

namespace {

void wait_for_simdgroup(const CallSite& site, CollectiveOp op, const void* in, void* out) {
  auto* s = reinterpret_cast<LaneSlot*>(current_lane);
  s->state = LaneState::waiting_simd;
  s->site = site;
  s->op = op;
  s->in = in;
  s->out = out;
  fiber_switch(s->context, static_cast<Worker*>(s->lane.group)->scheduler);
}

CallSite site_of(const DeferredMatrixOp& op) {
  return {op.file, op.line, "simdgroup_matrix multiply"};
}

// Every lane of the simdgroup has queued the same products (the same call sites in the same
// order), so position i of every lane's queue is one product.
void run_deferred_matrix_ops(const CollectiveSlots& slots) {
  if (slots.active_mask != 0xffffffffu)
    fail("simdgroup_matrix multiply with inactive lanes in the simdgroup");
  auto& queue = *static_cast<DeferredMatrixOps*>(slots.out[0]);
  const unsigned count = queue.count[0];
  for (unsigned l = 1; l < kSimdWidth; ++l) {
    if (queue.count[l] != count) {
      throw Failure{"simdgroup_matrix multiply in divergent control flow: lane 0 issued " +
                    std::to_string(count) + " products, lane " + std::to_string(l) + " " +
                    std::to_string(queue.count[l])};
    }
  }
  for (unsigned i = 0; i < count; ++i) {
    const DeferredMatrixOp* lanes = queue.ops[i];
    for (unsigned l = 1; l < kSimdWidth; ++l) {
      if (lanes[l].line != lanes[0].line ||
          (lanes[l].file != lanes[0].file && std::strcmp(lanes[l].file, lanes[0].file))) {
        throw Failure{"divergent control flow: lane 0 queued " + describe(site_of(lanes[0])) +
                      ", lane " + std::to_string(l) + " queued " + describe(site_of(lanes[l]))};
      }
    }
    lanes[0].run(lanes);
    ++this_worker->matrix_products[lanes[0].operands];
  }
  for (unsigned l = 0; l < kSimdWidth; ++l) queue.count[l] = 0;
}

constexpr CallSite kMatrixFlushSite{"<queued products>", 0, "simdgroup_matrix multiply"};

// Before any other collective, the lane's simdgroup computes what it has queued.
void flush_queued_products() {
  if (current_lane->deferred->count[current_lane->thread_index_in_simdgroup]) flush_matrix_ops();
}

}  // namespace

void flush_matrix_ops() {
  wait_for_simdgroup(kMatrixFlushSite, &run_deferred_matrix_ops, nullptr, current_lane->deferred);
}

void count_matrix_products(MatrixOperands kind, uint64_t products) {
  this_worker->matrix_products[size_t(kind)] += products;
}

void simd_rendezvous(const CallSite& site, CollectiveOp op, const void* in, void* out) {
  flush_queued_products();
  wait_for_simdgroup(site, op, in, out);
}

void threadgroup_rendezvous(const CallSite& site) {
  flush_queued_products();
  auto* s = reinterpret_cast<LaneSlot*>(current_lane);
  s->state = LaneState::waiting_barrier;
  s->site = site;
  fiber_switch(s->context, static_cast<Worker*>(s->lane.group)->scheduler);
}

void* threadgroup_variable(unsigned slot, size_t bytes, size_t align, const char* name,
                           const ArrayShape* shape) {
  return static_cast<Worker*>(current_lane->group)
      ->threadgroup_variable(slot, bytes, align, name, shape);
}

void abandon_lane(std::string message) {
  Worker* w = this_worker;
  w->fault_message = std::move(message);
  w->fault = Fault::check;
  w->in_lane = 0;
  check_context = nullptr;
  FiberContext abandoned;
  fiber_switch(abandoned, w->scheduler);
  __builtin_trap();  // an abandoned fiber is never resumed
}

void fail(const char* message) { throw Failure{message}; }

// ---- fault handling ----------------------------------------------------------------------------

namespace {

struct sigaction previous_segv, previous_bus;

void on_fault(int sig, siginfo_t* info, void*) {
  Worker* w = this_worker;
  if (w && w->in_lane) {
    auto a = reinterpret_cast<uintptr_t>(info->si_addr);
    auto unbound = reinterpret_cast<uintptr_t>(unbound_base());
    if (w->owns_guard(a))
      w->fault = Fault::stack_overflow;
    else if (a >= unbound && a < unbound + kUnboundRegion * kMaxBufferBindings)
      w->fault = Fault::unbound_buffer;
    else
      w->fault = Fault::bad_address;
    w->fault_address = a;
    w->in_lane = 0;
    // We leave the handler without returning, so undo the signal's blocking ourselves.
    sigset_t unblock;
    sigemptyset(&unblock);
    sigaddset(&unblock, sig);
    pthread_sigmask(SIG_UNBLOCK, &unblock, nullptr);
    FiberContext abandoned;
    fiber_switch(abandoned, w->scheduler);
  }
  // Not ours: restore the previous handler and let the fault happen again under it.
  sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
}

void install_fault_handler() {
  for (int sig : {SIGSEGV, SIGBUS}) {
    struct sigaction current;
    sigaction(sig, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_fault) continue;
    struct sigaction ours{};
    ours.sa_sigaction = &on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    sigaction(sig, &ours, sig == SIGSEGV ? &previous_segv : &previous_bus);
  }
}

}  // namespace

// ---- the executor ------------------------------------------------------------------------------

Executor::Executor(LaneOrder order, uint64_t seed, unsigned workers) : order_(order), seed_(seed) {
  if (workers == 0) workers = std::max(1u, std::thread::hardware_concurrency());
  unbound_base();
  for (unsigned i = 0; i < workers; ++i) workers_.push_back(std::make_unique<Worker>());
  // Worker 0 is whichever thread calls run(); the others get threads of their own.
  for (unsigned i = 1; i < workers; ++i)
    threads_.emplace_back([this, w = workers_[i].get()] { helper_loop(*w); });
}

Executor::~Executor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void Executor::work(Worker& worker, const PreparedDispatch& d) {
  while (!abort_.load(std::memory_order_relaxed)) {
    uint64_t g = next_group_.fetch_add(1, std::memory_order_relaxed);
    if (g >= group_count_) break;
    std::string message;
    try {
      worker.run_threadgroup(d, g, order_, seed_);
      continue;
    } catch (const Failure& f) {
      message = f.message;
    } catch (const std::exception& e) {  // e.g. no memory for fiber stacks
      message = e.what();
    }
    const Ids3 n = d.threadgroups;
    std::string where = "kernel '" + std::string(d.kernel->host_name) + "' threadgroup (" +
                        std::to_string(g % n.x) + "," + std::to_string(g / n.x % n.y) + "," +
                        std::to_string(g / (uint64_t(n.x) * n.y)) + "): ";
    std::lock_guard lock(mutex_);
    if (!abort_.exchange(true)) error_ = where + message;
  }
}

void Executor::helper_loop(Worker& worker) {
  this_worker = &worker;
  worker.attach();
  uint64_t seen = 0;
  while (true) {
    const PreparedDispatch* d;
    {
      std::unique_lock lock(mutex_);
      start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      d = dispatch_;
    }
    work(worker, *d);
    std::lock_guard lock(mutex_);
    if (--busy_ == 0) done_.notify_all();
  }
}

void Executor::run(const PreparedDispatch& d) {
  const uint64_t groups = uint64_t(d.threadgroups.x) * d.threadgroups.y * d.threadgroups.z;
  if (groups == 0 || uint64_t(d.threads.x) * d.threads.y * d.threads.z == 0) return;
  install_fault_handler();
  Worker& self = *workers_[0];
  if (this_worker != &self) {
    this_worker = &self;
    self.attach();
  }
  // The helpers are idle here: their counts can be reset without a lock.
  for (auto& w : workers_)
    std::fill(std::begin(w->matrix_products), std::end(w->matrix_products), 0);
  // A single threadgroup runs here without waking anyone: most engine dispatches are small.
  const bool helpers = groups > 1 && workers_.size() > 1;
  {
    std::lock_guard lock(mutex_);
    dispatch_ = &d;
    group_count_ = groups;
    next_group_ = 0;
    abort_ = false;
    error_.clear();
    if (helpers) {
      busy_ = unsigned(workers_.size() - 1);
      ++generation_;
    }
  }
  if (helpers) start_.notify_all();
  work(self, d);
  if (helpers) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return busy_ == 0; });
  }
  if (abort_) throw lily::KernelError(error_);
}

// Called after run() returned, which waited for every helper under the mutex.
std::array<uint64_t, kMatrixOperandKinds> Executor::matrix_products() const {
  std::array<uint64_t, kMatrixOperandKinds> total{};
  for (const auto& w : workers_)
    for (unsigned k = 0; k < kMatrixOperandKinds; ++k) total[k] += w->matrix_products[k];
  return total;
}

}  // namespace lily_sim
