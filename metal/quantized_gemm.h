// The quantized GEMM tile of batched prefill: Y_tile = X_tile W_tile^T, with X fp32 row-major
// [tokens, in_dim], W an MLX affine matrix (quantized.h, 4 or 8 bits, groups of 64), Y fp32.
// Operands are staged in threadgroup memory as T (fp32, bfloat or half) and multiplied in
// simdgroup_matrix<T, 8, 8> fragments into fp32 accumulators (simdgroup_float8x8).
//
// A threadgroup of four SIMD-groups computes TOKENS (8, 16, 32 or 64) tokens x 128 weight rows,
// 32 inputs per stage. Per stage every thread stages weight row `thread_id`: it reads that row's
// codes as uint4 (one at 4 bits, two at 8), dequantizes them with the row's group scale and bias
// (32 inputs never straddle a group of 64) as one fma in fp32, and writes them as a vector of 4
// T; the threads also copy the TOKENS x 32 block of X (float4 loads). Each SIMD-group multiplies
// all TOKENS tokens by its own 32 weight rows (TOKENS / 8 x 4 fragments). The next stage's device
// loads are issued before this stage's multiplies, so they are in flight while the SIMD-groups
// compute. Results go from the accumulators straight to device memory (each lane holds 2
// adjacent columns of one row of each fragment), so Y needs no threadgroup memory.
//
// 2-byte operands are double-buffered: the next stage is written to the other half of the
// staging memory while this one is multiplied, one barrier per stage (a buffer is overwritten two
// stages later, after the barrier that follows every SIMD-group's multiplies of it); at 64 tokens
// the two stages take 2 x 192 rows x 40 x 2 bytes = 30 KiB. fp32 operands take one stage (27 KiB at
// 64 tokens) and two barriers per stage.
//
// Why 2-byte operands are not used yet: bfloat's 8-bit significand moves the tiny models'
// prefill logits by 2e-2 to 5e-2 from the float64 reference, over the engine tests' 1e-2, where
// fp32 operands stay within 5e-5 and half ones within 4e-3 (docs/benchmarks.md). But half
// overflows past 65504, which the inputs of the down and output projections (the SwiGLU hidden
// state, attention and GDN outputs) are not bounded by in this model; only the normed inputs are
// (at most sqrt(in_dim) times the largest gain). Half with a range guard for those inputs (a
// power-of-two scale per row) is the next step; bfloat has fp32's range but not the accuracy.
//
// Why tokens x 128 weight rows: an fp32 activation is 8 times the bytes of a 4-bit weight, so the
// traffic that dominates is re-reading X once per weight tile; 128 weight rows give each thread
// exactly one uint4 of codes per stage at 4 bits. The token count is the caller's choice: the
// dense GEMMs take 64 (fewer for chunks of fewer tokens), the MoE experts a size per expert from
// its token count (quantized_gemm.metal), so that few tokens do not multiply mostly-empty rows.
#pragma once

#include "common.h"
#include "quantized.h"

constexpr constant uint QGEMM_MAX_TOKENS = 64;
constexpr constant uint QGEMM_WEIGHT_ROWS = 128;
constexpr constant uint QGEMM_DEPTH = 32;
constexpr constant uint QGEMM_THREADS = 128;  // thread t stages weight row t
// An X row index meaning "no token here": the staged row is zero and nothing is read.
constexpr constant uint QGEMM_NO_ROW = 0xFFFFFFFFu;

static_assert(QUANT_GROUP_SIZE % QGEMM_DEPTH == 0, "a stage stays inside one quantization group");

// A staged row: 32 operands plus padding, so that the 8 rows one fragment load reads start in
// different banks (36 floats: 4 words apart; 40 bfloat, 80 bytes: 20 words apart, 8 distinct
// groups of 4 banks); both keep every row 16-byte aligned.
template <typename T>
constexpr uint qgemm_stage_stride() { return sizeof(T) == 4 ? QGEMM_DEPTH + 4 : QGEMM_DEPTH + 8; }

