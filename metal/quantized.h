// MLX affine quantization, the building blocks of every quantized GEMV.
//
// A projection with `out` rows and `in` inputs is stored as codes packed low bits first into uint32
// words along the input dimension (`[out, in * BITS / 32]`) and one bf16 scale and bias per group
// of 64 inputs (`[out, in / 64]`); a weight is `scale * code + bias`. Stacked experts add a leading
// axis. A lane reads its codes 16 bytes at a time (one uint4): 32 inputs at 4 bits, 16 at 8 bits,
// always inside one group, so one scale and bias apply to the whole chunk and
//   sum(w * x) = scale * sum(code * x) + bias * sum(x).
#pragma once

#include "common.h"

constexpr constant uint QUANT_GROUP_SIZE = 64;

// Inputs covered by one 16-byte load of codes.
constexpr uint quant_chunk(uint bits) { return 128 / bits; }

// One quantized matrix (or one expert of a stacked tensor), addressed where it lies in memory.
struct QuantMatrix {
  device const uint* weight;
  device const bfloat* scales;
  device const bfloat* biases;
};

inline QuantMatrix quant_expert(QuantMatrix stacked, uint expert, uint rows, uint in_dim, uint bits) {
  const ulong words = ulong(rows) * (in_dim * bits / 32);
  const ulong groups = ulong(rows) * (in_dim / QUANT_GROUP_SIZE);
  return QuantMatrix{stacked.weight + expert * words, stacked.scales + expert * groups,
                     stacked.biases + expert * groups};
}

// Loads the activations of one chunk (starting at input k) as float and returns their sum.
// x is read as 4-element vectors (16 bytes of fp32, 8 of bf16): a chunk starts at a multiple of
// 16 inputs, so a 16-byte aligned x keeps every vector aligned. The sum still runs input by
// input, so the vector loads change no rounding.
template <uint BITS, typename T>
inline float load_chunk(device const T* x, uint k, thread float* xs) {
  device const vec<T, 4>* x4 = reinterpret_cast<device const vec<T, 4>*>(x + k);
  float sum = 0.0f;
  for (uint v = 0; v < quant_chunk(BITS) / 4; ++v) {
    const vec<T, 4> loaded = x4[v];
    const float4 values = float4(loaded);
    for (uint i = 0; i < 4; ++i) {
      xs[4 * v + i] = values[i];
      sum += values[i];
    }
  }
  return sum;
}

// Input j of a word of codes, dequantized: scale * code + bias in fp32. The embedding lookup
// and the GEMV that reads the embedding row itself (embedding.h) both go through this one
// expression, so the row they see is the same, bit for bit.
template <uint BITS>
inline float dequantize_code(uint packed, uint j, float scale, float bias) {
  constexpr uint mask = (1u << BITS) - 1u;
  return scale * float((packed >> (j * BITS)) & mask) + bias;
}

// sum over one chunk of (scale * code + bias) * x, for row `row` and inputs [k, k + chunk).
template <uint BITS>
inline float qdot_chunk(QuantMatrix m, uint in_dim, uint row, uint k, thread const float* xs,
                        float xsum) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  const ulong word = ulong(row) * (in_dim * BITS / 32) + k * BITS / 32;
  const uint4 codes = *reinterpret_cast<device const uint4*>(m.weight + word);
  float dot = 0.0f;
  for (uint w = 0; w < 4; ++w) {
    const uint packed = codes[w];
    for (uint j = 0; j < per_word; ++j) {
      dot += float((packed >> (j * BITS)) & mask) * xs[w * per_word + j];
    }
  }
  const ulong group = ulong(row) * (in_dim / QUANT_GROUP_SIZE) + k / QUANT_GROUP_SIZE;
  return float(m.scales[group]) * dot + float(m.biases[group]) * xsum;
}

