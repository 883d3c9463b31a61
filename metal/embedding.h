// The embedding row of a token, the parts shared by the embedding lookup (embedding.metal) and by
// the decode step's first GEMV, which reads the row straight from the quantized table
// (qgemv_embedded in quantized_gemv.metal) instead of from a residual the lookup wrote.
#pragma once

#include "common.h"
#include "quantized.h"

// The table row of a token id. An id past the table would read outside it; the engine only
// produces ids below vocab_size, so this only keeps a broken id inside the buffer.
inline uint embedding_row(uint token, uint rows) { return min(token, rows - 1); }

// A GEMV's x as row `row` of an MLX-quantized embedding table of EMBED_BITS codes
// (`[rows, dim * EMBED_BITS / 32]` words, bf16 scales and biases per group of 64). When
// `writes_residual`, the loads also store the dequantized inputs to `residual` (fp32 [dim]).
template <uint EMBED_BITS>
struct EmbeddedRow {
  QuantMatrix table;
  uint dim;
  uint row;
  device float* residual;
  bool writes_residual;
};

// One chunk of the embedding row for a normed GEMV of BITS codes, as load_chunk_gained of an fp32
// x holding the row: the chunk [k, k + 128 / BITS) lies inside one group of 64, so one scale and
// bias apply; its EMBED_BITS codes are 2, 4 or 8 words, read as uint2 (8-byte aligned: rows and
// chunks are whole multiples of two words).
template <uint BITS, uint EMBED_BITS>
inline float load_chunk_gained(EmbeddedRow<EMBED_BITS> x, device const bfloat* gain, uint k,
                               thread float* xs, thread float& squares) {
  constexpr uint chunk = quant_chunk(BITS);
  constexpr uint per_word = 32 / EMBED_BITS;
  const ulong word = ulong(x.row) * (x.dim / per_word) + k / per_word;
  const ulong group = ulong(x.row) * (x.dim / QUANT_GROUP_SIZE) + k / QUANT_GROUP_SIZE;
  const float scale = float(x.table.scales[group]);
  const float bias = float(x.table.biases[group]);
  device const uint2* codes = reinterpret_cast<device const uint2*>(x.table.weight + word);
  float values[chunk];
  for (uint pair = 0; pair < chunk / per_word / 2; ++pair) {
    const uint2 packed = codes[pair];
    for (uint w = 0; w < 2; ++w) {
      for (uint j = 0; j < per_word; ++j) {
        values[(2 * pair + w) * per_word + j] =
            dequantize_code<EMBED_BITS>(packed[w], j, scale, bias);
      }
    }
  }
  if (x.writes_residual) {
    device float4* out = reinterpret_cast<device float4*>(x.residual + k);
    for (uint v = 0; v < chunk / 4; ++v) {
      out[v] = float4(values[4 * v], values[4 * v + 1], values[4 * v + 2], values[4 * v + 3]);
    }
  }
  float gains[chunk];
  load_gains<BITS>(gain, k, gains);
  return gain_chunk<BITS>(values, gains, xs, squares);
}
