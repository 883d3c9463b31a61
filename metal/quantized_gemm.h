// The quantized GEMM tile of batched prefill: Y_tile = X_tile W_tile^T, with X fp32 row-major
// [tokens, in_dim], W an MLX affine matrix (quantized.h, 4 or 8 bits, groups of 64), Y fp32.
// Operands are staged in threadgroup memory as half and multiplied in simdgroup_half8x8
// fragments into fp32 accumulators (simdgroup_float8x8): each product of two halves is exact in
// fp32, so the only roundings are the operands' (11 significant bits) and the fp32 sums.
//
// A threadgroup of four SIMD-groups computes TOKENS (8, 16, 32 or 64) tokens x 128 weight rows,
// 32 inputs per stage. Per stage every thread stages weight row `thread_id`: it reads that row's
// codes as uint4 (one at 4 bits, two at 8), dequantizes them with the row's group scale and bias
// (32 inputs never straddle a group of 64) as one fma in fp32, and writes them as a half4; the
// threads also copy the TOKENS x 32 block of X (float4 loads). Each SIMD-group multiplies all
// TOKENS tokens by its own 32 weight rows (TOKENS / 8 x 4 fragments). The next stage's device
// loads are issued before this stage's multiplies, so they are in flight while the SIMD-groups
// compute. Results go from the accumulators straight to device memory (each lane holds 2
// adjacent columns of one row of each fragment), so Y needs no threadgroup memory.
//
// Stages are double-buffered: the next stage is written to the other half of the staging memory
// while this one is multiplied, one barrier per stage (a buffer is overwritten two stages later,
// after the barrier that follows every SIMD-group's multiplies of it); at 64 tokens the two
// stages take 2 x 192 rows x 40 x 2 bytes = 30 KiB.
//
// Why half, and the range guard. Half's 11-bit significand keeps the tiny models' prefill logits
// within 1.4e-3..4.2e-3 of the float64 reference (the engine tests allow 1e-2), where bfloat's 8
// bits move them 1.7e-2..4.7e-2 (docs/benchmarks.md, benchmarks/gemm_operands_study.py); a token
// whose k-th and next expert are within the logits' error of a tie may be routed either way,
// which moved one prompt's logits by 4e-2 (with fp32 operands only in the router, 5e-2). But half
// ends at 65504. The normed inputs (of the input projections, the router, the experts' gate/up)
// are bounded: an RMSNorm's output is at most sqrt(in_dim) times its largest gain. The others (the
// SwiGLU hidden state the down projections read, the attention and GDN outputs o_proj and out_proj
// read) are not, so for them the GEMM takes a power-of-two exponent e per row of X
// (qgemm_row_exponents, a pass of its own before the GEMM): it stages X_row * 2^-e as half and
// multiplies the fp32 result row by 2^e. Scaling by a power of two is exact (barring fp32
// under/overflow, which the limits below rule out), and rounding to half commutes with it for
// every element that stays a normal half, so a guarded row is as accurate as an unguarded one in
// range; e puts the row's largest |x| in [2^8, 2^9), far below 65504 (no product or partial sum
// is ever held in half: the accumulators are fp32) and far above half's smallest normal, so only
// elements below 2^-22 of the row's largest become subnormal. Rows of zeros keep e = 0, and so
// do rows holding an inf (whose products propagate it as they would unguarded); a NaN is ignored
// by the max, and its products propagate it whatever e is.
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
// A guarded row's largest |x| * 2^-e lies in [2^QGEMM_ROW_TOP, 2^(QGEMM_ROW_TOP + 1)).
constexpr constant int QGEMM_ROW_TOP = 8;
// |e| is at most this, so 2^e and 2^-e are normal floats (rows past 2^80 would still overflow).
constexpr constant int QGEMM_ROW_EXPONENT_LIMIT = 64;

static_assert(QUANT_GROUP_SIZE % QGEMM_DEPTH == 0, "a stage stays inside one quantization group");

// The dense GEMMs' launch order. Their grid is (token tiles, weight tiles) and threadgroups
// usually start in x-major order, so the token tiles of one weight tile run side by side: the
// weights come from memory about once per chunk, but every weight tile streams all of X again
// (32 MiB of fp32 at 4,096 tokens x 2048, more than a GPU's L2 holds). Threadgroup (x, y) instead
// computes the tile qgemm_band_tile gives it: the token tiles go in bands of QGEMM_BAND_TOKENS
// rows, and within a band every weight tile in turn, the band's token tiles side by side. X is
// then read from memory about once (a band is 8 MiB of fp32) and the weights once per band:
// 0.8 GB per band for the real model's projections, at most 4 times per 4,096-token chunk. A
// chunk of one band or less keeps the x-major order exactly.
constexpr constant uint QGEMM_BAND_TOKENS = 1024;

