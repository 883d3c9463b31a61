// Gated full attention, in three dispatches for one decoded token (the decode step runs the
// first two as one, attention_decode_fused):
//
//   attention_prepare  per-head RMSNorm of q and k, partial rotate-half RoPE, and the append of
//                      the rotated key and the value to the KV cache at the position
//   attention_decode   softmax(q K^T * scale) V over the whole context with GQA, the context
//                      split into ranges of positions ("splits", split_length below) that run
//                      as separate threadgroups; each split leaves an unnormalised partial per
//                      query head
//   attention_combine  merges the partials of the splits the context reaches and applies the
//                      sigmoid output gate
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
//
// The KV cache holds rows of one of two formats, a template parameter of every kernel that
// touches it (host names without a suffix are bf16, `_int8` the int8 cache):
//
//   bf16  256 bf16 values, 512 bytes;
//   int8  256 int8 codes, then 8 fp16 scales, one per group of 32 dims: 272 bytes. A group's
//         scale is its max |x| / 127 rounded to fp16 and its codes x / scale rounded to nearest
//         (ties to even), so a value is code * scale within half a step (docs/benchmarks.md,
//         "An int8 KV cache", chose the groups and the scales' type).
//
// A cache array is [num_kv_heads, capacity] rows; 272 is a multiple of 16, so every row of
// either format starts 16-byte aligned.
#include "attention_chunk.h"
#include "common.h"
#include "step.h"

// kHeadDim (256) is in attention_chunk.h: this lane's dims of a row.
constexpr constant uint kPerLane = kHeadDim / SIMD_WIDTH;

// This lane's 8 dims of an fp32 row (16-byte aligned: rows start at multiples of 256 floats).
inline void load_float_row(device const float* row, uint lane, thread float* x) {
  const float4 low = reinterpret_cast<device const float4*>(row)[2 * lane];
  const float4 high = reinterpret_cast<device const float4*>(row)[2 * lane + 1];
  for (uint i = 0; i < 4; ++i) {
    x[i] = low[i];
    x[4 + i] = high[i];
  }
}

// Stores of this lane's 8 dims of an fp32 row, and threadgroup-memory loads and stores of them,
// as float4s: 16-byte accesses, which the checking sim sees (8 scalar stores to consecutive
// floats may be merged by the compiler into one access it does not).
inline void store_float_row(thread const float* x, uint lane, device float* row) {
  reinterpret_cast<device float4*>(row)[2 * lane] = float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<device float4*>(row)[2 * lane + 1] = float4(x[4], x[5], x[6], x[7]);
}

inline void store_threadgroup_row(thread const float* x, uint lane, threadgroup float* row) {
  reinterpret_cast<threadgroup float4*>(row)[2 * lane] = float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<threadgroup float4*>(row)[2 * lane + 1] = float4(x[4], x[5], x[6], x[7]);
}

inline void load_threadgroup_row(threadgroup const float* row, uint lane, thread float* x) {
  const float4 low = reinterpret_cast<threadgroup const float4*>(row)[2 * lane];
  const float4 high = reinterpret_cast<threadgroup const float4*>(row)[2 * lane + 1];
  for (uint i = 0; i < 4; ++i) {
    x[i] = low[i];
    x[4 + i] = high[i];
  }
}

// ---- the KV cache's row formats ---------------------------------------------------------------

// (kBf16RowBytes is in attention_chunk.h.) Dims per scale of the int8 format, and the scales of a row.
constexpr constant uint kInt8Group = 32;
constexpr constant uint kInt8Groups = kHeadDim / kInt8Group;
constexpr constant uint kInt8RowBytes = kHeadDim + 2 * kInt8Groups;

template <bool kInt8>
constexpr uint kv_row_bytes() {
  return kInt8 ? kInt8RowBytes : kBf16RowBytes;
}

// The bf16 bits of this lane's 8 dims, packed as a 16-byte row share.
inline uint4 pack_bf16(thread const float* x) {
  uint4 words;
  for (uint i = 0; i < 4; ++i) {
    words[i] = uint(as_type<ushort>(bfloat(x[2 * i]))) |
               (uint(as_type<ushort>(bfloat(x[2 * i + 1]))) << 16);
  }
  return words;
}

// This lane's share of a row (its dims 8 lane to 8 lane + 7) in a cache format: bf16, the 8
// values in `bits`, 16 bytes at byte 16 lane; int8, the 8 codes in bits.xy, 8 bytes at byte
// 8 lane, and the scale of its group, which lane 4 j stores for group j.
struct KvShare {
  uint4 bits;
  half scale;
};

// Encodes this lane's dims; for int8 the 4 lanes of a group (lanes 4 j to 4 j + 3) take its
// max together, so every lane of the simdgroup must call it.
template <bool kInt8>
inline KvShare encode_share(thread const float* x, uint lane) {
  KvShare share;
  share.scale = half(0.0f);
  if (!kInt8) {
    share.bits = pack_bf16(x);
    return share;
  }
  float group_max = 0.0f;
  for (uint j = 0; j < kPerLane; ++j) {
    group_max = max(group_max, abs(x[j]));
  }
  group_max = max(group_max, simd_shuffle_xor(group_max, 1));
  group_max = max(group_max, simd_shuffle_xor(group_max, 2));
  share.scale = half(group_max / 127.0f);
  // An all-zero group (or one below fp16's range) has scale 0: its values decode to 0 whatever
  // the codes, which the divisor keeps finite.
  const float step = float(share.scale);
  const float divisor = step > 0.0f ? step : 1.0f;
  uint words[2];
  for (uint w = 0; w < 2; ++w) {
    words[w] = 0;
    for (uint b = 0; b < 4; ++b) {
      // The fp16 rounding of the scale can put the group's max just past 127 steps.
      const float code = clamp(rint(x[4 * w + b] / divisor), -127.0f, 127.0f);
      words[w] |= (uint(int(code)) & 0xFFu) << (8 * b);
    }
  }
  share.bits = uint4(words[0], words[1], 0u, 0u);
  return share;
}

template <bool kInt8>
inline void store_share(KvShare share, uint lane, device uchar* row) {
  if (kInt8) {
    reinterpret_cast<device uint2*>(row)[lane] = share.bits.xy;
    if (lane % 4 == 0) {
      reinterpret_cast<device half*>(row + kHeadDim)[lane / 4] = share.scale;
    }
  } else {
    reinterpret_cast<device uint4*>(row)[lane] = share.bits;
  }
}

template <bool kInt8>
inline void stage_share(KvShare share, uint lane, threadgroup uchar* row) {
  if (kInt8) {
    reinterpret_cast<threadgroup uint2*>(row)[lane] = share.bits.xy;
    if (lane % 4 == 0) {
      reinterpret_cast<threadgroup half*>(row + kHeadDim)[lane / 4] = share.scale;
    }
  } else {
    reinterpret_cast<threadgroup uint4*>(row)[lane] = share.bits;
  }
}

// Multimodal rotary positions (M-RoPE, docs/vision.md): a token has three positions, temporal,
// height and width, equal for text. With `table` set, a token's three are row `slot` of the
// rope-position table [capacity, 3] (the host writes it for every slot a generation uses); without,
// all three are the slot. Interleaved sections pick the stream per rotary frequency i: height
// for i % 3 == 1 below height_end, width for i % 3 == 2 below width_end, temporal otherwise.
struct MropeParams {
  uint table;
  uint height_end;
  uint width_end;
};

struct AttentionPrepareParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;  // positions per head in the cache
  uint rotary_dim;      // a multiple of 64 (the host checks; rotate-half needs a multiple of 16)
  float rope_theta;
  float norm_eps;
  MropeParams mrope;
};

inline uint3 rope_positions_of(uint slot, constant MropeParams& mrope,
                               device const uint* rope_table, uint capacity) {
  // A slot past the cache (a chunk running past it, a step queued past it) writes no row, so its
  // rotation only needs to be defined.
  if (mrope.table == 0 || slot >= capacity) {
    return uint3(slot);
  }
  device const uint* row = rope_table + 3 * ulong(slot);
  return uint3(row[0], row[1], row[2]);
}

