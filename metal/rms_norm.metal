// RMSNorm over rows: out = x * rsqrt(mean(x^2) + eps) * w, with w the gain as stored.
//
// Qwen3.6's zero-centred norms compute x * rsqrt(...) * (1 + w); MLX-format files already store
// 1 + w and HF-format files get it added at load time, so one formula on the stored weight serves
// both, and plain-gain norms too. One threadgroup per row; activations leave as fp32.
#include "common.h"

struct RmsNormParams {
  uint dim;
  float eps;
};

// The norm of one row, written to out; `x` is read as given, summed in fp32.
template <typename T>
inline void normalize_row(device const T* x, device const bfloat* w, device float* out,
                          constant RmsNormParams& p, threadgroup float* scratch, uint thread_id,
                          uint threads, uint simdgroup, uint lane) {
  float squares = 0.0f;
  for (uint i = thread_id; i < p.dim; i += threads) {
    const float v = float(x[i]);
    squares += v * v;
  }
  const float total = threadgroup_sum(squares, scratch, threads, simdgroup, lane);
  const float inv_rms = rsqrt(total / float(p.dim) + p.eps);
  for (uint i = thread_id; i < p.dim; i += threads) out[i] = float(x[i]) * inv_rms * float(w[i]);
}

template <typename T>
[[kernel]] void rms_norm(constant RmsNormParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                         device const bfloat* w [[buffer(2)]], device float* out [[buffer(3)]],
                         uint row [[threadgroup_position_in_grid]],
                         uint thread_id [[thread_index_in_threadgroup]],
                         uint threads [[threads_per_threadgroup]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[SIMD_WIDTH];
  normalize_row(x + ulong(row) * p.dim, w, out + ulong(row) * p.dim, p, scratch, thread_id, threads,
                simdgroup, lane);
}

template [[host_name("rms_norm_float")]] [[kernel]] decltype(rms_norm<float>) rms_norm<float>;
template [[host_name("rms_norm_bfloat")]] [[kernel]] decltype(rms_norm<bfloat>) rms_norm<bfloat>;

// The residual add fused with the next norm: h = residual + delta is written back (h may be the
// residual buffer itself), then out = rmsnorm(h) * w. One threadgroup per row.
[[kernel]] void add_rms_norm(constant RmsNormParams& p [[buffer(0)]],
                             device const float* residual [[buffer(1)]],
                             device const float* delta [[buffer(2)]],
                             device const bfloat* w [[buffer(3)]], device float* h [[buffer(4)]],
                             device float* out [[buffer(5)]],
                             uint row [[threadgroup_position_in_grid]],
                             uint thread_id [[thread_index_in_threadgroup]],
                             uint threads [[threads_per_threadgroup]],
                             uint simdgroup [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[SIMD_WIDTH];
  const ulong base = ulong(row) * p.dim;
  // Each thread later reads back only the elements it wrote itself, so no barrier is needed here.
  for (uint i = thread_id; i < p.dim; i += threads) h[base + i] = residual[base + i] + delta[base + i];
  normalize_row(h + base, w, out + base, p, scratch, thread_id, threads, simdgroup, lane);
}