// float4 loads of X per thread and stage (tokens x 8 of them); at 8 tokens half the threads load
// one and the other half none.
constexpr uint qgemm_x_loads(uint tokens) { return tokens >= 16 ? tokens / 16 : 1; }
// Two-byte operands are double-buffered; fp32 ones are not (two stages of 64 + 128 rows would
// take 54 KiB).
template <typename T>
constexpr uint qgemm_stages() { return sizeof(T) == 4 ? 1 : 2; }
// One stage of a tile of `tokens` tokens, and all stages' threadgroup memory, in elements of T.
template <typename T>
constexpr uint qgemm_stage_elements(uint tokens) {
  return (tokens + QGEMM_WEIGHT_ROWS) * qgemm_stage_stride<T>();
}
template <typename T>
constexpr uint qgemm_tile_elements(uint tokens) {
  return qgemm_stages<T>() * qgemm_stage_elements<T>(tokens);
}
static_assert(qgemm_tile_elements<float>(QGEMM_MAX_TOKENS) * 4 <= 32 * 1024, "fits in 32 KiB");
static_assert(qgemm_tile_elements<bfloat>(QGEMM_MAX_TOKENS) * 2 <= 32 * 1024, "fits in 32 KiB");

// Four inputs or weights as the staged operand type T (the second argument only picks it).
inline float4 qgemm_operands(float4 v, float) { return v; }
inline bfloat4 qgemm_operands(float4 v, bfloat) { return bfloat4(v); }
inline half4 qgemm_operands(float4 v, half) { return half4(v); }

// The X tile row thread `thread_id` copies as its i-th load in every stage: thread_id / 8 + 16 i;
// rows at or past TOKENS are nobody's (8-token tiles).
inline uint qgemm_x_tile_row(uint thread_id, uint i) {
  return thread_id / (QGEMM_DEPTH / 4) + i * (QGEMM_THREADS / (QGEMM_DEPTH / 4));
}

// One thread's share of one stage, held in registers between its device loads and its
// threadgroup stores.
template <uint BITS, uint TOKENS>
struct QgemmStage {
  static_assert(TOKENS == 8 || TOKENS == 16 || TOKENS == 32 || TOKENS == 64, "8 to 64 tokens");
  uint4 codes[BITS / 4];  // 32 codes of one weight row
  float scale;
  float bias;
  float4 x[qgemm_x_loads(TOKENS)];
};

template <uint BITS, uint TOKENS>
inline void qgemm_load_stage(thread QgemmStage<BITS, TOKENS>& stage, device const float* x,
                             uint in_dim, thread const uint* x_rows, uint x_col, QuantMatrix w,
                             uint w_row, bool w_valid, uint k0) {
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
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    stage.x[i] = x_rows[i] == QGEMM_NO_ROW
                     ? float4(0.0f)
                     : *reinterpret_cast<device const float4*>(x + ulong(x_rows[i]) * in_dim + k0 +
                                                               x_col);
  }
}

template <typename T, uint BITS, uint TOKENS>
inline void qgemm_store_stage(thread const QgemmStage<BITS, TOKENS>& stage,
                              threadgroup T* x_tile, threadgroup T* w_tile, uint thread_id,
                              uint x_col) {
  constexpr uint stride = qgemm_stage_stride<T>();
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  threadgroup vec<T, 4>* w_row =
      reinterpret_cast<threadgroup vec<T, 4>*>(w_tile + thread_id * stride);
  const float4 scale = float4(stage.scale);
  const float4 bias = float4(stage.bias);
  for (uint v = 0; v < BITS / 4; ++v) {
    for (uint word = 0; word < 4; ++word) {
      const uint packed = stage.codes[v][word];
      for (uint q = 0; q < per_word / 4; ++q) {
        const uint shift = 4 * q * BITS;
        const float4 codes = float4(float((packed >> shift) & mask),
                                    float((packed >> (shift + BITS)) & mask),
                                    float((packed >> (shift + 2 * BITS)) & mask),
                                    float((packed >> (shift + 3 * BITS)) & mask));
        // One rounding to fp32 (the fma), then to T: what the tests' references model.
        w_row[(v * 4 + word) * (per_word / 4) + q] = qgemm_operands(fma(codes, scale, bias), T());
      }
    }
  }
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    const uint row = qgemm_x_tile_row(thread_id, i);
    if (row < TOKENS) {
      *reinterpret_cast<threadgroup vec<T, 4>*>(x_tile + row * stride + x_col) =
          qgemm_operands(stage.x[i], T());
    }
  }
}

