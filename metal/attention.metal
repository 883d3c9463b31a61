// Gated full attention for one decoded token, in three dispatches:
//
//   attention_prepare  per-head RMSNorm of q and k, partial rotate-half RoPE, and the append of
//                      the rotated key and the value to the bf16 KV cache at the position
//   attention_decode   softmax(q K^T * scale) V over the whole context with GQA, the context
//                      split into a fixed number of ranges ("splits") so that long contexts
//                      spread over many threadgroups; each split leaves an unnormalised partial
//   attention_combine  merges the partials of every split and applies the sigmoid output gate
//
// The position is read from the step buffer (uint32 [position, ...]) because the graph is
// recorded once and replayed every step; the number of cached tokens after the append is
// position + 1. The query/gate split needs no copy: q_proj's output holds per head
// [query(head_dim) | gate(head_dim)], prepare reads the query half and combine the gate half.
#include "common.h"

// Every Qwen3.5/3.6 attention layer has 256-dim heads; a simdgroup covers one head with 8
// elements per lane (lane, lane + 32, ...), so loads are coalesced across the simdgroup.
constexpr constant uint kHeadDim = 256;
constexpr constant uint kPerLane = kHeadDim / SIMD_WIDTH;

struct AttentionPrepareParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;  // positions per head in the cache
  uint rotary_dim;      // a multiple of 64, so that rotate-half partners share a lane
  float rope_theta;
  float norm_eps;
};

// One simdgroup per head: threadgroups [0, num_q_heads) are query heads, the next num_kv_heads
// are key/value heads. Threads per threadgroup: 32.
[[kernel]] void attention_prepare(
    constant AttentionPrepareParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],  // [Hq, 2, head_dim]: query | gate per head
    device const float* k_proj [[buffer(2)]],  // [Hkv, head_dim]
    device const float* v_proj [[buffer(3)]],  // [Hkv, head_dim]
    device const bfloat* q_norm [[buffer(4)]],  // [head_dim], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [head_dim], stored gain
    device const uint* step [[buffer(6)]],      // [position, ...]
    device float* queries [[buffer(7)]],        // [Hq, head_dim]: normed, rotated
    device bfloat* k_cache [[buffer(8)]],       // [Hkv, cache_capacity, head_dim]
    device bfloat* v_cache [[buffer(9)]],       // [Hkv, cache_capacity, head_dim]
    uint head [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint position = step[0];
  const bool is_query = head < params.num_q_heads;
  const uint kv_head = head - params.num_q_heads;
  device const float* src = is_query ? q_proj + head * 2 * kHeadDim : k_proj + kv_head * kHeadDim;
  device const bfloat* gain = is_query ? q_norm : k_norm;

  float x[kPerLane];
  float sum_sq = 0.0f;
  for (uint j = 0; j < kPerLane; ++j) {
    x[j] = src[lane + SIMD_WIDTH * j];
    sum_sq += x[j] * x[j];
  }
  const float inv_rms = rsqrt(simd_sum(sum_sq) / float(kHeadDim) + params.norm_eps);
  for (uint j = 0; j < kPerLane; ++j) {
    x[j] *= inv_rms * float(gain[lane + SIMD_WIDTH * j]);
  }

  // Rotate-half RoPE on the first rotary_dim dims: dim i pairs with i + rotary_dim / 2, which
  // sits in the same lane, slot j + pair_offset.
  const uint half_rotary = params.rotary_dim / 2;
  const uint pair_offset = half_rotary / SIMD_WIDTH;
  const float log2_theta = log2(params.rope_theta);
  for (uint j = 0; j < pair_offset; ++j) {
    const uint i = lane + SIMD_WIDTH * j;
    const float inv_freq = exp2(-float(2 * i) / float(params.rotary_dim) * log2_theta);
    const float angle = float(position) * inv_freq;
    // Angles reach the hundreds of thousands of radians; the fast-math versions are only
    // accurate near [-pi, pi], and this runs 32 times per head, so take the precise ones.
    const float c = precise::cos(angle);
    const float s = precise::sin(angle);
    const float first = x[j];
    const float second = x[j + pair_offset];
    x[j] = first * c - second * s;
    x[j + pair_offset] = second * c + first * s;
  }

  if (is_query) {
    device float* dst = queries + head * kHeadDim;
    for (uint j = 0; j < kPerLane; ++j) {
      dst[lane + SIMD_WIDTH * j] = x[j];
    }
    return;
  }
  const ulong row = (ulong(kv_head) * params.cache_capacity + position) * kHeadDim;
  device const float* v_src = v_proj + kv_head * kHeadDim;
  for (uint j = 0; j < kPerLane; ++j) {
    k_cache[row + lane + SIMD_WIDTH * j] = bfloat(x[j]);
    v_cache[row + lane + SIMD_WIDTH * j] = bfloat(v_src[lane + SIMD_WIDTH * j]);
  }
}