// The (token tile, weight tile) that threadgroup `tile_id` of a grid of `tiles` computes: a
// permutation of the grid, the identity when tiles.x fits in one band.
template <uint TOKENS>
inline uint2 qgemm_band_tile(uint2 tile_id, uint2 tiles) {
  constexpr uint band = QGEMM_BAND_TOKENS / TOKENS;
  static_assert(band * TOKENS == QGEMM_BAND_TOKENS, "whole token tiles per band");
  const uint launched = tile_id.y * tiles.x + tile_id.x;
  const uint first = launched / (band * tiles.y) * band;  // the band's first token tile
  const uint width = min(band, tiles.x - first);          // the last band may be narrower
  const uint in_band = launched - first * tiles.y;
  return uint2(first + in_band % width, in_band / width);
}

// A staged row: 32 halves plus 8 of padding (80 bytes: 20 words apart, so the 8 rows one fragment
// load reads start in 8 distinct groups of 4 banks), which keeps every row 16-byte aligned.
constexpr constant uint QGEMM_STAGE_STRIDE = QGEMM_DEPTH + 8;
constexpr constant uint QGEMM_STAGES = 2;

// float4 loads of X per thread and stage (tokens x 8 of them); at 8 tokens half the threads load
// one and the other half none.
constexpr uint qgemm_x_loads(uint tokens) { return tokens >= 16 ? tokens / 16 : 1; }
// One stage of a tile of `tokens` tokens, and both stages' threadgroup memory, in halves.
constexpr uint qgemm_stage_elements(uint tokens) {
  return (tokens + QGEMM_WEIGHT_ROWS) * QGEMM_STAGE_STRIDE;
}
constexpr uint qgemm_tile_elements(uint tokens) {
  return QGEMM_STAGES * qgemm_stage_elements(tokens);
}
static_assert(qgemm_tile_elements(QGEMM_MAX_TOKENS) * 2 <= 32 * 1024, "fits in 32 KiB");

// 2^e for |e| <= 126, built from its bits: exact, where exp2 under fast math need not be.
inline float qgemm_power_of_two(int e) { return as_type<float>(uint(127 + e) << 23); }

// The range guard's exponent of a row whose largest |x| is `largest` (>= 0; inf or NaN give 0).
inline int qgemm_row_exponent(float largest) {
  const int biased = int((as_type<uint>(largest) >> 23) & 0xFFu);
  // 0: zeros or fp32 subnormals, which round to half's zero either way; 255: inf or NaN.
  if (biased == 0 || biased == 255) return 0;
  return clamp(biased - 127 - QGEMM_ROW_TOP, -QGEMM_ROW_EXPONENT_LIMIT, QGEMM_ROW_EXPONENT_LIMIT);
}

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

// x_rows[i], x_down[i]: the row of x this thread's i-th load reads (or QGEMM_NO_ROW) and the
// factor 2^-e its values are staged with (1 for unguarded inputs).
template <uint BITS, uint TOKENS>
inline void qgemm_load_stage(thread QgemmStage<BITS, TOKENS>& stage, device const float* x,
                             uint in_dim, thread const uint* x_rows, thread const float* x_down,
                             uint x_col, QuantMatrix w, uint w_row, bool w_valid, uint k0) {
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
                     : x_down[i] * *reinterpret_cast<device const float4*>(
                                       x + ulong(x_rows[i]) * in_dim + k0 + x_col);
  }
}

// STRIDE: halves from one staged row to the next (the tensor-op kernels stage two stages side
// by side in rows of 64).
template <uint BITS, uint TOKENS, uint STRIDE = QGEMM_STAGE_STRIDE>
inline void qgemm_store_stage(thread const QgemmStage<BITS, TOKENS>& stage,
                              threadgroup half* x_tile, threadgroup half* w_tile, uint thread_id,
                              uint x_col) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  threadgroup half4* w_row =
      reinterpret_cast<threadgroup half4*>(w_tile + thread_id * STRIDE);
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
        // One rounding to fp32 (the fma), then to half: what the tests' references model.
        w_row[(v * 4 + word) * (per_word / 4) + q] = half4(fma(codes, scale, bias));
      }
    }
  }
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    const uint row = qgemm_x_tile_row(thread_id, i);
    if (row < TOKENS) {
      *reinterpret_cast<threadgroup half4*>(x_tile + row * STRIDE + x_col) =
          half4(stage.x[i]);
    }
  }
}

