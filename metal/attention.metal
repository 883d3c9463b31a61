// Gated full attention, in three dispatches for one decoded token (the decode step runs the
// first two as one, attention_decode_fused):
//
//   attention_prepare  per-head RMSNorm of q and k, partial rotate-half RoPE, and the append of
//                      the rotated key and the value to the bf16 KV cache at the position
//   attention_decode   softmax(q K^T * scale) V over the whole context with GQA, the context
//                      split into a fixed number of ranges ("splits") so that long contexts
//                      spread over many threadgroups; each split leaves an unnormalised partial
//   attention_combine  merges the partials of every split and applies the sigmoid output gate
//
// and in two for a chunk of T prompt tokens: attention_prepare over the T tokens (token t sits at
// position + t), then attention_chunk, a causal flash-attention pass whose epilogue applies the
// output gate.
//
// The position is read from the step buffer (uint32 [position, ...]) because the graph is
// recorded once and replayed every step; the number of cached tokens after the append is
// position + T. The query/gate split needs no copy: q_proj's output holds per head
// [query(head_dim) | gate(head_dim)], prepare reads the query half and combine (or the chunk
// epilogue) the gate half.
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

// One head of one token as attention uses it: RMSNorm with the stored gain, then rotate-half
// RoPE at `position`; this lane's 8 dims (lane, lane + 32, ...) in x. The prepare kernel and the
// fused decode kernel both go through it, so they agree bit for bit.
inline void prepare_head(device const float* src, device const bfloat* gain, uint position,
                         uint rotary_dim, float rope_theta, float norm_eps, uint lane,
                         thread float* x) {
  float sum_sq = 0.0f;
  for (uint j = 0; j < kPerLane; ++j) {
    x[j] = src[lane + SIMD_WIDTH * j];
    sum_sq += x[j] * x[j];
  }
  const float inv_rms = rsqrt(simd_sum(sum_sq) / float(kHeadDim) + norm_eps);
  for (uint j = 0; j < kPerLane; ++j) {
    x[j] *= inv_rms * float(gain[lane + SIMD_WIDTH * j]);
  }

  // Rotate-half RoPE on the first rotary_dim dims: dim i pairs with i + rotary_dim / 2, which
  // sits in the same lane, slot j + pair_offset.
  const uint half_rotary = rotary_dim / 2;
  const uint pair_offset = half_rotary / SIMD_WIDTH;
  const float log2_theta = log2(rope_theta);
  for (uint j = 0; j < pair_offset; ++j) {
    const uint i = lane + SIMD_WIDTH * j;
    const float inv_freq = exp2(-float(2 * i) / float(rotary_dim) * log2_theta);
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
}

// One simdgroup per head of one token: grid (num_q_heads + num_kv_heads, tokens); threadgroups
// x < num_q_heads are query heads, the next num_kv_heads are key/value heads, and y is the token
// of the chunk. Threads per threadgroup: 32.
[[kernel]] void attention_prepare(
    constant AttentionPrepareParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],  // [T, Hq, 2, head_dim]: query | gate per head
    device const float* k_proj [[buffer(2)]],  // [T, Hkv, head_dim]
    device const float* v_proj [[buffer(3)]],  // [T, Hkv, head_dim]
    device const bfloat* q_norm [[buffer(4)]],  // [head_dim], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [head_dim], stored gain
    device const uint* step [[buffer(6)]],      // [position, ...]
    device float* queries [[buffer(7)]],        // [T, Hq, head_dim]: normed, rotated
    device bfloat* k_cache [[buffer(8)]],       // [Hkv, cache_capacity, head_dim]
    device bfloat* v_cache [[buffer(9)]],       // [Hkv, cache_capacity, head_dim]
    uint2 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint head = group_id.x;
  const uint token = group_id.y;
  const uint position = step[0] + token;
  const bool is_query = head < params.num_q_heads;
  const uint kv_head = head - params.num_q_heads;
  const ulong q_row = (ulong(token) * params.num_q_heads + head) * 2 * kHeadDim;
  const ulong kv_row = (ulong(token) * params.num_kv_heads + kv_head) * kHeadDim;
  device const float* src = is_query ? q_proj + q_row : k_proj + kv_row;
  device const bfloat* gain = is_query ? q_norm : k_norm;

  float x[kPerLane];
  prepare_head(src, gain, position, params.rotary_dim, params.rope_theta, params.norm_eps, lane, x);

  if (is_query) {
    device float* dst = queries + (ulong(token) * params.num_q_heads + head) * kHeadDim;
    for (uint j = 0; j < kPerLane; ++j) {
      dst[lane + SIMD_WIDTH * j] = x[j];
    }
    return;
  }
  // A chunk running past the cache must not write past the end of it.
  if (position >= params.cache_capacity) {
    return;
  }
  const ulong row = (ulong(kv_head) * params.cache_capacity + position) * kHeadDim;
  device const float* v_src = v_proj + kv_row;
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

// One position of the online softmax: this lane's 8 dims of the position's key and value.
inline void attend_position(thread const float* q, thread const float* k, thread const float* v,
                            thread float& running_max, thread float& running_sum,
                            thread float* acc) {
  float dot = 0.0f;
  for (uint j = 0; j < kPerLane; ++j) {
    dot += q[j] * k[j];
  }
  const float score = simd_sum(dot);
  const float new_max = max(running_max, score);
  const float rescale = exp(running_max - new_max);
  const float weight = exp(score - new_max);
  running_sum = running_sum * rescale + weight;
  for (uint j = 0; j < kPerLane; ++j) {
    acc[j] = acc[j] * rescale + weight * v[j];
  }
  running_max = new_max;
}

// The online softmax over cached positions [begin, end) of one kv head's cache rows.
inline void attend_cached(thread const float* q, device const bfloat* k_head,
                          device const bfloat* v_head, uint begin, uint end, uint lane,
                          thread float& running_max, thread float& running_sum,
                          thread float* acc) {
  for (uint t = begin; t < end; ++t) {
    device const bfloat* k_row = k_head + ulong(t) * kHeadDim;
    device const bfloat* v_row = v_head + ulong(t) * kHeadDim;
    float k[kPerLane];
    float v[kPerLane];
    for (uint j = 0; j < kPerLane; ++j) {
      k[j] = float(k_row[lane + SIMD_WIDTH * j]);
      v[j] = float(v_row[lane + SIMD_WIDTH * j]);
    }
    attend_position(q, k, v, running_max, running_sum, acc);
  }
}

// A split's partial: its running max, its sum of exp(score - max) and the weighted values.
inline void store_partial(thread const float* acc, float running_max, float running_sum,
                          uint slot, device float* partial_out, device float* partial_stats,
                          uint lane) {
  for (uint j = 0; j < kPerLane; ++j) {
    partial_out[ulong(slot) * kHeadDim + lane + SIMD_WIDTH * j] = acc[j];
  }
  if (lane == 0) {
    partial_stats[2 * slot] = running_max;
    partial_stats[2 * slot + 1] = running_sum;
  }
}

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
  attend_cached(q, k_cache + head_base, v_cache + head_base, begin, end, lane, running_max,
                running_sum, acc);
  store_partial(acc, running_max, running_sum, q_head * params.num_splits + split, partial_out,
                partial_stats, lane);
}

