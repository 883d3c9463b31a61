// Kernels with planted bugs the sim's checking mode must report (tests/test_sim_check.py), each
// next to the correct kernel it was made from where that is not an existing one. On an unchecked
// device most of them run "fine": that is the point.
#include <metal_stdlib>
using namespace metal;

struct Span {
  uint n;
};

// out[i] = x[i] + x[i + 1], forgetting that the last thread has no x[i + 1].
[[kernel]] void broken_read_past_input(device const float* x [[buffer(0)]],
                                       device float* out [[buffer(1)]],
                                       constant Span& span [[buffer(2)]],
                                       uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i] = x[i] + x[i + 1];
}
[[kernel]] void test_pair_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              constant Span& span [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i] = x[i] + (i + 1 < span.n ? x[i + 1] : 0.0f);
}

// Shifts x one to the right, writing one element past the end of out.
[[kernel]] void broken_write_past_output(device const float* x [[buffer(0)]],
                                         device float* out [[buffer(1)]],
                                         constant Span& span [[buffer(2)]],
                                         uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i + 1] = x[i];
}

// Reads x four at a time through a vector cast, rounding n up to a multiple of 4.
[[kernel]] void broken_vector_read_past_input(device const float* x [[buffer(0)]],
                                              device float* out [[buffer(1)]],
                                              constant Span& span [[buffer(2)]],
                                              uint i [[thread_position_in_grid]]) {
  if (4 * i < span.n) {
    const float4 v = *reinterpret_cast<device const float4*>(x + 4 * i);
    out[i] = v.x + v.y + v.z + v.w;
  }
}

// Pointers carried in a struct into an inline function, which reads one row too many.
struct Rows {
  device const float* data;
  uint width;
};
inline float row_sum(Rows rows, uint row) {
  float sum = 0.0f;
  for (uint k = 0; k < rows.width; ++k) sum += rows.data[row * rows.width + k];
  return sum;
}
[[kernel]] void broken_struct_pointer_past_input(device const float* x [[buffer(0)]],
                                                 device float* out [[buffer(1)]],
                                                 constant Span& span [[buffer(2)]],
                                                 uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i] = row_sum(Rows{x, 4}, i + 1);
}

// An 8x8 tile loaded from the last rows of a matrix with fewer than 8 rows left.
[[kernel]] void broken_simdgroup_load_past_input(device const float* x [[buffer(0)]],
                                                 device float* out [[buffer(1)]],
                                                 constant Span& span [[buffer(2)]]) {
  simdgroup_float8x8 tile;
  simdgroup_load(tile, x, 8, ulong2(0, span.n - 4));
  simdgroup_store(tile, out, 8);
}

// Half of the tile is staged; every thread reads the tile mirrored.
[[kernel]] void broken_read_unwritten_threadgroup(device const float* x [[buffer(0)]],
                                                  device float* out [[buffer(1)]],
                                                  uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  if (lid < 32) tile[lid] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[63 - lid];
}

// Every thread writes the slot after its own, so the last one writes past the tile.
[[kernel]] void broken_threadgroup_past_end(device const float* x [[buffer(0)]],
                                            device float* out [[buffer(1)]],
                                            uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  threadgroup float after[64];
  tile[lid] = 0.0f;
  after[lid] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile[lid + 1] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[lid] + after[lid];
}

// Reads the tile another simdgroup staged, then restages its own part without the barrier that
// would keep the other simdgroup from reading the new values.
[[kernel]] void broken_overwrite_without_barrier(device const float* x [[buffer(0)]],
                                                 device float* out [[buffer(1)]],
                                                 uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float mirrored = tile[63 - lid];
  tile[lid] = 2.0f * x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = mirrored + tile[63 - lid];
}
[[kernel]] void test_overwrite_after_barrier(device const float* x [[buffer(0)]],
                                             device float* out [[buffer(1)]],
                                             uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float mirrored = tile[63 - lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile[lid] = 2.0f * x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = mirrored + tile[63 - lid];
}

// Threads of every simdgroup count into one threadgroup atomic and one device atomic in the same
// barrier interval: atomics do not race. counts[group] = threads of the group, total = all.
[[kernel]] void test_atomic_counts(device atomic_uint* total [[buffer(0)]],
                                   device uint* counts [[buffer(1)]],
                                   uint lid [[thread_index_in_threadgroup]],
                                   uint group [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint count;
  if (lid == 0) atomic_store_explicit(&count, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) counts[group] = atomic_load_explicit(&count, memory_order_relaxed);
}

// The same, with the threadgroup counter never initialised.
[[kernel]] void broken_atomic_unwritten(device atomic_uint* total [[buffer(0)]],
                                        device uint* counts [[buffer(1)]],
                                        uint lid [[thread_index_in_threadgroup]],
                                        uint group [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint count;
  atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) counts[group] = atomic_load_explicit(&count, memory_order_relaxed);
}

// out[i] = 2 x[i]: reads every x byte once, writes every out byte once (traffic counting).
[[kernel]] void test_double(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                            constant Span& span [[buffer(2)]],
                            uint i [[thread_position_in_grid]]) {
  if (i < span.n) out[i] = 2.0f * x[i];
}

// Every thread reads all of x (n floats) and writes its own output: x is read n times over but
// counts once as distinct bytes.
[[kernel]] void test_broadcast_sum(device const float* x [[buffer(0)]],
                                   device float* out [[buffer(1)]],
                                   constant Span& span [[buffer(2)]],
                                   uint i [[thread_position_in_grid]]) {
  float sum = 0.0f;
  for (uint k = 0; k < span.n; ++k) sum += x[k];
  if (i < span.n) out[i] = sum;
}