// acc[4 i + j] += X rows [8 i, 8 i + 8) times W rows [32 s + 8 j, 32 s + 8 j + 8) of the stage, for
// SIMD-group s. W is staged row-major, so its fragments load transposed.
template <uint TOKENS>
inline void qgemm_multiply_stage(threadgroup const half* x_tile, threadgroup const half* w_tile,
                                 uint simdgroup, thread simdgroup_float8x8* acc) {
  constexpr uint stride = QGEMM_STAGE_STRIDE;
  threadgroup const half* w_rows = w_tile + simdgroup * 32 * stride;
  for (uint step = 0; step < QGEMM_DEPTH; step += 8) {
    simdgroup_half8x8 w_frag[4];
    for (uint j = 0; j < 4; ++j)
      simdgroup_load(w_frag[j], w_rows + j * 8 * stride + step, stride, ulong2(0, 0), true);
    for (uint i = 0; i < TOKENS / 8; ++i) {
      simdgroup_half8x8 x_frag;
      simdgroup_load(x_frag, x_tile + i * 8 * stride + step, stride);
      for (uint j = 0; j < 4; ++j)
        simdgroup_multiply_accumulate(acc[4 * i + j], x_frag, w_frag[j], acc[4 * i + j]);
    }
  }
}

// Computes the tile into acc[4 i + j]: tokens [8 i, 8 i + 8) x tile weight rows
// [32 s + 8 j, 32 s + 8 j + 8) for SIMD-group s (lane l holds row fragment_row(l), columns
// fragment_col(l) and the one after: common.h), in units of 2^e of each row's guard (the caller
// multiplies them back).
//   x_rows[i], x_down[i]: the row of x staged as tile row qgemm_x_tile_row(thread_id, i), or
//     QGEMM_NO_ROW, and its factor 2^-e (1 unguarded);
//   w, w_row, w_valid: the matrix and row this thread stages as tile row thread_id;
//   tile: qgemm_tile_elements(TOKENS) of threadgroup memory.
// Call from uniform control flow with all QGEMM_THREADS threads. On return other SIMD-groups may
// still read `tile`: a caller reusing it needs a barrier first.
template <uint BITS, uint TOKENS>
inline void qgemm_tile(device const float* x, uint in_dim, thread const uint* x_rows,
                       thread const float* x_down, QuantMatrix w, uint w_row, bool w_valid,
                       threadgroup half* tile, uint thread_id, uint simdgroup,
                       thread simdgroup_float8x8* acc) {
  constexpr uint stage_elements = qgemm_stage_elements(TOKENS);
  constexpr uint w_offset = TOKENS * QGEMM_STAGE_STRIDE;
  const uint x_col = (thread_id % (QGEMM_DEPTH / 4)) * 4;
  for (uint f = 0; f < TOKENS / 2; ++f) acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  QgemmStage<BITS, TOKENS> stage;
  qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_down, x_col, w, w_row, w_valid, 0);
  qgemm_store_stage<BITS, TOKENS>(stage, tile, tile + w_offset, thread_id, x_col);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint current = 0;
  for (uint k0 = 0; k0 < in_dim; k0 += QGEMM_DEPTH) {
    const bool more = k0 + QGEMM_DEPTH < in_dim;
    if (more) {
      qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_down, x_col, w, w_row, w_valid,
                                     k0 + QGEMM_DEPTH);
    }
    threadgroup const half* staged = tile + current * stage_elements;
    qgemm_multiply_stage<TOKENS>(staged, staged + w_offset, simdgroup, acc);
    if (more) {
      const uint next = 1 - current;
      threadgroup half* target = tile + next * stage_elements;
      qgemm_store_stage<BITS, TOKENS>(stage, target, target + w_offset, thread_id, x_col);
      current = next;
    }
    // The next stage is visible; the one just multiplied is overwritten only after the next
    // barrier.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// ---- shared by the simdgroup-matrix kernels (quantized_gemm.metal) and the tensor-op ones
// (quantized_gemm_tensor_ops.metal) ----

constexpr constant uint QGEMM_MAX_PROJECTIONS = 4;

struct QGemmParams {
  uint in_dim;
  uint tokens;
  uint x_guarded;  // 1: x row r is staged times 2^-x_exponents[r], its outputs times 2^e
  uint projections;
  uint rows[QGEMM_MAX_PROJECTIONS];
  uint first_tile[QGEMM_MAX_PROJECTIONS];
};

