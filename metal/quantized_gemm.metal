// Quantized GEMMs of batched prefill, built on the tile of quantized_gemm.h (32 tokens x 128
// weight rows per threadgroup of 128 threads).
//   qgemm           y_i = x W_i^T for up to four projections sharing one input x [tokens, in_dim]
//                   (GDN in_proj qkv|z|a|b, attention q|k|v, router|shared-expert gate), y_i
//                   [tokens, rows_i]. Grid: x over 32-token tiles, y over every projection's
//                   128-row tiles in turn. Threadgroups usually start in x-major order, so the
//                   token tiles of one weight tile run side by side and the weights come from DRAM
//                   about once per chunk, while x (4 MiB at 512 tokens x 2048) stays in the caches.
//   qgemm_grouped   the MoE experts of a chunk: assignments (token, expert) sorted by expert,
//                   expert e owning [expert_offsets[e], expert_offsets[e + 1]); out[a] =
//                   x[row(a)] W_e^T, or with SWIGLU silu(x[row(a)] G_e^T) * (x[row(a)] U_e^T),
//                   the gate and up weights staged as the two halves of one 128-row tile. Grid:
//                   x over output-column tiles (128 columns, 64 with SWIGLU), y over an upper bound
//                   on the 32-assignment tiles; each threadgroup finds its expert and tile on the
//                   device.
// Every output element is written by one thread, once, so the results do not depend on scheduling.
#include "common.h"
#include "quantized.h"
#include "quantized_gemm.h"

constexpr constant uint QGEMM_MAX_PROJECTIONS = 4;

struct QGemmParams {
  uint in_dim;
  uint tokens;
  uint projections;
  uint rows[QGEMM_MAX_PROJECTIONS];
  uint first_tile[QGEMM_MAX_PROJECTIONS];
};

template <uint BITS>
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
           uint2 tile_id [[threadgroup_position_in_grid]],
           uint thread_id [[thread_index_in_threadgroup]],
           uint simdgroup [[simdgroup_index_in_threadgroup]]) {
  alignas(16) threadgroup float tile[QGEMM_TILE_FLOATS];  // staged as float4 (qgemm_store_stage)

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
  const uint m0 = tile_id.x * QGEMM_TOKENS;

  uint x_rows[QGEMM_X_LOADS];
  for (uint i = 0; i < QGEMM_X_LOADS; ++i) {
    const uint token = m0 + qgemm_x_tile_row(thread_id, i);
    x_rows[i] = token < p.tokens ? token : QGEMM_NO_ROW;
  }
  const uint n = n0 + thread_id;
  qgemm_tile<BITS>(x, p.in_dim, x_rows, m, n, n < rows, tile, thread_id, simdgroup);

  // Thread t stores column t of the tile: neighbouring threads write neighbouring addresses.
  if (n >= rows) return;
  const uint count = min(QGEMM_TOKENS, p.tokens - m0);
  for (uint r = 0; r < count; ++r) {
    y[ulong(m0 + r) * rows + n] = tile[r * QGEMM_OUT_STRIDE + thread_id];
  }
}

template [[host_name("qgemm_4")]] [[kernel]] decltype(qgemm<4>) qgemm<4>;
template [[host_name("qgemm_8")]] [[kernel]] decltype(qgemm<8>) qgemm<8>;

struct QGemmGroupedParams {
  uint in_dim;
  uint rows;             // output rows of one expert's weight
  uint experts;
  uint max_assignments;  // rows of out; offsets past it are clamped to it
  uint gather;           // 1: assignment a reads x row row_index[a]; 0: x row a
};

// The sorted assignments a threadgroup multiplies: [first, first + count) of `expert`.
struct QGemmGroupedTile {
  uint expert;
  uint first;
  uint count;  // 0: the tile index is past the last non-empty tile
};

inline uint qgemm_token_tiles(uint assignments) {
  return (assignments + QGEMM_TOKENS - 1) / QGEMM_TOKENS;
}

