// Test-only kernels: one MSL feature each, compared with numpy by tests/test_sim_msl.py.
#include <metal_stdlib>
using namespace metal;

constant uint kSimdOps = 16;

// out[op * n + i] for every SIMD-group function, x read per thread. n = threads in the grid.
[[kernel]] void test_simd_ops(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              uint i [[thread_position_in_grid]],
                              uint grid [[threads_per_grid]],
                              ushort lane [[thread_index_in_simdgroup]]) {
  const uint n = grid;
  float v = x[i];
  float r[kSimdOps];
  r[0] = simd_sum(v);
  r[1] = simd_max(v);
  r[2] = simd_min(v);
  r[3] = simd_prefix_inclusive_sum(v);
  r[4] = simd_prefix_exclusive_sum(v);
  r[5] = simd_shuffle(v, ushort(31 - lane));
  r[6] = simd_shuffle_xor(v, ushort(5));
  r[7] = simd_shuffle_down(v, ushort(3));
  r[8] = simd_shuffle_up(v, ushort(2));
  r[9] = simd_broadcast(v, ushort(7));
  r[10] = simd_broadcast_first(v);
  r[11] = float(uint(simd_vote::vote_t(simd_ballot(v > 0.0f))) & 0xffffu);
  r[12] = float(uint(simd_vote::vote_t(simd_ballot(v > 0.0f))) >> 16);
  r[13] = simd_any(v > 1.5f) ? 1.0f : 0.0f;
  r[14] = simd_all(v > -1.5f) ? 1.0f : 0.0f;
  r[15] = float(simd_sum(int(v * 4.0f)));
  for (uint k = 0; k < kSimdOps; ++k) out[k * n + i] = r[k];
}

// Sum of each threadgroup through a tree in threadgroup memory declared in the kernel body.
[[kernel]] void test_threadgroup_sum(device const float* x [[buffer(0)]],
                                     device float* sums [[buffer(1)]],
                                     uint i [[thread_position_in_grid]],
                                     uint lid [[thread_index_in_threadgroup]],
                                     uint n [[threads_per_threadgroup]],
                                     uint group [[threadgroup_position_in_grid]]) {
  alignas(16) threadgroup float partial[256];
  partial[lid] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (lid < stride) partial[lid] += partial[lid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) sums[group] = partial[0];
}

// The same with the threadgroup memory passed as a [[threadgroup(0)]] argument, and a second
// stage through simd_sum.
[[kernel]] void test_threadgroup_arg_sum(device const float* x [[buffer(0)]],
                                         device float* sums [[buffer(1)]],
                                         threadgroup float* partial [[threadgroup(0)]],
                                         uint i [[thread_position_in_grid]],
                                         ushort lid [[thread_index_in_threadgroup]],
                                         ushort sg [[simdgroup_index_in_threadgroup]],
                                         ushort lane [[thread_index_in_simdgroup]],
                                         ushort sgs [[simdgroups_per_threadgroup]],
                                         uint group [[threadgroup_position_in_grid]]) {
  float s = simd_sum(x[i]);
  if (lane == 0) partial[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float t = lane < sgs ? partial[lane] : 0.0f;
    t = simd_sum(t);
    if (lane == 0) sums[group] = t;
  }
}

