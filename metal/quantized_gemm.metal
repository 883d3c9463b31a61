// Quantized GEMMs of batched prefill, built on the tile of quantized_gemm.h (up to 64 tokens x
// 128 weight rows per threadgroup of 128 threads, half operands, fp32 sums), at 4 and 8 bits.
//   qgemm_BITS_TOKENS  y_i = x W_i^T for up to four projections sharing one input x [tokens,
//                   in_dim] (GDN in_proj qkv|z|a|b, attention q|k|v, router|shared-expert gate),
//                   y_i [tokens, rows_i], in tiles of TOKENS tokens (the host picks 8 to 64 by the
//                   chunk's length). Grid: x over token tiles, y over every projection's 128-row
//                   tiles in turn, launched in bands of 1,024 tokens (qgemm_band_tile in
//                   quantized_gemm.h): the weights come from DRAM once per band, x about once.
//   qgemm_grouped   the MoE experts of a chunk: assignments (token, expert) sorted by expert,
//                   expert e owning [expert_offsets[e], expert_offsets[e + 1]); out[a] =
//                   x[row(a)] W_e^T, or with SWIGLU silu(x[row(a)] G_e^T) * (x[row(a)] U_e^T),
//                   64 gate and the same 64 up rows staged in one 128-row tile. Each expert's
//                   assignments go in tiles of 64, 32, 16 and 8 rows sized by its count
//                   (qgemm_expert_tiles), so a 10-token expert multiplies 16 rows, not 32 or 64.
//                   Grid: x over output-column tiles (128 columns, 64 with SWIGLU), y over an
//                   upper bound on the tiles; each threadgroup finds its expert and tile on the
//                   device.
//   qgemm_row_exponents  the range guard's exponent e of each row of an input the GEMMs take
//                   unbounded (quantized_gemm.h): one SIMD-group per row.
// Both GEMMs take the guard's exponents per row of x (`x_exponents`, when `x_guarded` is 1): the
// exponents come from a pass of their own, not from the kernels that write x, because the
// inputs they guard come from chunk attention and the GDN's gated norm (whose threadgroups each
// hold a part of a row) and from the grouped SwiGLU GEMM (64 of a row's columns per threadgroup):
// a row's largest |x| would need a reduction across threadgroups there, where the pass reads each
// row once, by one SIMD-group, for one more dispatch and barrier level.
// Every output element is written by one thread, once, so the results do not depend on scheduling.
#include "common.h"
#include "quantized.h"
#include "quantized_gemm.h"

// Stores this SIMD-group's part of a tile qgemm_tile computed: fragment acc[4 i + j] goes to rows
// row0 + 8 i.. and columns col0 + 8 j.. of out (row stride out_stride), times up[i] (2^e of the
// row's guard), tile rows below `count` and columns below `columns` only.
template <uint TOKENS>
inline void qgemm_store_tile(thread simdgroup_float8x8* acc, thread const float* up,
                             device float* out, uint row0, uint count, uint col0, uint columns,
                             uint out_stride, uint lane) {
  const uint row = fragment_row(lane);
  const uint col = fragment_col(lane);
  for (uint i = 0; i < TOKENS / 8; ++i) {
    const uint r = 8 * i + row;
    for (uint j = 0; j < 4; ++j) {
      const float2 values = up[i] * acc[4 * i + j].thread_elements();
      const uint c = col0 + 8 * j + col;
      if (r >= count) continue;
      device float* at = out + ulong(row0 + r) * out_stride + c;
      if (c < columns) at[0] = values[0];
      if (c + 1 < columns) at[1] = values[1];
    }
  }
}