// Which (expert, 32-assignment tile) the tile index `tile_index` is, counting the non-empty tiles
// of experts 0, 1, ... in order. One SIMD-group: lane l sums the tile counts of a contiguous run of
// experts, a prefix sum over lanes places the runs, and the one lane whose run holds the tile
// walks it. Only expert_offsets is read, never the weights of an expert with no assignment.
inline QGemmGroupedTile qgemm_find_tile(device const uint* expert_offsets, uint experts,
                                        uint max_assignments, uint tile_index, uint lane) {
  const uint per_lane = (experts + SIMD_WIDTH - 1) / SIMD_WIDTH;
  const uint begin = min(lane * per_lane, experts);
  const uint end = min(begin + per_lane, experts);
  uint lane_tiles = 0;
  uint lo = min(expert_offsets[begin], max_assignments);
  for (uint e = begin; e < end; ++e) {
    const uint hi = min(expert_offsets[e + 1], max_assignments);
    lane_tiles += hi > lo ? qgemm_token_tiles(hi - lo) : 0;
    lo = hi;
  }
  const uint before = simd_prefix_exclusive_sum(lane_tiles);

  uint expert = 0;
  uint first = 0;
  uint count = 0;
  if (before <= tile_index && tile_index < before + lane_tiles) {
    uint tiles_before = before;
    lo = min(expert_offsets[begin], max_assignments);
    for (uint e = begin; e < end; ++e) {
      const uint hi = min(expert_offsets[e + 1], max_assignments);
      const uint tiles = hi > lo ? qgemm_token_tiles(hi - lo) : 0;
      if (tile_index < tiles_before + tiles) {
        expert = e;
        first = lo + (tile_index - tiles_before) * QGEMM_TOKENS;
        count = min(QGEMM_TOKENS, hi - first);
        break;
      }
      tiles_before += tiles;
      lo = hi;
    }
  }
  // At most one lane found the tile; the sums hand its answer to every lane.
  return QGemmGroupedTile{simd_sum(expert), simd_sum(first), simd_sum(count)};
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
                   uint2 tile_id [[threadgroup_position_in_grid]],
                   uint thread_id [[thread_index_in_threadgroup]],
                   uint simdgroup [[simdgroup_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
  alignas(16) threadgroup float tile[QGEMM_TILE_FLOATS];  // staged as float4 (qgemm_store_stage)
  threadgroup uint found[3];  // expert, first, count

  if (simdgroup == 0) {
    const QGemmGroupedTile mine =
        qgemm_find_tile(expert_offsets, p.experts, p.max_assignments, tile_id.y, lane);
    if (lane == 0) {
      found[0] = mine.expert;
      found[1] = mine.first;
      found[2] = mine.count;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const QGemmGroupedTile t{found[0], found[1], found[2]};
  // The grid is an upper bound on the tiles; a threadgroup past the last one leaves as a whole.
  if (t.count == 0) return;

  // With SWIGLU the tile's first 64 rows are gate rows n0.., the last 64 the same up rows.
  constexpr uint out_columns = SWIGLU ? QGEMM_WEIGHT_ROWS / 2 : QGEMM_WEIGHT_ROWS;
  const uint n0 = tile_id.x * out_columns;
  const uint column = thread_id % out_columns;
  const uint n = n0 + column;
  const QuantMatrix stacked = SWIGLU && thread_id >= out_columns ? QuantMatrix{w1, s1, b1}
                                                                 : QuantMatrix{w0, s0, b0};
  const QuantMatrix m = quant_expert(stacked, t.expert, p.rows, p.in_dim, BITS);

  uint x_rows[QGEMM_X_LOADS];
  for (uint i = 0; i < QGEMM_X_LOADS; ++i) {
    const uint local = qgemm_x_tile_row(thread_id, i);
    const uint a = t.first + local;
    x_rows[i] = local < t.count ? (p.gather != 0 ? row_index[a] : a) : QGEMM_NO_ROW;
  }
  qgemm_tile<BITS>(x, p.in_dim, x_rows, m, n, n < p.rows, tile, thread_id, simdgroup);

  if (n >= p.rows) return;
  if (SWIGLU) {
    // Threads t and t + 64 share column t and take alternate tokens.
    for (uint r = thread_id / out_columns; r < t.count; r += QGEMM_THREADS / out_columns) {
      const float gate = tile[r * QGEMM_OUT_STRIDE + column];
      const float up = tile[r * QGEMM_OUT_STRIDE + out_columns + column];
      out[ulong(t.first + r) * p.rows + n] = silu(gate) * up;
    }
  } else {
    for (uint r = 0; r < t.count; ++r) {
      out[ulong(t.first + r) * p.rows + n] = tile[r * QGEMM_OUT_STRIDE + column];
    }
  }
}

template [[host_name("qgemm_grouped_4")]] [[kernel]] decltype(qgemm_grouped<4, false>)
    qgemm_grouped<4, false>;
template [[host_name("qgemm_grouped_8")]] [[kernel]] decltype(qgemm_grouped<8, false>)
    qgemm_grouped<8, false>;
template [[host_name("qgemm_grouped_swiglu_4")]] [[kernel]] decltype(qgemm_grouped<4, true>)
    qgemm_grouped<4, true>;
template [[host_name("qgemm_grouped_swiglu_8")]] [[kernel]] decltype(qgemm_grouped<8, true>)
    qgemm_grouped<8, true>;
