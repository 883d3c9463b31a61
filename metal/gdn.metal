// The Gated DeltaNet recurrence, fused end to end, for one decoded token or a chunk of tokens.
//
// Per value head h (key head h / (Hv/Hk)), with the fp32 state S [Dv, Dk]:
//   q, k  <- L2-normalised (q also scaled by Dk^-0.5)
//   g     =  exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S'    =  g * S;  delta = beta * (v - S' k);  S = S' + delta k^T;  o = S q
//   out   =  rmsnorm(o) * norm_weight * silu(z)
// Every row of S (one value dim) evolves independently given q, k, g and beta, so both kernels
// split a head's rows over several threadgroups. The step kernel (one token) runs the recurrence
// as written: each SIMD-group owns whole rows and the two dot products are simd reductions. The
// chunk kernel runs the chunkwise form of the same recurrence (the section below) with 8x8
// simdgroup-matrix products. Neither applies the gated RMSNorm, which needs a whole head: the
// step leaves it to its consumer, the out_proj GEMV (gdn_out_proj.metal), the chunk to
// gdn_gated_norm. The chunk equals its tokens decoded one by one within fp32 rounding, not bit
// for bit: it sums in another order.
#include "common.h"

// Both head dims are 128 in every Qwen3.5/3.6 model; each lane holds 4 adjacent key dims
// (4 lane .. 4 lane + 3), so a row, q or k is one 16-byte load per lane.
constexpr constant uint kKeyDim = 128;
constexpr constant uint kValueDim = 128;
constexpr constant uint kKeyPerLane = kKeyDim / SIMD_WIDTH;
// A simdgroup owns 4 state rows, so its rows fit one float4 reduction.
constexpr constant uint kRowsPerSimdgroup = 4;

// This lane's dims of one token's q and k.
inline void load_qk(device const float* q_in, device const float* k_in, uint lane,
                    thread float* q, thread float* k) {
  const float4 q4 = *reinterpret_cast<device const float4*>(q_in + kKeyPerLane * lane);
  const float4 k4 = *reinterpret_cast<device const float4*>(k_in + kKeyPerLane * lane);
  for (uint j = 0; j < kKeyPerLane; ++j) {
    q[j] = q4[j];
    k[j] = k4[j];
  }
}

// L2-normalises q and k in place across the simdgroup, q also scaled by Dk^-0.5. Both sums of
// squares share one reduction.
inline void normalize_qk(thread float* q, thread float* k) {
  float2 qk_sq = float2(0.0f);
  for (uint j = 0; j < kKeyPerLane; ++j) {
    qk_sq.x += q[j] * q[j];
    qk_sq.y += k[j] * k[j];
  }
  const float2 qk_norm_sq = simd_sum(qk_sq);
  const float q_scale = rsqrt(qk_norm_sq.x + 1e-6f) * rsqrt(float(kKeyDim));
  const float k_scale = rsqrt(qk_norm_sq.y + 1e-6f);
  for (uint j = 0; j < kKeyPerLane; ++j) {
    q[j] *= q_scale;
    k[j] *= k_scale;
  }
}

struct GdnGates {
  float decay;
  float beta;
};

// log g = -exp(A_log) * softplus(a + dt_bias).
inline float gdn_log_decay(float a, float a_log, bfloat dt_bias) {
  // softplus(x) = max(x, 0) + log(1 + exp(-|x|)) never overflows.
  const float gate_in = a + float(dt_bias);
  const float softplus = max(gate_in, 0.0f) + log(1.0f + exp(-abs(gate_in)));
  return -exp(a_log) * softplus;
}

inline GdnGates gdn_gates(float a, float b, float a_log, bfloat dt_bias) {
  return GdnGates{exp(gdn_log_decay(a, a_log, dt_bias)), sigmoid(b)};
}

// This simdgroup's state rows through one token, in place on this lane's 4 entries of each;
// returns the rows' readouts (S q)[row], the same on every lane. The rows' partial dot products
// are reduced together, one float4 per reduction: two reductions per token rather than two per
// row, and the rows' dependency chains overlap. Each row's arithmetic is as if done alone.
// `delta` receives the rows' beta (v - g S k), what the token adds to them along k
// (gdn_apply_update).
inline float4 gdn_update_rows(thread float (*s)[kKeyPerLane], thread const float* q,
                              thread const float* k, GdnGates gates, float4 v,
                              thread float4& delta) {
  // Per-row sums in scalars, packed for each reduction: accumulating into a vector's elements by
  // a loop index makes the sim's compiler go through memory.
  float predicted[kRowsPerSimdgroup];
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    predicted[r] = 0.0f;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = gates.decay * s[r][j];
      predicted[r] += s[r][j] * k[j];
    }
  }
  delta =
      gates.beta * (v - simd_sum(float4(predicted[0], predicted[1], predicted[2], predicted[3])));
  float o[kRowsPerSimdgroup];
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    o[r] = 0.0f;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] += delta[r] * k[j];
      o[r] += s[r][j] * q[j];
    }
  }
  return simd_sum(float4(o[0], o[1], o[2], o[3]));
}