// The factors this thread's i-th X load is staged with: 2^-e of its row's guard, 1 unguarded
// or for no row.
template <uint TOKENS>
inline void qgemm_x_down(device const int* x_exponents, bool guarded, thread const uint* x_rows,
                         thread float* x_down) {
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    x_down[i] = guarded && x_rows[i] != QGEMM_NO_ROW
                    ? qgemm_power_of_two(-x_exponents[x_rows[i]])
                    : 1.0f;
  }
}

struct QGemmGroupedParams {
  uint in_dim;
  uint rows;             // output rows of one expert's weight
  uint experts;
  uint max_assignments;  // rows of out; offsets past it are clamped to it
  uint gather;           // 1: assignment a reads x row row_index[a]; 0: x row a
  uint x_guarded;        // 1: x row r is staged times 2^-x_exponents[r], its outputs times 2^e
};

// The sorted assignments a threadgroup multiplies: [first, first + count) of `expert`, in a tile
// of `tokens` rows.
struct QGemmGroupedTile {
  uint expert;
  uint first;
  uint count;   // 0: the tile index is past the last non-empty tile
  uint tokens;  // 8, 16, 32 or 64
};

// An expert's n assignments are cut into tiles sized by n: n / 64 tiles of 64, then the rest
// rounded up to a multiple of 8 (r8, 8 to 64) as one tile of 64 when r8 is 64, else one tile of
// each of 32, 16 and 8 its binary digits name, largest first. So an expert executes at most 7
// rows more than it has assignments, and never more than 3 tiles smaller than 64.
inline uint qgemm_rest_rows(uint assignments) {
  return ((assignments % QGEMM_MAX_TOKENS + 7) / 8) * 8;
}
inline uint qgemm_expert_tiles(uint assignments) {
  const uint rest = qgemm_rest_rows(assignments);
  return assignments / QGEMM_MAX_TOKENS + (rest == QGEMM_MAX_TOKENS ? 1u : popcount(rest / 8));
}

// Which (expert, tile) the tile index `tile_index` is, counting the tiles of experts 0, 1, ... in
// order. One SIMD-group: lane l sums the tile counts of a contiguous run of experts, a prefix sum
// over lanes places the runs, and the one lane whose run holds the tile walks it. Only
// expert_offsets is read, never the weights of an expert with no assignment.
inline QGemmGroupedTile qgemm_find_tile(device const uint* expert_offsets, uint experts,
                                        uint max_assignments, uint tile_index, uint lane) {
  const uint per_lane = (experts + SIMD_WIDTH - 1) / SIMD_WIDTH;
  const uint begin = min(lane * per_lane, experts);
  const uint end = min(begin + per_lane, experts);
  uint lane_tiles = 0;
  uint lo = min(expert_offsets[begin], max_assignments);
  for (uint e = begin; e < end; ++e) {
    const uint hi = min(expert_offsets[e + 1], max_assignments);
    lane_tiles += hi > lo ? qgemm_expert_tiles(hi - lo) : 0;
    lo = hi;
  }
  const uint before = simd_prefix_exclusive_sum(lane_tiles);

  QGemmGroupedTile found{0, 0, 0, 0};
  if (before <= tile_index && tile_index < before + lane_tiles) {
    uint tiles_before = before;
    lo = min(expert_offsets[begin], max_assignments);
    for (uint e = begin; e < end; ++e) {
      const uint hi = min(expert_offsets[e + 1], max_assignments);
      const uint n = hi > lo ? hi - lo : 0;
      const uint tiles = n > 0 ? qgemm_expert_tiles(n) : 0;
      if (tile_index < tiles_before + tiles) {
        uint local = tile_index - tiles_before;
        uint start = 0;
        uint tokens = QGEMM_MAX_TOKENS;
        const uint full = n / QGEMM_MAX_TOKENS;
        if (local < full) {
          start = local * QGEMM_MAX_TOKENS;
        } else {
          local -= full;
          start = full * QGEMM_MAX_TOKENS;
          const uint rest = qgemm_rest_rows(n);
          if (rest != QGEMM_MAX_TOKENS) {
            for (tokens = QGEMM_MAX_TOKENS / 2; tokens >= 8; tokens /= 2) {
              if ((rest & tokens) == 0) continue;
              if (local == 0) break;
              --local;
              start += tokens;
            }
          }
        }
        found = QGemmGroupedTile{e, lo + start, min(tokens, n - start), tokens};
        break;
      }
      tiles_before += tiles;
      lo = hi;
    }
  }
  // At most one lane found the tile; the sums hand its answer to every lane.
  return QGemmGroupedTile{simd_sum(found.expert), simd_sum(found.first), simd_sum(found.count),
                          simd_sum(found.tokens)};
}

