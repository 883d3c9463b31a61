// The Gated DeltaNet recurrence for one decoded token, fused end to end.
//
// Per value head h (key head h / (Hv/Hk)), with the fp32 state S [Dv, Dk]:
//   q, k  <- L2-normalised (q also scaled by Dk^-0.5)
//   g     =  exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S'    =  g * S;  delta = beta * (v - S' k);  S = S' + delta k^T;  o = S q
//   out   =  rmsnorm(o) * norm_weight * silu(z)
// Every row of S (one value dim) evolves independently given q, k, g and beta, so each
// simdgroup owns whole rows: the two dot products are simd reductions and the state is read
// and written exactly once. Only the final RMSNorm needs the whole head, through threadgroup
// memory.
#include "common.h"

struct GdnStepParams {
  uint num_key_heads;
  uint num_value_heads;
  float norm_eps;  // of the gated RMSNorm
};

// Both head dims are 128 in every Qwen3.5/3.6 model; each lane holds 4 of the 128 key dims
// (lane, lane + 32, ...), so loads are coalesced across the simdgroup.
constexpr constant uint kKeyDim = 128;
constexpr constant uint kValueDim = 128;
constexpr constant uint kKeyPerLane = kKeyDim / SIMD_WIDTH;

// One threadgroup per value head; any multiple of 32 threads up to kValueDim * 32 works.
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

  const uint simdgroups = threads / SIMD_WIDTH;
  const uint key_head = head / (params.num_value_heads / params.num_key_heads);
  const uint key_total = params.num_key_heads * kKeyDim;
  device const float* q_in = qkv + key_head * kKeyDim;
  device const float* k_in = qkv + key_total + key_head * kKeyDim;
  device const float* v_in = qkv + 2 * key_total + head * kValueDim;

  float q[kKeyPerLane];
  float k[kKeyPerLane];
  float q_sq = 0.0f;
  float k_sq = 0.0f;
  for (uint j = 0; j < kKeyPerLane; ++j) {
    q[j] = q_in[lane + SIMD_WIDTH * j];
    k[j] = k_in[lane + SIMD_WIDTH * j];
    q_sq += q[j] * q[j];
    k_sq += k[j] * k[j];
  }
  const float q_scale = rsqrt(simd_sum(q_sq) + 1e-6f) * rsqrt(float(kKeyDim));
  const float k_scale = rsqrt(simd_sum(k_sq) + 1e-6f);
  for (uint j = 0; j < kKeyPerLane; ++j) {
    q[j] *= q_scale;
    k[j] *= k_scale;
  }

  // softplus(x) = max(x, 0) + log(1 + exp(-|x|)) never overflows.
  const float gate_in = a[head] + float(dt_bias[head]);
  const float softplus = max(gate_in, 0.0f) + log(1.0f + exp(-abs(gate_in)));
  const float decay = exp(-exp(a_log[head]) * softplus);
  const float beta = sigmoid(b[head]);

  for (uint row = simd_index; row < kValueDim; row += simdgroups) {
    device float* s = state + (head * kValueDim + row) * kKeyDim;
    float s_row[kKeyPerLane];
    float predicted = 0.0f;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s_row[j] = decay * s[lane + SIMD_WIDTH * j];
      predicted += s_row[j] * k[j];
    }
    const float delta = beta * (v_in[row] - simd_sum(predicted));
    float o = 0.0f;
    for (uint j = 0; j < kKeyPerLane; ++j) {
      s_row[j] += delta * k[j];
      s[lane + SIMD_WIDTH * j] = s_row[j];
      o += s_row[j] * q[j];
    }
    o = simd_sum(o);
    if (lane == 0) {
      readout[row] = o;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Every simdgroup reduces the whole head itself, which saves a second barrier.
  float o_sq = 0.0f;
  for (uint i = lane; i < kValueDim; i += SIMD_WIDTH) {
    o_sq += readout[i] * readout[i];
  }
  const float inv_rms = rsqrt(simd_sum(o_sq) / float(kValueDim) + params.norm_eps);
  for (uint i = thread_index; i < kValueDim; i += threads) {
    out[head * kValueDim + i] =
        readout[i] * inv_rms * float(norm_weight[i]) * silu(z[head * kValueDim + i]);
  }
}
