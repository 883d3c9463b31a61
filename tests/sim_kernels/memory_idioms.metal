// Plain loops and copies that clang -O2 turns into memset / memcpy / memmove: a call to the C
// library or an inline expansion of the llvm.mem* intrinsic, where the kernel wrote single loads
// and stores (tests/test_sim_memory_idioms.py). The checked build must see every byte of them.
#include <metal_stdlib>
using namespace metal;

struct Span {
  uint n;
};

// Each thread zeroes its own row of `width` floats: a loop of stores of one value (a memset call).
[[kernel]] void test_zero_rows(device float* out [[buffer(0)]], constant uint& width [[buffer(1)]],
                               uint i [[thread_position_in_grid]]) {
  device float* row = out + i * width;
  for (uint k = 0; k < width; ++k) row[k] = 0.0f;
}

// Each thread zeroes eight consecutive floats: one 32-byte memset, expanded inline.
[[kernel]] void test_zero_eight(device float* out [[buffer(0)]],
                                uint i [[thread_position_in_grid]]) {
  for (uint k = 0; k < 8; ++k) out[8 * i + k] = 0.0f;
}

// Each thread stages up to 16 consecutive floats of its row in a local array, doubles them and
// writes them back out: two loops copying consecutive elements (memcpy calls, device to stack
// and stack to device).
[[kernel]] void test_stage_rows(device const float* x [[buffer(0)]],
                                device float* out [[buffer(1)]], constant Span& span [[buffer(2)]],
                                uint i [[thread_position_in_grid]]) {
  const uint n = min(span.n, 16u);
  float staged[16];
  for (uint k = 0; k < n; ++k) staged[k] = x[i * 16 + k];
  for (uint k = 0; k < n; ++k) staged[k] *= 2.0f;
  device float* row = out + i * 16;
  for (uint k = 0; k < n; ++k) row[k] = staged[k];
}

// Thread 0 shifts the first n floats one to the left: a copy within one buffer (a memmove call).
[[kernel]] void test_shift_left(device float* x [[buffer(0)]], constant Span& span [[buffer(1)]],
                                uint i [[thread_position_in_grid]]) {
  const uint n = span.n;
  if (i == 0)
    for (uint k = 0; k + 1 < n; ++k) x[k] = x[k + 1];
}

// One struct per thread copied between device buffers: a 48-byte memcpy, expanded inline.
struct Record {
  float4 position;
  float4 velocity;
  uint id;
  uint flags;
};
[[kernel]] void test_copy_records(device const Record* x [[buffer(0)]],
                                  device Record* out [[buffer(1)]],
                                  constant Span& span [[buffer(2)]],
                                  uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i] = x[i];
}
