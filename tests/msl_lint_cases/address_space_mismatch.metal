// Every pointer here names an address space, so the lint is satisfied; only the clang
// address-space pass sees that the spaces do not match where the pointers are used. The whole-
// struct copies across address spaces are legal MSL, and the pass must accept them.
#include <metal_stdlib>
using namespace metal;

struct Params {
  uint n;
};

struct Entry {
  uint index;
  float value;
};

inline float first_shared(threadgroup const float* values) { return values[0]; }

inline float first_global(device const float* values) { return values[0]; }

inline float first_private(thread const float* values) { return values[0]; }

inline float value_of(Entry entry) { return entry.value; }

[[kernel]] void mismatch(constant Params& p [[buffer(0)]], device const float* x [[buffer(1)]],
                         device float* y [[buffer(2)]], constant float* table [[buffer(3)]],
                         device Entry* entries [[buffer(4)]],
                         uint i [[thread_index_in_threadgroup]]) {
  const Params params = p;
  Entry entry = entries[0];
  entries[1] = Entry{params.n, value_of(entries[2])};
  entries[2] = entry;
  threadgroup float shared[32];
  shared[i % 32] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float local = shared[0];
  float sum = first_shared(shared) + first_global(x) + first_private(&local);  // all fine
  sum += first_shared(x);  // expect-clang: error
  sum += first_global(shared);  // expect-clang: error
  sum += first_global(table);  // expect-clang: error
  sum += first_private(x);  // expect-clang: error
  device float* out = table;  // expect-clang: error
  out[i] = sum * float(p.n) + entry.value;
}
