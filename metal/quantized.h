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
template <uint BITS, typename T>
inline float load_chunk(device const T* x, uint k, thread float* xs) {
  float sum = 0.0f;
  for (uint i = 0; i < quant_chunk(BITS); ++i) {
    xs[i] = float(x[k + i]);
    sum += xs[i];
  }
  return sum;
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

// This lane's partial dot products of rows [row0, row0 + count) with x; count <= R. The caller
// reduces acc across the SIMD-group. Lanes walk the input in chunks strided by the SIMD-group width,
// so an input dimension that is not a multiple of 32 chunks just leaves some lanes idle at the end.
template <uint BITS, uint R, typename T>
inline void qgemv_rows(QuantMatrix m, uint in_dim, uint row0, uint count, device const T* x,
                       uint lane, thread float* acc) {
  constexpr uint chunk = quant_chunk(BITS);
  for (uint r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint k = lane * chunk; k < in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk<BITS>(x, k, xs);
    for (uint r = 0; r < count; ++r) acc[r] += qdot_chunk<BITS>(m, in_dim, row0 + r, k, xs, xsum);
  }
}

// An RMSNorm folded into the GEMV that consumes it: y = W (x * rsqrt(mean(x^2) + eps) * gain).
// The inverse RMS is one scalar, so it factors out of every dot product: a lane loads x * gain,
// keeps the sum of x^2 over its chunks, and the finished (SIMD-summed) dot products are scaled by
// `folded_inv_rms`. Every SIMD-group already reads all of x, so the norm costs no extra pass and
// no dispatch of its own; each SIMD-group sums the squares in the same order, so all agree.
template <uint BITS>
inline float load_chunk_gained(device const float* x, device const bfloat* gain, uint k,
                               thread float* xs, thread float& squares) {
  float sum = 0.0f;
  for (uint i = 0; i < quant_chunk(BITS); ++i) {
    const float v = x[k + i];
    squares += v * v;
    xs[i] = v * float(gain[k + i]);
    sum += xs[i];
  }
  return sum;
}

// The inverse RMS of x from one lane's partial sum of squares; all lanes of the SIMD-group call it.
inline float folded_inv_rms(float squares, uint in_dim, float eps) {
  return rsqrt(simd_sum(squares) / float(in_dim) + eps);
}

// qgemv_rows on x * gain, also returning this lane's sum of x^2 (for folded_inv_rms).
template <uint BITS, uint R>
inline float qgemv_rows_gained(QuantMatrix m, uint in_dim, uint row0, uint count,
                               device const float* x, device const bfloat* gain, uint lane,
                               thread float* acc) {
  constexpr uint chunk = quant_chunk(BITS);
  for (uint r = 0; r < R; ++r) acc[r] = 0.0f;
  float squares = 0.0f;
  for (uint k = lane * chunk; k < in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk_gained<BITS>(x, gain, k, xs, squares);
    for (uint r = 0; r < count; ++r) acc[r] += qdot_chunk<BITS>(m, in_dim, row0 + r, k, xs, xsum);
  }
  return squares;
}
