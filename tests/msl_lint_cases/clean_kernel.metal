// Legal MSL that looks like violations to a careless token pass; the lint must stay silent.
#include <metal_stdlib>
using namespace metal;

struct Params {
  uint n;
  float scale;
};

template <typename T, int N>
inline T dot_n(device const T* a, thread const T* b) {
  T acc = T(0);
  for (int k = 0; k < N; ++k) acc += a[k] * b[k];
  return acc * N;
}

/* A comment with float* p and (float4)x and double must not count. */
[[kernel]] void clean(constant Params& p [[buffer(0)]], device const float* x [[buffer(1)]],
                      device float* y [[buffer(2)]], device const bfloat* w [[buffer(3)]],
                      threadgroup float* scratch [[threadgroup(0)]],
                      uint row [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint simdgroup [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  static_assert(sizeof(float) == 4, "float* and (float4)x and double in a string");
  if (row >= p.n) return;  // the whole threadgroup leaves together
  uint count = p.n & 3;
  const uint4 codes = uint4(count);
  const uint4 shifted = (codes >> 4) | (codes << 2);
  float mask_product = float(count) * float(p.n > 2 && count < 4);
  float local[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  thread float* lp = local;
  device const float* row_x = x + row * p.n;
  float partial = 0.0f;
  for (uint i = tid; i < p.n; i += 64) partial += row_x[i] * float(w[i]);
  partial = simd_sum(partial);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simdgroup >= 2) return;  // whole SIMD-groups leave; the collectives below stay uniform
  if (simdgroup == 0) {
    float v = lane < 2 ? scratch[lane] : 0.0f;
    v = simd_sum(v);
    if (lane == 0) y[row] = v * p.scale + dot_n<float, 4>(x, lp) + mask_product + float(shifted.x);
  }
}
