// The Gated DeltaNet recurrence, fused end to end, for one decoded token or a chunk of tokens.
//
// Per value head h (key head h / (Hv/Hk)), with the fp32 state S [Dv, Dk]:
//   q, k  <- L2-normalised (q also scaled by Dk^-0.5)
//   g     =  exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S'    =  g * S;  delta = beta * (v - S' k);  S = S' + delta k^T;  o = S q
//   out   =  rmsnorm(o) * norm_weight * silu(z)
// Every row of S (one value dim) evolves independently given q, k, g and beta, so each
// simdgroup owns whole rows: the two dot products are simd reductions, taken for all of a
// simdgroup's rows at once. Only the final RMSNorm needs the whole head. The chunk kernel does it
// through threadgroup memory; the step kernel leaves it to its consumer, the out_proj GEMV
// (gdn_out_proj.metal), and so can split a head's rows over several threadgroups. Both kernels
// run each token through the same inline functions below, in the same order, so a chunk equals
// its tokens decoded one by one (state, and readout before the norm), bit for bit where the
// compiler keeps that order.
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

inline GdnGates gdn_gates(float a, float b, float a_log, bfloat dt_bias) {
  // softplus(x) = max(x, 0) + log(1 + exp(-|x|)) never overflows.
  const float gate_in = a + float(dt_bias);
  const float softplus = max(gate_in, 0.0f) + log(1.0f + exp(-abs(gate_in)));
  return GdnGates{exp(-exp(a_log) * softplus), sigmoid(b)};
}

// This simdgroup's state rows through one token, in place on this lane's 4 entries of each;
// returns the rows' readouts (S q)[row], the same on every lane. The rows' partial dot products
// are reduced together, one float4 per reduction: two reductions per token rather than two per
// row, and the rows' dependency chains overlap. Each row's arithmetic is as if done alone.
inline float4 gdn_update_rows(thread float (*s)[kKeyPerLane], thread const float* q,
                              thread const float* k, GdnGates gates, float4 v) {
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
  const float4 delta =
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

// Threadgroups of exactly kStepSimdgroups * 32 threads, kValueDim / kStepRowsPerThreadgroup per
// value head. The state is read and written exactly once; the readout is S q, the gated RMSNorm
// left to its consumer (gdn_out_proj).
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
  const float4 o = gdn_update_rows(s, q, k, gates, v);
  store_state_rows(s, rows, lane, head_state);
  if (lane == 0) {
    *reinterpret_cast<device float4*>(readout + head * kValueDim + rows.first) = o;
  }
}

// The chunk kernel runs 32 simdgroups of 4 state rows each (rows simd_index + 32 r): a head's
// whole state in registers at 16 floats per thread.
constexpr constant uint kChunkSimdgroups = kValueDim / kRowsPerSimdgroup;

// Writes this simdgroup's rows' readouts into a head's readout in threadgroup memory.
inline void store_readout(float4 o, threadgroup float* readout, StateRows rows, uint lane) {
  if (lane == 0) {
    for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
      readout[rows.first + rows.stride * r] = o[r];
    }
  }
}

// out = rmsnorm(readout) * norm_weight * silu(z) over one head, by one simdgroup; readout must be
// complete (after a barrier).
inline void gdn_gated_rms_norm(threadgroup const float* readout, device const bfloat* norm_weight,
                               device const float* z, float eps, device float* out, uint lane) {
  float o_sq = 0.0f;
  for (uint i = lane; i < kValueDim; i += SIMD_WIDTH) {
    o_sq += readout[i] * readout[i];
  }
  const float inv_rms = rsqrt(simd_sum(o_sq) / float(kValueDim) + eps);
  for (uint i = lane; i < kValueDim; i += SIMD_WIDTH) {
    out[i] = readout[i] * inv_rms * float(norm_weight[i]) * silu(z[i]);
  }
}

struct GdnChunkParams {
  uint num_key_heads;
  uint num_value_heads;
  uint tokens;
  float norm_eps;  // of the gated RMSNorm
};

// The chunk kernel takes its tokens in blocks. Per block: each of the first `count` simdgroups
// prepares one token (q/k norms and gates, into threadgroup memory); after a barrier every
// simdgroup scans the block's tokens through its state rows, writing readouts; after a second
// barrier each of the first `count` simdgroups normalises one token's readout into the output,
// while the next block is prepared. Per token a lane thus pays for the two row reductions only,
// and the per-token work every lane would repeat is done once.
constexpr constant uint kBlockTokens = 16;
static_assert(kBlockTokens <= kChunkSimdgroups, "one simdgroup prepares each token of a block");

// A block's prepared tokens: L2-normalised q and k (q also scaled), each lane's dims as one
// float4, and the gates.
struct GdnBlock {
  float4 q[kBlockTokens][SIMD_WIDTH];
  float4 k[kBlockTokens][SIMD_WIDTH];
  GdnGates gates[kBlockTokens];
};

