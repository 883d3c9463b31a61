// The DFlash drafter's attention (docs/dflash.md): the parameters its two kernels share with the
// host (lily.kernels.dflash_attention packs them field for field) and its rotary angles.
//
// The drafter's heads are 128 wide (a lane holds 4 consecutive dims of a row), RoPE turns all of
// them with YaRN's blend of frequencies, and its KV cache holds bf16 rows [Hkv, capacity, 128]:
// row p of a head is the token at position p.
#pragma once

#include "common.h"

constexpr constant uint kDraftHeadDim = 128;
constexpr constant uint kDraftPerLane = kDraftHeadDim / SIMD_WIDTH;
constexpr constant uint kDraftPairs = kDraftHeadDim / 2;

// A row's 4 bf16 values per lane as two words (the low half first), and back.
inline uint2 pack_bf16x4(float4 x) {
  return uint2(uint(as_type<ushort>(bfloat(x.x))) | (uint(as_type<ushort>(bfloat(x.y))) << 16),
               uint(as_type<ushort>(bfloat(x.z))) | (uint(as_type<ushort>(bfloat(x.w))) << 16));
}

inline float4 unpack_bf16x4(uint2 words) {
  return float4(as_type<float>(words.x << 16), as_type<float>(words.x & 0xFFFF0000u),
                as_type<float>(words.y << 16), as_type<float>(words.y & 0xFFFF0000u));
}

// YaRN: pair i turns at theta^(-2i/128) below ramp_low (extrapolated), that divided by factor
// from ramp_high on (interpolated), blended linearly between; then queries and keys are scaled
// by attention_factor. factor 1 with attention_factor 1 is plain RoPE.
struct DraftRopeParams {
  float theta;
  float factor;
  float ramp_low;
  float ramp_high;  // > ramp_low
  float attention_factor;
};

struct DraftPrepareParams {
  uint num_q_heads;  // 0: keys and values only (the catch-up over context rows)
  uint num_kv_heads;
  uint cache_capacity;
  float norm_eps;
  DraftRopeParams rope;
};

struct DraftAttentionParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint block_rows;
  uint causal;  // block keys only up to the query's own row
  uint window;  // 0: every context key; else only those less than this far behind the query
  float scale;
};

// cos and sin of pair i's angle at `position`, for the pairs i = thread_id, thread_id + threads..
// (the caller puts a threadgroup barrier between this and the first read).
inline void fill_draft_rope(uint position, constant DraftRopeParams& rope, uint thread_id,
                            uint threads, threadgroup float* cos_table,
                            threadgroup float* sin_table) {
  const float log2_theta = log2(rope.theta);
  for (uint i = thread_id; i < kDraftPairs; i += threads) {
    const float extrapolated = exp2(-float(2 * i) / float(kDraftHeadDim) * log2_theta);
    const float share =
        clamp((float(i) - rope.ramp_low) / (rope.ramp_high - rope.ramp_low), 0.0f, 1.0f);
    const float inv_freq = extrapolated * (1.0f - share) + extrapolated / rope.factor * share;
    const float angle = float(position) * inv_freq;
    // Angles reach many radians; the fast-math versions are only accurate near [-pi, pi].
    cos_table[i] = precise::cos(angle);
    sin_table[i] = precise::sin(angle);
  }
}