struct AttentionDecodeFusedParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint num_splits;
  float scale;
  uint rotary_dim;
  float rope_theta;
  float norm_eps;
};

// attention_prepare and attention_decode in one dispatch, for the decode step: grid and splits
// as attention_decode. Each simdgroup norms and rotates its own query head from q_proj, and the
// current token's key (normed, rotated) and value from k_proj / v_proj, rounded to bf16 as the
// cache holds them, so the current position is attended from registers, exactly as if read from
// the cache. Only the split holding the current position attends it; that split's simdgroup 0 also
// appends the key and value to the cache for later steps. No other threadgroup reads that row, so
// the append needs no barrier before attention, and attention no level after the prepare.
[[kernel]] void attention_decode_fused(
    constant AttentionDecodeFusedParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],   // [Hq, 2, head_dim]: query | gate per head
    device const float* k_proj [[buffer(2)]],   // [Hkv, head_dim]
    device const float* v_proj [[buffer(3)]],   // [Hkv, head_dim]
    device const bfloat* q_norm [[buffer(4)]],  // [head_dim], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [head_dim], stored gain
    device const uint* step [[buffer(6)]],      // [position, ...]
    device bfloat* k_cache [[buffer(7)]],       // [Hkv, cache_capacity, head_dim]
    device bfloat* v_cache [[buffer(8)]],
    device float* partial_out [[buffer(9)]],    // [Hq, num_splits, head_dim]
    device float* partial_stats [[buffer(10)]],  // [Hq, num_splits, 2]: max, sum
    uint2 group_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint split = group_id.x;
  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint q_head = kv_head * group_size + simd_index;
  const uint position = step[0];
  const uint context = position + 1;
  const uint chunk = (context + params.num_splits - 1) / params.num_splits;
  const uint begin = min(split * chunk, context);
  const uint end = min(begin + chunk, context);
  const bool holds_current = begin <= position && position < end;

  float q[kPerLane];
  prepare_head(q_proj + q_head * 2 * kHeadDim, q_norm, position, params.rotary_dim,
               params.rope_theta, params.norm_eps, lane, q);
  for (uint j = 0; j < kPerLane; ++j) q[j] *= params.scale;

  float running_max = -1.0e30f;
  float running_sum = 0.0f;
  float acc[kPerLane];
  for (uint j = 0; j < kPerLane; ++j) {
    acc[j] = 0.0f;
  }
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kHeadDim;
  attend_cached(q, k_cache + head_base, v_cache + head_base, begin, holds_current ? position : end,
                lane, running_max, running_sum, acc);
  if (holds_current) {
    float k[kPerLane];
    float v[kPerLane];
    prepare_head(k_proj + kv_head * kHeadDim, k_norm, position, params.rotary_dim,
                 params.rope_theta, params.norm_eps, lane, k);
    for (uint j = 0; j < kPerLane; ++j) {
      k[j] = float(bfloat(k[j]));
      v[j] = float(bfloat(v_proj[kv_head * kHeadDim + lane + SIMD_WIDTH * j]));
    }
    attend_position(q, k, v, running_max, running_sum, acc);
    // A step queued past the capacity must not write past the end of the cache.
    if (simd_index == 0 && position < params.cache_capacity) {
      const ulong row = head_base + ulong(position) * kHeadDim;
      for (uint j = 0; j < kPerLane; ++j) {
        k_cache[row + lane + SIMD_WIDTH * j] = bfloat(k[j]);
        v_cache[row + lane + SIMD_WIDTH * j] = bfloat(v[j]);
      }
    }
  }
  store_partial(acc, running_max, running_sum, q_head * params.num_splits + split, partial_out,
                partial_stats, lane);
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