// Simdgroup `simd_index` < count prepares token first + simd_index of the chunk.
inline void prepare_block_token(threadgroup GdnBlock& block, device const float* qkv,
                                device const float* a, device const float* b, uint first,
                                uint count, uint conv_dim, uint key_head, uint head,
                                uint num_value_heads, uint key_total, float a_log_head,
                                bfloat dt_bias_head, uint simd_index, uint lane) {
  if (simd_index >= count) return;
  const uint token = first + simd_index;
  device const float* row = qkv + ulong(token) * conv_dim;
  float q[kKeyPerLane];
  float k[kKeyPerLane];
  load_qk(row + key_head * kKeyDim, row + key_total + key_head * kKeyDim, lane, q, k);
  normalize_qk(q, k);
  block.q[simd_index][lane] = float4(q[0], q[1], q[2], q[3]);
  block.k[simd_index][lane] = float4(k[0], k[1], k[2], k[3]);
  if (lane == 0) {
    block.gates[simd_index] = gdn_gates(a[token * num_value_heads + head],
                                        b[token * num_value_heads + head], a_log_head,
                                        dt_bias_head);
  }
}

// One threadgroup of exactly kChunkSimdgroups * 32 threads per value head scans the chunk's
// tokens in order, with the head's state in registers: read from device memory before the first
// token and written back after the last.
[[kernel, max_total_threads_per_threadgroup(kChunkSimdgroups * SIMD_WIDTH)]] void gdn_chunk(
    constant GdnChunkParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // conv output [tokens, q Hk*Dk | k Hk*Dk | v Hv*Dv]
    device const float* z [[buffer(2)]],    // [tokens, Hv*Dv]
    device const float* a [[buffer(3)]],    // [tokens, Hv]
    device const float* b [[buffer(4)]],    // [tokens, Hv]
    device const float* a_log [[buffer(5)]],         // [Hv]
    device const bfloat* dt_bias [[buffer(6)]],      // [Hv]
    device const bfloat* norm_weight [[buffer(7)]],  // [Dv], a plain gain
    device float* state [[buffer(8)]],               // [Hv, Dv, Dk], updated in place
    device float* out [[buffer(9)]],                 // [tokens, Hv*Dv]
    uint head [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup GdnBlock block;
  threadgroup float readout[kBlockTokens * kValueDim];

  const uint num_value_heads = params.num_value_heads;
  const uint key_head = head / (num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  const uint value_total = num_value_heads * kValueDim;
  const uint conv_dim = 2 * key_total + value_total;
  const uint tokens = params.tokens;
  const float a_log_head = a_log[head];
  const bfloat dt_bias_head = dt_bias[head];
  device float* head_state = state + head * kValueDim * kKeyDim;

  const StateRows rows{simd_index, kChunkSimdgroups};
  float s[kRowsPerSimdgroup][kKeyPerLane];
  load_state_rows(head_state, rows, lane, s);

  uint count = min(tokens, kBlockTokens);
  prepare_block_token(block, qkv, a, b, 0, count, conv_dim, key_head, head, num_value_heads,
                      key_total, a_log_head, dt_bias_head, simd_index, lane);
  for (uint first = 0; first < tokens; first += kBlockTokens) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the block is prepared
    float4 v = load_rows_v(qkv, first, conv_dim, key_total, head, rows);
    for (uint t = 0; t < count; ++t) {
      const float4 current_v = v;
      if (t + 1 < count) v = load_rows_v(qkv, first + t + 1, conv_dim, key_total, head, rows);
      float q[kKeyPerLane];
      float k[kKeyPerLane];
      for (uint j = 0; j < kKeyPerLane; ++j) {
        q[j] = block.q[t][lane][j];
        k[j] = block.k[t][lane][j];
      }
      store_readout(gdn_update_rows(s, q, k, block.gates[t], current_v),
                    readout + t * kValueDim, rows, lane);
    }
    // The readouts are complete, and every simdgroup is done with the block's q, k and gates.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (simd_index < count) {
      const uint offset = (first + simd_index) * value_total + head * kValueDim;
      gdn_gated_rms_norm(readout + simd_index * kValueDim, norm_weight, z + offset,
                         params.norm_eps, out + offset, lane);
    }
    const uint next = first + kBlockTokens;
    const uint next_count = next < tokens ? min(tokens - next, kBlockTokens) : 0;
    prepare_block_token(block, qkv, a, b, next, next_count, conv_dim, key_head, head,
                        num_value_heads, key_total, a_log_head, dt_bias_head, simd_index, lane);
    // The next block's scan overwrites readouts still being normalised.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    count = next_count;
  }

  store_state_rows(s, rows, lane, head_state);
}