// cos and sin of the RoPE angles at `positions` (temporal, height, width), entry i for the
// rotate-half pair of dims i and i + rotary_dim / 2, filled by `threads` threads together; the
// caller puts a threadgroup barrier between this and the first read. Every kernel rotates with a
// table from this function, so they all rotate by the same bits; with the three positions equal
// the angles are those of plain RoPE at that position, bit for bit.
inline void fill_rope_table(uint3 positions, constant MropeParams& mrope, uint rotary_dim,
                            float rope_theta, uint thread_id, uint threads,
                            threadgroup float* cos_table, threadgroup float* sin_table) {
  const float log2_theta = log2(rope_theta);
  for (uint i = thread_id; i < rotary_dim / 2; i += threads) {
    const float inv_freq = exp2(-float(2 * i) / float(rotary_dim) * log2_theta);
    const uint position = (i % 3 == 1 && i < mrope.height_end)  ? positions.y
                          : (i % 3 == 2 && i < mrope.width_end) ? positions.z
                                                                : positions.x;
    const float angle = float(position) * inv_freq;
    // Angles reach the hundreds of thousands of radians; the fast-math versions are only
    // accurate near [-pi, pi], and this runs once per pair and threadgroup, so take the precise
    // ones.
    cos_table[i] = precise::cos(angle);
    sin_table[i] = precise::sin(angle);
  }
}

// One head of one token as attention uses it: RMSNorm with the stored gain, then rotate-half
// RoPE with the table of fill_rope_table; this lane's 8 dims in x. The prepare kernel and the
// fused decode kernel both go through it, so they agree bit for bit.
inline void prepare_head(device const float* src, device const bfloat* gain, uint rotary_dim,
                         float norm_eps, threadgroup const float* cos_table,
                         threadgroup const float* sin_table, uint lane, thread float* x) {
  load_float_row(src, lane, x);
  float sum_sq = 0.0f;
  for (uint j = 0; j < kPerLane; ++j) {
    sum_sq += x[j] * x[j];
  }
  const float inv_rms = rsqrt(simd_sum(sum_sq) / float(kHeadDim) + norm_eps);
  // The gains are checkpoint tensors, not necessarily 16-byte aligned: scalar loads.
  for (uint j = 0; j < kPerLane; ++j) {
    x[j] *= inv_rms * float(gain[kPerLane * lane + j]);
  }

  // Rotate-half on the first rotary_dim dims: dim i pairs with i + rotary_dim / 2, the same slot
  // half_lanes lanes further on.
  const uint half_lanes = rotary_dim / 2 / kPerLane;
  const bool first_half = lane < half_lanes;
  const uint partner_lane = first_half ? lane + half_lanes : lane - half_lanes;
  float partner[kPerLane];
  for (uint j = 0; j < kPerLane; ++j) {
    partner[j] = simd_shuffle(x[j], partner_lane);
  }
  if (lane < 2 * half_lanes) {
    const uint pair = kPerLane * (first_half ? lane : lane - half_lanes);
    for (uint j = 0; j < kPerLane; ++j) {
      const float c = cos_table[pair + j];
      const float s = sin_table[pair + j];
      x[j] = first_half ? x[j] * c - partner[j] * s : x[j] * c + partner[j] * s;
    }
  }
}

// One simdgroup per head of one token: grid (num_q_heads + num_kv_heads, tokens); threadgroups
// x < num_q_heads are query heads, the next num_kv_heads are key/value heads, and y is the token
// of the chunk. Threads per threadgroup: 32.
template <bool kInt8>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]] void attention_prepare(
    constant AttentionPrepareParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],  // [T, Hq, 2, head_dim]: query | gate per head
    device const float* k_proj [[buffer(2)]],  // [T, Hkv, head_dim]
    device const float* v_proj [[buffer(3)]],  // [T, Hkv, head_dim]
    device const bfloat* q_norm [[buffer(4)]],  // [head_dim], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [head_dim], stored gain
    device const uint* step [[buffer(6)]],      // [position, ...]
    device float* queries [[buffer(7)]],        // [T, Hq, head_dim]: normed, rotated
    device uchar* k_cache [[buffer(8)]],        // [Hkv, cache_capacity] rows
    device uchar* v_cache [[buffer(9)]],        // [Hkv, cache_capacity] rows
    device const uint* rope_table [[buffer(10)]],  // [cache_capacity, 3] if params.mrope.table
    uint2 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float rope_cos[kHeadDim / 2];
  threadgroup float rope_sin[kHeadDim / 2];
  const uint head = group_id.x;
  const uint token = group_id.y;
  const uint position = step[0] + token;
  const bool is_query = head < params.num_q_heads;
  const uint kv_head = head - params.num_q_heads;
  const ulong q_row = (ulong(token) * params.num_q_heads + head) * 2 * kHeadDim;
  const ulong kv_row = (ulong(token) * params.num_kv_heads + kv_head) * kHeadDim;
  device const float* src = is_query ? q_proj + q_row : k_proj + kv_row;
  device const bfloat* gain = is_query ? q_norm : k_norm;

  fill_rope_table(rope_positions_of(position, params.mrope, rope_table, params.cache_capacity),
                  params.mrope, params.rotary_dim, params.rope_theta, lane, SIMD_WIDTH, rope_cos,
                  rope_sin);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float x[kPerLane];
  prepare_head(src, gain, params.rotary_dim, params.norm_eps, rope_cos, rope_sin, lane, x);

  if (is_query) {
    store_float_row(x, lane, queries + (ulong(token) * params.num_q_heads + head) * kHeadDim);
    return;
  }
  // A chunk running past the cache must not write past the end of it.
  if (position >= params.cache_capacity) {
    return;
  }
  const ulong row = (ulong(kv_head) * params.cache_capacity + position) * kv_row_bytes<kInt8>();
  float v[kPerLane];
  load_float_row(v_proj + kv_row, lane, v);
  store_share<kInt8>(encode_share<kInt8>(x, lane), lane, k_cache + row);
  store_share<kInt8>(encode_share<kInt8>(v, lane), lane, v_cache + row);
}

template [[host_name("attention_prepare")]] [[kernel]] decltype(attention_prepare<false>)
    attention_prepare<false>;
template [[host_name("attention_prepare_int8")]] [[kernel]] decltype(attention_prepare<true>)
    attention_prepare<true>;

// ---- shared by decode and chunk: simdgroup_matrix fragments ------------------------------------

constexpr constant uint kHeadFragments = kHeadDim / 8;

// The softmax and the epilogues work on a lane's own elements (fragment_row, fragment_col in
// common.h); the four lanes of a row differ in lane bits 0 and 3.

inline float row_max(float value) {
  value = max(value, simd_shuffle_xor(value, 1));
  return max(value, simd_shuffle_xor(value, 8));
}

inline float row_sum(float value) {
  value += simd_shuffle_xor(value, 1);
  return value + simd_shuffle_xor(value, 8);
}

// ---- decode: one token's queries over the cached context ----------------------------------------
//
// A threadgroup takes one split of one kv head. The group's query heads are the 8 rows of
// simdgroup_matrix fragments (rows past the group hold zero queries and are never stored), so a
// score S = Q K^T of 8 heads by 8 positions costs 32 fragment products and every (head, position)
// score and softmax term is computed once. Its kDecodeSimdgroups simdgroups take the split's
// tiles of kTile positions in turn; per tile each lane issues all its loads first, 8 16-byte
// loads of K (its 4 x 8 dims of 2 positions) and 8 of V (its 8 x 8 dims of 1 position), so the
// tile's 8 KB are in flight together (int8: 4 16-byte loads of K codes, 4 of V codes and 3
// small loads of scales, 4 KB). Then S, an online softmax on S in registers (each lane
// holds 2 of a row's 8 scores; a row's max and sum take 2 shuffles), and O = O * rescale + P V
// (32 products), O holding the 8 heads' fp32 accumulators across the head dim. An int8 cache is
// dequantized as its fragments are filled, code * scale in fp32.
//
// The fragments' columns do not map to consecutive dims: a dot product may sum its dims in any
// order, so each operand's dims are permuted to whatever makes a lane's share of a row few
// 16-byte runs, per cache format (the permutations below, at load_tile); the queries take the
// keys' permutation and the output is stored back in dim order.
//
// At the end the simdgroups' (max, sum, O) merge in threadgroup memory into the split's partial
// per query head, which attention_combine merges across splits.
constexpr constant uint kDecodeSimdgroups = 4;
constexpr constant uint kDecodeThreads = kDecodeSimdgroups * SIMD_WIDTH;
// The rows of a fragment: the most query heads per kv head (the real model has 8: 16 q, 2 kv).
constexpr constant uint kMaxGroup = 8;
// Positions per tile: the columns of a score fragment.
constexpr constant uint kTile = 8;
// One tile for each simdgroup: splits are whole rounds, so every split starts a round.
constexpr constant uint kRound = kTile * kDecodeSimdgroups;
// Positions per split while the grid has splits to spare: each split writes 8 KB of partials
// per kv head (the group's 8 rows of 256 floats) and the combine reads them back, a few percent
// of the 256 KB of K and V such a split reads.
constexpr constant uint kSplitPositions = 256;
// Splits a context of up to kMinSplits * kSplitPositions positions is spread over, in whole
// rounds: on the real model's 2 kv heads 64 threadgroups of 4 simdgroups, 6 simdgroups per core
// of a 40-core GPU, so that a context of a few thousand positions does not run on a few cores.
constexpr constant uint kMinSplits = 32;

