// The quantized GEMM tile of batched prefill: Y_tile = X_tile W_tile^T, with X fp32 row-major
// [tokens, in_dim], W an MLX affine matrix (quantized.h, 4 or 8 bits, groups of 64), Y fp32, and
// fp32 products and sums in simdgroup_matrix<float, 8, 8> fragments.
//
// A threadgroup of four SIMD-groups computes 32 tokens x 128 weight rows, 32 inputs per stage.
// Per stage every thread stages weight row `thread_id`: it reads that row's codes as uint4 (one at
// 4 bits, two at 8), dequantizes them with the row's group scale and bias (32 inputs never
// straddle a group of 64), and writes them to threadgroup memory; the 128 threads also copy the
// 32 x 32 block of X as float4. Each SIMD-group then multiplies all 32 tokens by its own 32 weight
// rows (4 x 4 fragments). The next stage's device loads are issued before this stage's multiplies,
// so they are in flight while the SIMD-groups compute.
//
// Why this shape. An fp32 activation is 8 times the bytes of a 4-bit weight, so the traffic that
// dominates is re-reading X once per weight tile, not re-reading weights once per token tile: per
// multiply-add it is 4/128 bytes of X plus 0.56/32 bytes of weight (codes, scales, biases) here,
// against 4/64 + 0.56/64 for a square 64 x 64 tile. (MLX's qmm_t uses 32 x 32 x 32 with bf16
// operands; the reference engine's Metal 4 path 32 or 64 tokens x 64 x 64.) 32 tokens also suit MoE
// experts, which get about 16 tokens each in a 512-token chunk, without multiplying mostly-empty
// rows. 128 weight rows give each thread exactly one uint4 per stage at 4 bits. 32 inputs per stage
// keep threadgroup memory at (32 + 128) x 36 floats = 22.5 KiB, under the 32 KiB limit with fp32
// staging (bf16 staging would halve it but round the activations to 8 bits of mantissa). Rows are
// padded by 4 floats so that the rows of one fragment fall in different banks.
#pragma once

#include "common.h"
#include "quantized.h"

constexpr constant uint QGEMM_TOKENS = 32;
constexpr constant uint QGEMM_WEIGHT_ROWS = 128;
constexpr constant uint QGEMM_DEPTH = 32;
constexpr constant uint QGEMM_THREADS = 128;  // thread t stages weight row t
constexpr constant uint QGEMM_STAGE_STRIDE = QGEMM_DEPTH + 4;
constexpr constant uint QGEMM_OUT_STRIDE = QGEMM_WEIGHT_ROWS + 4;
// float4 loads of X per thread and stage: 32 rows x 8 float4, strided by the 128 threads.
constexpr constant uint QGEMM_X_LOADS = QGEMM_TOKENS * QGEMM_DEPTH / 4 / QGEMM_THREADS;
// The staged X and W of one stage; the finished Y tile (32 x 132 floats) reuses the same memory.
constexpr constant uint QGEMM_TILE_FLOATS = (QGEMM_TOKENS + QGEMM_WEIGHT_ROWS) * QGEMM_STAGE_STRIDE;
// An X row index meaning "no token here": the staged row is zero and nothing is read.
constexpr constant uint QGEMM_NO_ROW = 0xFFFFFFFFu;

static_assert(QGEMM_TOKENS * QGEMM_OUT_STRIDE <= QGEMM_TILE_FLOATS, "the Y tile reuses the stage");
static_assert(QUANT_GROUP_SIZE % QGEMM_DEPTH == 0, "a stage stays inside one quantization group");

// The X rows thread `thread_id` copies in every stage, as tile rows: thread_id / 8 + 16 i.
inline uint qgemm_x_tile_row(uint thread_id, uint i) {
  return thread_id / (QGEMM_DEPTH / 4) + i * (QGEMM_THREADS / (QGEMM_DEPTH / 4));
}

// One thread's share of one stage, held in registers between its device loads and its
// threadgroup stores.
template <uint BITS>
struct QgemmStage {
  uint4 codes[BITS / 4];  // 32 codes of one weight row
  float scale;
  float bias;
  float4 x[QGEMM_X_LOADS];
};

template <uint BITS>
inline void qgemm_load_stage(thread QgemmStage<BITS>& stage, device const float* x, uint in_dim,
                             thread const uint* x_rows, uint x_col, QuantMatrix w, uint w_row,
                             bool w_valid, uint k0) {
  if (w_valid) {
    const ulong word = ulong(w_row) * (in_dim * BITS / 32) + k0 * BITS / 32;
    device const uint4* codes = reinterpret_cast<device const uint4*>(w.weight + word);
    for (uint v = 0; v < BITS / 4; ++v) stage.codes[v] = codes[v];
    const ulong group = ulong(w_row) * (in_dim / QUANT_GROUP_SIZE) + k0 / QUANT_GROUP_SIZE;
    stage.scale = float(w.scales[group]);
    stage.bias = float(w.biases[group]);
  } else {
    // A row past the matrix's end stages as zeros; its column of Y is never stored.
    for (uint v = 0; v < BITS / 4; ++v) stage.codes[v] = uint4(0u);
    stage.scale = 0.0f;
    stage.bias = 0.0f;
  }
  for (uint i = 0; i < QGEMM_X_LOADS; ++i) {
    stage.x[i] = x_rows[i] == QGEMM_NO_ROW
                     ? float4(0.0f)
                     : *reinterpret_cast<device const float4*>(x + ulong(x_rows[i]) * in_dim + k0 +
                                                               x_col);
  }
}