// acc[4 i + j] += X rows [8 i, 8 i + 8) times W rows [32 s + 8 j, 32 s + 8 j + 8) of the stage, for
// SIMD-group s. W is staged row-major, so its fragments load transposed.
template <typename T, uint TOKENS>
inline void qgemm_multiply_stage(threadgroup const T* x_tile, threadgroup const T* w_tile,
                                 uint simdgroup, thread simdgroup_float8x8* acc) {
  constexpr uint stride = qgemm_stage_stride<T>();
  threadgroup const T* w_rows = w_tile + simdgroup * 32 * stride;
  for (uint step = 0; step < QGEMM_DEPTH; step += 8) {
    simdgroup_matrix<T, 8, 8> w_frag[4];
    for (uint j = 0; j < 4; ++j)
      simdgroup_load(w_frag[j], w_rows + j * 8 * stride + step, stride, ulong2(0, 0), true);
    for (uint i = 0; i < TOKENS / 8; ++i) {
      simdgroup_matrix<T, 8, 8> x_frag;
      simdgroup_load(x_frag, x_tile + i * 8 * stride + step, stride);
      for (uint j = 0; j < 4; ++j)
        simdgroup_multiply_accumulate(acc[4 * i + j], x_frag, w_frag[j], acc[4 * i + j]);
    }
  }
}

// Computes the tile into acc[4 i + j]: tokens [8 i, 8 i + 8) x tile weight rows
// [32 s + 8 j, 32 s + 8 j + 8) for SIMD-group s (lane l holds row qgemm_fragment_row(l), columns
// qgemm_fragment_col(l) and the one after).
//   x_rows[i]: the row of x staged as tile row qgemm_x_tile_row(thread_id, i), or QGEMM_NO_ROW;
//   w, w_row, w_valid: the matrix and row this thread stages as tile row thread_id;
//   tile: qgemm_tile_elements(TOKENS) of threadgroup memory.
// Call from uniform control flow with all QGEMM_THREADS threads. On return other SIMD-groups may
// still read `tile`: a caller reusing it needs a barrier first.
template <typename T, uint BITS, uint TOKENS>
inline void qgemm_tile(device const float* x, uint in_dim, thread const uint* x_rows,
                       QuantMatrix w, uint w_row, bool w_valid, threadgroup T* tile,
                       uint thread_id, uint simdgroup, thread simdgroup_float8x8* acc) {
  constexpr uint stage_elements = qgemm_stage_elements<T>(TOKENS);
  constexpr uint w_offset = TOKENS * qgemm_stage_stride<T>();
  constexpr bool double_buffered = qgemm_stages<T>() == 2;
  const uint x_col = (thread_id % (QGEMM_DEPTH / 4)) * 4;
  for (uint f = 0; f < TOKENS / 2; ++f) acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  QgemmStage<BITS, TOKENS> stage;
  qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_col, w, w_row, w_valid, 0);
  qgemm_store_stage<T, BITS, TOKENS>(stage, tile, tile + w_offset, thread_id, x_col);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint current = 0;
  for (uint k0 = 0; k0 < in_dim; k0 += QGEMM_DEPTH) {
    const bool more = k0 + QGEMM_DEPTH < in_dim;
    if (more) {
      qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_col, w, w_row, w_valid,
                                     k0 + QGEMM_DEPTH);
    }
    threadgroup const T* staged = tile + current * stage_elements;
    qgemm_multiply_stage<T, TOKENS>(staged, staged + w_offset, simdgroup, acc);
    if (more) {
      // Single-buffered, the stage is overwritten only once every SIMD-group has multiplied it.
      if (!double_buffered) threadgroup_barrier(mem_flags::mem_threadgroup);
      const uint next = double_buffered ? 1 - current : current;
      threadgroup T* target = tile + next * stage_elements;
      qgemm_store_stage<T, BITS, TOKENS>(stage, target, target + w_offset, thread_id, x_col);
      current = next;
    }
    // The next stage is visible. Double-buffered, the one just multiplied is overwritten only
    // after the next barrier.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Where lane `lane` holds its 2 elements of an 8x8 fragment (Apple's layout).
inline uint qgemm_fragment_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint qgemm_fragment_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }
