// Quantized GEMV: y = W x for up to four projections that share one input, in one dispatch
// (GDN in_proj_qkv|z|a|b, attention q|k|v, shared expert gate|up, router|shared-expert gate).
// Weights are read where they lie in the checkpoint; one projection is just the case count == 1.
//
// Each SIMD-group computes four rows; a threadgroup is one or two SIMD-groups, as the host chose
// for the dispatch's size (kernels/quantized.py, gemv_simdgroups). The grid is the concatenation
// of every projection's threadgroups; `first_threadgroup` tells a threadgroup which projection it
// serves.
//
// The decode step folds its residual adds and RMSNorms into these GEMVs: the `qgemv_normed_*`
// kernels take the un-normed residual as x and the norm's gain (see qgemv_rows_gained), and with
// `accumulate` a GEMV adds its result to y instead of overwriting it (y = residual + W x), so the
// mixer's output projection writes the next residual directly. With `conv`, projection 0's rows
// (the GDN's in_proj_qkv) leave through the causal conv1d step (conv_step_channel), so the conv
// is no dispatch of its own either.
#include "common.h"
#include "conv1d.h"
#include "quantized.h"

constexpr constant uint QGEMV_MAX_PROJECTIONS = 4;
constexpr constant uint QGEMV_ROWS_PER_SIMDGROUP = 4;

struct QGemvParams {
  uint in_dim;
  uint projections;
  uint rows[QGEMV_MAX_PROJECTIONS];
  uint first_threadgroup[QGEMV_MAX_PROJECTIONS];
  float eps;        // the folded norm's epsilon (normed kernels only)
  uint accumulate;  // y += W x instead of y = W x
  uint conv;        // projection 0's outputs go through the conv1d step (conv weight, window)
};

template <uint BITS, typename T, bool NORMED>
[[kernel]] void qgemv(constant QGemvParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                      device const uint* w0 [[buffer(2)]], device const bfloat* s0 [[buffer(3)]],
                      device const bfloat* b0 [[buffer(4)]], device float* y0 [[buffer(5)]],
                      device const uint* w1 [[buffer(6)]], device const bfloat* s1 [[buffer(7)]],
                      device const bfloat* b1 [[buffer(8)]], device float* y1 [[buffer(9)]],
                      device const uint* w2 [[buffer(10)]], device const bfloat* s2 [[buffer(11)]],
                      device const bfloat* b2 [[buffer(12)]], device float* y2 [[buffer(13)]],
                      device const uint* w3 [[buffer(14)]], device const bfloat* s3 [[buffer(15)]],
                      device const bfloat* b3 [[buffer(16)]], device float* y3 [[buffer(17)]],
                      device const bfloat* gain [[buffer(18)]],
                      device const bfloat* conv_weight [[buffer(19)]],
                      device float* conv_window [[buffer(20)]],
                      uint threadgroup_id [[threadgroup_position_in_grid]],
                      uint simdgroup [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
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
                        (simdgroups * QGEMV_ROWS_PER_SIMDGROUP) +
                    simdgroup * QGEMV_ROWS_PER_SIMDGROUP;
  if (row0 >= rows) return;  // the whole SIMD-group leaves together
  const uint count = min(QGEMV_ROWS_PER_SIMDGROUP, rows - row0);

  float acc[QGEMV_ROWS_PER_SIMDGROUP];
  float scale = 1.0f;
  if (NORMED) {
    const float squares = qgemv_rows_gained<BITS, QGEMV_ROWS_PER_SIMDGROUP>(
        m, p.in_dim, row0, count, reinterpret_cast<device const float*>(x), gain, lane, acc);
    scale = folded_inv_rms(squares, p.in_dim, p.eps);
  } else {
    qgemv_rows<BITS, QGEMV_ROWS_PER_SIMDGROUP>(m, p.in_dim, row0, count, x, lane, acc);
  }
  for (uint r = 0; r < QGEMV_ROWS_PER_SIMDGROUP; ++r) {
    float total = simd_sum(acc[r]);
    if (NORMED) total *= scale;
    // Each row (and its conv channel) is read and written by the one lane that owns it, so
    // accumulating and the window's in-place shift are race-free.
    if (lane == 0 && r < count) {
      if (p.conv != 0 && proj == 0) {
        total = conv_step_channel(conv_weight, conv_window, rows, row0 + r, total);
      }
      y[row0 + r] = p.accumulate != 0 ? y[row0 + r] + total : total;
    }
  }
}

template [[host_name("qgemv_4_float")]] [[kernel]] decltype(qgemv<4, float, false>)
    qgemv<4, float, false>;
template [[host_name("qgemv_4_bfloat")]] [[kernel]] decltype(qgemv<4, bfloat, false>)
    qgemv<4, bfloat, false>;
template [[host_name("qgemv_8_float")]] [[kernel]] decltype(qgemv<8, float, false>)
    qgemv<8, float, false>;
template [[host_name("qgemv_8_bfloat")]] [[kernel]] decltype(qgemv<8, bfloat, false>)
    qgemv<8, bfloat, false>;
// The residual stream is fp32, so only fp32 inputs are ever normed on the fly.
template [[host_name("qgemv_normed_4_float")]] [[kernel]] decltype(qgemv<4, float, true>)
    qgemv<4, float, true>;
template [[host_name("qgemv_normed_8_float")]] [[kernel]] decltype(qgemv<8, float, true>)
    qgemv<8, float, true>;