template <uint BITS>
inline void qgemm_store_stage(thread const QgemmStage<BITS>& stage, threadgroup float* x_tile,
                              threadgroup float* w_tile, uint thread_id, uint x_col) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  threadgroup float4* w_row =
      reinterpret_cast<threadgroup float4*>(w_tile + thread_id * QGEMM_STAGE_STRIDE);
  for (uint v = 0; v < BITS / 4; ++v) {
    for (uint word = 0; word < 4; ++word) {
      const uint packed = stage.codes[v][word];
      for (uint q = 0; q < per_word / 4; ++q) {
        const uint shift = 4 * q * BITS;
        const float4 codes = float4(float((packed >> shift) & mask),
                                    float((packed >> (shift + BITS)) & mask),
                                    float((packed >> (shift + 2 * BITS)) & mask),
                                    float((packed >> (shift + 3 * BITS)) & mask));
        w_row[(v * 4 + word) * (per_word / 4) + q] = codes * stage.scale + stage.bias;
      }
    }
  }
  for (uint i = 0; i < QGEMM_X_LOADS; ++i) {
    *reinterpret_cast<threadgroup float4*>(
        x_tile + qgemm_x_tile_row(thread_id, i) * QGEMM_STAGE_STRIDE + x_col) = stage.x[i];
  }
}

// acc[4 i + j] += X rows [8 i, 8 i + 8) times W rows [32 s + 8 j, 32 s + 8 j + 8) of the stage, for
// SIMD-group s. W is staged row-major, so its fragments load transposed.
inline void qgemm_multiply_stage(threadgroup const float* x_tile, threadgroup const float* w_tile,
                                 uint simdgroup, thread simdgroup_float8x8* acc) {
  threadgroup const float* w_rows = w_tile + simdgroup * 32 * QGEMM_STAGE_STRIDE;
  for (uint step = 0; step < QGEMM_DEPTH; step += 8) {
    simdgroup_float8x8 x_frag[4];
    simdgroup_float8x8 w_frag[4];
    for (uint i = 0; i < 4; ++i) {
      simdgroup_load(x_frag[i], x_tile + i * 8 * QGEMM_STAGE_STRIDE + step, QGEMM_STAGE_STRIDE);
      simdgroup_load(w_frag[i], w_rows + i * 8 * QGEMM_STAGE_STRIDE + step, QGEMM_STAGE_STRIDE,
                     ulong2(0, 0), true);
    }
    for (uint i = 0; i < 4; ++i)
      for (uint j = 0; j < 4; ++j)
        simdgroup_multiply_accumulate(acc[4 * i + j], x_frag[i], w_frag[j], acc[4 * i + j]);
  }
}

// Computes the tile and leaves it in `tile` (QGEMM_TILE_FLOATS floats of threadgroup memory) as
// Y[token][weight row] with row stride QGEMM_OUT_STRIDE, visible to every thread on return.
//   x_rows[i]: the row of x staged as tile row qgemm_x_tile_row(thread_id, i), or QGEMM_NO_ROW;
//   w, w_row, w_valid: the matrix and row this thread stages as tile row thread_id.
// Call from uniform control flow with all QGEMM_THREADS threads.
template <uint BITS>
inline void qgemm_tile(device const float* x, uint in_dim, thread const uint* x_rows, QuantMatrix w,
                       uint w_row, bool w_valid, threadgroup float* tile, uint thread_id,
                       uint simdgroup) {
  threadgroup float* x_tile = tile;
  threadgroup float* w_tile = tile + QGEMM_TOKENS * QGEMM_STAGE_STRIDE;
  const uint x_col = (thread_id % (QGEMM_DEPTH / 4)) * 4;

  simdgroup_float8x8 acc[16];
  for (uint f = 0; f < 16; ++f) acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  QgemmStage<BITS> stage;
  qgemm_load_stage<BITS>(stage, x, in_dim, x_rows, x_col, w, w_row, w_valid, 0);
  for (uint k0 = 0; k0 < in_dim; k0 += QGEMM_DEPTH) {
    qgemm_store_stage<BITS>(stage, x_tile, w_tile, thread_id, x_col);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (k0 + QGEMM_DEPTH < in_dim) {
      qgemm_load_stage<BITS>(stage, x, in_dim, x_rows, x_col, w, w_row, w_valid,
                             k0 + QGEMM_DEPTH);
    }
    qgemm_multiply_stage(x_tile, w_tile, simdgroup, acc);
    // The next stage (or the Y tile) overwrites what other SIMD-groups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint i = 0; i < 4; ++i)
    for (uint j = 0; j < 4; ++j)
      simdgroup_store(acc[4 * i + j], tile + i * 8 * QGEMM_OUT_STRIDE + simdgroup * 32 + j * 8,
                      QGEMM_OUT_STRIDE);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
