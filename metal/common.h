// Small helpers every kernel family shares. Other kernel files include this header, so it stays
// small and its names stay stable.
#pragma once

#include <metal_stdlib>
using namespace metal;

// Threads in one SIMD-group on every Apple GPU Lily targets.
constexpr constant uint SIMD_WIDTH = 32;

// Apple's simdgroup_matrix layout (which the sim reproduces): lane l holds row fragment_row(l),
// columns fragment_col(l) and fragment_col(l) + 1 of an 8x8 matrix. Kernels that work on a
// lane's own elements (a softmax, a per-row scaling) need to know which those are.
inline uint fragment_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint fragment_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

inline float silu(float x) { return x * sigmoid(x); }

// The lowest index among the lanes holding the largest value: an argmax that breaks ties towards
// the lowest index, whatever order the lanes scanned their values in. Every lane must call it with
// its own best (value, index); all lanes get the same answer.
inline uint simd_argmax(float value, uint index) {
  float best = simd_max(value);
  return simd_min(value == best ? index : 0xFFFFFFFFu);
}

// Sum of `value` over the whole threadgroup; every thread gets the same result, summed in the same
// order. `scratch` holds one float per SIMD-group and must not be reused before a barrier. Call
// from uniform control flow only.
inline float threadgroup_sum(float value, threadgroup float* scratch, uint threads,
                             uint simdgroup, uint lane) {
  const float partial = simd_sum(value);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < (threads + SIMD_WIDTH - 1) / SIMD_WIDTH; ++s) total += scratch[s];
  return total;
}
