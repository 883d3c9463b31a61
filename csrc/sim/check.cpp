// The load/store hooks of the checked kernel build and what they check; see check.h.
#include "check.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace lily_sim {

constinit thread_local CheckContext* check_context LILY_SIM_FAST_TLS = nullptr;

// ---- ByteBits ----------------------------------------------------------------------------------

ByteBits::ByteBits(size_t bytes)
    : bytes_(bytes), chunk_count_((bytes + kChunkBytes - 1) >> kChunkShift) {
  chunks_ = std::make_unique<std::atomic<uint64_t*>[]>(chunk_count_);
  for (size_t i = 0; i < chunk_count_; ++i) chunks_[i].store(nullptr, std::memory_order_relaxed);
}

ByteBits& ByteBits::operator=(ByteBits&& other) noexcept {
  if (this != &other) {
    release();
    bytes_ = std::exchange(other.bytes_, 0);
    chunks_ = std::move(other.chunks_);
    chunk_count_ = std::exchange(other.chunk_count_, 0);
  }
  return *this;
}

ByteBits::~ByteBits() { release(); }

void ByteBits::release() {
  for (size_t i = 0; i < chunk_count_; ++i) std::free(chunks_[i].load(std::memory_order_relaxed));
  chunk_count_ = 0;
}

size_t ByteBits::chunk_words() const {
  return (std::min(bytes_, kChunkBytes) + 63) / 64;
}

uint64_t* ByteBits::chunk(size_t index) {
  uint64_t* bits = chunks_[index].load(std::memory_order_acquire);
  if (bits) return bits;
  auto* fresh = static_cast<uint64_t*>(std::calloc(chunk_words(), sizeof(uint64_t)));
  if (!fresh) throw std::bad_alloc();
  if (chunks_[index].compare_exchange_strong(bits, fresh, std::memory_order_acq_rel)) return fresh;
  std::free(fresh);  // another thread allocated it first
  return bits;
}

void ByteBits::set(size_t offset, size_t n) {
  while (n) {
    uint64_t* bits = chunk(offset >> kChunkShift);
    const size_t within = offset & (kChunkBytes - 1);
    const unsigned bit = unsigned(within & 63);
    const size_t take = std::min<size_t>(n, 64 - bit);
    const uint64_t mask = (take == 64 ? ~uint64_t(0) : (uint64_t(1) << take) - 1) << bit;
    uint64_t* word = bits + within / 64;
    if ((__atomic_load_n(word, __ATOMIC_RELAXED) & mask) != mask)
      __atomic_fetch_or(word, mask, __ATOMIC_RELAXED);
    offset += take;
    n -= take;
  }
}

bool ByteBits::test(size_t offset) const {
  const uint64_t* bits = chunk_if_any(offset >> kChunkShift);
  if (!bits) return false;
  const size_t within = offset & (kChunkBytes - 1);
  return __atomic_load_n(bits + within / 64, __ATOMIC_RELAXED) >> (within & 63) & 1;
}

size_t ByteBits::count() const {
  size_t total = 0;
  for (size_t c = 0; c < chunk_count_; ++c) {
    const uint64_t* bits = chunk_if_any(c);
    if (!bits) continue;
    for (size_t w = 0; w < chunk_words(); ++w) total += size_t(__builtin_popcountll(bits[w]));
  }
  return total;
}

// ---- threadgroup memory --------------------------------------------------------------------------

namespace {
constexpr uint8_t kWriterAtomic = 1, kReaderAtomic = 2, kOtherReader = 4;

std::string thread_name(uint32_t thread) {
  return "thread " + std::to_string(thread) + " (simdgroup " + std::to_string(thread / kSimdWidth) +
         ")";
}
}  // namespace

ThreadgroupShadow::ThreadgroupShadow(size_t bytes) : entries_(bytes) {}

void ThreadgroupShadow::begin_threadgroup() {
  if (epoch_ > 0xF0000000u) {  // before the 32-bit epochs wrap, forget everything explicitly
    std::memset(static_cast<void*>(entries_.data()), 0, entries_.size() * sizeof(Entry));
    epoch_ = 0;
  }
  first_epoch_ = ++epoch_;
  regions_.clear();
}

void ThreadgroupShadow::declare(uint32_t offset, uint32_t bytes, const char* name,
                                const ArrayShape* shape, unsigned argument_index) {
  for (uint32_t i = offset; i < offset + bytes; ++i) entries_[i].declared = first_epoch_;
  regions_.push_back({offset, bytes, name, shape, argument_index});
}

std::string ThreadgroupShadow::where(uint32_t offset) const {
  for (const Region& r : regions_) {
    if (offset < r.offset || offset >= r.offset + r.bytes) continue;
    const uint32_t within = offset - r.offset;
    if (!r.name) {
      return "byte " + std::to_string(within) + " of the threadgroup argument [[threadgroup(" +
             std::to_string(r.argument_index) + ")]]";
    }
    std::string text = "'" + std::string(r.name) + "'";
    uint32_t element = within / r.shape->element_bytes;
    if (r.shape->rank == 0) return text + (within ? " byte " + std::to_string(within) : "");
    std::string index;
    for (uint32_t d = std::min<uint32_t>(r.shape->rank, 4); d-- > 0;) {
      const uint32_t extent = r.shape->extents[d];
      index = "[" + std::to_string(d == 0 || !extent ? element : element % extent) + "]" + index;
      if (extent) element /= extent;
    }
    return text + index;
  }
  return "threadgroup byte " + std::to_string(offset);
}

