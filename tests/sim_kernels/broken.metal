// Deliberately broken kernels: each must raise lily.device.KernelError on the sim, never crash.
// tests/test_sim_diagnostics.py runs them.
#include <metal_stdlib>
using namespace metal;

// Half of each simdgroup returns before a barrier the other half waits at.
[[kernel]] void broken_barrier_after_return(device float* out [[buffer(0)]],
                                            uint lid [[thread_index_in_threadgroup]]) {
  if (lid % 2 == 1) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

// The two simdgroups wait at two different barriers.
[[kernel]] void broken_barrier_two_sites(device float* out [[buffer(0)]],
                                         uint lid [[thread_index_in_threadgroup]]) {
  if (lid < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
  out[lid] = 1.0f;
}

// Lanes of one simdgroup call different collectives.
[[kernel]] void broken_divergent_simd(device float* out [[buffer(0)]],
                                      ushort lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 16)
    v = simd_sum(v);
  else
    v = simd_max(v);
  out[lane] = v;
}

// Half a simdgroup multiplies matrices.
[[kernel]] void broken_divergent_product(device float* out [[buffer(0)]],
                                         ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_float8x8 d = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  if (lane < 16) simdgroup_multiply_accumulate(d, m, m, d);
  simdgroup_store(d, out, 8);
}

// One simdgroup waits at a simd collective while the other lanes of it are at a barrier.
[[kernel]] void broken_simd_vs_barrier(device float* out [[buffer(0)]],
                                       ushort lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 8) v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = v;
}

// 36 000 bytes of threadgroup memory declared in the body.
[[kernel]] void broken_threadgroup_memory(device float* out [[buffer(0)]],
                                          uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float big[9000];
  big[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = big[lid];
}

// Reads [[buffer(1)]], which the test leaves unbound.
[[kernel]] void broken_unbound_read(device float* out [[buffer(0)]],
                                    device const float* in [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  out[i] = in[i];
}

// Unbounded recursion with a frame too large to stay inside any fiber stack.
static float deep(device const float* x, uint depth) {
  volatile float frame[256];
  for (uint k = 0; k < 256; ++k) frame[k] = x[0] + float(k + depth);
  return depth == 0 ? frame[3] : deep(x, depth - 1) + frame[depth % 256];
}
[[kernel]] void broken_stack_overflow(device float* out [[buffer(0)]],
                                      device const float* x [[buffer(1)]],
                                      uint i [[thread_position_in_grid]]) {
  out[i] = deep(x, 100000u + i);
}