// One chunk of one row's codes (16 bytes), each code as a float: decoded once, then used for
// every token of a verify pass (the shift, mask and conversion would otherwise cost three of
// every four instructions per weight and token).
template <uint BITS>
inline void decode_codes(uint4 codes, thread float* decoded) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  for (uint w = 0; w < 4; ++w) {
    for (uint j = 0; j < per_word; ++j) {
      decoded[w * per_word + j] = float((codes[w] >> (j * BITS)) & mask);
    }
  }
}

// sum over one chunk of (scale * code + bias) * x for one row whose codes are decoded:
// qdot_chunk's arithmetic, in its order, so each token's rows are the single-token GEMV's.
template <uint BITS>
inline float qdot_decoded(thread const float* decoded, float scale, float bias,
                          thread const float* xs, float xsum) {
  float dot = 0.0f;
  for (uint i = 0; i < quant_chunk(BITS); ++i) dot += decoded[i] * xs[i];
  return scale * dot + bias * xsum;
}

// The row that slot r (< R) of a SIMD-group's rows [row0, row0 + count) computes. The row loops
// run all R slots, a compile-time trip count that keeps acc[] in registers; the slots past count
// (only in the last SIMD-group of a matrix whose rows are not a multiple of R) recompute the last
// row, an in-bounds read of cached data, and the caller drops their results.
inline uint clamped_row(uint row0, uint count, uint r) { return row0 + min(r, count - 1); }

// The SIMD-group's sums of four rows' partial dot products, in one reduction of a float4: each
// component is what simd_sum of that row alone gives, in a quarter of the exchanges (on the sim
// each exchange is a rendezvous of the SIMD-group's 32 fibers). moe_down alone reduces through
// this: a SIMD-group of it has one token's four rows, one exchange either way. Every other GEMV
// (the projections', the MoE's gate/up, the GDN output projection) reduces through lane_sum
// below, so a row's sum is the same in each of those.
inline float4 simd_sum_rows(thread const float* acc) {
  return simd_sum(float4(acc[0], acc[1], acc[2], acc[3]));
}

// The SIMD-group's sums of many values per lane in one exchange through threadgroup memory, where
// simd_sum would take one per four values: the GEMV kernels (quantized_gemv.metal, the MoE's
// gate/up and gdn_out_proj) reduce every row of every token of a pass, and a folded norm's sums
// of squares, at once (on the sim each exchange is a rendezvous of the SIMD-group's 32 fibers,
// which dominated batched passes). Each lane writes its values to its own run of `scratch`,
// `stride` floats apart (lane_sums_stride: odd, so the 32 lanes' writes of one value fall in
// distinct banks), then a simdgroup_barrier; lane_sum(scratch, stride, i) reads value i's column
// (consecutive words across the lanes that read neighbouring values) and adds it in lane order,
// as the sim's simd_sum does: a value's sum is the same in every kernel that reduces through it,
// whichever lane computes it, and on the sim the same as simd_sum's
// (tests/test_kernel_gemv_order.py pins that order). The 32 adds form one dependent chain per
// lane, a short tail to a GEMV bound by reading its weights.
constexpr uint lane_sums_stride(uint values) { return values | 1u; }

inline float lane_sum(threadgroup const float* scratch, uint stride, uint i) {
  float total = scratch[i];
  for (uint l = 1; l < SIMD_WIDTH; ++l) total += scratch[l * stride + i];
  return total;
}

// This lane's partial dot products of rows [row0, row0 + count) with x in acc[0, count);
// 1 <= count <= R. The caller reduces acc across the SIMD-group. Lanes walk the input in chunks
// strided by the SIMD-group width, so an input dimension that is not a multiple of 32 chunks just
// leaves some lanes idle at the end.
template <uint BITS, uint R, typename T>
inline void qgemv_rows(QuantMatrix m, uint in_dim, uint row0, uint count, device const T* x,
                       uint lane, thread float* acc) {
  constexpr uint chunk = quant_chunk(BITS);
  for (uint r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint k = lane * chunk; k < in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk<BITS>(x, k, xs);
    for (uint r = 0; r < R; ++r) {
      acc[r] += qdot_chunk<BITS>(m, in_dim, clamped_row(row0, count, r), k, xs, xsum);
    }
  }
}

