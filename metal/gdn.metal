// The Gated DeltaNet recurrence, fused end to end, for one decoded token or a chunk of tokens.
//
// Per value head h (key head h / (Hv/Hk)), with the fp32 state S [Dv, Dk]:
//   q, k  <- L2-normalised (q also scaled by Dk^-0.5)
//   g     =  exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S'    =  g * S;  delta = beta * (v - S' k);  S = S' + delta k^T;  o = S q
//   out   =  rmsnorm(o) * norm_weight * silu(z)
// Every row of S (one value dim) evolves independently given q, k, g and beta, so each
// simdgroup owns whole rows: the two dot products are simd reductions, taken for all of a
// simdgroup's rows at once. Only the final RMSNorm needs the whole head, through threadgroup
// memory. Both kernels run each token through the
// same inline functions below, in the same order, so a chunk equals its tokens decoded one by
// one, bit for bit where the compiler keeps that order.
#include "common.h"

// Both head dims are 128 in every Qwen3.5/3.6 model; each lane holds 4 of the 128 key dims
// (lane, lane + 32, ...), so loads are coalesced across the simdgroup.
constexpr constant uint kKeyDim = 128;
constexpr constant uint kValueDim = 128;
constexpr constant uint kKeyPerLane = kKeyDim / SIMD_WIDTH;
// Both kernels run 32 simdgroups of 4 state rows each (rows simd_index + 32 r): a head's whole
// state in registers at 16 floats per thread, and a simdgroup's rows fit one float4 reduction.
constexpr constant uint kSimdgroups = 32;
constexpr constant uint kRowsPerSimdgroup = kValueDim / kSimdgroups;
static_assert(kRowsPerSimdgroup == 4, "a simdgroup's rows are reduced as one float4");

// This lane's dims of one token's q and k.
inline void load_qk(device const float* q_in, device const float* k_in, uint lane,
                    thread float* q, thread float* k) {
  for (uint j = 0; j < kKeyPerLane; ++j) {
    q[j] = q_in[lane + SIMD_WIDTH * j];
    k[j] = k_in[lane + SIMD_WIDTH * j];
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
  float4 predicted = float4(0.0f);
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = gates.decay * s[r][j];
      predicted[r] += s[r][j] * k[j];
    }
  }
  const float4 delta = gates.beta * (v - simd_sum(predicted));
  float4 o = float4(0.0f);
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] += delta[r] * k[j];
      o[r] += s[r][j] * q[j];
    }
  }
  return simd_sum(o);
}

// Writes this simdgroup's rows' readouts into a head's readout buffer.
inline void store_readout(float4 o, threadgroup float* readout, uint simd_index, uint lane) {
  if (lane == 0) {
    for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
      readout[simd_index + kSimdgroups * r] = o[r];
    }
  }
}

// out = rmsnorm(readout) * norm_weight * silu(z) over one head. Every simdgroup reduces the
// whole head itself, which saves a second barrier; readout must be complete (after a barrier).
inline void gdn_gated_rms_norm(threadgroup const float* readout, device const bfloat* norm_weight,
                               device const float* z, float eps, device float* out,
                               uint thread_index, uint threads, uint lane) {
  float o_sq = 0.0f;
  for (uint i = lane; i < kValueDim; i += SIMD_WIDTH) {
    o_sq += readout[i] * readout[i];
  }
  const float inv_rms = rsqrt(simd_sum(o_sq) / float(kValueDim) + eps);
  for (uint i = thread_index; i < kValueDim; i += threads) {
    out[i] = readout[i] * inv_rms * float(norm_weight[i]) * silu(z[i]);
  }
}

struct GdnStepParams {
  uint num_key_heads;
  uint num_value_heads;
  float norm_eps;  // of the gated RMSNorm
};