// Each thread reads what its left neighbour wrote, but without the barrier in between: correct
// only when lanes happen to run in forward order.
[[kernel]] void test_missing_barrier(device const float* x [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     uint i [[thread_position_in_grid]],
                                     uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float shared[64];
  shared[lid] = x[i];
  out[i] = lid > 0 ? shared[lid - 1] : x[i];
}

// D = A * B + C for 8x8 matrices, one simdgroup.
template <typename T>
[[kernel]] void test_simdgroup_mma(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                                   device const T* c [[buffer(2)]], device T* d [[buffer(3)]]) {
  simdgroup_matrix<T, 8, 8> ma, mb, mc, md;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_load(mc, c, 8);
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  simdgroup_store(md, d, 8);
}
template [[host_name("test_simdgroup_mma_float")]] [[kernel]] decltype(test_simdgroup_mma<float>) test_simdgroup_mma<float>;
template [[host_name("test_simdgroup_mma_half")]] [[kernel]] decltype(test_simdgroup_mma<half>) test_simdgroup_mma<half>;
template [[host_name("test_simdgroup_mma_bfloat")]] [[kernel]] decltype(test_simdgroup_mma<bfloat>) test_simdgroup_mma<bfloat>;

// A 16x16 product through threadgroup memory: tiles loaded with a stride and a transposed load,
// two simdgroups, a float accumulator over half inputs.
[[kernel]] void test_simdgroup_tiles(device const half* a [[buffer(0)]],
                                     device const half* bt [[buffer(1)]],
                                     device float* d [[buffer(2)]],
                                     ushort lid [[thread_index_in_threadgroup]],
                                     ushort sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup half ta[16 * 16];
  threadgroup half tb[16 * 16];
  for (uint k = lid; k < 256; k += 64) {
    ta[k] = a[k];
    tb[k] = bt[k];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Simdgroup s computes output rows 8*(s/2).., columns 8*(s%2)..; 64 threads = 2 simdgroups,
  // each doing two tiles.
  for (uint tile = sg; tile < 4; tile += 2) {
    uint row = (tile / 2) * 8, col = (tile % 2) * 8;
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint k = 0; k < 16; k += 8) {
      simdgroup_half8x8 ma, mb;
      simdgroup_load(ma, ta, 16, ulong2(k, row));
      simdgroup_load(mb, tb, 16, ulong2(k, col), true);
      simdgroup_multiply_accumulate(acc, ma, mb, acc);
    }
    simdgroup_store(acc, d, 16, ulong2(col, row));
  }
}

// Products whose results are used in every way the sim's queue of products must honour: as an
// operand of the next product, read by half the lanes only, accumulated into, left unread in a
// matrix that goes out of scope, and stored.
[[kernel]] void test_simdgroup_products_in_order(device const float* a [[buffer(0)]],
                                                 device float* out [[buffer(1)]],
                                                 ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 ma, p, q;
  simdgroup_load(ma, a, 8);
  simdgroup_multiply(p, ma, ma);  // P = A A
  simdgroup_multiply(q, p, ma);   // Q = P A
  float seen = -1.0f;
  if (lane % 2 == 0) seen = q.thread_elements()[1];
  simdgroup_multiply_accumulate(p, q, ma, p);  // P = Q A + P
  {
    simdgroup_float8x8 unread;
    simdgroup_multiply(unread, q, q);
  }
  simdgroup_store(p, out, 8);
  simdgroup_store(q, out + 64, 8);
  out[128 + lane] = seen;
}

// Every element of an 8x8 matrix set to the lane that holds it, through thread_elements().
[[kernel]] void test_simdgroup_layout(device float* out [[buffer(0)]],
                                      ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  m.thread_elements()[0] = float(lane);
  m.thread_elements()[1] = float(lane) + 0.5f;
  simdgroup_store(m, out, 8);
}

// Per-operation rounding: ((a + b) * c - a) / b in half and in bfloat.
[[kernel]] void test_half_ops(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                              device const half* c [[buffer(2)]], device half* out [[buffer(3)]],
                              uint i [[thread_position_in_grid]]) {
  out[i] = ((a[i] + b[i]) * c[i] - a[i]) / b[i];
}
[[kernel]] void test_bfloat_ops(device const bfloat* a [[buffer(0)]],
                                device const bfloat* b [[buffer(1)]],
                                device const bfloat* c [[buffer(2)]], device bfloat* out [[buffer(3)]],
                                device bfloat* from_float [[buffer(4)]],
                                uint i [[thread_position_in_grid]]) {
  out[i] = ((a[i] + b[i]) * c[i] - a[i]) / b[i];
  from_float[i] = bfloat(float(a[i]) * 1.001f);
}

// as_type between same-sized types; half literals.
[[kernel]] void test_as_type(device const float* x [[buffer(0)]], device uint* bits [[buffer(1)]],
                             device half2* halves [[buffer(2)]], device float* back [[buffer(3)]],
                             device half* literal [[buffer(4)]], uint i [[thread_position_in_grid]]) {
  uint u = as_type<uint>(x[i]);
  bits[i] = u;
  halves[i] = as_type<half2>(u);
  back[i] = as_type<float>(as_type<uint>(halves[i]));
  literal[i] = 1.5h * half(i) + 0.25h;
}

// Device atomics from every thread, threadgroup atomics inside each group.
[[kernel]] void test_atomics(device atomic_uint* count [[buffer(0)]],
                             device atomic_float* total [[buffer(1)]],
                             device atomic_int* largest [[buffer(2)]],
                             device uint* group_counts [[buffer(3)]],
                             device const float* x [[buffer(4)]],
                             uint i [[thread_position_in_grid]],
                             uint lid [[thread_index_in_threadgroup]],
                             uint group [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint in_group;
  if (lid == 0) atomic_store_explicit(&in_group, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(count, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, x[i], memory_order_relaxed);
  atomic_fetch_max_explicit(largest, int(x[i] * 100.0f), memory_order_relaxed);
  atomic_fetch_add_explicit(&in_group, 2u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) group_counts[group] = atomic_load_explicit(&in_group, memory_order_relaxed);
}

// Vector constructors, swizzles, conversions.
[[kernel]] void test_vectors(device const float* x [[buffer(0)]], device float4* out [[buffer(1)]],
                             device int4* ints [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float s = x[i];
  float4 v = float4(s, s + 1.0f, s + 2.0f, s + 3.0f);
  float4 w = v.wzyx;
  w.xy = v.zw;
  float3 t = float3(v.xy, 7.0f);
  half4 h = half4(v);
  float4 back = float4(h);
  out[i * 4 + 0] = w;
  out[i * 4 + 1] = float4(t, float(i));
  out[i * 4 + 2] = back + float4(1.0f);
  out[i * 4 + 3] = float4(float2(0.5f), v.yx);
  ints[i] = int4(v * -1.5f);
}

constant uint kMathOps = 24;

// out[op * n + i] for metal math functions on x (positive) and y (any sign).
[[kernel]] void test_math(device const float* x [[buffer(0)]], device const float* y [[buffer(1)]],
                          device float* out [[buffer(2)]], device half* hout [[buffer(3)]],
                          uint i [[thread_position_in_grid]], uint grid [[threads_per_grid]]) {
  const uint n = grid;
  float a = x[i], b = y[i];
  float r[kMathOps] = {
      exp(b),
      exp2(b),
      log(a),
      log2(a),
      sqrt(a),
      rsqrt(a),
      tanh(b),
      fma(a, b, 1.0f),
      mix(a, b, 0.25f),
      clamp(b, -0.5f, 0.5f),
      min(a, b),
      max(a, b),
      abs(b),
      floor(b),
      ceil(b),
      round(b),
      trunc(b),
      copysign(a, b),
      precise::divide(a, b),
      fast::exp(b),
      select(a, b, b > 0.0f),
      isnan(log(b)) ? 1.0f : 0.0f,
      isinf(a / 0.0f) ? 1.0f : 0.0f,
      dot(float2(a, b), float2(b, a)),
  };
  for (uint k = 0; k < kMathOps; ++k) out[k * n + i] = r[k];
  hout[i] = exp(half(b));
}

constant uint kMoreSimdOps = 12;

// out[op * n + i]: integer reductions, rotations, products and quad-group functions.
[[kernel]] void test_simd_more(device const int* x [[buffer(0)]], device int* out [[buffer(1)]],
                               uint i [[thread_position_in_grid]],
                               uint grid [[threads_per_grid]],
                               ushort lane [[thread_index_in_simdgroup]]) {
  const uint n = grid;
  int v = x[i];
  int r[kMoreSimdOps] = {
      simd_and(v),
      simd_or(v),
      simd_xor(v),
      simd_product(v % 3 + 2),
      simd_prefix_exclusive_product(v % 3 + 2),
      simd_shuffle_rotate_down(v, ushort(5)),
      simd_shuffle_rotate_up(v, ushort(3)),
      quad_sum(v),
      quad_max(v),
      quad_shuffle_xor(v, ushort(1)),
      quad_broadcast(v, ushort(2)),
      simd_is_first() ? 1 : 0,
  };
  for (uint k = 0; k < kMoreSimdOps; ++k) out[k * n + i] = r[k];
}