// Positions per split at `context` tokens over a grid of `num_splits` splits: the context spread
// over kMinSplits splits of one round to kSplitPositions positions, then kSplitPositions per
// split until the grid's splits run out, then evenly more; always whole rounds. Splits at or past
// the context are empty. The decode kernels and the combine derive it alike from the step buffer.
inline uint split_length(uint context, uint num_splits) {
  const uint spread = clamp((context + kMinSplits - 1) / kMinSplits, kRound, kSplitPositions);
  const uint length = max(spread, (context + num_splits - 1) / num_splits);
  return (length + kRound - 1) / kRound * kRound;
}

struct AttentionDecodeParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint num_splits;  // the grid's, sized for the cache capacity
  float scale;
};

// A tile as one lane (row = fragment_row, col = fragment_col) loads it.
//
// bf16: K of positions tile + col and tile + col + 1, dims 64 g + 8 row to 64 g + 8 row + 7 for
// g = 0..3, in key[2 g] and key[2 g + 1]; V of position tile + row, dims 32 g + 4 col to
// 32 g + 4 col + 7 for g = 0..7, in value[g].
//
// int8: K codes of position tile + col + e, dims 32 row to 32 row + 31 (one scale group), in
// key[2 e] and key[2 e + 1], their scale in key_scale[e]; V codes of position tile + row, dims
// 64 (col / 2) to 64 (col / 2) + 63, in value[0..3], the scales of their two groups in
// value_scale.
struct DecodeTile {
  uint4 key[8];
  uint4 value[8];
  float key_scale[2];
  float value_scale[2];
};

// The permutations. bf16: score fragment f = 8 g + i pairs query dim and key dim 64 g + 8 c + i
// in column c of the queries (row c of K^T), so lane (r, c) holds of K^T dim 64 g + 8 r + i of
// positions c and c + 1, half i % 2 of word i / 2 of key[2 g] and key[2 g + 1], and of the
// queries dims 64 g + 8 c + i and 64 g + 8 c + 8 + i. Output fragment f = 4 g + i holds in
// columns c and c + 1 (c even) dims 32 g + 4 c + 2 i and the next, which for lane (r, c) are
// word i of value[g].
//
// int8: score fragment f = 8 g + i pairs dims 32 c + 8 g + i in column c, so lane (r, c) holds
// of K^T dim 32 r + 8 g + i, byte 8 g + i of its 32 per position, and of the queries dims
// 32 c + 8 g + i and 32 c + 32 + 8 g + i. Output fragment f holds in columns c and c + 1 dims
// 64 (c / 2) + 2 f and the next, bytes 2 f and 2 f + 1 of the lane's 64, in group
// 2 (c / 2) + f / 16.
template <bool kInt8>
inline uint query_dim(uint g, uint i, uint col, uint e) {
  return kInt8 ? 32 * (col + e) + 8 * g + i : 64 * g + 8 * (col + e) + i;
}

// The first of the 4 consecutive output dims that output fragments 2 j and 2 j + 1 hold in this
// lane's columns.
template <bool kInt8>
inline uint output_dims(uint j, uint col) {
  return kInt8 ? 64 * (col / 2) + 4 * j : 32 * (j / 2) + 4 * col + 4 * (j % 2);
}

// Where a tile's rows come from: the kv head's rows in the cache below cached_end, the staged
// current row (the fused kernel's, in the cache's format; none when cached_end == end) below
// end, zeros from end on, so that masked positions add 0 * 0, never 0 * NaN.
struct KvRows {
  device const uchar* cache;
  threadgroup const uchar* staged;
  uint cached_end;
  uint end;
};

template <typename T, bool kInt8, bool kEdge>
inline T load_kv(KvRows rows, uint position, uint byte) {
  if (!kEdge || position < rows.cached_end) {
    return *reinterpret_cast<device const T*>(rows.cache +
                                              ulong(position) * kv_row_bytes<kInt8>() + byte);
  }
  return position < rows.end ? *reinterpret_cast<threadgroup const T*>(rows.staged + byte) : T();
}

// Rows staged in threadgroup memory by attention_decode_tokens: position `first` and the next
// kStagePositions - 1, staged_row_bytes apart, zeros where the context ends (so no edge case).
struct StagedKvRows {
  threadgroup const uchar* rows;
  uint first;
};

constexpr constant uint kStagePositions = 16;

// A staged row is the cache's row and 16 bytes of padding: the rows a load's lanes read at the
// same byte offset then start 4 banks apart instead of in the same bank.
template <bool kInt8>
constexpr uint staged_row_bytes() {
  return kv_row_bytes<kInt8>() + 16;
}

template <typename T, bool kInt8, bool kEdge>
inline T load_kv(StagedKvRows rows, uint position, uint byte) {
  return *reinterpret_cast<threadgroup const T*>(
      rows.rows + (position - rows.first) * staged_row_bytes<kInt8>() + byte);
}

// Rows is KvRows (the cache, and the fused kernel's staged current row) or StagedKvRows.
template <bool kInt8, bool kEdge, typename Rows>
inline void load_tile(Rows k, Rows v, uint tile, uint row, uint col, thread DecodeTile& t) {
  if (kInt8) {
    for (uint e = 0; e < 2; ++e) {
      for (uint j = 0; j < 2; ++j) {
        t.key[2 * e + j] = load_kv<uint4, true, kEdge>(k, tile + col + e, 32 * row + 16 * j);
      }
      t.key_scale[e] = float(load_kv<half, true, kEdge>(k, tile + col + e, kHeadDim + 2 * row));
    }
    for (uint j = 0; j < 4; ++j) {
      t.value[j] = load_kv<uint4, true, kEdge>(v, tile + row, 64 * (col / 2) + 16 * j);
    }
    const half2 scales = load_kv<half2, true, kEdge>(v, tile + row, kHeadDim + 4 * (col / 2));
    t.value_scale[0] = float(scales[0]);
    t.value_scale[1] = float(scales[1]);
    return;
  }
  for (uint g = 0; g < 4; ++g) {
    for (uint e = 0; e < 2; ++e) {
      t.key[2 * g + e] = load_kv<uint4, false, kEdge>(k, tile + col + e, 16 * (8 * g + row));
    }
  }
  for (uint g = 0; g < 8; ++g) {
    t.value[g] = load_kv<uint4, false, kEdge>(v, tile + row, 16 * (4 * g + col / 2));
  }
}

// This lane's element of K^T in score fragment 8 g + i, for its position tile + col + e.
template <bool kInt8>
inline float key_element(thread const DecodeTile& t, uint g, uint i, uint e) {
  if (kInt8) {
    const uint byte = 8 * g + i;
    const char4 codes = as_type<char4>(t.key[2 * e + byte / 16][(byte % 16) / 4]);
    return float(codes[byte % 4]) * t.key_scale[e];
  }
  const uint shift = 16 * (1 - i % 2);
  return as_type<float>((t.key[2 * g + e][i / 2] << shift) & 0xFFFF0000u);
}

// This lane's two elements of V in output fragment f.
template <bool kInt8>
inline float2 value_pair(thread const DecodeTile& t, uint f) {
  if (kInt8) {
    const char4 codes = as_type<char4>(t.value[f / 8][(f % 8) / 2]);
    const uint first = 2 * (f % 2);
    return float2(float(codes[first]), float(codes[first + 1])) * t.value_scale[f / 16];
  }
  const uint word = t.value[f / 4][f % 4];
  return float2(bf16_low(word), bf16_high(word));
}

// One tile for the group's rows: S = Q K^T, the online softmax of each row over the tile's
// positions below `end`, O = O * rescale + P V.
template <bool kInt8>
inline void attend_tile(thread const simdgroup_float8x8* q, thread simdgroup_float8x8* acc,
                        thread float& running_max, thread float& lane_sum,
                        thread const DecodeTile& t, uint tile, uint end, uint col) {
  // Four partial sums over the head dim, one per g, so that the products form four dependent
  // chains of 8 rather than one of 32.
  simdgroup_float8x8 partial_scores[4];
  for (uint g = 0; g < 4; ++g) {
    partial_scores[g] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint i = 0; i < 8; ++i) {
      simdgroup_float8x8 k_frag;
      k_frag.thread_elements()[0] = key_element<kInt8>(t, g, i, 0);
      k_frag.thread_elements()[1] = key_element<kInt8>(t, g, i, 1);
      simdgroup_multiply_accumulate(partial_scores[g], q[8 * g + i], k_frag, partial_scores[g]);
    }
  }
  simdgroup_float8x8 scores;
  scores.thread_elements() =
      (partial_scores[0].thread_elements() + partial_scores[1].thread_elements()) +
      (partial_scores[2].thread_elements() + partial_scores[3].thread_elements());

  float tile_max = running_max;
  for (uint e = 0; e < 2; ++e) {
    const bool visible = tile + col + e < end;
    tile_max = visible ? max(tile_max, scores.thread_elements()[e]) : tile_max;
  }
  const float new_max = row_max(tile_max);
  const float rescale = exp(running_max - new_max);
  running_max = new_max;
  lane_sum *= rescale;
  for (uint e = 0; e < 2; ++e) {
    const bool visible = tile + col + e < end;
    const float p = visible ? exp(scores.thread_elements()[e] - new_max) : 0.0f;
    scores.thread_elements()[e] = p;
    lane_sum += p;
  }

  for (uint f = 0; f < kHeadFragments; ++f) {
    simdgroup_float8x8 v_frag;
    v_frag.thread_elements() = value_pair<kInt8>(t, f);
    acc[f].thread_elements() *= rescale;
    simdgroup_multiply_accumulate(acc[f], scores, v_frag, acc[f]);
  }
}

