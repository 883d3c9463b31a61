// MSL5: barriers and SIMD collectives in uniform control flow only.
#include <metal_stdlib>
using namespace metal;

inline float block_sum(float v, threadgroup float* scratch, uint simdgroup, uint lane) {
  float partial = simd_sum(v);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return scratch[0] + scratch[1];
}

// Uniform or not depending on what the caller passes: checked per call.
inline void sync_if(bool flag) {
  if (flag) threadgroup_barrier(mem_flags::mem_threadgroup);  // expect: MSL5
}

[[kernel]] void reduce(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       constant uint& n [[buffer(2)]],
                       uint row [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint simdgroup [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[2];
  float v = x[row * 64 + tid];
  uint index = tid * 2;
  if (index < n) {
    v = simd_sum(v);  // expect: MSL5
  }
  if (simdgroup == 0) {
    v = simd_sum(v);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // expect: MSL5
  } else {
    v += block_sum(v, scratch, simdgroup, lane);  // expect: MSL5
  }
  for (uint k = lane; k < n; k += 32) {
    v += simd_shuffle_xor(v, 1);  // expect: MSL5
  }
  sync_if(row > 3);  // a uniform flag: the barrier inside stays uniform
  sync_if(lane == 0);
  // A reduction through threadgroup memory returns the same value to every thread.
  const float shared_total = block_sum(v, scratch, simdgroup, lane);
  if (shared_total > 0.0f) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (block_sum(v, scratch, simdgroup, lane) > 1.0f) v += 1.0f;
  if (lane == 0 || block_sum(v, scratch, simdgroup, lane) > 0.0f) {  // expect: MSL5
    v += 1.0f;
  }
  const float total = simd_sum(v);
  if (total > 0.0f) {
    v = simd_max(v);
  }
  if (row >= n) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane >= n) return;
  y[row] = simd_sum(v);  // expect: MSL5
}