template <uint BITS, uint TOKENS>
[[kernel, max_total_threads_per_threadgroup(QGEMM_THREADS)]]
void qgemm(constant QGemmParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
           device const uint* w0 [[buffer(2)]], device const bfloat* s0 [[buffer(3)]],
           device const bfloat* b0 [[buffer(4)]], device float* y0 [[buffer(5)]],
           device const uint* w1 [[buffer(6)]], device const bfloat* s1 [[buffer(7)]],
           device const bfloat* b1 [[buffer(8)]], device float* y1 [[buffer(9)]],
           device const uint* w2 [[buffer(10)]], device const bfloat* s2 [[buffer(11)]],
           device const bfloat* b2 [[buffer(12)]], device float* y2 [[buffer(13)]],
           device const uint* w3 [[buffer(14)]], device const bfloat* s3 [[buffer(15)]],
           device const bfloat* b3 [[buffer(16)]], device float* y3 [[buffer(17)]],
           device const int* x_exponents [[buffer(18)]],
           uint2 launched [[threadgroup_position_in_grid]],
           uint2 tiles [[threadgroups_per_grid]],
           uint thread_id [[thread_index_in_threadgroup]],
           uint simdgroup [[simdgroup_index_in_threadgroup]],
           uint lane [[thread_index_in_simdgroup]]) {
  alignas(16) threadgroup half tile[qgemm_tile_elements(TOKENS)];  // staged as half4

  const uint2 tile_id = qgemm_band_tile<TOKENS>(launched, tiles);
  uint proj = 0;
  while (proj + 1 < p.projections && tile_id.y >= p.first_tile[proj + 1]) ++proj;
  QuantMatrix m{w0, s0, b0};
  device float* y = y0;
  if (proj == 1) {
    m = QuantMatrix{w1, s1, b1};
    y = y1;
  } else if (proj == 2) {
    m = QuantMatrix{w2, s2, b2};
    y = y2;
  } else if (proj == 3) {
    m = QuantMatrix{w3, s3, b3};
    y = y3;
  }
  const uint rows = p.rows[proj];
  const uint n0 = (tile_id.y - p.first_tile[proj]) * QGEMM_WEIGHT_ROWS;
  const uint m0 = tile_id.x * TOKENS;

  uint x_rows[qgemm_x_loads(TOKENS)];
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    const uint local = qgemm_x_tile_row(thread_id, i);
    x_rows[i] = local < TOKENS && m0 + local < p.tokens ? m0 + local : QGEMM_NO_ROW;
  }
  float x_down[qgemm_x_loads(TOKENS)];
  qgemm_x_down<TOKENS>(x_exponents, p.x_guarded != 0, x_rows, x_down);
  const uint count = min(TOKENS, p.tokens - m0);
  float up[TOKENS / 8];
  for (uint i = 0; i < TOKENS / 8; ++i) {
    const uint r = 8 * i + fragment_row(lane);
    up[i] = p.x_guarded != 0 && r < count ? qgemm_power_of_two(x_exponents[m0 + r]) : 1.0f;
  }
  const uint n = n0 + thread_id;
  simdgroup_float8x8 acc[TOKENS / 2];
  qgemm_tile<BITS, TOKENS>(x, p.in_dim, x_rows, x_down, m, n, n < rows, tile, thread_id,
                           simdgroup, acc);
  qgemm_store_tile<TOKENS>(acc, up, y, m0, count, n0 + 32 * simdgroup, rows, rows, lane);
}

template [[host_name("qgemm_4_8")]] [[kernel]] decltype(qgemm<4, 8>)
    qgemm<4, 8>;
template [[host_name("qgemm_4_16")]] [[kernel]] decltype(qgemm<4, 16>)
    qgemm<4, 16>;
template [[host_name("qgemm_4_32")]] [[kernel]] decltype(qgemm<4, 32>)
    qgemm<4, 32>;
template [[host_name("qgemm_4_64")]] [[kernel]] decltype(qgemm<4, 64>)
    qgemm<4, 64>;
template [[host_name("qgemm_8_8")]] [[kernel]] decltype(qgemm<8, 8>)
    qgemm<8, 8>;
template [[host_name("qgemm_8_16")]] [[kernel]] decltype(qgemm<8, 16>)
    qgemm<8, 16>;
template [[host_name("qgemm_8_32")]] [[kernel]] decltype(qgemm<8, 32>)
    qgemm<8, 32>;
template [[host_name("qgemm_8_64")]] [[kernel]] decltype(qgemm<8, 64>)
    qgemm<8, 64>;