// An RMSNorm folded into the GEMV that consumes it: y = W (x * rsqrt(mean(x^2) + eps) * gain).
// The inverse RMS is one scalar, so it factors out of every dot product: a lane loads x * gain,
// keeps the sum of x^2 over its chunks, and the finished (SIMD-summed) dot products are scaled by
// `inv_rms_of` the SIMD-summed squares. Every SIMD-group already reads all of x, so the norm
// costs no extra pass and no dispatch of its own; each SIMD-group sums the squares in the same
// order, so all agree.
// The gain is read as vectors as x is in load_chunk (8-byte aligned).
//
// gain_chunk is that step on one chunk of x already loaded as float, with the chunk's gains
// loaded as float (load_gains): every source of a normed GEMV's x (the fp32 residual below, the
// embedding row in embedding.h) goes through it, so they round alike; a verify pass's GEMV loads
// a chunk's gains once for all its tokens.
template <uint BITS>
inline void load_gains(device const bfloat* gain, uint k, thread float* gains) {
  device const bfloat4* gain4 = reinterpret_cast<device const bfloat4*>(gain + k);
  for (uint v = 0; v < quant_chunk(BITS) / 4; ++v) {
    const bfloat4 loaded = gain4[v];
    const float4 widened = float4(loaded);
    for (uint i = 0; i < 4; ++i) gains[4 * v + i] = widened[i];
  }
}

template <uint BITS>
inline float gain_chunk(thread const float* values, thread const float* gains, thread float* xs,
                        thread float& squares) {
  float sum = 0.0f;
  for (uint i = 0; i < quant_chunk(BITS); ++i) {
    const float value = values[i];
    squares += value * value;
    xs[i] = value * gains[i];
    sum += xs[i];
  }
  return sum;
}

// One chunk of an fp32 x (the residual) for a normed GEMV, read as float4 vectors, with the
// chunk's gains already loaded.
template <uint BITS>
inline float load_chunk_gained(device const float* x, thread const float* gains, uint k,
                               thread float* xs, thread float& squares) {
  device const float4* x4 = reinterpret_cast<device const float4*>(x + k);
  float values[quant_chunk(BITS)];
  for (uint v = 0; v < quant_chunk(BITS) / 4; ++v) {
    const float4 loaded = x4[v];
    for (uint i = 0; i < 4; ++i) values[4 * v + i] = loaded[i];
  }
  return gain_chunk<BITS>(values, gains, xs, squares);
}

// The same, loading the chunk's gains.
template <uint BITS>
inline float load_chunk_gained(device const float* x, device const bfloat* gain, uint k,
                               thread float* xs, thread float& squares) {
  float gains[quant_chunk(BITS)];
  load_gains<BITS>(gain, k, gains);
  return load_chunk_gained<BITS>(x, gains, k, xs, squares);
}

// The inverse RMS of x from its sum of squares over the SIMD-group.
inline float inv_rms_of(float sum_of_squares, uint in_dim, float eps) {
  return rsqrt(sum_of_squares / float(in_dim) + eps);
}

// qgemv_rows on x * gain, also returning this lane's sum of x^2 (for inv_rms_of). x is an
// fp32 `device const float*`, or any other source with a load_chunk_gained overload (the
// embedding row, embedding.h).
template <uint BITS, uint R, typename Input>
inline float qgemv_rows_gained(QuantMatrix m, uint in_dim, uint row0, uint count, Input x,
                               device const bfloat* gain, uint lane, thread float* acc) {
  constexpr uint chunk = quant_chunk(BITS);
  for (uint r = 0; r < R; ++r) acc[r] = 0.0f;
  float squares = 0.0f;
  for (uint k = lane * chunk; k < in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk_gained<BITS>(x, gain, k, xs, squares);
    for (uint r = 0; r < R; ++r) {
      acc[r] += qdot_chunk<BITS>(m, in_dim, clamped_row(row0, count, r), k, xs, xsum);
    }
  }
  return squares;
}