std::string ThreadgroupShadow::outside(uint32_t offset) const {
  const Region* below = nullptr;
  for (const Region& r : regions_)
    if (r.offset + r.bytes <= offset && (!below || r.offset > below->offset)) below = &r;
  std::string text = "threadgroup memory outside every threadgroup variable";
  if (below) {
    text += " (" + std::to_string(offset - below->offset - below->bytes) + " bytes past the end of ";
    text += below->name ? "'" + std::string(below->name) + "'"
                        : "[[threadgroup(" + std::to_string(below->argument_index) + ")]]";
    text += ")";
  }
  return text;
}

std::string ThreadgroupShadow::access(uint32_t offset, uint32_t n, bool reads, bool writes,
                                      bool atomic, uint32_t thread) {
  const uint32_t simdgroup = thread / kSimdWidth;
  const char* verb = writes ? (reads ? "updates" : "writes") : "reads";
  for (uint32_t i = offset; i < offset + n; ++i) {
    if (i >= entries_.size() || entries_[i].declared < first_epoch_)
      return thread_name(thread) + " " + verb + " " + outside(i);
    Entry& e = entries_[i];
    const bool written_now = e.written == epoch_;
    if (reads && e.written < first_epoch_)
      return thread_name(thread) + " " + verb + " " + where(i) + ", which no thread has written";
    if (written_now && e.writer / kSimdWidth != simdgroup &&
        !(atomic && (e.flags & kWriterAtomic))) {
      return thread_name(thread) + " " + verb + " " + where(i) + ", which " +
             thread_name(e.writer) +
             " wrote since the last threadgroup_barrier: a race between SIMD-groups";
    }
    if (writes && e.read == epoch_ && !(atomic && (e.flags & kReaderAtomic))) {
      const uint32_t reader = e.reader / kSimdWidth != simdgroup ? e.reader
                              : e.flags & kOtherReader         ? e.other_reader
                                                               : ~0u;
      if (reader != ~0u) {
        return thread_name(thread) + " " + verb + " " + where(i) + ", which " +
               thread_name(reader) +
               " read since the last threadgroup_barrier: a race between SIMD-groups";
      }
    }
    if (reads) {
      if (e.read == epoch_) {
        if (e.reader / kSimdWidth != simdgroup && !(e.flags & kOtherReader)) {
          e.other_reader = uint16_t(thread);
          e.flags |= kOtherReader;
        }
        if (!atomic) e.flags &= uint8_t(~kReaderAtomic);
      } else {
        e.read = epoch_;
        e.reader = uint16_t(thread);
        e.flags = uint8_t((e.flags & kWriterAtomic) | (atomic ? kReaderAtomic : 0));
      }
    }
    if (writes) {
      e.written = epoch_;
      e.writer = uint16_t(thread);
      e.flags = uint8_t((e.flags & ~kWriterAtomic) | (atomic ? kWriterAtomic : 0));
    }
  }
  return {};
}

// ---- device memory -------------------------------------------------------------------------------

