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
//
// Verify passes (speculative decoding: the last accepted token and up to 8 drafts) run the same
// projections over a few tokens. Decode-sized work is bound by reading the weights, so
// `qgemv_tokens` reads each weight once for all of them: x is [tokens, in_dim], each projection's
// y is [tokens, rows], and a SIMD-group decodes its rows' codes of a chunk once, into registers
// (4 rows x 32 floats at 4 bits), and walks the tokens over them. The token loop has a
// compile-time trip count (QGEMV_MAX_TOKENS) so that acc[] stays in registers; tokens past
// p.tokens are skipped, uniformly for the SIMD-group. A verify pass folds what the decode step
// folds, per token: `qgemv_tokens_normed_*` norms each token's residual row, `accumulate` adds
// into the residual rows, and `conv` runs projection 0 through the conv (QGemvConvTail).
//
// Every kernel here ends with one reduction across its SIMD-group, however many tokens: the
// lanes' partial dot products of all its rows and tokens, and a folded norm's partial sums of
// squares, go through the SIMD-group's own slice of threadgroup memory (lane_sum, quantized.h),
// whose fixed order makes a token's rows the same in qgemv, qgemv_embedded and qgemv_tokens.
//
// The decode step's very first GEMV (layer 0's in_proj_qkv|z|a|b, or q|k|v) also folds the
// embedding lookup: `qgemv_embedded_*` reads x as the embedding row of the token at the step's
// position, dequantized by each lane from the quantized table (EmbeddedRow, embedding.h), and
// writes that row to the residual for the layer's residual adds.
#include "common.h"
#include "conv1d.h"
#include "embedding.h"
#include "quantized.h"

constexpr constant uint QGEMV_MAX_PROJECTIONS = 4;
constexpr constant uint QGEMV_ROWS_PER_SIMDGROUP = 4;
constexpr constant uint QGEMV_MAX_TOKENS = 9;

struct QGemvParams {
  uint in_dim;
  uint projections;
  uint rows[QGEMV_MAX_PROJECTIONS];
  uint first_threadgroup[QGEMV_MAX_PROJECTIONS];
  float eps;        // the folded norm's epsilon (normed kernels only)
  uint accumulate;  // y += W x instead of y = W x
  uint conv;        // projection 0's outputs go through the conv1d step (conv weight, window)
  uint embed_rows;  // the embedding table's rows (embedded kernels only)
  uint tokens;      // x's rows (qgemv_tokens only; 1 elsewhere)
  uint conv_tail_rows;  // qgemv_tokens with conv: the rows it leaves in the conv's tail
  uint lane_stride;     // lane_sums_stride of the values a lane shares (record_qgemv)
};

// The values each lane shares for the reduction (lane_sum, quantized.h): its partial dot product
// of every row for every token (token n's row r at n * R + r), then, normed, its partial sum of
// squares of every token. The host sizes the threadgroup memory from the same count: per
// SIMD-group SIMD_WIDTH lanes' runs, then the R * tokens totals a conv reads back.
inline uint qgemv_scratch_floats(constant QGemvParams& p) {
  return SIMD_WIDTH * p.lane_stride + QGEMV_ROWS_PER_SIMDGROUP * p.tokens;
}

// The rows one SIMD-group of a dispatch computes: [row0, row0 + count) of projection `proj`,
// whose matrix is m and output y; count is 0 for a SIMD-group past its projection's rows.
struct QGemvTarget {
  QuantMatrix m;
  device float* y;
  uint proj;
  uint row0;
  uint count;
};