// One tile of the grouped GEMM: the threadgroup's part after it found its tile `t`.
template <uint BITS, bool SWIGLU, uint TOKENS>
inline void qgemm_grouped_tile(constant QGemmGroupedParams& p, device const float* x,
                               device const uint* row_index, device const int* x_exponents,
                               QuantMatrix m, uint n0, uint column, QGemmGroupedTile t,
                               device float* out, threadgroup half* tile, uint thread_id,
                               uint simdgroup, uint lane) {
  const bool guarded = p.x_guarded != 0;
  uint x_rows[qgemm_x_loads(TOKENS)];
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    const uint local = qgemm_x_tile_row(thread_id, i);
    const uint a = t.first + local;
    x_rows[i] = local < t.count ? (p.gather != 0 ? row_index[a] : a) : QGEMM_NO_ROW;
  }
  float x_down[qgemm_x_loads(TOKENS)];
  qgemm_x_down<TOKENS>(x_exponents, guarded, x_rows, x_down);
  float up[TOKENS / 8];
  for (uint i = 0; i < TOKENS / 8; ++i) {
    const uint r = 8 * i + fragment_row(lane);
    const uint a = t.first + r;
    up[i] = guarded && r < t.count
                ? qgemm_power_of_two(x_exponents[p.gather != 0 ? row_index[a] : a])
                : 1.0f;
  }
  const uint n = n0 + column;
  simdgroup_float8x8 acc[TOKENS / 2];
  qgemm_tile<BITS, TOKENS>(x, p.in_dim, x_rows, x_down, m, n, n < p.rows, tile, thread_id,
                           simdgroup, acc);
  if (!SWIGLU) {
    qgemm_store_tile<TOKENS>(acc, up, out, t.first, t.count, n0 + 32 * simdgroup, p.rows, p.rows,
                             lane);
    return;
  }
  // SIMD-group s holds gate columns 16 s.. in fragments j = 0, 1 and the same up columns in
  // j = 2, 3, element for element.
  const uint row = fragment_row(lane);
  const uint col = fragment_col(lane);
  for (uint i = 0; i < TOKENS / 8; ++i) {
    const uint r = 8 * i + row;
    for (uint j = 0; j < 2; ++j) {
      const float2 gate = up[i] * acc[4 * i + j].thread_elements();
      const float2 linear = up[i] * acc[4 * i + j + 2].thread_elements();
      const uint c = n0 + 16 * simdgroup + 8 * j + col;
      if (r >= t.count) continue;
      device float* at = out + ulong(t.first + r) * p.rows + c;
      if (c < p.rows) at[0] = silu(gate[0]) * linear[0];
      if (c + 1 < p.rows) at[1] = silu(gate[1]) * linear[1];
    }
  }
}