// ---- attention for a chunk of prompt tokens ---------------------------------------------------
//
// A threadgroup takes 32 consecutive rows of the chunk's (token, query head) pairs of one kv head,
// row = token * group_size + head_in_group, so the query heads that share a kv head share every
// K/V tile it stages. Its four simdgroups own 8 rows each and keep, in simdgroup_matrix 8x8
// fragments, their rows' scaled queries and fp32 output accumulators across the full head dim
// (32 fragments each). Per tile of 16 keys: S = Q K^T (2 fragments per simdgroup), an online
// softmax on S in registers, O = O * rescale + P V. Query t of the chunk sees positions
// [0, position + t]; keys past the threadgroup's last visible position are staged as zeros.
//
// The tiles stay bf16 in threadgroup memory (20.25 KiB with the padding) and each lane widens
// its own two elements into float fragments: a float tile for simdgroup_load would take twice
// the space, and float fragments keep every product and sum of Q K^T and P V in fp32.
constexpr constant uint kChunkSimdgroups = 4;
constexpr constant uint kChunkThreads = kChunkSimdgroups * SIMD_WIDTH;
constexpr constant uint kChunkRows = 8 * kChunkSimdgroups;
constexpr constant uint kChunkKeys = 16;
constexpr constant uint kHeadFragments = kHeadDim / 8;
// Staged rows are padded so that the 8 rows a fragment reads start in different banks.
constexpr constant uint kKeysStride = kChunkKeys + 8;
constexpr constant uint kValuesStride = kHeadDim + 8;

// Apple's simdgroup_matrix layout (which the sim reproduces): lane l holds row fragment_row(l),
// columns fragment_col(l) and fragment_col(l) + 1. The softmax and the epilogue work on a lane's
// own elements, so they need to know which row and columns those are; the four lanes of a row
// differ in lane bits 0 and 3.
inline uint fragment_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint fragment_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

inline float row_max(float value) {
  value = max(value, simd_shuffle_xor(value, 1));
  return max(value, simd_shuffle_xor(value, 8));
}

inline float row_sum(float value) {
  value += simd_shuffle_xor(value, 1);
  return value + simd_shuffle_xor(value, 8);
}

struct AttentionChunkParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint tokens;
  float scale;
};