inline QGemvTarget qgemv_target(constant QGemvParams& p, QuantMatrix m0, device float* y0,
                                QuantMatrix m1, device float* y1, QuantMatrix m2,
                                device float* y2, QuantMatrix m3, device float* y3,
                                uint threadgroup_id, uint simdgroup, uint simdgroups) {
  QGemvTarget t{m0, y0, 0, 0, 0};
  while (t.proj + 1 < p.projections && threadgroup_id >= p.first_threadgroup[t.proj + 1]) {
    ++t.proj;
  }
  if (t.proj == 1) {
    t.m = m1;
    t.y = y1;
  } else if (t.proj == 2) {
    t.m = m2;
    t.y = y2;
  } else if (t.proj == 3) {
    t.m = m3;
    t.y = y3;
  }
  const uint rows = p.rows[t.proj];
  t.row0 = (threadgroup_id - p.first_threadgroup[t.proj]) *
               (simdgroups * QGEMV_ROWS_PER_SIMDGROUP) +
           simdgroup * QGEMV_ROWS_PER_SIMDGROUP;
  t.count = t.row0 < rows ? min(QGEMV_ROWS_PER_SIMDGROUP, rows - t.row0) : 0;
  return t;
}

// Reduces the lanes' partial dot products (and, NORMED, their sums of squares) in one exchange,
// scales them by a folded norm's inverse RMS when NORMED, and writes (or adds) the target's
// rows, through the conv step for projection 0 with `conv`: row r by lane r, the one lane that
// reads and writes it (and its conv channel), so accumulating and the window's in-place shift
// are race-free. Call from uniform control flow within the SIMD-group.
template <bool NORMED>
inline void qgemv_store(constant QGemvParams& p, QGemvTarget t, thread const float* acc,
                        float squares, threadgroup float* scratch,
                        device const bfloat* conv_weight, device float* conv_window, uint lane) {
  constexpr uint R = QGEMV_ROWS_PER_SIMDGROUP;
  const uint stride = p.lane_stride;
  for (uint r = 0; r < R; ++r) scratch[lane * stride + r] = acc[r];
  if (NORMED) scratch[lane * stride + R] = squares;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lane >= t.count) return;
  float total = lane_sum(scratch, stride, lane);
  if (NORMED) total *= inv_rms_of(lane_sum(scratch, stride, R), p.in_dim, p.eps);
  const uint row = t.row0 + lane;
  if (p.conv != 0 && t.proj == 0) {
    total = conv_step_channel(conv_weight, conv_window, p.rows[0], row, total);
  }
  t.y[row] = p.accumulate != 0 ? t.y[row] + total : total;
}

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
                      threadgroup float* scratch [[threadgroup(0)]],
                      uint threadgroup_id [[threadgroup_position_in_grid]],
                      uint simdgroup [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  const QGemvTarget t = qgemv_target(p, QuantMatrix{w0, s0, b0}, y0, QuantMatrix{w1, s1, b1}, y1,
                                     QuantMatrix{w2, s2, b2}, y2, QuantMatrix{w3, s3, b3}, y3,
                                     threadgroup_id, simdgroup, simdgroups);
  if (t.count == 0) return;  // the whole SIMD-group leaves together

  float acc[QGEMV_ROWS_PER_SIMDGROUP];
  float squares = 0.0f;
  if (NORMED) {
    squares = qgemv_rows_gained<BITS, QGEMV_ROWS_PER_SIMDGROUP>(
        t.m, p.in_dim, t.row0, t.count, reinterpret_cast<device const float*>(x), gain, lane, acc);
  } else {
    qgemv_rows<BITS, QGEMV_ROWS_PER_SIMDGROUP>(t.m, p.in_dim, t.row0, t.count, x, lane, acc);
  }
  qgemv_store<NORMED>(p, t, acc, squares, scratch + simdgroup * qgemv_scratch_floats(p),
                      conv_weight, conv_window, lane);
}

// A verify pass's conv: projection 0's rows of every token leave through the conv and SiLU,
// token after token from the window, in conv_step_channel's expression. The window stays as it
// is; the last tail_rows rows of "window, then the tokens' pre-conv rows" go to `tail`, from
// which conv1d_commit takes the window after the position the acceptance keeps (as conv1d_chunk
// leaves them). A channel's window, history and tail are touched by the one lane owning its row.
struct QGemvConvTail {
  device const bfloat* weight;  // [channels, 4, 1]
  device const float* window;   // [3, channels]
  device float* tail;           // [tail_rows, channels]
  uint tail_first;              // the tail's first row of "window, then the tokens"
  uint channels;
};