struct AttentionDecodeParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint num_splits;
  float scale;
};

// Grid (num_splits, num_kv_heads); one simdgroup per query head of the kv head's group, so a
// threadgroup has (num_q_heads / num_kv_heads) * 32 threads and its simdgroups read the same
// cache rows. Split s covers positions [s * chunk, (s + 1) * chunk) of the context, chunk =
// ceil(context / num_splits). The partial of a split is its running max m, its sum of
// exp(score - m), and sum exp(score - m) * v; an empty split writes sum 0.
[[kernel]] void attention_decode(
    constant AttentionDecodeParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [Hq, head_dim]
    device const bfloat* k_cache [[buffer(2)]],
    device const bfloat* v_cache [[buffer(3)]],
    device const uint* step [[buffer(4)]],
    device float* partial_out [[buffer(5)]],    // [Hq, num_splits, head_dim]
    device float* partial_stats [[buffer(6)]],  // [Hq, num_splits, 2]: max, sum
    uint2 group_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint split = group_id.x;
  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint q_head = kv_head * group_size + simd_index;
  const uint context = step[0] + 1;
  const uint chunk = (context + params.num_splits - 1) / params.num_splits;
  const uint begin = min(split * chunk, context);
  const uint end = min(begin + chunk, context);

  float q[kPerLane];
  for (uint j = 0; j < kPerLane; ++j) {
    q[j] = queries[q_head * kHeadDim + lane + SIMD_WIDTH * j] * params.scale;
  }

  // Finite start value: fast math does not promise IEEE infinities.
  float running_max = -1.0e30f;
  float running_sum = 0.0f;
  float acc[kPerLane];
  for (uint j = 0; j < kPerLane; ++j) {
    acc[j] = 0.0f;
  }
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kHeadDim;
  for (uint t = begin; t < end; ++t) {
    device const bfloat* k_row = k_cache + head_base + ulong(t) * kHeadDim;
    device const bfloat* v_row = v_cache + head_base + ulong(t) * kHeadDim;
    float dot = 0.0f;
    for (uint j = 0; j < kPerLane; ++j) {
      dot += q[j] * float(k_row[lane + SIMD_WIDTH * j]);
    }
    const float score = simd_sum(dot);
    const float new_max = max(running_max, score);
    const float rescale = exp(running_max - new_max);
    const float weight = exp(score - new_max);
    running_sum = running_sum * rescale + weight;
    for (uint j = 0; j < kPerLane; ++j) {
      acc[j] = acc[j] * rescale + weight * float(v_row[lane + SIMD_WIDTH * j]);
    }
    running_max = new_max;
  }

  const uint slot = q_head * params.num_splits + split;
  for (uint j = 0; j < kPerLane; ++j) {
    partial_out[ulong(slot) * kHeadDim + lane + SIMD_WIDTH * j] = acc[j];
  }
  if (lane == 0) {
    partial_stats[2 * slot] = running_max;
    partial_stats[2 * slot + 1] = running_sum;
  }
}

struct AttentionCombineParams {
  uint num_q_heads;
  uint num_splits;
};

// One threadgroup per query head, one thread per head dim (head_dim threads).
[[kernel]] void attention_combine(
    constant AttentionCombineParams& params [[buffer(0)]],
    device const float* partial_out [[buffer(1)]],
    device const float* partial_stats [[buffer(2)]],
    device const float* q_proj [[buffer(3)]],  // the gate half of each head is read here
    device float* out [[buffer(4)]],           // [Hq, head_dim]: attention * sigmoid(gate)
    uint head [[threadgroup_position_in_grid]],
    uint dim [[thread_index_in_threadgroup]]) {
  const uint splits = params.num_splits;
  device const float* stats = partial_stats + 2 * head * splits;

  float global_max = -1.0e30f;
  for (uint s = 0; s < splits; ++s) {
    if (stats[2 * s + 1] > 0.0f) {
      global_max = max(global_max, stats[2 * s]);
    }
  }
  float numerator = 0.0f;
  float denominator = 0.0f;
  for (uint s = 0; s < splits; ++s) {
    const float sum = stats[2 * s + 1];
    if (sum > 0.0f) {
      const float w = exp(stats[2 * s] - global_max);
      denominator += w * sum;
      numerator += w * partial_out[(ulong(head) * splits + s) * kHeadDim + dim];
    }
  }
  const float gate = q_proj[head * 2 * kHeadDim + kHeadDim + dim];
  out[head * kHeadDim + dim] = numerator / denominator / (1.0f + exp(-gate));
}