// One token's update of this simdgroup's rows from what gdn_update_rows computed for it: the
// same two statements on the same values, so the rows come out bit for bit as they did there.
inline void gdn_apply_update(thread float (*s)[kKeyPerLane], thread const float* k, float decay,
                             float4 delta) {
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = decay * s[r][j];
      s[r][j] += delta[r] * k[j];
    }
  }
}

// Which rows of a head a simdgroup owns: first, first + stride, ... (kRowsPerSimdgroup of them).
struct StateRows {
  uint first;
  uint stride;
};

// This simdgroup's state rows of a head, this lane's entries.
inline void load_state_rows(device const float* head_state, StateRows rows, uint lane,
                            thread float (*s)[kKeyPerLane]) {
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device const float* s_in = head_state + (rows.first + rows.stride * r) * kKeyDim;
    const float4 entries = *reinterpret_cast<device const float4*>(s_in + kKeyPerLane * lane);
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = entries[j];
    }
  }
}
inline void store_state_rows(thread const float (*s)[kKeyPerLane], StateRows rows, uint lane,
                             device float* head_state) {
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device float* s_out = head_state + (rows.first + rows.stride * r) * kKeyDim;
    *reinterpret_cast<device float4*>(s_out + kKeyPerLane * lane) =
        float4(s[r][0], s[r][1], s[r][2], s[r][3]);
  }
}

// v of this simdgroup's rows for one token.
inline float4 load_rows_v(device const float* qkv, uint token, uint conv_dim, uint key_total,
                          uint head, StateRows rows) {
  device const float* v_in =
      qkv + ulong(token) * conv_dim + 2 * key_total + head * kValueDim + rows.first;
  float4 v;
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    v[r] = v_in[rows.stride * r];
  }
  return v;
}

struct GdnStepParams {
  uint num_key_heads;
  uint num_value_heads;
};

// The step splits each head's rows over threadgroups of kStepSimdgroups simdgroups, each
// simdgroup 4 adjacent rows: many small threadgroups spread the state's 2 MiB per layer over
// every GPU core. A simdgroup needs nothing from the others: each normalises q and k itself.
constexpr constant uint kStepSimdgroups = 4;
constexpr constant uint kStepRowsPerThreadgroup = kStepSimdgroups * kRowsPerSimdgroup;
static_assert(kValueDim % kStepRowsPerThreadgroup == 0, "a head splits into whole threadgroups");