// Grid (ceil(tokens * group_size / 32), num_kv_heads), 128 threads per threadgroup.
[[kernel]] void attention_chunk(
    constant AttentionChunkParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [T, Hq, head_dim]: normed, rotated
    device const float* q_proj [[buffer(2)]],   // [T, Hq, 2, head_dim]: the gate halves are read
    device const bfloat* k_cache [[buffer(3)]],  // [Hkv, cache_capacity, head_dim]
    device const bfloat* v_cache [[buffer(4)]],  // [Hkv, cache_capacity, head_dim]
    device const uint* step [[buffer(5)]],       // [position, ...]
    device float* out [[buffer(6)]],             // [T, Hq, head_dim]: attention * sigmoid(gate)
    uint2 group_id [[threadgroup_position_in_grid]],
    uint thread_id [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup bfloat keys_t[kHeadDim * kKeysStride];      // [dim][key]
  threadgroup bfloat values[kChunkKeys * kValuesStride];  // [key][dim]

  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint position = step[0];
  const uint frag_row = fragment_row(lane);
  const uint frag_col = fragment_col(lane);

  const uint first_row = group_id.x * kChunkRows;
  const uint row = first_row + simd_index * 8 + frag_row;
  const uint token = row / group_size;
  const bool row_in_chunk = token < params.tokens;
  const uint q_head = kv_head * group_size + row % group_size;
  // Rows past the chunk (in the last threadgroup) also see the zeros staged past the context:
  // finite, and never stored.
  const uint last_visible = position + token;
  const uint last_row = min(first_row + kChunkRows, params.tokens * group_size) - 1;
  const uint context = min(position + last_row / group_size + 1, params.cache_capacity);

  const ulong q_offset = (ulong(token) * params.num_q_heads + q_head) * kHeadDim + frag_col;
  simdgroup_float8x8 q[kHeadFragments];
  simdgroup_float8x8 acc[kHeadFragments];
  for (uint f = 0; f < kHeadFragments; ++f) {
    for (uint i = 0; i < 2; ++i) {
      q[f].thread_elements()[i] =
          row_in_chunk ? queries[q_offset + 8 * f + i] * params.scale : 0.0f;
    }
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // Finite start value: fast math does not promise IEEE infinities. Key 0 is visible to every
  // row, so the first tile replaces it.
  float running_max = -1.0e30f;
  float lane_sum = 0.0f;  // this lane's share of its row's softmax denominator
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kHeadDim;
  for (uint key0 = 0; key0 < context; key0 += kChunkKeys) {
    // Zeros past the context: P is 0 there, and 0 * (whatever the cache holds) must stay 0.
    for (uint e = thread_id; e < kChunkKeys * kHeadDim; e += kChunkThreads) {
      const uint key = e / kHeadDim;
      const uint dim = e % kHeadDim;
      const bool inside = key0 + key < context;
      const ulong at = head_base + ulong(key0 + key) * kHeadDim + dim;
      keys_t[dim * kKeysStride + key] = inside ? k_cache[at] : bfloat(0.0f);
      values[key * kValuesStride + dim] = inside ? v_cache[at] : bfloat(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_float8x8 scores[kChunkKeys / 8];
    for (uint c = 0; c < kChunkKeys / 8; ++c) {
      scores[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint f = 0; f < kHeadFragments; ++f) {
        threadgroup const bfloat* src =
            keys_t + (8 * f + frag_row) * kKeysStride + 8 * c + frag_col;
        simdgroup_float8x8 k_frag;
        k_frag.thread_elements()[0] = float(src[0]);
        k_frag.thread_elements()[1] = float(src[1]);
        simdgroup_multiply_accumulate(scores[c], q[f], k_frag, scores[c]);
      }
    }

    float tile_max = running_max;
    for (uint c = 0; c < kChunkKeys / 8; ++c) {
      for (uint i = 0; i < 2; ++i) {
        const bool visible = key0 + 8 * c + frag_col + i <= last_visible;
        tile_max = visible ? max(tile_max, scores[c].thread_elements()[i]) : tile_max;
      }
    }
    const float new_max = row_max(tile_max);
    const float rescale = exp(running_max - new_max);
    running_max = new_max;
    lane_sum *= rescale;
    for (uint c = 0; c < kChunkKeys / 8; ++c) {
      for (uint i = 0; i < 2; ++i) {
        const bool visible = key0 + 8 * c + frag_col + i <= last_visible;
        const float p = visible ? exp(scores[c].thread_elements()[i] - running_max) : 0.0f;
        scores[c].thread_elements()[i] = p;
        lane_sum += p;
      }
    }

    for (uint f = 0; f < kHeadFragments; ++f) {
      acc[f].thread_elements() *= rescale;
      for (uint c = 0; c < kChunkKeys / 8; ++c) {
        threadgroup const bfloat* src =
            values + (8 * c + frag_row) * kValuesStride + 8 * f + frag_col;
        simdgroup_float8x8 v_frag;
        v_frag.thread_elements()[0] = float(src[0]);
        v_frag.thread_elements()[1] = float(src[1]);
        simdgroup_multiply_accumulate(acc[f], scores[c], v_frag, acc[f]);
      }
    }
    // The next tile overwrites what the other simdgroups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float denominator = row_sum(lane_sum);
  if (row_in_chunk) {
    const ulong gate_offset =
        (ulong(token) * params.num_q_heads + q_head) * 2 * kHeadDim + kHeadDim + frag_col;
    for (uint f = 0; f < kHeadFragments; ++f) {
      for (uint i = 0; i < 2; ++i) {
        out[q_offset + 8 * f + i] = acc[f].thread_elements()[i] / denominator *
                                    sigmoid(q_proj[gate_offset + 8 * f + i]);
      }
    }
  }
}