namespace {

std::string binding_name(const CheckedBinding& b) {
  return (b.inline_bytes ? "the inline bytes at index " : "buffer ") + std::to_string(b.index);
}

[[noreturn]] void out_of_bounds(const DispatchCheck& d, uintptr_t a, size_t n, const char* verb,
                                uint32_t thread) {
  const CheckedBinding* nearest = nullptr;
  uintptr_t best = ~uintptr_t(0);
  for (const CheckedBinding& b : d.bindings) {
    const auto start = reinterpret_cast<uintptr_t>(b.seen);
    const uintptr_t distance = a < start ? start - a : a + n - (start + b.extent);
    if (distance < best) best = distance, nearest = &b;
  }
  const auto offset = intptr_t(a - reinterpret_cast<uintptr_t>(nearest->seen));
  std::string message = thread_name(thread) + " " + verb + " " + std::to_string(n) +
                        " bytes at byte offset " + std::to_string(offset) + " of " +
                        binding_name(*nearest) + ", outside its " +
                        std::to_string(nearest->extent) + " bound bytes";
  abandon_lane(std::move(message));
}

void record(CheckedBinding& b, size_t offset, size_t n, bool reads, bool writes,
            uint32_t thread) {
  const char* verb = writes ? (reads ? "updates" : "writes") : "reads";
  if (writes && !b.writable) {
    std::string message = thread_name(thread) + " " + verb + " " + std::to_string(n) +
                          " bytes at byte offset " + std::to_string(offset) + " of " +
                          binding_name(b) + ", which is read-only";
    abandon_lane(std::move(message));
  }
  if (reads && b.defined) {
    for (size_t i = offset; i < offset + n; ++i) {
      if (b.defined->test(b.defined_offset + i) || b.written.test(i)) continue;
      std::string message = thread_name(thread) + " " + verb + " byte offset " +
                            std::to_string(i) + " of " + binding_name(b) +
                            ", scratch memory nothing has written";
      abandon_lane(std::move(message));
    }
  }
  if (reads) b.read.set(offset, n);
  if (writes) b.written.set(offset, n);
}

void device_access(DispatchCheck& d, uintptr_t a, size_t n, bool reads, bool writes) {
  const uint32_t thread = current_lane->thread_index_in_threadgroup;
  for (CheckedBinding& b : d.bindings) {
    const uintptr_t offset = a - reinterpret_cast<uintptr_t>(b.seen);
    if (offset < b.extent && n <= b.extent - offset) return record(b, offset, n, reads, writes, thread);
  }
  // In count mode bindings are used in place, and an address between them is not theirs.
  if (d.mode == CheckMode::check)
    out_of_bounds(d, a, n, writes ? (reads ? "updates" : "writes") : "reads", thread);
}

// An access of n > 0 bytes from p (a load, a store, an atomic, or one side of a mem* call).
inline void on_access(const volatile void* p, size_t n, bool reads, bool writes, bool atomic) {
  CheckContext* c = check_context;
  if (__builtin_expect(c == nullptr, 1)) return;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a - c->threadgroup_lo < c->threadgroup_span) {
    const uintptr_t offset = a - c->threadgroup_lo;
    // A range longer than the rest of threadgroup memory is checked up to one byte past it.
    const auto bytes = uint32_t(std::min<size_t>(n, c->threadgroup_span - offset + 1));
    std::string error = c->shadow->access(uint32_t(offset), bytes, reads, writes, atomic,
                                          current_lane->thread_index_in_threadgroup);
    if (!error.empty()) abandon_lane(std::move(error));
    return;
  }
  if (a - c->dispatch->lo < c->dispatch->span) device_access(*c->dispatch, a, n, reads, writes);
}

}  // namespace

void atomic_access(const volatile void* object, size_t bytes, AtomicAccess kind) {
  on_access(object, bytes, kind != AtomicAccess::store, kind != AtomicAccess::load, true);
}

}  // namespace lily_sim

// The hooks clang's -fsanitize-coverage=trace-loads,trace-stores calls before each load and
// store of the checked kernel build. Hidden, so the calls bind directly within the module.
#define LILY_SIM_HOOKS(bytes, type)                                                           \
  extern "C" __attribute__((visibility("hidden"))) void __sanitizer_cov_load##bytes(type* p) { \
    lily_sim::on_access(p, bytes, true, false, false);                                       \
  }                                                                                          \
  extern "C" __attribute__((visibility("hidden"))) void __sanitizer_cov_store##bytes(type* p) { \
    lily_sim::on_access(p, bytes, false, true, false);                                       \
  }
LILY_SIM_HOOKS(1, uint8_t)
LILY_SIM_HOOKS(2, uint16_t)
LILY_SIM_HOOKS(4, uint32_t)
LILY_SIM_HOOKS(8, uint64_t)
LILY_SIM_HOOKS(16, __int128)
#undef LILY_SIM_HOOKS

// The checked build's memset / memcpy / memmove. The optimiser turns loops of stores into
// llvm.memset, loops of copies into llvm.memcpy or llvm.memmove, and clang emits struct copies
// as llvm.memcpy; the backend expands the small ones inline and calls the C library for the
// rest, and neither is a load or store the hooks above see. So the checked build is also
// compiled with -fsanitize=thread reduced to its replacement of every memory intrinsic by a
// call to these functions (CMakeLists.txt: no access, atomic or function-entry instrumentation),
// the interface ThreadSanitizer's own runtime and the Linux kernel's KCSAN implement. Each checks
// and records its whole source and destination range, then does the operation. Hidden, as the
// hooks are, so they never stand in for a sanitizer runtime loaded in the same process.
#define LILY_SIM_HOOK extern "C" __attribute__((visibility("hidden")))
LILY_SIM_HOOK void* __tsan_memset(void* destination, int value, uintptr_t n) {
  if (n) lily_sim::on_access(destination, n, false, true, false);
  return std::memset(destination, value, n);
}
LILY_SIM_HOOK void* __tsan_memcpy(void* destination, const void* source, uintptr_t n) {
  if (n) {
    lily_sim::on_access(source, n, true, false, false);
    lily_sim::on_access(destination, n, false, true, false);
  }
  return std::memcpy(destination, source, n);
}
LILY_SIM_HOOK void* __tsan_memmove(void* destination, const void* source, uintptr_t n) {
  if (n) {
    lily_sim::on_access(source, n, true, false, false);
    lily_sim::on_access(destination, n, false, true, false);
  }
  return std::memmove(destination, source, n);
}
// Called by the module constructor the instrumentation adds to every checked kernel object.
LILY_SIM_HOOK void __tsan_init() {}
#undef LILY_SIM_HOOK