// One threadgroup's part of the step: its simdgroups' rows of one value head. The state is read
// and written exactly once; the readout is S q, the gated RMSNorm left to its consumer.
inline void gdn_step_rows_of(constant GdnStepParams& params, device const float* qkv,
                             device const float* a, device const float* b,
                             device const float* a_log, device const bfloat* dt_bias,
                             device float* state, device float* readout, uint threadgroup_id,
                             uint simd_index, uint lane) {
  constexpr uint parts = kValueDim / kStepRowsPerThreadgroup;
  const uint head = threadgroup_id / parts;
  const StateRows rows{(threadgroup_id % parts) * kStepRowsPerThreadgroup +
                           simd_index * kRowsPerSimdgroup,
                       1};
  const uint key_head = head / (params.num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;

  float q[kKeyPerLane];
  float k[kKeyPerLane];
  load_qk(qkv + key_head * kKeyDim, qkv + key_total + key_head * kKeyDim, lane, q, k);
  normalize_qk(q, k);
  const GdnGates gates = gdn_gates(a[head], b[head], a_log[head], dt_bias[head]);

  device float* head_state = state + head * kValueDim * kKeyDim;
  float s[kRowsPerSimdgroup][kKeyPerLane];
  load_state_rows(head_state, rows, lane, s);
  const float4 v = load_rows_v(qkv, 0, 0, key_total, head, rows);
  float4 delta;
  const float4 o = gdn_update_rows(s, q, k, gates, v, delta);
  store_state_rows(s, rows, lane, head_state);
  if (lane == 0) {
    *reinterpret_cast<device float4*>(readout + head * kValueDim + rows.first) = o;
  }
}

// Threadgroups of exactly kStepSimdgroups * 32 threads, kValueDim / kStepRowsPerThreadgroup per
// value head (gdn_out_proj applies the gated RMSNorm to the readout).
[[kernel, max_total_threads_per_threadgroup(kStepSimdgroups * SIMD_WIDTH)]] void gdn_step(
    constant GdnStepParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // conv output: [q Hk*Dk | k Hk*Dk | v Hv*Dv]
    device const float* a [[buffer(2)]],    // [Hv]
    device const float* b [[buffer(3)]],    // [Hv]
    device const float* a_log [[buffer(4)]],     // [Hv]
    device const bfloat* dt_bias [[buffer(5)]],  // [Hv]
    device float* state [[buffer(6)]],           // [Hv, Dv, Dk], updated in place
    device float* readout [[buffer(7)]],         // [Hv*Dv]
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  gdn_step_rows_of(params, qkv, a, b, a_log, dt_bias, state, readout, threadgroup_id,
                   simd_index, lane);
}

// A batched decode pass's steps in one dispatch: grid y is the pass's row, and row r steps its
// own qkv, a, b and readout rows on the state of sequence slot row_slots[r], the states of all
// slots lying one after another in one buffer.
[[kernel, max_total_threads_per_threadgroup(kStepSimdgroups * SIMD_WIDTH)]] void gdn_step_rows(
    constant GdnStepParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // [rows, Hk*Dk + Hk*Dk + Hv*Dv]
    device const float* a [[buffer(2)]],    // [rows, Hv]
    device const float* b [[buffer(3)]],    // [rows, Hv]
    device const float* a_log [[buffer(4)]],     // [Hv]
    device const bfloat* dt_bias [[buffer(5)]],  // [Hv]
    device float* states [[buffer(6)]],          // [slots, Hv, Dv, Dk], updated in place
    device float* readout [[buffer(7)]],         // [rows, Hv*Dv]
    device const uint* row_slots [[buffer(8)]],  // [rows]
    uint2 threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = threadgroup_id.y;
  const uint heads = params.num_value_heads;
  const ulong value_width = ulong(heads) * kValueDim;
  const ulong conv_width = 2 * params.num_key_heads * kKeyDim + value_width;
  device float* state = states + ulong(row_slots[row]) * value_width * kKeyDim;
  gdn_step_rows_of(params, qkv + row * conv_width, a + row * heads, b + row * heads, a_log,
                   dt_bias, state, readout + row * value_width, threadgroup_id.x, simd_index,
                   lane);
}

// ---- a verify pass: the state after each position it may keep -----------------------------------
//
// A verify pass feeds T tokens of which the last `candidates` end at positions the acceptance
// (sampling.metal's accept_drafts) chooses among: it keeps the state after the last waiting token
// plus as many drafts as it accepts. Rather than T states, gdn_tokens keeps what each candidate
// token adds to the state: its decay g, its normalised key and each row's delta = beta (v - g S k),
// 4 (Hv + Hk Dk + Hv Dv) bytes a token (24.7 KiB on the real model, whose state is 2 MiB a layer).
// It runs the step's recurrence token by token, writes the state back after the tokens before the
// candidates (those are always kept) and the readout of every token; once the acceptance has
// counted the kept drafts n, gdn_commit applies the first n + 1 candidates' updates to the state
// (S <- g S + delta k^T, gdn_apply_update), leaving it bit for bit as the step kernel, token after
// token, would have. A pass thus reads the state twice and writes it once, whatever T, where a
// backup copy and the chunk kernel's update moved it four times (six with a rejection's restore).

struct GdnTokensParams {
  uint num_key_heads;
  uint num_value_heads;
  uint tokens;
  uint candidates;  // 1..tokens: the last tokens whose updates go to keys, deltas and decays
};

// The step's grid and threadgroups (kStepSimdgroups simdgroups of 4 rows).
[[kernel, max_total_threads_per_threadgroup(kStepSimdgroups * SIMD_WIDTH)]] void gdn_tokens(
    constant GdnTokensParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // conv output [tokens, q Hk*Dk | k Hk*Dk | v Hv*Dv]
    device const float* a [[buffer(2)]],    // [tokens, Hv]
    device const float* b [[buffer(3)]],    // [tokens, Hv]
    device const float* a_log [[buffer(4)]],     // [Hv]
    device const bfloat* dt_bias [[buffer(5)]],  // [Hv]
    device float* state [[buffer(6)]],    // [Hv, Dv, Dk]: left after the tokens before candidates
    device float* readout [[buffer(7)]],  // [tokens, Hv*Dv]
    device float* keys [[buffer(8)]],     // [candidates, Hk*Dk]: normalised
    device float* deltas [[buffer(9)]],   // [candidates, Hv*Dv]
    device float* decays [[buffer(10)]],  // [candidates, Hv]
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint parts = kValueDim / kStepRowsPerThreadgroup;
  const uint head = threadgroup_id / parts;
  const StateRows rows{(threadgroup_id % parts) * kStepRowsPerThreadgroup +
                           simd_index * kRowsPerSimdgroup,
                       1};
  const uint num_value_heads = params.num_value_heads;
  const uint heads_per_key = num_value_heads / params.num_key_heads;
  const uint key_head = head / heads_per_key;
  const uint key_total = params.num_key_heads * kKeyDim;
  const uint value_total = num_value_heads * kValueDim;
  const uint conv_dim = 2 * key_total + value_total;
  const uint sure = params.tokens - params.candidates;
  // One simdgroup per key head writes its keys, one per value head its decays.
  const bool writes_decay = threadgroup_id % parts == 0 && simd_index == 0;
  const bool writes_keys = writes_decay && head % heads_per_key == 0;

  device float* head_state = state + head * kValueDim * kKeyDim;
  float s[kRowsPerSimdgroup][kKeyPerLane];
  load_state_rows(head_state, rows, lane, s);
  for (uint t = 0; t < params.tokens; ++t) {
    if (t == sure && sure > 0) {
      store_state_rows(s, rows, lane, head_state);
    }
    device const float* row = qkv + ulong(t) * conv_dim;
    float q[kKeyPerLane];
    float k[kKeyPerLane];
    load_qk(row + key_head * kKeyDim, row + key_total + key_head * kKeyDim, lane, q, k);
    normalize_qk(q, k);
    const uint gate = t * num_value_heads + head;
    const GdnGates gates = gdn_gates(a[gate], b[gate], a_log[head], dt_bias[head]);
    const float4 v = load_rows_v(qkv, t, conv_dim, key_total, head, rows);
    float4 delta;
    const float4 o = gdn_update_rows(s, q, k, gates, v, delta);
    const ulong value_offset = ulong(t) * value_total + head * kValueDim + rows.first;
    if (lane == 0) {
      *reinterpret_cast<device float4*>(readout + value_offset) = o;
    }
    if (t < sure) continue;
    const uint slot = t - sure;
    if (lane == 0) {
      *reinterpret_cast<device float4*>(deltas + ulong(slot) * value_total + head * kValueDim +
                                        rows.first) = delta;
    }
    if (writes_keys) {
      *reinterpret_cast<device float4*>(keys + ulong(slot) * key_total + key_head * kKeyDim +
                                        kKeyPerLane * lane) = float4(k[0], k[1], k[2], k[3]);
    }
    if (writes_decay && lane == 0) {
      decays[slot * num_value_heads + head] = gates.decay;
    }
  }
}

struct GdnCommitParams {
  uint num_key_heads;
  uint num_value_heads;
  uint candidates;
};

// After accept_drafts: the first accepted[0] + 1 candidate updates gdn_tokens kept, applied to the
// state in place. The step's grid; each simdgroup its 4 rows, each lane its 4 key dims of them.
[[kernel, max_total_threads_per_threadgroup(kStepSimdgroups * SIMD_WIDTH)]] void gdn_commit(
    constant GdnCommitParams& params [[buffer(0)]],
    device const uint* accepted [[buffer(1)]],  // accept_drafts' output: [0] the kept drafts
    device float* state [[buffer(2)]],          // [Hv, Dv, Dk], updated in place
    device const float* keys [[buffer(3)]],     // gdn_tokens' [candidates, Hk*Dk]
    device const float* deltas [[buffer(4)]],   // [candidates, Hv*Dv]
    device const float* decays [[buffer(5)]],   // [candidates, Hv]
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint parts = kValueDim / kStepRowsPerThreadgroup;
  const uint head = threadgroup_id / parts;
  const StateRows rows{(threadgroup_id % parts) * kStepRowsPerThreadgroup +
                           simd_index * kRowsPerSimdgroup,
                       1};
  const uint num_value_heads = params.num_value_heads;
  const uint key_head = head / (num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  const uint value_total = num_value_heads * kValueDim;
  const uint updates = min(accepted[0] + 1, params.candidates);

  device float* head_state = state + head * kValueDim * kKeyDim;
  float s[kRowsPerSimdgroup][kKeyPerLane];
  load_state_rows(head_state, rows, lane, s);
  for (uint t = 0; t < updates; ++t) {
    const float4 k4 = *reinterpret_cast<device const float4*>(
        keys + ulong(t) * key_total + key_head * kKeyDim + kKeyPerLane * lane);
    const float k[kKeyPerLane] = {k4[0], k4[1], k4[2], k4[3]};
    const float4 delta = *reinterpret_cast<device const float4*>(
        deltas + ulong(t) * value_total + head * kValueDim + rows.first);
    gdn_apply_update(s, k, decays[t * num_value_heads + head], delta);
  }
  store_state_rows(s, rows, lane, head_state);
}

// ---- the chunk: chunkwise-parallel over sub-chunks of kSubChunk tokens -------------------------
//
// The recurrence unrolled over a sub-chunk of n tokens (the WY form of the delta rule): with S
// the state before it, Gamma_t the sum of log g over the sub-chunk's tokens up to t, and K, Q, V
// the sub-chunk's normalised keys, queries and values as rows,
//   U = X (V - diag(e^Gamma) K S^T),   X = (I + M)^-1 diag(beta),
//       M[i][j] = beta_i e^(Gamma_i - Gamma_j) k_i.k_j   (j < i),
//   O = diag(e^Gamma) Q S^T + P U,     P[i][j] = e^(Gamma_i - Gamma_j) q_i.k_j   (j <= i),
//   S <- e^Gamma_last S + U^T diag(e^(Gamma_last - Gamma)) K.
// Every matrix product is an 8x8 simdgroup-matrix multiply; the diagonal scalings are applied to
// each lane's own elements in fp32; only the triangular solve for X (n steps) and the
// sub-chunk-to-sub-chunk state are serial. Each row of S (a value dim) still evolves on its own
// given K, Q, g and beta, so a head's rows split over kValueDim / kChunkRows threadgroups, each
// recomputing the key-side matrices (K K^T, Q K^T, X) its rows need: 4 threadgroups per head
// where a serial scan has one, for about 20% more products than a head's state-side ones alone.
// lily.diagnostics.kernel_checks.reference_gdn_chunkwise is this algorithm in float64.
//
// Operands are half, accumulators fp32 (the state, U, O and every sum stay fp32):
//   q, k      unit vectors (q also scaled by Dk^-0.5): every element within [-1, 1], rounded by
//             at most 2^-11 of itself; an element small enough to be a half subnormal adds
//             under 2^-25 to a dot product of unit vectors.
//   P, X      |P[i][j]| <= |q_i||k_j| <= 1; X = (I + M)^-1 diag(beta) with M strictly lower
//             triangular and |M[i][j]| <= 1 (beta, e^(Gamma_i - Gamma_j) <= 1, unit keys), so
//             |X[i][j]| <= 2^(i-j-1) <= 2^14 over 16 tokens: half's range holds both.
//   S, R, U   the state, V - diag(e^Gamma) K S^T and U follow the values, whose magnitude nothing
//             bounds: each SIMD-group converts its part of them with one power-of-two factor
//             that brings its largest |x| into [2^14, 2^15) (half_range_scale), and scales the
//             fp32 product back by the inverse power of two, both exact. Every element then keeps
//             half's 11 bits down to 2^-28 of the largest; the few below add under 2^-39 of it.
//   e^Gamma   never an operand: the decays that reach the products are inside P and X (fp32
//             until rounded with them) or multiply U before its rounding; tiny ones underflow
//             to half subnormals or zero only where their term weighs under 2^-25.
// Measured against float64 (tests/test_kernel_gdn.py, docs/benchmarks.md), from 1 to 4,097
// tokens: the state off by at most 4.9e-4 for entries up to ~0.8, about 2^-11 of its entries at
// any length (the decay forgets old roundings with the tokens), the readouts by 5.6e-5 for
// values up to ~0.07; fp32 operands erred 1.5e-7 and 3e-8.

// Tokens per sub-chunk. The key-side matrices cost O(kSubChunk) products per token, the
// state-side ones a constant, and each sub-chunk 4 barriers: 16 tokens keep both small, with q
// and k of the whole sub-chunk in threadgroup memory (15 KiB in all).
constexpr constant uint kSubChunk = 16;
constexpr constant uint kTile = 8;
constexpr constant uint kTokenTiles = kSubChunk / kTile;
constexpr constant uint kKeyTiles = kKeyDim / kTile;
// State rows per threadgroup: 4 SIMD-groups, each owning one 8-row tile column of the state.
constexpr constant uint kChunkRows = 32;
constexpr constant uint kChunkSimdgroups = kChunkRows / kTile;
// Each SIMD-group prepares (normalises, gates) this many of a sub-chunk's tokens.
constexpr constant uint kPreparedPerSimdgroup = kSubChunk / kChunkSimdgroups;
static_assert(kValueDim % kChunkRows == 0, "a head's rows split into whole threadgroups");
static_assert(kChunkRows == SIMD_WIDTH, "a lane loads one value dim of each token");
// Key-side tiles: the lower triangles (diagonal tiles included) of K K^T and Q K^T.
constexpr constant uint kLowerTiles = kTokenTiles * (kTokenTiles + 1) / 2;

struct GdnSubChunk {
  alignas(16) half q[kSubChunk][kKeyDim];  // normalised and scaled; zero past the last token
  alignas(16) half k[kSubChunk][kKeyDim];  // normalised; zero past the last token
  float v[kSubChunk][kChunkRows];          // this threadgroup's value dims
  float gram[kSubChunk][kSubChunk];        // K K^T, lower triangle
  float qk[kSubChunk][kSubChunk];          // Q K^T, lower triangle
  half p[kSubChunk][kSubChunk];            // P
  half solve[kSubChunk][kSubChunk];        // X
  float readout[kSubChunk][kChunkRows];    // O, staged for the copy of its valid rows
  float log_decay[kSubChunk];              // zero past the last token: g = 1 leaves S alone
  float beta[kSubChunk];                   // zero past the last token: no update
  float gamma[kSubChunk];
};

// Tile (row, col) of a [rows, stride] matrix in threadgroup memory, optionally transposed.
template <typename T>
inline void load_tile(thread simdgroup_matrix<T, 8, 8>& tile, threadgroup const T* matrix,
                      uint stride, uint row, uint col, bool transpose = false) {
  simdgroup_load(tile, matrix + row * kTile * stride + col * kTile, stride, ulong2(0, 0),
                 transpose);
}

// A power of two and its inverse, both exact in fp32: `to_half` takes the largest |x| of the
// SIMD-group (lane_max is this lane's) into [2^14, 2^15), inside half's range with room for the
// rounding, so that x * to_half keeps 11 bits; `from_half` undoes it on an fp32 product.
struct HalfRangeScale {
  float to_half;
  float from_half;
};
inline HalfRangeScale half_range_scale(float lane_max) {
  // max_abs lies in [2^(e-127), 2^(e-126)) for its biased exponent e; 2^(141-e) takes it under
  // 2^15. e >= 15 keeps both factors normal (an all-zero part gets the largest, harmlessly).
  const uint e = max(as_type<uint>(simd_max(lane_max)) >> 23, 15u);
  return HalfRangeScale{as_type<float>((268u - e) << 23), as_type<float>((e - 14u) << 23)};
}

// The largest |x| of this lane's elements of `count` fp32 tiles.
inline float lane_max_abs(thread const simdgroup_float8x8* tiles, uint count) {
  float largest = 0.0f;
  for (uint t = 0; t < count; ++t) {
    largest = max(largest, max(abs(tiles[t].thread_elements()[0]),
                               abs(tiles[t].thread_elements()[1])));
  }
  return largest;
}

// Step 1: SIMD-group s normalises q and k of its kPreparedPerSimdgroup tokens, loads their
// values of this threadgroup's rows and computes their gates; tokens past `count` are zeros.
inline void prepare_sub_chunk(threadgroup GdnSubChunk& sc, device const float* qkv,
                              device const float* a, device const float* b, uint first,
                              uint count, uint conv_dim, uint key_total, uint key_head, uint head,
                              uint value_row, uint num_value_heads, float a_log_head,
                              bfloat dt_bias_head, uint simd_index, uint lane) {
  for (uint i = 0; i < kPreparedPerSimdgroup; ++i) {
    const uint t = simd_index * kPreparedPerSimdgroup + i;
    float q[kKeyPerLane];
    float k[kKeyPerLane];
    for (uint j = 0; j < kKeyPerLane; ++j) {
      q[j] = 0.0f;
      k[j] = 0.0f;
    }
    float v = 0.0f;
    if (t < count) {
      device const float* row = qkv + ulong(first + t) * conv_dim;
      load_qk(row + key_head * kKeyDim, row + key_total + key_head * kKeyDim, lane, q, k);
      v = row[2 * key_total + head * kValueDim + value_row + lane];
    }
    normalize_qk(q, k);  // zeros stay zeros
    *reinterpret_cast<threadgroup half4*>(&sc.q[t][kKeyPerLane * lane]) =
        half4(float4(q[0], q[1], q[2], q[3]));
    *reinterpret_cast<threadgroup half4*>(&sc.k[t][kKeyPerLane * lane]) =
        half4(float4(k[0], k[1], k[2], k[3]));
    sc.v[t][lane] = v;
    if (lane == 0) {
      float log_decay = 0.0f;
      float beta = 0.0f;
      if (t < count) {
        const uint gate = (first + t) * num_value_heads + head;
        log_decay = gdn_log_decay(a[gate], a_log_head, dt_bias_head);
        beta = sigmoid(b[gate]);
      }
      sc.log_decay[t] = log_decay;
      sc.beta[t] = beta;
    }
  }
}

// Step 2's key side: tile `job` of the lower triangles of K K^T (jobs 0..kLowerTiles-1) and
// Q K^T (the rest), into gram and qk.
inline void key_products(threadgroup GdnSubChunk& sc, uint job) {
  const bool is_gram = job < kLowerTiles;
  uint tile = is_gram ? job : job - kLowerTiles;
  uint row = 0;
  while (tile > row) {
    tile -= row + 1;
    ++row;
  }
  const uint col = tile;
  simdgroup_float8x8 sum = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint kb = 0; kb < kKeyTiles; ++kb) {
    simdgroup_half8x8 left, right;
    load_tile(left, is_gram ? &sc.k[0][0] : &sc.q[0][0], kKeyDim, row, kb);
    load_tile(right, &sc.k[0][0], kKeyDim, col, kb, true);
    simdgroup_multiply_accumulate(sum, left, right, sum);
  }
  threadgroup float* out = is_gram ? &sc.gram[0][0] : &sc.qk[0][0];
  simdgroup_store(sum, out + row * kTile * kSubChunk + col * kTile, kSubChunk);
}

// Step 3: column `col` of X = (I + M)^-1 diag(beta) by forward substitution in fp32, one lane per
// column: X[i][col] = beta_i ([i == col] - sum_{m < i} e^(Gamma_i - Gamma_m) (k_i.k_m) X[m][col]);
// rounded to half only as U's operand.
inline void solve_column(threadgroup GdnSubChunk& sc, uint col) {
  float x[kSubChunk];
  for (uint i = 0; i < kSubChunk; ++i) {
    float remembered = 0.0f;
    for (uint m = col; m < i; ++m) {
      remembered += exp(sc.gamma[i] - sc.gamma[m]) * sc.gram[i][m] * x[m];
    }
    x[i] = i < col ? 0.0f : sc.beta[i] * ((i == col ? 1.0f : 0.0f) - remembered);
    sc.solve[i][col] = half(x[i]);
  }
}

struct GdnChunkParams {
  uint num_key_heads;
  uint num_value_heads;
  uint tokens;
};

// kValueDim / kChunkRows threadgroups of exactly kChunkSimdgroups * 32 threads per value head,
// each owning kChunkRows rows of the head's state, held transposed in fp32 in its SIMD-groups'
// matrix registers (SIMD-group s: rows 8s..8s+7 of its part, one 8x8 tile per 8 key dims) from
// the first sub-chunk to the last. Writes the readout S q of every token; the gated RMSNorm,
// which needs a whole head, is gdn_gated_norm's.
[[kernel, max_total_threads_per_threadgroup(kChunkSimdgroups * SIMD_WIDTH)]] void gdn_chunk(
    constant GdnChunkParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // conv output [tokens, q Hk*Dk | k Hk*Dk | v Hv*Dv]
    device const float* a [[buffer(2)]],    // [tokens, Hv]
    device const float* b [[buffer(3)]],    // [tokens, Hv]
    device const float* a_log [[buffer(4)]],     // [Hv]
    device const bfloat* dt_bias [[buffer(5)]],  // [Hv]
    device float* state [[buffer(6)]],           // [Hv, Dv, Dk], updated in place
    device float* readout [[buffer(7)]],         // [tokens, Hv*Dv]
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup GdnSubChunk sc;

  constexpr uint parts = kValueDim / kChunkRows;
  const uint head = threadgroup_id / parts;
  const uint value_row = (threadgroup_id % parts) * kChunkRows;  // the part's first row
  const uint tile_row = simd_index * kTile;                       // this SIMD-group's, in the part
  const uint num_value_heads = params.num_value_heads;
  const uint key_head = head / (num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  const uint value_total = num_value_heads * kValueDim;
  const uint conv_dim = 2 * key_total + value_total;
  const float a_log_head = a_log[head];
  const bfloat dt_bias_head = dt_bias[head];
  // This lane's elements of any 8x8 tile: (token or key dim) row frag_row, columns frag_col and
  // frag_col + 1.
  const uint frag_row = fragment_row(lane);
  const uint frag_col = fragment_col(lane);

  // S^T of this SIMD-group's 8 rows: tile kb is key dims 8kb.. by the 8 rows.
  device float* rows_state = state + (head * kValueDim + value_row + tile_row) * kKeyDim;
  simdgroup_float8x8 state_t[kKeyTiles];
  for (uint kb = 0; kb < kKeyTiles; ++kb) {
    simdgroup_load(state_t[kb], rows_state + kb * kTile, kKeyDim, ulong2(0, 0), true);
  }

  for (uint first = 0; first < params.tokens; first += kSubChunk) {
    const uint count = min(params.tokens - first, kSubChunk);
    prepare_sub_chunk(sc, qkv, a, b, first, count, conv_dim, key_total, key_head, head,
                      value_row, num_value_heads, a_log_head, dt_bias_head, simd_index, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Step 2: the key-side tiles, spread over the SIMD-groups; Gamma; and each SIMD-group's
    // K S^T and Q S^T for its rows, in units of s_scale.from_half.
    for (uint job = simd_index; job < 2 * kLowerTiles; job += kChunkSimdgroups) {
      key_products(sc, job);
    }
    if (simd_index == 0 && lane < kSubChunk) {
      float gamma = 0.0f;
      for (uint t = 0; t <= lane; ++t) gamma += sc.log_decay[t];
      sc.gamma[lane] = gamma;
    }
    const HalfRangeScale s_scale = half_range_scale(lane_max_abs(state_t, kKeyTiles));
    simdgroup_float8x8 ks[kTokenTiles], qs[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      ks[tb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      qs[tb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (uint kb = 0; kb < kKeyTiles; ++kb) {
      simdgroup_half8x8 s_t;
      s_t.thread_elements() = half2(state_t[kb].thread_elements() * s_scale.to_half);
      for (uint tb = 0; tb < kTokenTiles; ++tb) {
        simdgroup_half8x8 k_tile, q_tile;
        load_tile(k_tile, &sc.k[0][0], kKeyDim, tb, kb);
        load_tile(q_tile, &sc.q[0][0], kKeyDim, tb, kb);
        simdgroup_multiply_accumulate(ks[tb], k_tile, s_t, ks[tb]);
        simdgroup_multiply_accumulate(qs[tb], q_tile, s_t, qs[tb]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Step 3: X (SIMD-group 0), and P, Q K^T with its decay and causal mask (1).
    if (simd_index == 0) {
      if (lane < kSubChunk) solve_column(sc, lane);
    } else if (simd_index == 1) {
      for (uint e = lane; e < kSubChunk * kSubChunk; e += SIMD_WIDTH) {
        const uint i = e / kSubChunk, j = e % kSubChunk;
        sc.p[i][j] = half(j <= i ? sc.qk[i][j] * exp(sc.gamma[i] - sc.gamma[j]) : 0.0f);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Step 4, per SIMD-group on its 8 rows: R = V - diag(e^Gamma) K S^T, U = X R, the readout O,
    // then the state. The diagonal scalings act on this lane's elements: row frag_row of token
    // tile tb is token t_row[tb].
    float decay[kTokenTiles];  // e^Gamma of this lane's tokens
    uint t_row[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      t_row[tb] = tb * kTile + frag_row;
      decay[tb] = exp(sc.gamma[t_row[tb]]);
    }
    simdgroup_float8x8 residual[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      const float remembered = decay[tb] * s_scale.from_half;
      for (uint i = 0; i < 2; ++i) {
        residual[tb].thread_elements()[i] = sc.v[t_row[tb]][tile_row + frag_col + i] -
                                            remembered * ks[tb].thread_elements()[i];
      }
    }
    const HalfRangeScale r_scale = half_range_scale(lane_max_abs(residual, kTokenTiles));
    simdgroup_half8x8 residual_h[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      residual_h[tb].thread_elements() = half2(residual[tb].thread_elements() * r_scale.to_half);
    }
    // U in units of r_scale.from_half.
    simdgroup_float8x8 u[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      u[tb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint from = 0; from <= tb; ++from) {
        simdgroup_half8x8 x_tile;
        load_tile(x_tile, &sc.solve[0][0], kSubChunk, tb, from);
        simdgroup_multiply_accumulate(u[tb], x_tile, residual_h[from], u[tb]);
      }
    }
    // U, and diag(e^(Gamma_last - Gamma)) U for the state, in units of u_from_half.
    const HalfRangeScale u_scale = half_range_scale(lane_max_abs(u, kTokenTiles));
    const float u_from_half = r_scale.from_half * u_scale.from_half;
    const float gamma_last = sc.gamma[kSubChunk - 1];
    simdgroup_half8x8 u_h[kTokenTiles], u_to_end_h[kTokenTiles];
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      const float2 scaled = u[tb].thread_elements() * u_scale.to_half;
      u_h[tb].thread_elements() = half2(scaled);
      u_to_end_h[tb].thread_elements() =
          half2(scaled * exp(gamma_last - sc.gamma[t_row[tb]]));
    }
    for (uint tb = 0; tb < kTokenTiles; ++tb) {
      simdgroup_float8x8 pu = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint from = 0; from <= tb; ++from) {
        simdgroup_half8x8 p_tile;
        load_tile(p_tile, &sc.p[0][0], kSubChunk, tb, from);
        simdgroup_multiply_accumulate(pu, p_tile, u_h[from], pu);
      }
      simdgroup_float8x8 o;
      o.thread_elements() = qs[tb].thread_elements() * (decay[tb] * s_scale.from_half) +
                            pu.thread_elements() * u_from_half;
      simdgroup_store(o, &sc.readout[tb * kTile][tile_row], kChunkRows);
    }
    for (uint kb = 0; kb < kKeyTiles; ++kb) {
      simdgroup_float8x8 update = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint tb = 0; tb < kTokenTiles; ++tb) {
        simdgroup_half8x8 k_t;
        load_tile(k_t, &sc.k[0][0], kKeyDim, tb, kb, true);
        simdgroup_multiply_accumulate(update, k_t, u_to_end_h[tb], update);
      }
      state_t[kb].thread_elements() = state_t[kb].thread_elements() * exp(gamma_last) +
                                      update.thread_elements() * u_from_half;
    }
    // The readout rows of real tokens, this SIMD-group's 8 columns of them.
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = lane; e < kSubChunk * kTile; e += SIMD_WIDTH) {
      const uint t = e / kTile, c = tile_row + e % kTile;
      if (t < count) {
        readout[ulong(first + t) * value_total + head * kValueDim + value_row + c] =
            sc.readout[t][c];
      }
    }
    // The next sub-chunk overwrites q, k, v and the key-side matrices.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint kb = 0; kb < kKeyTiles; ++kb) {
    simdgroup_store(state_t[kb], rows_state + kb * kTile, kKeyDim, ulong2(0, 0), true);
  }
}

// ---- the chunk's gated RMSNorm ------------------------------------------------------------------

struct GdnGatedNormParams {
  uint rows;  // tokens * Hv
  float eps;
};

constexpr constant uint kNormSimdgroups = 8;
constexpr constant uint kValuePerLane = kValueDim / SIMD_WIDTH;

// x = rmsnorm(x) * norm_weight * silu(z) over each 128-wide head row of the chunk's readout, in
// place: one SIMD-group per row, kNormSimdgroups rows per threadgroup.
[[kernel, max_total_threads_per_threadgroup(kNormSimdgroups * SIMD_WIDTH)]] void gdn_gated_norm(
    constant GdnGatedNormParams& params [[buffer(0)]],
    device float* x [[buffer(1)]],                   // [rows, Dv]: readout in, output out
    device const float* z [[buffer(2)]],             // [rows, Dv]
    device const bfloat* norm_weight [[buffer(3)]],  // [Dv], a plain gain
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = threadgroup_id * kNormSimdgroups + simd_index;
  if (row >= params.rows) return;
  device float* head = x + ulong(row) * kValueDim + kValuePerLane * lane;
  device const float* gate = z + ulong(row) * kValueDim + kValuePerLane * lane;
  const float4 o = *reinterpret_cast<device const float4*>(head);
  float o_sq = 0.0f;
  for (uint j = 0; j < kValuePerLane; ++j) o_sq += o[j] * o[j];
  const float inv_rms = rsqrt(simd_sum(o_sq) / float(kValueDim) + params.eps);
  for (uint j = 0; j < kValuePerLane; ++j) {
    head[j] = o[j] * inv_rms * float(norm_weight[kValuePerLane * lane + j]) * silu(gate[j]);
  }
}