// The query fragments of this lane's row (zeros for a row past the group, whose row is not
// read), in the keys' dim permutation; `row` is the row as float4s, in threadgroup memory
// (attend_split's) or on the device (attention_decode_tokens'). The lane's query dims are
// 16-dim runs (bf16: 64 g + 8 col, g = 0..3) or one 64-dim run (int8: 32 col): 4 runs of 4
// per g.
template <bool kInt8, typename Float4s>
inline void load_query_fragments(Float4s row, bool row_in_group, uint col,
                                 thread simdgroup_float8x8* q) {
  for (uint g = 0; g < 4; ++g) {
    for (uint e = 0; e < 2; ++e) {
      // Dims query_dim(g, 0, col, e) to query_dim(g, 7, col, e): 8 consecutive dims.
      const uint run = query_dim<kInt8>(g, 0, col, e) / 4;
      for (uint half_run = 0; half_run < 2; ++half_run) {
        const float4 part = row_in_group ? row[run + half_run] : float4(0.0f);
        for (uint k = 0; k < 4; ++k) {
          q[8 * g + 4 * half_run + k].thread_elements()[e] = part[k];
        }
      }
    }
  }
}

// The split [begin, end) of one kv head, its positions below cached_end in the cache and (the
// fused kernel's, when cached_end < end) the one at cached_end in `staged` (K then V, in the
// cache's format), into its partial per query head of the group: its max m, its sum of
// exp(score - m) and sum exp(score - m) * v. The group's scaled queries are in `exchange`
// (kMaxGroup rows of kHeadDim floats, rows past the group unwritten), which this then uses for
// the merge; `stats` holds 2 * kMaxGroup * kDecodeSimdgroups floats. Called by the whole
// threadgroup.
template <bool kInt8>
inline void attend_split(uint group, uint first_head, uint split, uint num_splits, uint begin,
                         uint end, uint cached_end, device const uchar* k_head,
                         device const uchar* v_head, threadgroup const uchar* staged,
                         threadgroup float* exchange, threadgroup float* stats, uint simd_index,
                         uint lane, device float* partial_out, device float* partial_stats) {
  const uint row = fragment_row(lane);
  const uint col = fragment_col(lane);
  const bool row_in_group = row < group;

  simdgroup_float8x8 q[kHeadFragments];
  simdgroup_float8x8 acc[kHeadFragments];
  load_query_fragments<kInt8>(
      reinterpret_cast<threadgroup const float4*>(exchange + row * kHeadDim), row_in_group, col,
      q);
  for (uint f = 0; f < kHeadFragments; ++f) {
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  // Finite start value: fast math does not promise IEEE infinities.
  float running_max = -1.0e30f;
  float lane_sum = 0.0f;

  const bool has_staged = cached_end < end;
  const KvRows k_rows{k_head, staged, cached_end, end};
  const KvRows v_rows{v_head, has_staged ? staged + kv_row_bytes<kInt8>() : staged, cached_end,
                      end};
  for (uint tile = begin + kTile * simd_index; tile < end; tile += kRound) {
    DecodeTile t;
    if (tile + kTile <= cached_end) {
      load_tile<kInt8, false>(k_rows, v_rows, tile, row, col, t);
    } else {
      load_tile<kInt8, true>(k_rows, v_rows, tile, row, col, t);
    }
    attend_tile<kInt8>(q, acc, running_max, lane_sum, t, tile, end, col);
  }

  // Merge: a simdgroup that took no tile (max -1e30, sum 0, O 0) adds nothing. Every simdgroup
  // has read its queries from `exchange` before the first barrier.
  const float row_total = row_sum(lane_sum);
  if (col == 0) {
    stats[2 * (row * kDecodeSimdgroups + simd_index)] = running_max;
    stats[2 * (row * kDecodeSimdgroups + simd_index) + 1] = row_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float* row_stats = stats + 2 * row * kDecodeSimdgroups;
  float split_max = -1.0e30f;
  for (uint g = 0; g < kDecodeSimdgroups; ++g) {
    split_max = max(split_max, row_stats[2 * g]);
  }
  float split_sum = 0.0f;
  for (uint g = 0; g < kDecodeSimdgroups; ++g) {
    split_sum += exp(row_stats[2 * g] - split_max) * row_stats[2 * g + 1];
  }
  const float weight = exp(running_max - split_max);

  // The simdgroups add their weighted O into `exchange` one after the other, the last first;
  // simdgroup 0 adds its own and stores the split's partial. Output fragments 2 j and 2 j + 1
  // hold 4 consecutive dims of this lane's row, from output_dims(j, col).
  threadgroup float* exchange_row = exchange + row * kHeadDim;
  for (uint writer = kDecodeSimdgroups - 1; writer > 0; --writer) {
    if (simd_index == writer) {
      for (uint j = 0; j < kHeadFragments / 2; ++j) {
        threadgroup float4* at =
            reinterpret_cast<threadgroup float4*>(exchange_row + output_dims<kInt8>(j, col));
        const float2 a = acc[2 * j].thread_elements() * weight;
        const float2 b = acc[2 * j + 1].thread_elements() * weight;
        const float4 mine = float4(a[0], a[1], b[0], b[1]);
        *at = writer == kDecodeSimdgroups - 1 ? mine : *at + mine;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (simd_index == 0 && row_in_group) {
    const uint slot = (first_head + row) * num_splits + split;
    device float* out_row = partial_out + ulong(slot) * kHeadDim;
    for (uint j = 0; j < kHeadFragments / 2; ++j) {
      const uint dim = output_dims<kInt8>(j, col);
      const float2 a = acc[2 * j].thread_elements() * weight;
      const float2 b = acc[2 * j + 1].thread_elements() * weight;
      const float4 mine = float4(a[0], a[1], b[0], b[1]);
      *reinterpret_cast<device float4*>(out_row + dim) =
          *reinterpret_cast<threadgroup const float4*>(exchange_row + dim) + mine;
    }
    if (col == 0) {
      partial_stats[2 * slot] = split_max;
      partial_stats[2 * slot + 1] = split_sum;
    }
  }
}

// Grid (num_splits, num_kv_heads), kDecodeThreads threads. Split s covers positions
// [s * length, (s + 1) * length) of the context, length = split_length(context, num_splits);
// splits past the context exit at once and leave their partials as they were.
template <bool kInt8>
[[kernel, max_total_threads_per_threadgroup(kDecodeThreads)]] void attention_decode(
    constant AttentionDecodeParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [Hq, head_dim]
    device const uchar* k_cache [[buffer(2)]],  // [Hkv, cache_capacity] rows
    device const uchar* v_cache [[buffer(3)]],
    device const uint* step [[buffer(4)]],
    device float* partial_out [[buffer(5)]],    // [Hq, num_splits, head_dim]
    device float* partial_stats [[buffer(6)]],  // [Hq, num_splits, 2]: max, sum
    uint2 group_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  // The group's scaled queries, then the merge's rows; read and written as float4.
  alignas(16) threadgroup float exchange[kMaxGroup * kHeadDim];
  threadgroup float stats[2 * kMaxGroup * kDecodeSimdgroups];
  const uint split = group_id.x;
  const uint kv_head = group_id.y;
  const uint group = params.num_q_heads / params.num_kv_heads;
  const uint context = step[0] + 1;
  const uint length = split_length(context, params.num_splits);
  const uint begin = split * length;
  if (begin >= context) {
    return;
  }
  const uint end = min(begin + length, context);

  const uint first_head = kv_head * group;
  for (uint h = simd_index; h < group; h += kDecodeSimdgroups) {
    float q[kPerLane];
    load_float_row(queries + (first_head + h) * kHeadDim, lane, q);
    for (uint j = 0; j < kPerLane; ++j) {
      q[j] *= params.scale;
    }
    store_threadgroup_row(q, lane, exchange + h * kHeadDim);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kv_row_bytes<kInt8>();
  attend_split<kInt8>(group, first_head, split, params.num_splits, begin, end, end,
                      k_cache + head_base, v_cache + head_base, nullptr, exchange, stats,
                      simd_index, lane, partial_out, partial_stats);
}

template [[host_name("attention_decode")]] [[kernel]] decltype(attention_decode<false>)
    attention_decode<false>;
template [[host_name("attention_decode_int8")]] [[kernel]] decltype(attention_decode<true>)
    attention_decode<true>;

struct AttentionDecodeFusedParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint num_splits;
  float scale;
  uint rotary_dim;
  float rope_theta;
  float norm_eps;
  MropeParams mrope;
};

// attention_prepare and attention_decode in one dispatch, for the decode step: grid, threads and
// splits as attention_decode. Simdgroup s norms and rotates query heads s, s + 4, ... of the group
// from q_proj into threadgroup memory, where every simdgroup takes the group's queries from. The
// current position is the context's last: in the split holding it, the last simdgroup norms and
// rotates the current key from k_proj, encodes it and the value from v_proj in the cache's
// format, stages them in threadgroup memory, where the tile holding the position reads them
// (exactly as if read from the cache), and appends them to the cache for later steps. No other
// threadgroup reads that row, so the append needs no barrier before attention, and attention no
// level after the prepare.
//
// kRows (attention_decode_fused_rows): a batched decode pass's rows in one dispatch, grid z the
// row. Row r reads its own q_proj, k_proj and v_proj rows, the step, K and V of sequence slot
// row_slots[r] (each kind's slots lying one after another in one buffer: kStepFields words, one
// cache of Hkv * cache_capacity rows and, with a rope table, one table of cache_capacity rows per
// slot: a slot holding an image's sequence rotates by its positions, the others by identity), and
// leaves its partials at row r of [rows, Hq, num_splits], as attention_decode_tokens leaves a
// token's.
template <bool kInt8, bool kRows>
[[kernel, max_total_threads_per_threadgroup(kDecodeThreads)]] void attention_decode_fused(
    constant AttentionDecodeFusedParams& params [[buffer(0)]],
    device const float* q_proj [[buffer(1)]],   // [Hq, 2, head_dim]: query | gate per head
    device const float* k_proj [[buffer(2)]],   // [Hkv, head_dim]
    device const float* v_proj [[buffer(3)]],   // [Hkv, head_dim]
    device const bfloat* q_norm [[buffer(4)]],  // [head_dim], stored gain
    device const bfloat* k_norm [[buffer(5)]],  // [head_dim], stored gain
    device const uint* step [[buffer(6)]],      // [position, ...]
    device uchar* k_cache [[buffer(7)]],        // [Hkv, cache_capacity] rows
    device uchar* v_cache [[buffer(8)]],
    device float* partial_out [[buffer(9)]],    // [Hq, num_splits, head_dim]
    device float* partial_stats [[buffer(10)]],  // [Hq, num_splits, 2]: max, sum
    device const uint* rope_table [[buffer(11)]],  // [cache_capacity, 3] if params.mrope.table
    device const uint* row_slots [[buffer(12)]],   // [rows], kRows only
    uint3 group_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  if (kRows) {
    const uint row = group_id.z;
    const ulong slot = row_slots[row];
    const ulong cache_bytes = ulong(params.num_kv_heads) * params.cache_capacity *
                              kv_row_bytes<kInt8>();
    const ulong q_heads = params.num_q_heads;
    q_proj += row * q_heads * 2 * kHeadDim;
    k_proj += row * params.num_kv_heads * kHeadDim;
    v_proj += row * params.num_kv_heads * kHeadDim;
    step += slot * kStepFields;
    k_cache += slot * cache_bytes;
    v_cache += slot * cache_bytes;
    if (params.mrope.table != 0) {
      rope_table += slot * 3 * ulong(params.cache_capacity);
    }
    partial_out += row * q_heads * params.num_splits * kHeadDim;
    partial_stats += row * q_heads * params.num_splits * 2;
  }
  // The group's scaled queries, then the merge's rows; read and written as float4.
  alignas(16) threadgroup float exchange[kMaxGroup * kHeadDim];
  threadgroup float stats[2 * kMaxGroup * kDecodeSimdgroups];
  threadgroup float rope_cos[kHeadDim / 2];
  threadgroup float rope_sin[kHeadDim / 2];
  // The current key's row, then its value's, in the cache's format (room for two bf16 rows).
  alignas(16) threadgroup uchar staged_kv[2 * kBf16RowBytes];
  const uint split = group_id.x;
  const uint kv_head = group_id.y;
  const uint group = params.num_q_heads / params.num_kv_heads;
  const uint position = step[0];
  const uint context = position + 1;
  const uint length = split_length(context, params.num_splits);
  const uint begin = split * length;
  if (begin >= context) {
    return;
  }
  const uint end = min(begin + length, context);
  const bool holds_current = end == context;

  fill_rope_table(rope_positions_of(position, params.mrope, rope_table, params.cache_capacity),
                  params.mrope, params.rotary_dim, params.rope_theta,
                  simd_index * SIMD_WIDTH + lane, kDecodeThreads, rope_cos, rope_sin);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint first_head = kv_head * group;
  for (uint h = simd_index; h < group; h += kDecodeSimdgroups) {
    float q[kPerLane];
    prepare_head(q_proj + (first_head + h) * 2 * kHeadDim, q_norm, params.rotary_dim,
                 params.norm_eps, rope_cos, rope_sin, lane, q);
    for (uint j = 0; j < kPerLane; ++j) {
      q[j] *= params.scale;
    }
    store_threadgroup_row(q, lane, exchange + h * kHeadDim);
  }
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kv_row_bytes<kInt8>();
  if (holds_current && simd_index == kDecodeSimdgroups - 1) {
    float k[kPerLane];
    float v[kPerLane];
    prepare_head(k_proj + kv_head * kHeadDim, k_norm, params.rotary_dim, params.norm_eps,
                 rope_cos, rope_sin, lane, k);
    load_float_row(v_proj + kv_head * kHeadDim, lane, v);
    const KvShare k_share = encode_share<kInt8>(k, lane);
    const KvShare v_share = encode_share<kInt8>(v, lane);
    stage_share<kInt8>(k_share, lane, staged_kv);
    stage_share<kInt8>(v_share, lane, staged_kv + kv_row_bytes<kInt8>());
    // A step queued past the capacity must not write past the end of the cache.
    if (position < params.cache_capacity) {
      const ulong row = head_base + ulong(position) * kv_row_bytes<kInt8>();
      store_share<kInt8>(k_share, lane, k_cache + row);
      store_share<kInt8>(v_share, lane, v_cache + row);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  attend_split<kInt8>(group, first_head, split, params.num_splits, begin, end,
                      holds_current ? position : end, k_cache + head_base, v_cache + head_base,
                      staged_kv, exchange, stats, simd_index, lane, partial_out, partial_stats);
}

template [[host_name("attention_decode_fused")]] [[kernel]]
    decltype(attention_decode_fused<false, false>) attention_decode_fused<false, false>;
template [[host_name("attention_decode_fused_int8")]] [[kernel]]
    decltype(attention_decode_fused<true, false>) attention_decode_fused<true, false>;
template [[host_name("attention_decode_fused_rows")]] [[kernel]]
    decltype(attention_decode_fused<false, true>) attention_decode_fused<false, true>;
template [[host_name("attention_decode_fused_rows_int8")]] [[kernel]]
    decltype(attention_decode_fused<true, true>) attention_decode_fused<true, true>;

// ---- decode of a few tokens: a verify pass's queries over the cached context ------------------
//
// A verify pass runs T = 2..kMaxDecodeTokens tokens at positions p0 .. p0 + T - 1 (the MTP head's
// passes also T = 1), whose rows attention_prepare has appended; token t attends to positions
// [0, p0 + t]. The grid and the splits are the decode kernels' (split_length of the last token's
// context p0 + T), and a threadgroup of T simdgroups takes one split of one kv head: simdgroup t
// holds token t's query heads as the 8 rows of its fragments, as a decode simdgroup holds the
// step's, and runs the decode tiles (load_tile, attend_tile) over the whole split, masking the
// positions past its token. The split's K and V rows are read from the device once for all T
// tokens: the threadgroup stages kStagePositions positions of both in the cache's format in
// threadgroup memory (each thread issuing up to kStageLoads 16-byte loads before it stores any),
// and the simdgroups read their lanes' shares of a tile from there in the decode layout.
// Positions past the split's context (or the cache's capacity) are staged as zeros. Each
// simdgroup leaves its token's partial per query head, [T, Hq, num_splits]; attention_combine,
// given T, merges each token's splits.
//
// One simdgroup per token, rather than decode's four taking turns at the tiles: a simdgroup keeps
// its rows' output accumulators across the head dim in registers (64 floats a lane) and has no
// room for a second token's, while T simdgroups on one staged tile already give the loads the
// company that decode gets from splitting the tiles. The decode step keeps its own kernels: they
// need no staging round trip and no barriers in the loop.
constexpr constant uint kMaxDecodeTokens = 9;
// 16-byte loads a thread issues before it stores any: a whole stage of bf16 rows (16 KB) in one
// round trip from T = 2 on. The 64 registers they take are free while the tiles' 64 are not
// live, so a lane holds about what a decode lane does.
constexpr constant uint kStageLoads = 16;

struct AttentionDecodeTokensParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint num_splits;  // the grid's, sized for the cache capacity
  uint tokens;      // the simdgroups of a threadgroup
  float scale;
};

// Stages K (first) and V rows of positions [first, first + kStagePositions) of one kv head: the
// cache's rows below `cached_end`, zeros from there. Consecutive threads load consecutive 16 bytes.
template <bool kInt8>
inline void stage_rows(device const uchar* k_head, device const uchar* v_head, uint first,
                       uint cached_end, uint thread_id, uint threads, threadgroup uchar* staged) {
  constexpr uint kRowLoads = kv_row_bytes<kInt8>() / 16;
  constexpr uint kLoads = 2 * kStagePositions * kRowLoads;
  for (uint base = thread_id; base < kLoads; base += kStageLoads * threads) {
    uint4 loaded[kStageLoads];
    for (uint i = 0; i < kStageLoads; ++i) {
      const uint e = base + i * threads;
      const uint position = first + (e / kRowLoads) % kStagePositions;
      device const uchar* head = e < kLoads / 2 ? k_head : v_head;
      const bool inside = e < kLoads && position < cached_end;
      loaded[i] = inside ? *reinterpret_cast<device const uint4*>(
                               head + ulong(position) * kv_row_bytes<kInt8>() +
                               16 * (e % kRowLoads))
                         : uint4(0u);
    }
    for (uint i = 0; i < kStageLoads; ++i) {
      const uint e = base + i * threads;
      if (e < kLoads) {
        const uint row = e / kRowLoads;  // K rows, then V rows
        *reinterpret_cast<threadgroup uint4*>(staged + row * staged_row_bytes<kInt8>() +
                                              16 * (e % kRowLoads)) = loaded[i];
      }
    }
  }
}

// Grid (num_splits, num_kv_heads), tokens * 32 threads. Split s covers positions
// [s * length, (s + 1) * length), length = split_length(step[0] + tokens, num_splits); splits
// past that context exit at once. A token that sees none of a split leaves max -1e30 and sum 0.
template <bool kInt8>
[[kernel, max_total_threads_per_threadgroup(kMaxDecodeTokens * SIMD_WIDTH)]] void
attention_decode_tokens(
    constant AttentionDecodeTokensParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [T, Hq, head_dim]: normed, rotated
    device const uchar* k_cache [[buffer(2)]],  // [Hkv, cache_capacity] rows
    device const uchar* v_cache [[buffer(3)]],
    device const uint* step [[buffer(4)]],      // [position, ...]
    device float* partial_out [[buffer(5)]],    // [T, Hq, num_splits, head_dim]
    device float* partial_stats [[buffer(6)]],  // [T, Hq, num_splits, 2]: max, sum
    uint2 group_id [[threadgroup_position_in_grid]],
    uint thread_id [[thread_index_in_threadgroup]],
    uint token [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  alignas(16) threadgroup uchar staged[2 * kStagePositions * staged_row_bytes<kInt8>()];
  const uint split = group_id.x;
  const uint kv_head = group_id.y;
  const uint group = params.num_q_heads / params.num_kv_heads;
  const uint position = step[0];
  const uint context = position + params.tokens;
  const uint length = split_length(context, params.num_splits);
  const uint begin = split * length;
  if (begin >= context) {
    return;
  }
  const uint end = min(begin + length, context);
  // A pass queued past the capacity has no rows there (prepare did not append them).
  const uint cached_end = min(end, params.cache_capacity);
  const uint token_end = min(end, position + token + 1);
  const uint row = fragment_row(lane);
  const uint col = fragment_col(lane);
  const bool row_in_group = row < group;
  const uint first_head = kv_head * group;

  simdgroup_float8x8 q[kHeadFragments];
  simdgroup_float8x8 acc[kHeadFragments];
  const ulong query_row = (ulong(token) * params.num_q_heads + first_head + row) * kHeadDim;
  load_query_fragments<kInt8>(reinterpret_cast<device const float4*>(queries + query_row),
                              row_in_group, col, q);
  for (uint f = 0; f < kHeadFragments; ++f) {
    q[f].thread_elements() *= params.scale;
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  // Finite start value: fast math does not promise IEEE infinities.
  float running_max = -1.0e30f;
  float lane_sum = 0.0f;

  const ulong head_base = ulong(kv_head) * params.cache_capacity * kv_row_bytes<kInt8>();
  threadgroup const uchar* staged_values = staged + kStagePositions * staged_row_bytes<kInt8>();
  for (uint first = begin; first < end; first += kStagePositions) {
    stage_rows<kInt8>(k_cache + head_base, v_cache + head_base, first, cached_end, thread_id,
                      params.tokens * SIMD_WIDTH, staged);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const StagedKvRows k_stage{staged, first};
    const StagedKvRows v_stage{staged_values, first};
    for (uint tile = first; tile < min(first + kStagePositions, token_end); tile += kTile) {
      DecodeTile t;
      load_tile<kInt8, false>(k_stage, v_stage, tile, row, col, t);
      attend_tile<kInt8>(q, acc, running_max, lane_sum, t, tile, token_end, col);
    }
    // The next stage overwrites what the other simdgroups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float row_total = row_sum(lane_sum);
  if (row_in_group) {
    const uint slot = (token * params.num_q_heads + first_head + row) * params.num_splits + split;
    device float* out_row = partial_out + ulong(slot) * kHeadDim;
    for (uint j = 0; j < kHeadFragments / 2; ++j) {
      const float2 a = acc[2 * j].thread_elements();
      const float2 b = acc[2 * j + 1].thread_elements();
      *reinterpret_cast<device float4*>(out_row + output_dims<kInt8>(j, col)) =
          float4(a[0], a[1], b[0], b[1]);
    }
    if (col == 0) {
      partial_stats[2 * slot] = running_max;
      partial_stats[2 * slot + 1] = row_total;
    }
  }
}

template [[host_name("attention_decode_tokens")]] [[kernel]]
    decltype(attention_decode_tokens<false>) attention_decode_tokens<false>;
template [[host_name("attention_decode_tokens_int8")]] [[kernel]]
    decltype(attention_decode_tokens<true>) attention_decode_tokens<true>;

struct AttentionCombineParams {
  uint num_q_heads;
  uint num_splits;  // the decode grid's
  uint tokens;      // 1 after a decode step, T after attention_decode_tokens
};

// Dims per combine threadgroup: four threadgroups per head spread a long context's partials
// (up to 1 KB per split and head) over more of the GPU than one per head would.
constexpr constant uint kCombineDims = 64;

// Grid (num_q_heads, head_dim / kCombineDims, tokens), one thread per head dim of one token. Only
// the splits the pass's context (step[0] + tokens) reaches are read: the others hold whatever an
// earlier step (of this sequence or of a longer one before it) left there. A split a token does
// not see has sum 0 and adds nothing.
//
// kRows (attention_combine_rows): the rows of a batched decode pass, T its rows, after
// attention_decode_fused_rows: row r's context is that of sequence slot row_slots[r], whose step
// is at kStepFields * row_slots[r] (params.tokens is 1).
template <bool kRows>
[[kernel, max_total_threads_per_threadgroup(kCombineDims)]] void attention_combine(
    constant AttentionCombineParams& params [[buffer(0)]],
    device const float* partial_out [[buffer(1)]],
    device const float* partial_stats [[buffer(2)]],
    device const float* q_proj [[buffer(3)]],  // [T, Hq, 2, head_dim]: the gate halves are read
    device float* out [[buffer(4)]],           // [T, Hq, head_dim]: attention * sigmoid(gate)
    device const uint* step [[buffer(5)]],     // [position, ...]
    device const uint* row_slots [[buffer(6)]],  // [T], kRows only
    uint3 group_id [[threadgroup_position_in_grid]],
    uint thread_id [[thread_index_in_threadgroup]]) {
  // The token's head: row `head` of [T, Hq] partials, gates and outputs.
  const uint head = group_id.z * params.num_q_heads + group_id.x;
  const uint dim = group_id.y * kCombineDims + thread_id;
  if (kRows) {
    step += ulong(row_slots[group_id.z]) * kStepFields;
  }
  const uint context = step[0] + params.tokens;
  const uint length = split_length(context, params.num_splits);
  const uint splits = (context + length - 1) / length;
  device const float* stats = partial_stats + 2 * head * params.num_splits;
  device const float* head_out = partial_out + ulong(head) * params.num_splits * kHeadDim;

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
      numerator += w * head_out[ulong(s) * kHeadDim + dim];
    }
  }
  const float gate = q_proj[head * 2 * kHeadDim + kHeadDim + dim];
  out[head * kHeadDim + dim] = numerator / denominator / (1.0f + exp(-gate));
}

template [[host_name("attention_combine")]] [[kernel]] decltype(attention_combine<false>)
    attention_combine<false>;
template [[host_name("attention_combine_rows")]] [[kernel]] decltype(attention_combine<true>)
    attention_combine<true>;

// ---- attention for a chunk of prompt tokens ---------------------------------------------------
//
// A threadgroup takes 64 consecutive rows of the chunk's (token, query head) pairs of one kv head,
// row = token * group_size + head_in_group, so the query heads that share a kv head share every
// K/V tile it stages: on the real model (8 query heads per kv head) 8 tokens, so each attention
// layer reads the cache T / 8 times per kv head for a chunk of T tokens, not T times. Its eight
// simdgroups own 8 rows each and keep, in simdgroup_matrix 8x8 fragments, their rows' scaled
// queries and fp32 output accumulators across the full head dim (32 fragments each). Per tile of
// 16 keys: S = Q K^T (2 fragments per simdgroup), an online softmax on S in registers,
// O = O * rescale + P V. Query t of the chunk sees positions [0, position + t]: the threadgroup
// stops at the last tile its last token sees, a simdgroup skips the tiles past its own last
// token (a tile no row of it sees would multiply by 1 and add zeros: skipping it changes no bit),
// and the diagonal tiles mask each row's keys past its position. Keys past the threadgroup's
// last visible position are staged as zeros.
//
// The K/V tiles (16 KB of a bf16 cache) are read once per threadgroup with 16-byte loads, each
// thread two pieces of 8 dims of K and of V (int8: one piece of 16 codes each, and a scale),
// converted as they are stored to threadgroup memory. The loads of the next tile go to
// registers before the current tile's products, so they are in flight while the products run:
// double-buffered in registers, as two threadgroup-memory tiles would need 42.5 KiB.
//
// Operands are 2-byte, accumulators fp32 (scores, the softmax and O stay fp32 throughout):
//
//   S = Q K^T in half: K is exact in half, Q rounds by at most 2^-11 of itself. A cached key is
//     RMS-normed (|k_i| <= sqrt(head_dim) |gain_i| = 16 |gain_i|), so its bf16 value lies in
//     half's normal range (2^-14 to 65504) for any gain under 4094 and keeps all 8 of its bits
//     there (half subnormals still hold bf16 values down to 2^-17 exactly; below that a key
//     element adds under 2^-25 |q_i| to a score). A scaled query element is at most
//     16 |gain_i| / 16. bfloat Q would round by up to 2^-8, 8 times more, for nothing.
//   O += P V in bfloat: V is exact in bfloat at any magnitude (values are not normed, so half's
//     range is not assured), P in [0, 1] rounds by at most 2^-8 of itself. The denominator sums
//     the rounded P, so the weights that multiply V still sum to one: rounding moves the output
//     by about 2^-8 |v| / sqrt(keys that matter), under a bf16 step of V itself.
//
// An int8 cache's K is dequantized as it is staged: code * scale (|.| <= the group's max |k|)
// rounded to half, 8 times inside the int8 step (a group's max / 254). Its P V is half: V's
// codes are exact in half, and each key's scale of a group multiplies its P before P's rounding
// (p * scale <= the fp16 scale, so in half's range), so P V rounds once, by 2^-11 of each
// weight, or by 2^-25 absolute (2^-18 at the largest code) where p * scale is a half subnormal.
// The denominator, which sums P, does not see that rounding as it does for a bf16 cache, so an
// output dim moves by up to 2^-11 of the largest |v| there; bfloat would allow 2^-8, which put
// the engine's int8 prefill past its bound.
//
// Measured against float64 (tests/test_kernel_attention*.py, docs/benchmarks.md), bf16 cache:
// outputs up to ~3 off by at most 2.3e-3 (RMS 2.4e-4), most of it P's rounding; with fp32
// operands they stayed within 1e-5 + 1e-4 |x|.
//
// The tiles are staged in the operands' types (20.25 KiB with the padding, and an int8 cache's
// value scales 0.5 KiB more) and loaded with simdgroup_load.
//
// On an M5 a bf16 cache's chunks run attention_chunk_tensor instead
// (attention_tensor_ops.metal): the two products on Metal 4 tensor ops. An int8 cache keeps this
// kernel there too.
constexpr constant uint kChunkSimdgroups = 8;
constexpr constant uint kChunkThreads = kChunkSimdgroups * SIMD_WIDTH;
constexpr constant uint kChunkRows = 8 * kChunkSimdgroups;
constexpr constant uint kChunkKeys = 16;
// Staged rows are padded so that the 8 rows a fragment reads start in different banks.
constexpr constant uint kKeysStride = kChunkKeys + 8;
constexpr constant uint kValuesStride = kHeadDim + 8;

// Dims of one staged piece (16 bytes of a cache row) and the pieces a thread stages per tile,
// of K and of V each.
template <bool kInt8>
constexpr uint chunk_piece_dims() {
  return kInt8 ? 16 : 8;
}
template <bool kInt8>
constexpr uint chunk_pieces() {
  return kChunkKeys * kHeadDim / chunk_piece_dims<kInt8>() / kChunkThreads;
}
static_assert(chunk_pieces<false>() == 2 && chunk_pieces<true>() == 1, "whole pieces per thread");
static_assert(2 * (kHeadDim * kKeysStride + kChunkKeys * kValuesStride) +
                      4 * kChunkKeys * kInt8Groups <=
                  32 * 1024,
              "the staged tile fits in 32 KiB of threadgroup memory");
static_assert(kChunkKeys * kInt8Groups <= kChunkThreads, "one value scale per thread at most");

// P V's operand type: bfloat for a bf16 cache, half for an int8 one (codes, and P times scales).
template <bool kInt8>
struct ChunkValueType {
  typedef bfloat type;
};
template <>
struct ChunkValueType<true> {
  typedef half type;
};
template <bool kInt8>
using ChunkValue = typename ChunkValueType<kInt8>::type;

// Head-dim fragments per int8 scale group.
constexpr constant uint kFragmentsPerGroup = kInt8Group / 8;

// A thread's share of one K/V tile as loaded from the cache: piece p of K and V is tile piece
// thread_id + p * kChunkThreads, key piece / pieces_per_row, dims from
// (piece % pieces_per_row) * piece_dims; int8: its K piece's group scale, and the value scale of
// key thread_id / 8, group thread_id % 8 (threads below 128). Zeros past the context.
struct ChunkStage {
  uint4 key[2];
  uint4 value[2];
  float key_scale;
  float value_scale;
};

template <bool kInt8>
inline ChunkStage load_chunk_stage(device const uchar* k_rows, device const uchar* v_rows,
                                   uint key0, uint context, uint thread_id) {
  constexpr uint per_row = kHeadDim / chunk_piece_dims<kInt8>();
  constexpr uint piece_bytes = 16;
  ChunkStage s;
  s.key_scale = 0.0f;
  s.value_scale = 0.0f;
  for (uint p = 0; p < chunk_pieces<kInt8>(); ++p) {
    const uint piece = thread_id + p * kChunkThreads;
    const uint key = key0 + piece / per_row;
    const ulong at = ulong(key) * kv_row_bytes<kInt8>() + (piece % per_row) * piece_bytes;
    const bool inside = key < context;
    s.key[p] = inside ? *reinterpret_cast<device const uint4*>(k_rows + at) : uint4(0);
    s.value[p] = inside ? *reinterpret_cast<device const uint4*>(v_rows + at) : uint4(0);
    if (kInt8 && inside) {
      const uint group = (piece % per_row) * chunk_piece_dims<kInt8>() / kInt8Group;
      s.key_scale = float(*reinterpret_cast<device const half*>(
          k_rows + ulong(key) * kInt8RowBytes + kHeadDim + 2 * group));
    }
  }
  if (kInt8 && thread_id < kChunkKeys * kInt8Groups) {
    const uint key = key0 + thread_id / kInt8Groups;
    if (key < context) {
      s.value_scale = float(*reinterpret_cast<device const half*>(
          v_rows + ulong(key) * kInt8RowBytes + kHeadDim + 2 * (thread_id % kInt8Groups)));
    }
  }
  return s;
}

// Stores a thread's share of the tile: K transposed, [dim][key], as half (int8: code * scale);
// V as [key][dim] in P V's operand type (bf16 bits as they are, int8 codes as half); int8, the
// value scales as [key][group].
template <bool kInt8>
inline void store_chunk_stage(thread const ChunkStage& s, uint thread_id,
                              threadgroup half* keys_t, threadgroup ChunkValue<kInt8>* values,
                              threadgroup float* value_scales) {
  constexpr uint dims = chunk_piece_dims<kInt8>();
  constexpr uint per_row = kHeadDim / dims;
  for (uint p = 0; p < chunk_pieces<kInt8>(); ++p) {
    const uint piece = thread_id + p * kChunkThreads;
    const uint key = piece / per_row;
    const uint dim0 = (piece % per_row) * dims;
    threadgroup half* k_column = keys_t + dim0 * kKeysStride + key;
    threadgroup ChunkValue<kInt8>* v_row = values + key * kValuesStride + dim0;
    if (kInt8) {
      for (uint w = 0; w < 4; ++w) {
        const char4 k_codes = as_type<char4>(s.key[p][w]);
        const char4 v_codes = as_type<char4>(s.value[p][w]);
        for (uint b = 0; b < 4; ++b) {
          k_column[(4 * w + b) * kKeysStride] = half(float(k_codes[b]) * s.key_scale);
        }
        reinterpret_cast<threadgroup half4*>(v_row)[w] = half4(float4(v_codes));
      }
    } else {
      for (uint w = 0; w < 4; ++w) {
        k_column[2 * w * kKeysStride] = half(bf16_low(s.key[p][w]));
        k_column[(2 * w + 1) * kKeysStride] = half(bf16_high(s.key[p][w]));
      }
      *reinterpret_cast<threadgroup uint4*>(v_row) = s.value[p];
    }
  }
  if (kInt8 && thread_id < kChunkKeys * kInt8Groups) {
    value_scales[thread_id] = s.value_scale;
  }
}

// Grid (ceil(tokens * group_size / 64), num_kv_heads), 256 threads per threadgroup.
template <bool kInt8>
[[kernel, max_total_threads_per_threadgroup(kChunkThreads)]] void attention_chunk(
    constant AttentionChunkParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [T, Hq, head_dim]: normed, rotated
    device const float* q_proj [[buffer(2)]],   // [T, Hq, 2, head_dim]: the gate halves are read
    device const uchar* k_cache [[buffer(3)]],  // [Hkv, cache_capacity] rows
    device const uchar* v_cache [[buffer(4)]],  // [Hkv, cache_capacity] rows
    device const uint* step [[buffer(5)]],      // [position, ...]
    device float* out [[buffer(6)]],             // [T, Hq, head_dim]: attention * sigmoid(gate)
    uint2 group_id [[threadgroup_position_in_grid]],
    uint thread_id [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  // 16-byte aligned: V rows are stored as uint4 / half4 (kValuesStride halves are 528 bytes).
  alignas(16) threadgroup half keys_t[kHeadDim * kKeysStride];  // [dim][key]
  // [key][dim] in P V's operand type: bf16 values, or int8 codes in half.
  alignas(16) threadgroup ushort value_bits[kChunkKeys * kValuesStride];
  threadgroup ChunkValue<kInt8>* values =
      reinterpret_cast<threadgroup ChunkValue<kInt8>*>(value_bits);
  // int8: the staged values' scales, [key][group]; unused for bf16.
  threadgroup float value_scales[kChunkKeys * kInt8Groups];

  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint position = step[0];
  const uint frag_row = fragment_row(lane);
  const uint frag_col = fragment_col(lane);

  const uint rows = params.tokens * group_size;
  const uint first_row = group_id.x * kChunkRows;
  const uint simd_first_row = first_row + simd_index * 8;
  const uint row = simd_first_row + frag_row;
  const uint token = row / group_size;
  const bool row_in_chunk = token < params.tokens;
  const uint q_head = kv_head * group_size + row % group_size;
  // Rows past the chunk (in the last threadgroup) also see the zeros staged past the context:
  // finite, and never stored.
  const uint last_visible = position + token;
  const uint last_row = min(first_row + kChunkRows, rows) - 1;
  const uint context = min(position + last_row / group_size + 1, params.cache_capacity);
  // The keys this simdgroup's rows see (none when all of them are past the chunk): uniform
  // over the simdgroup, as its products must be.
  const bool simd_has_rows = simd_first_row < rows;
  const uint simd_context = position + (min(simd_first_row + 8, rows) - 1) / group_size + 1;

  const ulong q_offset = (ulong(token) * params.num_q_heads + q_head) * kHeadDim + frag_col;
  simdgroup_half8x8 q[kHeadFragments];
  simdgroup_float8x8 acc[kHeadFragments];
  for (uint f = 0; f < kHeadFragments; ++f) {
    const float2 pair = row_in_chunk
                            ? *reinterpret_cast<device const float2*>(queries + q_offset + 8 * f)
                            : float2(0.0f);
    for (uint i = 0; i < 2; ++i) {
      q[f].thread_elements()[i] = half(pair[i] * params.scale);
    }
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // Finite start value: fast math does not promise IEEE infinities. Key 0 is visible to every
  // row, so the first tile replaces it.
  float running_max = -1.0e30f;
  float lane_sum = 0.0f;  // this lane's share of its row's softmax denominator
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kv_row_bytes<kInt8>();
  device const uchar* k_rows = k_cache + head_base;
  device const uchar* v_rows = v_cache + head_base;
  ChunkStage stage = load_chunk_stage<kInt8>(k_rows, v_rows, 0, context, thread_id);
  for (uint key0 = 0; key0 < context; key0 += kChunkKeys) {
    store_chunk_stage<kInt8>(stage, thread_id, keys_t, values, value_scales);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (key0 + kChunkKeys < context) {
      stage = load_chunk_stage<kInt8>(k_rows, v_rows, key0 + kChunkKeys, context, thread_id);
    }

    if (simd_has_rows && key0 < simd_context) {
      simdgroup_float8x8 scores[kChunkKeys / 8];
      for (uint c = 0; c < kChunkKeys / 8; ++c) {
        scores[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint f = 0; f < kHeadFragments; ++f) {
          simdgroup_half8x8 k_frag;
          simdgroup_load(k_frag, keys_t + 8 * f * kKeysStride + 8 * c, kKeysStride);
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
      // P in fp32 in `scores`, and as P V's operand (int8: times a group's scales, below).
      simdgroup_matrix<ChunkValue<kInt8>, 8, 8> probabilities[kChunkKeys / 8];
      for (uint c = 0; c < kChunkKeys / 8; ++c) {
        for (uint i = 0; i < 2; ++i) {
          const bool visible = key0 + 8 * c + frag_col + i <= last_visible;
          const float p = visible ? exp(scores[c].thread_elements()[i] - running_max) : 0.0f;
          scores[c].thread_elements()[i] = p;
          probabilities[c].thread_elements()[i] = ChunkValue<kInt8>(p);
          lane_sum += float(bfloat(p));
        }
      }

      for (uint f = 0; f < kHeadFragments; ++f) {
        acc[f].thread_elements() *= rescale;
        if (kInt8 && f % kFragmentsPerGroup == 0) {
          // A lane's P elements are keys 8 c + frag_col + i.
          for (uint c = 0; c < kChunkKeys / 8; ++c) {
            for (uint i = 0; i < 2; ++i) {
              const uint key = 8 * c + frag_col + i;
              probabilities[c].thread_elements()[i] = ChunkValue<kInt8>(
                  scores[c].thread_elements()[i] *
                  value_scales[key * kInt8Groups + f / kFragmentsPerGroup]);
            }
          }
        }
        for (uint c = 0; c < kChunkKeys / 8; ++c) {
          simdgroup_matrix<ChunkValue<kInt8>, 8, 8> v_frag;
          simdgroup_load(v_frag, values + 8 * c * kValuesStride + 8 * f, kValuesStride);
          simdgroup_multiply_accumulate(acc[f], probabilities[c], v_frag, acc[f]);
        }
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
      const float2 gate = *reinterpret_cast<device const float2*>(q_proj + gate_offset + 8 * f);
      const float2 attended = float2(acc[f].thread_elements()[0], acc[f].thread_elements()[1]);
      *reinterpret_cast<device float2*>(out + q_offset + 8 * f) =
          attended / denominator * float2(sigmoid(gate[0]), sigmoid(gate[1]));
    }
  }
}

template [[host_name("attention_chunk")]] [[kernel]] decltype(attention_chunk<false>)
    attention_chunk<false>;
template [[host_name("attention_chunk_int8")]] [[kernel]] decltype(attention_chunk<true>)
    attention_chunk<true>;