// A channel's history before the first token: its window, whose rows from tail_first on also
// open the tail.
inline void conv_tail_start(QGemvConvTail c, uint channel, thread float* history) {
  for (uint t = 0; t < kHistory; ++t) {
    history[t] = c.window[t * c.channels + channel];
    if (t >= c.tail_first) c.tail[(t - c.tail_first) * c.channels + channel] = history[t];
  }
}

// Token n's output of one channel from its pre-conv value, which joins the history (and the
// tail, from tail_first on).
inline float conv_tail_step(QGemvConvTail c, uint channel, uint n, thread float* history,
                            float current) {
  const float out = causal_conv_silu(c.weight + channel * kTaps, history, current);
  for (uint t = 0; t + 1 < kHistory; ++t) history[t] = history[t + 1];
  history[kHistory - 1] = current;
  const uint row = n + kHistory;
  if (row >= c.tail_first) c.tail[(row - c.tail_first) * c.channels + channel] = current;
  return out;
}

// NORMED: x is [tokens, in_dim] of the un-normed residual and each token's rows are
// qgemv_normed's for that token, bit for bit (the same sums of squares, products and scaling).
// `accumulate` adds to y as qgemv does; `conv` runs QGemvConvTail on projection 0.
template <uint BITS, bool NORMED>
[[kernel]] void qgemv_tokens(
    constant QGemvParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
    device const uint* w0 [[buffer(2)]], device const bfloat* s0 [[buffer(3)]],
    device const bfloat* b0 [[buffer(4)]], device float* y0 [[buffer(5)]],
    device const uint* w1 [[buffer(6)]], device const bfloat* s1 [[buffer(7)]],
    device const bfloat* b1 [[buffer(8)]], device float* y1 [[buffer(9)]],
    device const uint* w2 [[buffer(10)]], device const bfloat* s2 [[buffer(11)]],
    device const bfloat* b2 [[buffer(12)]], device float* y2 [[buffer(13)]],
    device const uint* w3 [[buffer(14)]], device const bfloat* s3 [[buffer(15)]],
    device const bfloat* b3 [[buffer(16)]], device float* y3 [[buffer(17)]],
    device const bfloat* gain [[buffer(18)]], device const bfloat* conv_weight [[buffer(19)]],
    device const float* conv_window [[buffer(20)]], device float* conv_tail [[buffer(21)]],
    threadgroup float* scratch [[threadgroup(0)]], uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const QGemvTarget t = qgemv_target(p, QuantMatrix{w0, s0, b0}, y0, QuantMatrix{w1, s1, b1}, y1,
                                     QuantMatrix{w2, s2, b2}, y2, QuantMatrix{w3, s3, b3}, y3,
                                     threadgroup_id, simdgroup, simdgroups);
  if (t.count == 0) return;  // the whole SIMD-group leaves together

  constexpr uint R = QGEMV_ROWS_PER_SIMDGROUP;
  constexpr uint chunk = quant_chunk(BITS);
  const uint words_per_row = p.in_dim * BITS / 32;
  const uint groups_per_row = p.in_dim / QUANT_GROUP_SIZE;
  float acc[R][QGEMV_MAX_TOKENS];
  float squares[QGEMV_MAX_TOKENS];
  for (uint n = 0; n < QGEMV_MAX_TOKENS; ++n) {
    squares[n] = 0.0f;
    for (uint r = 0; r < R; ++r) acc[r][n] = 0.0f;
  }
  for (uint k = lane * chunk; k < p.in_dim; k += SIMD_WIDTH * chunk) {
    float decoded[R][chunk];
    float scales[R], biases[R];
    for (uint r = 0; r < R; ++r) {
      const ulong row = clamped_row(t.row0, t.count, r);
      decode_codes<BITS>(*reinterpret_cast<device const uint4*>(t.m.weight + row * words_per_row +
                                                                k * BITS / 32),
                         decoded[r]);
      const ulong group = row * groups_per_row + k / QUANT_GROUP_SIZE;
      scales[r] = float(t.m.scales[group]);
      biases[r] = float(t.m.biases[group]);
    }
    float gains[chunk];
    if (NORMED) load_gains<BITS>(gain, k, gains);
    for (uint n = 0; n < QGEMV_MAX_TOKENS; ++n) {
      if (n >= p.tokens) break;
      float xs[chunk];
      device const float* token_x = x + ulong(n) * p.in_dim;
      const float xsum = NORMED ? load_chunk_gained<BITS>(token_x, gains, k, xs, squares[n])
                                : load_chunk<BITS>(token_x, k, xs);
      for (uint r = 0; r < R; ++r) {
        acc[r][n] += qdot_decoded<BITS>(decoded[r], scales[r], biases[r], xs, xsum);
      }
    }
  }
  // Every token's rows, and their norms' sums of squares, reduced in one exchange (qgemv_store's
  // sums, bit for bit): value i = n * R + r by lanes i, i + 32, ...; through the conv, the totals
  // go back to threadgroup memory, where the lane owning a row walks its tokens in order.
  const uint rows = p.rows[t.proj];
  const uint stride = p.lane_stride;
  const uint values = R * p.tokens;
  threadgroup float* mine = scratch + simdgroup * qgemv_scratch_floats(p);
  for (uint n = 0; n < QGEMV_MAX_TOKENS; ++n) {
    if (n >= p.tokens) break;
    for (uint r = 0; r < R; ++r) mine[lane * stride + n * R + r] = acc[r][n];
    if (NORMED) mine[lane * stride + values + n] = squares[n];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const bool convolves = p.conv != 0 && t.proj == 0;
  threadgroup float* totals = mine + SIMD_WIDTH * stride;
  for (uint i = lane; i < values; i += SIMD_WIDTH) {
    const uint n = i / R, r = i % R;
    float total = lane_sum(mine, stride, i);
    if (NORMED) total *= inv_rms_of(lane_sum(mine, stride, values + n), p.in_dim, p.eps);
    if (convolves) {
      totals[i] = total;
    } else if (r < t.count) {
      device float* y = t.y + ulong(n) * rows + t.row0 + r;
      *y = p.accumulate != 0 ? *y + total : total;
    }
  }
  if (!convolves) return;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lane >= t.count) return;
  const QGemvConvTail conv{conv_weight, conv_window, conv_tail,
                           p.tokens + kHistory - p.conv_tail_rows, rows};
  const uint row = t.row0 + lane;
  float history[kHistory];
  conv_tail_start(conv, row, history);
  for (uint n = 0; n < QGEMV_MAX_TOKENS; ++n) {
    if (n >= p.tokens) break;
    const float total = conv_tail_step(conv, row, n, history, totals[n * R + lane]);
    device float* y = t.y + ulong(n) * rows + row;
    *y = p.accumulate != 0 ? *y + total : total;
  }
}