template <uint BITS, bool SWIGLU>
[[kernel, max_total_threads_per_threadgroup(QGEMM_THREADS)]]
void qgemm_grouped(constant QGemmGroupedParams& p [[buffer(0)]],
                   device const float* x [[buffer(1)]],
                   device const uint* expert_offsets [[buffer(2)]],
                   device const uint* row_index [[buffer(3)]],
                   device const uint* w0 [[buffer(4)]],
                   device const bfloat* s0 [[buffer(5)]],
                   device const bfloat* b0 [[buffer(6)]],
                   device const uint* w1 [[buffer(7)]],
                   device const bfloat* s1 [[buffer(8)]],
                   device const bfloat* b1 [[buffer(9)]],
                   device float* out [[buffer(10)]],
                   device const int* x_exponents [[buffer(11)]],
                   uint2 tile_id [[threadgroup_position_in_grid]],
                   uint thread_id [[thread_index_in_threadgroup]],
                   uint simdgroup [[simdgroup_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
  // Sized for the largest tile, staged as half4.
  alignas(16) threadgroup half tile[qgemm_tile_elements(QGEMM_MAX_TOKENS)];
  threadgroup uint found[4];  // expert, first, count, tokens

  if (simdgroup == 0) {
    const QGemmGroupedTile mine =
        qgemm_find_tile(expert_offsets, p.experts, p.max_assignments, tile_id.y, lane);
    if (lane == 0) {
      found[0] = mine.expert;
      found[1] = mine.first;
      found[2] = mine.count;
      found[3] = mine.tokens;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const QGemmGroupedTile t{found[0], found[1], found[2], found[3]};
  // The grid is an upper bound on the tiles; a threadgroup past the last one leaves as a whole.
  if (t.count == 0) return;

  // With SWIGLU, SIMD-group s stages gate rows n0 + 16 s.. (its threads 0-15) and the same up
  // rows (threads 16-31), so that each lane ends up holding matching gate and up values.
  constexpr uint out_columns = SWIGLU ? QGEMM_WEIGHT_ROWS / 2 : QGEMM_WEIGHT_ROWS;
  const uint n0 = tile_id.x * out_columns;
  const bool stages_up = SWIGLU && lane >= SIMD_WIDTH / 2;
  const uint column = SWIGLU ? 16 * simdgroup + lane % (SIMD_WIDTH / 2) : thread_id;
  const QuantMatrix stacked = stages_up ? QuantMatrix{w1, s1, b1} : QuantMatrix{w0, s0, b0};
  const QuantMatrix m = quant_expert(stacked, t.expert, p.rows, p.in_dim, BITS);

  // The tile size is the same for the whole threadgroup: uniform control flow.
  if (t.tokens == 64) {
    qgemm_grouped_tile<BITS, SWIGLU, 64>(p, x, row_index, x_exponents, m, n0, column, t, out, tile,
                                      thread_id,
                                         simdgroup, lane);
  } else if (t.tokens == 32) {
    qgemm_grouped_tile<BITS, SWIGLU, 32>(p, x, row_index, x_exponents, m, n0, column, t, out, tile,
                                      thread_id,
                                         simdgroup, lane);
  } else if (t.tokens == 16) {
    qgemm_grouped_tile<BITS, SWIGLU, 16>(p, x, row_index, x_exponents, m, n0, column, t, out, tile,
                                      thread_id,
                                         simdgroup, lane);
  } else {
    qgemm_grouped_tile<BITS, SWIGLU, 8>(p, x, row_index, x_exponents, m, n0, column, t, out, tile,
                                      thread_id,
                                        simdgroup, lane);
  }
}

template [[host_name("qgemm_grouped_4")]] [[kernel]]
    decltype(qgemm_grouped<4, false>) qgemm_grouped<4, false>;
template [[host_name("qgemm_grouped_swiglu_4")]] [[kernel]]
    decltype(qgemm_grouped<4, true>) qgemm_grouped<4, true>;
template [[host_name("qgemm_grouped_8")]] [[kernel]]
    decltype(qgemm_grouped<8, false>) qgemm_grouped<8, false>;
template [[host_name("qgemm_grouped_swiglu_8")]] [[kernel]]
    decltype(qgemm_grouped<8, true>) qgemm_grouped<8, true>;

constexpr constant uint QGEMM_ROW_EXPONENT_THREADS = 128;

struct QGemmRowExponentsParams {
  uint rows;
  uint in_dim;  // a multiple of 4
};

// exponents[r] = qgemm_row_exponent(largest |x[r, k]|) for each of `rows` rows of x [rows,
// in_dim]. One SIMD-group per row (a max is exact in any order), four rows per threadgroup.
[[kernel, max_total_threads_per_threadgroup(QGEMM_ROW_EXPONENT_THREADS)]]
void qgemm_row_exponents(constant QGemmRowExponentsParams& p [[buffer(0)]],
                         device const float4* x [[buffer(1)]],
                         device int* exponents [[buffer(2)]],
                         uint group [[threadgroup_position_in_grid]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group * (QGEMM_ROW_EXPONENT_THREADS / SIMD_WIDTH) + simdgroup;
  if (row >= p.rows) return;  // the whole SIMD-group
  const uint vectors = p.in_dim / 4;
  device const float4* values = x + ulong(row) * vectors;
  float largest = 0.0f;
  for (uint v = lane; v < vectors; v += SIMD_WIDTH) {
    const float4 a = abs(values[v]);
    largest = max(largest, max(max(a.x, a.y), max(a.z, a.w)));
  }
  largest = simd_max(largest);
  if (lane == 0) exponents[row] = qgemm_row_exponent(largest);
}
