// C = A B^T with simdgroup_matrix 8x8 fragments: A [M, K] and B [N, K] row-major in float or
// bfloat, C [M, N] float, any M, N, K. The building block of batched prefill.
//
// A threadgroup of four SIMD-groups computes a 32x32 tile of C, each SIMD-group a 16x16 quarter
// (2x2 fragments). Operands are staged through threadgroup memory as float, 16 inputs at a time,
// zero-padded past the matrix edges so ragged sizes need no special path; B is staged transposed
// so both fragments load without a transpose.
#include "common.h"

constexpr constant uint GEMM_TILE = 32;
constexpr constant uint GEMM_DEPTH = 16;
constexpr constant uint GEMM_THREADS = 128;

struct GemmParams {
  uint m;
  uint n;
  uint k;
};

template <typename T>
[[kernel, max_total_threads_per_threadgroup(GEMM_THREADS)]]
void gemm_nt(constant GemmParams& p [[buffer(0)]], device const T* a [[buffer(1)]],
             device const T* b [[buffer(2)]], device float* c [[buffer(3)]],
             uint2 tile [[threadgroup_position_in_grid]],
             uint thread_id [[thread_index_in_threadgroup]],
             uint simdgroup [[simdgroup_index_in_threadgroup]]) {
  threadgroup float a_tile[GEMM_TILE * GEMM_DEPTH];    // [row][depth]
  threadgroup float bt_tile[GEMM_DEPTH * GEMM_TILE];   // [depth][column]
  threadgroup float c_tile[GEMM_TILE * GEMM_TILE];

  const uint row0 = tile.y * GEMM_TILE;
  const uint col0 = tile.x * GEMM_TILE;
  const uint sg_row = (simdgroup / 2) * 16;
  const uint sg_col = (simdgroup % 2) * 16;

  simdgroup_float8x8 acc[2][2];
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < p.k; k0 += GEMM_DEPTH) {
    for (uint e = thread_id; e < GEMM_TILE * GEMM_DEPTH; e += GEMM_THREADS) {
      const uint r = e / GEMM_DEPTH;
      const uint d = e % GEMM_DEPTH;
      const bool inside_k = k0 + d < p.k;
      a_tile[r * GEMM_DEPTH + d] =
          row0 + r < p.m && inside_k ? float(a[ulong(row0 + r) * p.k + k0 + d]) : 0.0f;
      bt_tile[d * GEMM_TILE + r] =
          col0 + r < p.n && inside_k ? float(b[ulong(col0 + r) * p.k + k0 + d]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint step = 0; step < GEMM_DEPTH; step += 8) {
      simdgroup_float8x8 a_frag[2];
      simdgroup_float8x8 b_frag[2];
      for (uint i = 0; i < 2; ++i) {
        simdgroup_load(a_frag[i], a_tile + (sg_row + i * 8) * GEMM_DEPTH + step, GEMM_DEPTH);
        simdgroup_load(b_frag[i], bt_tile + step * GEMM_TILE + sg_col + i * 8, GEMM_TILE);
      }
      for (uint i = 0; i < 2; ++i)
        for (uint j = 0; j < 2; ++j)
          simdgroup_multiply_accumulate(acc[i][j], a_frag[i], b_frag[j], acc[i][j]);
    }
    // The next stage overwrites the tiles other SIMD-groups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j)
      simdgroup_store(acc[i][j], c_tile + (sg_row + i * 8) * GEMM_TILE + sg_col + j * 8, GEMM_TILE);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint e = thread_id; e < GEMM_TILE * GEMM_TILE; e += GEMM_THREADS) {
    const uint r = e / GEMM_TILE;
    const uint col = e % GEMM_TILE;
    if (row0 + r < p.m && col0 + col < p.n) c[ulong(row0 + r) * p.n + col0 + col] = c_tile[e];
  }
}

template [[host_name("gemm_nt_float")]] [[kernel]] decltype(gemm_nt<float>) gemm_nt<float>;
template [[host_name("gemm_nt_bfloat")]] [[kernel]] decltype(gemm_nt<bfloat>) gemm_nt<bfloat>;
