// Quantized GEMV: y = W x for up to four projections that share one input, in one dispatch
// (GDN in_proj_qkv|z|a|b, attention q|k|v, shared expert gate|up, router|shared-expert gate).
// Weights are read where they lie in the checkpoint; one projection is just the case count == 1.
//
// Each threadgroup is two SIMD-groups of four rows each. The grid is the concatenation of every
// projection's threadgroups; `first_threadgroup` tells a threadgroup which projection it serves.
#include "common.h"
#include "quantized.h"

constexpr constant uint QGEMV_MAX_PROJECTIONS = 4;
constexpr constant uint QGEMV_ROWS_PER_SIMDGROUP = 4;
constexpr constant uint QGEMV_SIMDGROUPS = 2;

struct QGemvParams {
  uint in_dim;
  uint projections;
  uint rows[QGEMV_MAX_PROJECTIONS];
  uint first_threadgroup[QGEMV_MAX_PROJECTIONS];
};

template <uint BITS, typename T>
[[kernel]] void qgemv(constant QGemvParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                      device const uint* w0 [[buffer(2)]], device const bfloat* s0 [[buffer(3)]],
                      device const bfloat* b0 [[buffer(4)]], device float* y0 [[buffer(5)]],
                      device const uint* w1 [[buffer(6)]], device const bfloat* s1 [[buffer(7)]],
                      device const bfloat* b1 [[buffer(8)]], device float* y1 [[buffer(9)]],
                      device const uint* w2 [[buffer(10)]], device const bfloat* s2 [[buffer(11)]],
                      device const bfloat* b2 [[buffer(12)]], device float* y2 [[buffer(13)]],
                      device const uint* w3 [[buffer(14)]], device const bfloat* s3 [[buffer(15)]],
                      device const bfloat* b3 [[buffer(16)]], device float* y3 [[buffer(17)]],
                      uint threadgroup_id [[threadgroup_position_in_grid]],
                      uint simdgroup [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  uint proj = 0;
  while (proj + 1 < p.projections && threadgroup_id >= p.first_threadgroup[proj + 1]) ++proj;

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
  const uint row0 = (threadgroup_id - p.first_threadgroup[proj]) *
                        (QGEMV_SIMDGROUPS * QGEMV_ROWS_PER_SIMDGROUP) +
                    simdgroup * QGEMV_ROWS_PER_SIMDGROUP;
  if (row0 >= rows) return;  // the whole SIMD-group leaves together
  const uint count = min(QGEMV_ROWS_PER_SIMDGROUP, rows - row0);

  float acc[QGEMV_ROWS_PER_SIMDGROUP];
  qgemv_rows<BITS, QGEMV_ROWS_PER_SIMDGROUP>(m, p.in_dim, row0, count, x, lane, acc);
  for (uint r = 0; r < QGEMV_ROWS_PER_SIMDGROUP; ++r) {
    const float total = simd_sum(acc[r]);
    if (lane == 0 && r < count) y[row0 + r] = total;
  }
}

template [[host_name("qgemv_4_float")]] [[kernel]] decltype(qgemv<4, float>) qgemv<4, float>;
template [[host_name("qgemv_4_bfloat")]] [[kernel]] decltype(qgemv<4, bfloat>) qgemv<4, bfloat>;
template [[host_name("qgemv_8_float")]] [[kernel]] decltype(qgemv<8, float>) qgemv<8, float>;
template [[host_name("qgemv_8_bfloat")]] [[kernel]] decltype(qgemv<8, bfloat>) qgemv<8, bfloat>;
