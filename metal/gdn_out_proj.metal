// The Gated DeltaNet's output projection in the decode step, with the gated RMSNorm folded in:
//   residual += W x,  x_h = rmsnorm(o_h) * norm_weight * silu(z_h) for each value head h,
// where o is gdn_step's readout. gdn_step splits each head's rows over several threadgroups, so
// none of them has the whole head to norm; this GEMV reads all of o anyway.
//
// A lane's 16-byte load of codes covers 32 (4-bit) or 16 (8-bit) inputs, which lie inside one
// 128-wide head, and the lanes holding one head's chunks are 4 (or 8) adjacent, aligned lanes.
// The head's sum of squares is thus each lane's own plus a butterfly of shuffles over that group,
// the same on each of its lanes and in every SIMD-group. Each input is then normed, gained and
// gated in the order gdn_gated_rms_norm uses, and the dot products are those of qgemv: only the
// order of the sum of squares differs from a separate norm. A verify pass runs it over its few
// tokens (gdn_out_proj_tokens), each token's norm folded in alike.
#include "common.h"
#include "quantized.h"

constexpr constant uint kNormedHeadDim = 128;  // Dv, the span of one inverse RMS
constexpr constant uint kOutProjRowsPerSimdgroup = 4;
// One SIMD-group per threadgroup: the real model's 2048 rows make 512 threadgroups, 12.8 per
// core of a 40-core GPU, where two SIMD-groups would make 256 and a last round 40% full (see
// gemv_simdgroups in lily/kernels/quantized.py). Each SIMD-group's threadgroup memory and
// barrier are its own, so nothing else depends on it.
constexpr constant uint kOutProjSimdgroups = 1;

// The most tokens of one gdn_out_proj_tokens dispatch: a verify pass's (QGEMV_MAX_TOKENS).
constexpr constant uint kOutProjMaxTokens = 9;

// What a lane shares for its one reduction: its partial sums of every row for each token (token
// n's row r at n * R + r). The threadgroup memory is SIMD_WIDTH such runs per SIMD-group
// (kernels/gdn_out_proj.py sizes it alike).
inline uint gdn_out_proj_lane_stride(uint tokens) {
  return lane_sums_stride(kOutProjRowsPerSimdgroup * tokens);
}

struct GdnOutProjParams {
  uint in_dim;  // Hv * Dv
  float eps;    // of the gated RMSNorm
  uint rows;    // the residual's width (hidden_size): a token's stride in it
  uint tokens;  // readout, z and residual rows (1 but in gdn_out_proj_tokens)
};