// The decode step's first GEMV: x is the embedding row of token tokens[position[0]] (clamped to
// the table, as embedding.metal does), with the layer's input norm folded in as qgemv_normed.
// The SIMD-group computing projection 0's first rows also writes the row to `residual`, each
// lane the chunks it dequantized. Nothing else in this dispatch reads `residual` (every
// SIMD-group dequantizes x from the table), so that write races with no read; the residual adds
// of later dispatches see it after the barrier that follows.
template <uint BITS, uint EMBED_BITS>
[[kernel]] void qgemv_embedded(
    constant QGemvParams& p [[buffer(0)]], device float* residual [[buffer(1)]],
    device const uint* w0 [[buffer(2)]], device const bfloat* s0 [[buffer(3)]],
    device const bfloat* b0 [[buffer(4)]], device float* y0 [[buffer(5)]],
    device const uint* w1 [[buffer(6)]], device const bfloat* s1 [[buffer(7)]],
    device const bfloat* b1 [[buffer(8)]], device float* y1 [[buffer(9)]],
    device const uint* w2 [[buffer(10)]], device const bfloat* s2 [[buffer(11)]],
    device const bfloat* b2 [[buffer(12)]], device float* y2 [[buffer(13)]],
    device const uint* w3 [[buffer(14)]], device const bfloat* s3 [[buffer(15)]],
    device const bfloat* b3 [[buffer(16)]], device float* y3 [[buffer(17)]],
    device const bfloat* gain [[buffer(18)]], device const bfloat* conv_weight [[buffer(19)]],
    device float* conv_window [[buffer(20)]], device const uint* tokens [[buffer(21)]],
    device const uint* position [[buffer(22)]], device const uint* table_weight [[buffer(23)]],
    device const bfloat* table_scales [[buffer(24)]],
    device const bfloat* table_biases [[buffer(25)]], threadgroup float* scratch [[threadgroup(0)]],
    uint threadgroup_id [[threadgroup_position_in_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const QGemvTarget t = qgemv_target(p, QuantMatrix{w0, s0, b0}, y0, QuantMatrix{w1, s1, b1}, y1,
                                     QuantMatrix{w2, s2, b2}, y2, QuantMatrix{w3, s3, b3}, y3,
                                     threadgroup_id, simdgroup, simdgroups);
  if (t.count == 0) return;  // the whole SIMD-group leaves together

  const EmbeddedRow<EMBED_BITS> x{QuantMatrix{table_weight, table_scales, table_biases},
                                  p.in_dim, embedding_row(tokens[position[0]], p.embed_rows),
                                  residual, t.proj == 0 && t.row0 == 0};
  float acc[QGEMV_ROWS_PER_SIMDGROUP];
  const float squares = qgemv_rows_gained<BITS, QGEMV_ROWS_PER_SIMDGROUP>(
      t.m, p.in_dim, t.row0, t.count, x, gain, lane, acc);
  qgemv_store<true>(p, t, acc, squares, scratch + simdgroup * qgemv_scratch_floats(p),
                    conv_weight, conv_window, lane);
}

template [[host_name("qgemv_4_float")]] [[kernel]] decltype(qgemv<4, float, false>)
    qgemv<4, float, false>;
template [[host_name("qgemv_4_bfloat")]] [[kernel]] decltype(qgemv<4, bfloat, false>)
    qgemv<4, bfloat, false>;
template [[host_name("qgemv_8_float")]] [[kernel]] decltype(qgemv<8, float, false>)
    qgemv<8, float, false>;
template [[host_name("qgemv_8_bfloat")]] [[kernel]] decltype(qgemv<8, bfloat, false>)
    qgemv<8, bfloat, false>;
template [[host_name("qgemv_tokens_4")]] [[kernel]] decltype(qgemv_tokens<4, false>)
    qgemv_tokens<4, false>;
template [[host_name("qgemv_tokens_8")]] [[kernel]] decltype(qgemv_tokens<8, false>)
    qgemv_tokens<8, false>;
template [[host_name("qgemv_tokens_normed_4")]] [[kernel]] decltype(qgemv_tokens<4, true>)
    qgemv_tokens<4, true>;
template [[host_name("qgemv_tokens_normed_8")]] [[kernel]] decltype(qgemv_tokens<8, true>)
    qgemv_tokens<8, true>;
// The residual stream is fp32, so only fp32 inputs are ever normed on the fly.
template [[host_name("qgemv_normed_4_float")]] [[kernel]] decltype(qgemv<4, float, true>)
    qgemv<4, float, true>;
template [[host_name("qgemv_normed_8_float")]] [[kernel]] decltype(qgemv<8, float, true>)
    qgemv<8, float, true>;
// The embedding table's bit width need not be the projection's: every pairing of 4 and 8 bits.
template [[host_name("qgemv_embedded_4_4")]] [[kernel]] decltype(qgemv_embedded<4, 4>)
    qgemv_embedded<4, 4>;
template [[host_name("qgemv_embedded_4_8")]] [[kernel]] decltype(qgemv_embedded<4, 8>)
    qgemv_embedded<4, 8>;
template [[host_name("qgemv_embedded_8_4")]] [[kernel]] decltype(qgemv_embedded<8, 4>)
    qgemv_embedded<8, 4>;
template [[host_name("qgemv_embedded_8_8")]] [[kernel]] decltype(qgemv_embedded<8, 8>)
    qgemv_embedded<8, 8>;