// One threadgroup of exactly kSimdgroups * 32 threads per value head. The state is read and
// written exactly once.
[[kernel]] void gdn_step(
    constant GdnStepParams& params [[buffer(0)]],
    device const float* qkv [[buffer(1)]],  // conv output: [q Hk*Dk | k Hk*Dk | v Hv*Dv]
    device const float* z [[buffer(2)]],    // [Hv*Dv]
    device const float* a [[buffer(3)]],    // [Hv]
    device const float* b [[buffer(4)]],    // [Hv]
    device const float* a_log [[buffer(5)]],         // [Hv]
    device const bfloat* dt_bias [[buffer(6)]],      // [Hv]
    device const bfloat* norm_weight [[buffer(7)]],  // [Dv], a plain gain
    device float* state [[buffer(8)]],               // [Hv, Dv, Dk], updated in place
    device float* out [[buffer(9)]],                 // [Hv*Dv]
    uint head [[threadgroup_position_in_grid]],
    uint thread_index [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float readout[kValueDim];

  const uint key_head = head / (params.num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  device const float* v_in = qkv + 2 * key_total + head * kValueDim + simd_index;

  float q[kKeyPerLane];
  float k[kKeyPerLane];
  load_qk(qkv + key_head * kKeyDim, qkv + key_total + key_head * kKeyDim, lane, q, k);
  normalize_qk(q, k);
  const GdnGates gates = gdn_gates(a[head], b[head], a_log[head], dt_bias[head]);

  device float* head_state = state + head * kValueDim * kKeyDim;
  float s[kRowsPerSimdgroup][kKeyPerLane];
  float4 v;
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device const float* s_in = head_state + (simd_index + kSimdgroups * r) * kKeyDim;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = s_in[lane + SIMD_WIDTH * j];
    }
    v[r] = v_in[kSimdgroups * r];
  }
  store_readout(gdn_update_rows(s, q, k, gates, v), readout, simd_index, lane);
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device float* s_out = head_state + (simd_index + kSimdgroups * r) * kKeyDim;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s_out[lane + SIMD_WIDTH * j] = s[r][j];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  gdn_gated_rms_norm(readout, norm_weight, z + head * kValueDim, params.norm_eps,
                     out + head * kValueDim, thread_index, threads, lane);
}

struct GdnChunkParams {
  uint num_key_heads;
  uint num_value_heads;
  uint tokens;
  float norm_eps;  // of the gated RMSNorm
};

// What one token brings to this lane in the chunk kernel: its raw q and k dims, v of this
// simdgroup's rows, and the head's a and b.
struct GdnChunkToken {
  float q[kKeyPerLane];
  float k[kKeyPerLane];
  float4 v;
  float a;
  float b;
};

inline GdnChunkToken load_chunk_token(device const float* qkv_row, device const float* a_row,
                                      device const float* b_row, uint key_head, uint head,
                                      uint key_total, uint simd_index, uint lane) {
  GdnChunkToken token;
  load_qk(qkv_row + key_head * kKeyDim, qkv_row + key_total + key_head * kKeyDim, lane, token.q,
          token.k);
  device const float* v_in = qkv_row + 2 * key_total + head * kValueDim + simd_index;
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    token.v[r] = v_in[kSimdgroups * r];
  }
  token.a = a_row[head];
  token.b = b_row[head];
  return token;
}

// One threadgroup of exactly kSimdgroups * 32 threads per value head scans the chunk's tokens
// in order, with the head's state in registers: read from device memory before the first token
// and written back after the last. Each token's inputs are loaded one token ahead so their latency overlaps the
// previous token's reductions. The readout alternates between two buffers: a simdgroup can only
// write one again after passing the next token's barrier, which every simdgroup reaches only
// once it has finished reading that buffer, so one barrier per token suffices.
[[kernel]] void gdn_chunk(
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
    uint thread_index [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float readout[2 * kValueDim];

  const uint num_value_heads = params.num_value_heads;
  const uint key_head = head / (num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  const uint value_total = num_value_heads * kValueDim;
  const uint conv_dim = 2 * key_total + value_total;
  const uint tokens = params.tokens;
  const float a_log_head = a_log[head];
  const bfloat dt_bias_head = dt_bias[head];
  device float* head_state = state + head * kValueDim * kKeyDim;

  float s[kRowsPerSimdgroup][kKeyPerLane];
  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device const float* s_in = head_state + (simd_index + kSimdgroups * r) * kKeyDim;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s[r][j] = s_in[lane + SIMD_WIDTH * j];
    }
  }

  GdnChunkToken next = load_chunk_token(qkv, a, b, key_head, head, key_total, simd_index, lane);
  for (uint token = 0; token < tokens; ++token) {
    GdnChunkToken current = next;
    if (token + 1 < tokens) {
      const uint ahead = token + 1;
      next = load_chunk_token(qkv + ahead * conv_dim, a + ahead * num_value_heads,
                              b + ahead * num_value_heads, key_head, head, key_total, simd_index,
                              lane);
    }
    normalize_qk(current.q, current.k);
    const GdnGates gates = gdn_gates(current.a, current.b, a_log_head, dt_bias_head);
    threadgroup float* slot = readout + (token % 2) * kValueDim;
    store_readout(gdn_update_rows(s, current.q, current.k, gates, current.v), slot, simd_index,
                  lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const uint offset = token * value_total + head * kValueDim;
    gdn_gated_rms_norm(slot, norm_weight, z + offset, params.norm_eps, out + offset,
                       thread_index, threads, lane);
  }

  for (uint r = 0; r < kRowsPerSimdgroup; ++r) {
    device float* s_out = head_state + (simd_index + kSimdgroups * r) * kKeyDim;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s_out[lane + SIMD_WIDTH * j] = s[r][j];
    }
  }
}
