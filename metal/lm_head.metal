// The last step of a decode: the index of the largest logit, written to a device buffer so the
// next step's embedding can read it without a trip through the host. (The lm_head projection
// itself is the quantized GEMV.) Ties go to the lowest index, as numpy's argmax does.
#include "common.h"

struct ArgmaxParams {
  uint count;
};

// One threadgroup of up to 1024 threads.
[[kernel]] void argmax(constant ArgmaxParams& p [[buffer(0)]],
                       device const float* values [[buffer(1)]], device uint* index [[buffer(2)]],
                       uint thread_id [[thread_index_in_threadgroup]],
                       uint threads [[threads_per_threadgroup]],
                       uint simdgroup [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float simd_best[SIMD_WIDTH];
  threadgroup uint simd_best_index[SIMD_WIDTH];

  // Each thread scans its indices in increasing order, so a strict > keeps the lowest on ties.
  // Starting from the thread's first value (not -inf) makes an all -inf input give index 0.
  float best = thread_id < p.count ? values[thread_id] : -INFINITY;
  uint best_index = thread_id < p.count ? thread_id : 0xFFFFFFFFu;
  for (uint i = thread_id + threads; i < p.count; i += threads) {
    const float v = values[i];
    if (v > best) {
      best = v;
      best_index = i;
    }
  }
  const uint simd_winner = simd_argmax(best, best_index);
  const float simd_winner_value = simd_max(best);
  if (lane == 0) {
    simd_best[simdgroup] = simd_winner_value;
    simd_best_index[simdgroup] = simd_winner;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (simdgroup == 0) {
    const uint simdgroups = (threads + SIMD_WIDTH - 1) / SIMD_WIDTH;
    const float v = lane < simdgroups ? simd_best[lane] : -INFINITY;
    const uint i = lane < simdgroups ? simd_best_index[lane] : 0xFFFFFFFFu;
    const uint winner = simd_argmax(v, i);
    if (lane == 0) index[0] = winner;
  }
}