// Threadgroups of kOutProjSimdgroups SIMD-groups of kOutProjRowsPerSimdgroup rows each; the rows
// are a whole number of threadgroups. TOKENS is the most tokens a dispatch takes: 1 for the
// decode step; a verify pass's few (gdn_out_proj_tokens) read each chunk of codes once, decoded
// into registers, for all of them (as qgemv_tokens does), each token's rows bit for bit the
// single-token kernel's.
template <uint BITS, uint TOKENS>
[[kernel, max_total_threads_per_threadgroup(kOutProjSimdgroups * SIMD_WIDTH)]]
void gdn_out_proj(constant GdnOutProjParams& p [[buffer(0)]],
                  device const float* readout [[buffer(1)]],       // [tokens, Hv*Dv]
                  device const float* z [[buffer(2)]],             // [tokens, Hv*Dv]
                  device const bfloat* norm_weight [[buffer(3)]],  // [Dv], a gain
                  device const uint* weight [[buffer(4)]],
                  device const bfloat* scales [[buffer(5)]],
                  device const bfloat* biases [[buffer(6)]],
                  device float* residual [[buffer(7)]],  // [tokens, rows], added to
                  threadgroup float* scratch [[threadgroup(0)]],
                  uint threadgroup_id [[threadgroup_position_in_grid]],
                  uint simdgroup [[simdgroup_index_in_threadgroup]],
                  uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint R = kOutProjRowsPerSimdgroup;
  constexpr uint chunk = quant_chunk(BITS);
  constexpr uint lanes_per_head = kNormedHeadDim / chunk;
  const QuantMatrix m{weight, scales, biases};
  const uint row0 = (threadgroup_id * kOutProjSimdgroups + simdgroup) * R;
  const uint words_per_row = p.in_dim * BITS / 32;
  const uint groups_per_row = p.in_dim / QUANT_GROUP_SIZE;

  float acc[R][TOKENS];
  for (uint r = 0; r < R; ++r) {
    for (uint n = 0; n < TOKENS; ++n) acc[r][n] = 0.0f;
  }
  // Every lane takes every pass, so that the shuffles stay in uniform control flow; a pass past
  // the end of a short input (a model with few heads) idles whole groups of lanes.
  for (uint base = 0; base < p.in_dim; base += SIMD_WIDTH * chunk) {
    const uint k = base + lane * chunk;
    const bool active = k < p.in_dim;
    float decoded[R][chunk];
    float row_scales[R], row_biases[R];
    if (TOKENS > 1 && active) {
      for (uint r = 0; r < R; ++r) {
        const ulong row = row0 + r;
        decode_codes<BITS>(
            *reinterpret_cast<device const uint4*>(weight + row * words_per_row + k * BITS / 32),
            decoded[r]);
        const ulong group = row * groups_per_row + k / QUANT_GROUP_SIZE;
        row_scales[r] = float(scales[group]);
        row_biases[r] = float(biases[group]);
      }
    }
    for (uint n = 0; n < TOKENS; ++n) {
      if (n >= p.tokens) break;
      device const float* token_readout = readout + ulong(n) * p.in_dim;
      device const float* token_z = z + ulong(n) * p.in_dim;
      float xs[chunk];
      float squares = 0.0f;
      if (active) {
        for (uint i = 0; i < chunk; i += 4) {
          const float4 o = *reinterpret_cast<device const float4*>(token_readout + k + i);
          for (uint j = 0; j < 4; ++j) {
            xs[i + j] = o[j];
            squares += o[j] * o[j];
          }
        }
      }
      for (uint offset = 1; offset < lanes_per_head; offset <<= 1) {
        squares += simd_shuffle_xor(squares, offset);
      }
      if (active) {
        const float inv_rms = rsqrt(squares / float(kNormedHeadDim) + p.eps);
        device const bfloat* gain = norm_weight + k % kNormedHeadDim;
        float xsum = 0.0f;
        for (uint i = 0; i < chunk; i += 4) {
          const float4 gate = *reinterpret_cast<device const float4*>(token_z + k + i);
          for (uint j = 0; j < 4; ++j) {
            xs[i + j] = xs[i + j] * inv_rms * float(gain[i + j]) * silu(gate[j]);
            xsum += xs[i + j];
          }
        }
        for (uint r = 0; r < R; ++r) {
          acc[r][n] += TOKENS > 1
                           ? qdot_decoded<BITS>(decoded[r], row_scales[r], row_biases[r], xs, xsum)
                           : qdot_chunk<BITS>(m, p.in_dim, row0 + r, k, xs, xsum);
        }
      }
    }
  }
  // Every token's rows in one exchange (lane_sum, quantized.h): value i = n * R + r, summed by
  // lanes i, i + 32, ..., each the one lane that reads and adds to its row.
  const uint stride = gdn_out_proj_lane_stride(p.tokens);
  threadgroup float* mine = scratch + simdgroup * SIMD_WIDTH * stride;
  for (uint n = 0; n < TOKENS; ++n) {
    if (n >= p.tokens) break;
    for (uint r = 0; r < R; ++r) mine[lane * stride + n * R + r] = acc[r][n];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = lane; i < R * p.tokens; i += SIMD_WIDTH) {
    residual[ulong(i / R) * p.rows + row0 + i % R] += lane_sum(mine, stride, i);
  }
}

template [[host_name("gdn_out_proj_4")]] [[kernel]] decltype(gdn_out_proj<4, 1>)
    gdn_out_proj<4, 1>;
template [[host_name("gdn_out_proj_8")]] [[kernel]] decltype(gdn_out_proj<8, 1>)
    gdn_out_proj<8, 1>;
template [[host_name("gdn_out_proj_tokens_4")]] [[kernel]]
decltype(gdn_out_proj<4, kOutProjMaxTokens>) gdn_out_proj<4, kOutProjMaxTokens>;
template [[host_name("gdn_out_proj_tokens_8")]] [[kernel]]
decltype(gdn_out_proj<8, kOutProjMaxTokens>) gdn_out_proj<8, kOutProjMaxTokens>;
