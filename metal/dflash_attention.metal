// The DFlash drafter's attention, in two dispatches (docs/dflash.md; numpy reference:
// lily.engine.dflash_reference):
//
//   dflash_prepare    per-head RMSNorm of q and k with the stored gains, rotate-half RoPE on
//                     all 128 dims with YaRN's frequencies and attention factor, and the write
//                     of the rotated key and the value to the drafter's bf16 cache at the row's
//                     position. With no query heads it is the catch-up over context rows.
//   dflash_attention  each block row's queries over the context keys (within a sliding
//                     layer's window) and the block's own keys: every block key (not causal,
//                     the full-attention layers), or those up to the row (causal), GQA, no
//                     output gate.
//
// Row t of a pass sits at position first[0] + t; the block's keys are written at the positions
// after the context and overwritten by the next catch-up, so attention reads one cache.
#include "dflash_attention.h"

// One simdgroup per head of one row: grid (num_q_heads + num_kv_heads, rows); threadgroups
// x < num_q_heads are query heads, the next num_kv_heads key/value heads. 32 threads.
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]] void dflash_prepare(
    constant DraftPrepareParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],   // [rows, Hq, 128]
    device const float* k_proj [[buffer(2)]],   // [rows, Hkv, 128]
    device const float* v_proj [[buffer(3)]],   // [rows, Hkv, 128]
    device const bfloat* q_norm [[buffer(4)]],  // [128], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [128], stored gain
    device const uint* first [[buffer(6)]],     // [position of row 0]
    device float* queries [[buffer(7)]],        // [rows, Hq, 128]: normed, rotated, scaled
    device uint2* k_cache [[buffer(8)]],        // bf16 [Hkv, cache_capacity, 128]
    device uint2* v_cache [[buffer(9)]],        // bf16 [Hkv, cache_capacity, 128]
    uint2 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float rope_cos[kDraftPairs];
  threadgroup float rope_sin[kDraftPairs];
  const uint head = group_id.x;
  const uint row = group_id.y;
  const uint position = first[0] + row;
  const bool is_query = head < params.num_q_heads;
  const uint kv_head = head - params.num_q_heads;
  device const float* src = is_query
                                ? q_proj + (ulong(row) * params.num_q_heads + head) * kDraftHeadDim
                                : k_proj + (ulong(row) * params.num_kv_heads + kv_head) * kDraftHeadDim;
  device const bfloat* gain = is_query ? q_norm : k_norm;

  fill_draft_rope(position, params.rope, lane, SIMD_WIDTH, rope_cos, rope_sin);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float4 loaded = reinterpret_cast<device const float4*>(src)[lane];
  float x[kDraftPerLane] = {loaded.x, loaded.y, loaded.z, loaded.w};
  float sum_sq = 0.0f;
  for (uint j = 0; j < kDraftPerLane; ++j) sum_sq += x[j] * x[j];
  const float inv_rms = rsqrt(simd_sum(sum_sq) / float(kDraftHeadDim) + params.norm_eps);
  for (uint j = 0; j < kDraftPerLane; ++j) {
    x[j] *= inv_rms * float(gain[kDraftPerLane * lane + j]);
  }
  // Rotate-half over all dims: dim i pairs with i + 64, the same slot 16 lanes further on.
  constexpr uint half_lanes = kDraftPairs / kDraftPerLane;
  const bool first_half = lane < half_lanes;
  const uint partner_lane = first_half ? lane + half_lanes : lane - half_lanes;
  float partner[kDraftPerLane];
  for (uint j = 0; j < kDraftPerLane; ++j) partner[j] = simd_shuffle(x[j], partner_lane);
  const uint pair = kDraftPerLane * (first_half ? lane : lane - half_lanes);
  float rotated[kDraftPerLane];
  for (uint j = 0; j < kDraftPerLane; ++j) {
    const float c = rope_cos[pair + j];
    const float s = rope_sin[pair + j];
    const float turned = first_half ? x[j] * c - partner[j] * s : x[j] * c + partner[j] * s;
    rotated[j] = turned * params.rope.attention_factor;
  }

  if (is_query) {
    device float4* out = reinterpret_cast<device float4*>(
        queries + (ulong(row) * params.num_q_heads + head) * kDraftHeadDim);
    out[lane] = float4(rotated[0], rotated[1], rotated[2], rotated[3]);
    return;
  }
  // A pass running past the cache must not write past the end of it.
  if (position >= params.cache_capacity) return;
  // A row is 32 lanes' uint2 shares.
  const ulong cache_row = (ulong(kv_head) * params.cache_capacity + position) * SIMD_WIDTH;
  const float4 v = reinterpret_cast<device const float4*>(
      v_proj + (ulong(row) * params.num_kv_heads + kv_head) * kDraftHeadDim)[lane];
  k_cache[cache_row + lane] = pack_bf16x4(float4(rotated[0], rotated[1], rotated[2], rotated[3]));
  v_cache[cache_row + lane] = pack_bf16x4(v);
}

// One simdgroup per query head of one block row: grid (num_q_heads, block_rows), 32 threads. An
// online softmax over the visible keys, one key at a time (a drafter pass has at most 9 rows).
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]] void dflash_attention(
    constant DraftAttentionParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],   // [block_rows, Hq, 128]
    device const uint2* k_cache [[buffer(2)]],  // bf16 [Hkv, cache_capacity, 128]
    device const uint2* v_cache [[buffer(3)]],  // bf16 [Hkv, cache_capacity, 128]
    device const uint* first [[buffer(4)]],      // [position of block row 0] = context rows
    device float* out [[buffer(5)]],             // [block_rows, Hq, 128]
    uint2 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint head = group_id.x;
  const uint row = group_id.y;
  const uint context = first[0];
  const uint query_position = context + row;
  const uint kv_head = head / (params.num_q_heads / params.num_kv_heads);
  const ulong q_offset = (ulong(row) * params.num_q_heads + head) * kDraftHeadDim;
  const float4 q = reinterpret_cast<device const float4*>(queries + q_offset)[lane];

  // Context keys [context_start, context), then block keys [context, block_end), within the cache.
  // (A window shorter than the block hides the whole context, not the block's own keys.)
  const uint context_start =
      params.window == 0 || query_position < params.window
          ? 0
          : min(query_position + 1 - params.window, context);
  const uint block_end =
      min(params.causal ? query_position + 1 : context + params.block_rows, params.cache_capacity);
  const ulong head_rows = ulong(kv_head) * params.cache_capacity;
  float running_max = -INFINITY;
  float total = 0.0f;
  float4 acc = float4(0.0f);
  for (uint key = context_start; key < block_end; ++key) {
    const ulong share = (head_rows + key) * SIMD_WIDTH + lane;
    const float4 k = unpack_bf16x4(k_cache[share]);
    const float score = simd_sum(dot(q, k)) * params.scale;
    const float new_max = max(running_max, score);
    const float shrink = exp(running_max - new_max);
    const float weight = exp(score - new_max);
    const float4 v = unpack_bf16x4(v_cache[share]);
    total = total * shrink + weight;
    acc = acc * shrink + weight * v;
    running_max = new_max;
  }
  reinterpret_cast<device float4*>(out + q_offset)[lane] = acc / total;
}
