// The quantized GEMMs of batched prefill on Metal 4 tensor ops (MSL 4.0, macOS 26): the same
// products as quantized_gemm.metal's qgemm_BITS_TOKENS and qgemm_grouped(_swiglu)_BITS, with the
// same parameters, bindings and grid, but multiplied by mpp::tensor_ops::matmul2d, which on an
// M5 (GPU family Apple10) runs on the GPU's neural accelerators. The host compiles this file on
// its own, at MSL 4.0, only on macOS 26 with an Apple10 GPU (csrc/metal/metal_device.mm), and
// runs the simdgroup-matrix kernels everywhere else and whenever this file fails to compile.
//
// It keeps to what Apple's header documentation of matmul2d and a working public example show (a
// 4-SIMD-group scope, static descriptors with M 32 or 64, N 64 and K 32, as the tensor-op chunk
// attention's P V, half operands in threadgroup memory, B given transposed, fp32 destination
// cooperative tensors read back element by element through get_multidimensional_index). Every
// MetalPerformancePrimitives declaration it uses was checked against the macOS 26.2 SDK's headers
// (csrc/sim/tensor_ops_declarations.py; tools/check_macos_build.py --mpp-headers): half x half
// into float is a row of their table, and both products run into destinations made for the same
// non-const half x half operands, which the header requires. It has not been compiled by Apple's
// compiler. The sim runs this same source on its emulation of those calls
// (csrc/sim/include/lily_sim_tensor_ops.h).
//
// Per threadgroup of 128 threads: TOKENS (32 or 64) token rows x 128 weight rows, 32 inputs per
// stage. Staging is that of quantized_gemm.h (thread t dequantizes weight row t to half with one
// fma, the threads copy X as half, times 2^-e under the range guard), in packed rows of 32
// halves, as the tensors want them. Weight rows 0-63 and 64-127 of the tile are two 64 x 32
// right operands, multiplied by one op into two accumulators of identical layout: output columns
// n0.. and n0 + 64.. or, with SWIGLU, the gate and the up projection of the same 64 columns, so
// that each thread holds the matching gate and up values and applies silu(gate) * up in
// registers.
//
// Double-buffered, as quantized_gemm.h's simdgroup tile: the next stage's device loads are issued
// before this stage's products and stored to the other buffer after them, one barrier per stage
// (a buffer is overwritten two stages after it was multiplied, past the barrier that follows
// every SIMD-group's products of it), so the tensor ops never wait for a stage's stores to the
// buffer they read. Two stages of (64 + 128) x 32 halves are 24 KiB, what one 64-input stage
// took before (two of those would be 48 KiB). The grouped GEMM's tiles of 8 and 16 assignments
// run as 32-row tiles (the smallest M the example shows), their other rows staged as zeros and
// never stored.
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "common.h"
#include "quantized.h"
#include "quantized_gemm.h"

constexpr constant uint QGEMM_TENSOR_COLUMNS = QGEMM_WEIGHT_ROWS / 2;  // N of one product
constexpr constant uint QGEMM_TENSOR_SIMDGROUPS = QGEMM_THREADS / SIMD_WIDTH;

static_assert(QGEMM_TENSOR_SIMDGROUPS == 4, "the documented scope: 4 SIMD-groups");

// Halves of one stage of a tile of `tokens` rows: X then the 128 weight rows, QGEMM_DEPTH inputs
// each; and of the staging memory, QGEMM_STAGES of them.
constexpr uint qgemm_tensor_stage_elements(uint tokens) {
  return (tokens + QGEMM_WEIGHT_ROWS) * QGEMM_DEPTH;
}
constexpr uint qgemm_tensor_tile_elements(uint tokens) {
  return QGEMM_STAGES * qgemm_tensor_stage_elements(tokens);
}
static_assert(qgemm_tensor_tile_elements(QGEMM_MAX_TOKENS) * 2 <= 32 * 1024, "fits in 32 KiB");

// Where a tile's results go: tile row r (below `count`) is output row first + r, reads x row
// x_row(r) (row_index[first + r] when gathered) and is scaled back by 2^e of that row's guard;
// output columns below `columns` only, row stride `stride`.
struct QgemmTensorOutput {
  device float* out;
  uint first;
  uint count;
  uint col0;
  uint columns;
  uint stride;
  bool gather;
  bool guarded;
};

inline uint qgemm_tensor_x_row(QgemmTensorOutput o, device const uint* row_index, uint r) {
  return o.gather ? row_index[o.first + r] : o.first + r;
}

// Computes a TOKENS x 128 tile and stores it as `o` says.
//   x_rows[i], x_down[i]: the row of x this thread stages as its i-th load of every 32-input
//     stage (tile row qgemm_x_tile_row(thread_id, i)), or QGEMM_NO_ROW, and its 2^-e;
//   w, w_row, w_valid: the matrix and row this thread stages as tile row thread_id.
// Call from uniform control flow with all QGEMM_THREADS threads.
template <uint BITS, uint TOKENS, bool SWIGLU>
inline void qgemm_tensor_tile(device const float* x, uint in_dim, thread const uint* x_rows,
                              thread const float* x_down, QuantMatrix w, uint w_row, bool w_valid,
                              device const uint* row_index, device const int* x_exponents,
                              QgemmTensorOutput o, threadgroup half* tile, uint thread_id) {
  using namespace mpp::tensor_ops;
  static_assert(TOKENS == 32 || TOKENS == 64, "the tensor-op tiles have 32 or 64 rows");
  constexpr uint depth = QGEMM_DEPTH;
  constexpr uint stage_elements = qgemm_tensor_stage_elements(TOKENS);
  const uint x_col = (thread_id % (QGEMM_DEPTH / 4)) * 4;

  // Extents are (inner, outer): X is TOKENS rows of 32 inputs (M x K); each weight half is 64
  // rows of 32 inputs, B^T, hence transpose_right. The same tensor types for either buffer.
  using XTensor = decltype(metal::tensor(tile, metal::dextents<int32_t, 2>(depth, TOKENS)));
  using WTensor =
      decltype(metal::tensor(tile, metal::dextents<int32_t, 2>(depth, QGEMM_TENSOR_COLUMNS)));
  constexpr auto desc = matmul2d_descriptor(TOKENS, QGEMM_TENSOR_COLUMNS, depth,
                                            /*transpose_left=*/false, /*transpose_right=*/true,
                                            /*relaxed_precision=*/false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, metal::execution_simdgroups<QGEMM_TENSOR_SIMDGROUPS>> op;
  auto acc_low = op.template get_destination_cooperative_tensor<XTensor, WTensor, float>();
  auto acc_high = op.template get_destination_cooperative_tensor<XTensor, WTensor, float>();
  for (uint16_t i = 0; i < acc_low.get_capacity(); ++i) {
    if (acc_low.is_valid_element(i)) {
      acc_low[i] = 0.0f;
      acc_high[i] = 0.0f;
    }
  }

  QgemmStage<BITS, TOKENS> stage;
  qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_down, x_col, w, w_row, w_valid, 0);
  qgemm_store_stage<BITS, TOKENS, depth>(stage, tile, tile + TOKENS * depth, thread_id, x_col);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint current = 0;
  for (uint k0 = 0; k0 < in_dim; k0 += depth) {
    const bool more = k0 + depth < in_dim;
    if (more) {
      qgemm_load_stage<BITS, TOKENS>(stage, x, in_dim, x_rows, x_down, x_col, w, w_row, w_valid,
                                     k0 + depth);
    }
    threadgroup half* staged = tile + current * stage_elements;
    auto x_staged = metal::tensor(staged, metal::dextents<int32_t, 2>(depth, TOKENS));
    auto w_low = metal::tensor(staged + TOKENS * depth,
                               metal::dextents<int32_t, 2>(depth, QGEMM_TENSOR_COLUMNS));
    auto w_high = metal::tensor(staged + (TOKENS + QGEMM_TENSOR_COLUMNS) * depth,
                                metal::dextents<int32_t, 2>(depth, QGEMM_TENSOR_COLUMNS));
    op.run(x_staged, w_low, acc_low);
    op.run(x_staged, w_high, acc_high);
    if (more) {
      current ^= 1;
      threadgroup half* target = tile + current * stage_elements;
      qgemm_store_stage<BITS, TOKENS, depth>(stage, target, target + TOKENS * depth, thread_id,
                                             x_col);
    }
    // The next stage is visible; the one just multiplied is overwritten only after the next
    // barrier, which every SIMD-group reaches after its products of it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint16_t i = 0; i < acc_low.get_capacity(); ++i) {
    if (!acc_low.is_valid_element(i)) continue;
    const auto at = acc_low.get_multidimensional_index(i);
    const uint column = uint(at[0]);
    const uint r = uint(at[1]);
    if (r >= o.count) continue;
    const float up =
        o.guarded ? qgemm_power_of_two(x_exponents[qgemm_tensor_x_row(o, row_index, r)]) : 1.0f;
    const float low = up * acc_low[i];
    const float high = up * acc_high[i];
    device float* row = o.out + ulong(o.first + r) * o.stride;
    if (SWIGLU) {
      const uint c = o.col0 + column;
      if (c < o.columns) row[c] = silu(low) * high;
    } else {
      const uint c = o.col0 + column;
      if (c < o.columns) row[c] = low;
      if (c + QGEMM_TENSOR_COLUMNS < o.columns) row[c + QGEMM_TENSOR_COLUMNS] = high;
    }
  }
}

// The factors of this thread's X loads (quantized_gemm.h's qgemm_x_down) for a tile of
// `tokens` rows whose row r reads x row x_row(r), or none at and past `count`.
template <uint TOKENS>
inline void qgemm_tensor_x_rows(QgemmTensorOutput o, device const uint* row_index,
                                device const int* x_exponents, uint thread_id,
                                thread uint* x_rows, thread float* x_down) {
  for (uint i = 0; i < qgemm_x_loads(TOKENS); ++i) {
    const uint local = qgemm_x_tile_row(thread_id, i);
    x_rows[i] = local < TOKENS && local < o.count ? qgemm_tensor_x_row(o, row_index, local)
                                                  : QGEMM_NO_ROW;
  }
  qgemm_x_down<TOKENS>(x_exponents, o.guarded, x_rows, x_down);
}

template <uint BITS, uint TOKENS>
[[kernel, max_total_threads_per_threadgroup(QGEMM_THREADS)]]
void qgemm_tensor(constant QGemmParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
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
                  uint thread_id [[thread_index_in_threadgroup]]) {
  alignas(16) threadgroup half tile[qgemm_tensor_tile_elements(TOKENS)];  // staged as half4

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
  const QgemmTensorOutput o{y, m0, min(TOKENS, p.tokens - m0), n0, rows, rows, false,
                            p.x_guarded != 0};
  uint x_rows[qgemm_x_loads(TOKENS)];
  float x_down[qgemm_x_loads(TOKENS)];
  // Not gathered: no row index is read.
  qgemm_tensor_x_rows<TOKENS>(o, nullptr, x_exponents, thread_id, x_rows, x_down);
  const uint n = n0 + thread_id;
  qgemm_tensor_tile<BITS, TOKENS, false>(x, p.in_dim, x_rows, x_down, m, n, n < rows, nullptr,
                                         x_exponents, o, tile, thread_id);
}

template [[host_name("qgemm_tensor_4_32")]] [[kernel]] decltype(qgemm_tensor<4, 32>)
    qgemm_tensor<4, 32>;
template [[host_name("qgemm_tensor_4_64")]] [[kernel]] decltype(qgemm_tensor<4, 64>)
    qgemm_tensor<4, 64>;
template [[host_name("qgemm_tensor_8_32")]] [[kernel]] decltype(qgemm_tensor<8, 32>)
    qgemm_tensor<8, 32>;
template [[host_name("qgemm_tensor_8_64")]] [[kernel]] decltype(qgemm_tensor<8, 64>)
    qgemm_tensor<8, 64>;

template <uint BITS, bool SWIGLU>
[[kernel, max_total_threads_per_threadgroup(QGEMM_THREADS)]]
void qgemm_grouped_tensor(constant QGemmGroupedParams& p [[buffer(0)]],
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
  alignas(16) threadgroup half tile[qgemm_tensor_tile_elements(QGEMM_MAX_TOKENS)];
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

  // With SWIGLU, threads 0-63 stage gate rows n0.. and threads 64-127 the same up rows.
  constexpr uint out_columns = SWIGLU ? QGEMM_TENSOR_COLUMNS : QGEMM_WEIGHT_ROWS;
  const uint n0 = tile_id.x * out_columns;
  const bool stages_up = SWIGLU && thread_id >= QGEMM_TENSOR_COLUMNS;
  const uint column = SWIGLU ? thread_id % QGEMM_TENSOR_COLUMNS : thread_id;
  const QuantMatrix stacked = stages_up ? QuantMatrix{w1, s1, b1} : QuantMatrix{w0, s0, b0};
  const QuantMatrix m = quant_expert(stacked, t.expert, p.rows, p.in_dim, BITS);
  const uint n = n0 + column;
  const QgemmTensorOutput o{out, t.first, t.count, n0, p.rows, p.rows, p.gather != 0,
                            p.x_guarded != 0};

  // The tile size is the same for the whole threadgroup: uniform control flow.
  if (t.tokens == QGEMM_MAX_TOKENS) {
    uint x_rows[qgemm_x_loads(64)];
    float x_down[qgemm_x_loads(64)];
    qgemm_tensor_x_rows<64>(o, row_index, x_exponents, thread_id, x_rows, x_down);
    qgemm_tensor_tile<BITS, 64, SWIGLU>(x, p.in_dim, x_rows, x_down, m, n, n < p.rows, row_index,
                                        x_exponents, o, tile, thread_id);
  } else {
    uint x_rows[qgemm_x_loads(32)];
    float x_down[qgemm_x_loads(32)];
    qgemm_tensor_x_rows<32>(o, row_index, x_exponents, thread_id, x_rows, x_down);
    qgemm_tensor_tile<BITS, 32, SWIGLU>(x, p.in_dim, x_rows, x_down, m, n, n < p.rows, row_index,
                                        x_exponents, o, tile, thread_id);
  }
}

template [[host_name("qgemm_grouped_tensor_4")]] [[kernel]]
    decltype(qgemm_grouped_tensor<4, false>) qgemm_grouped_tensor<4, false>;
template [[host_name("qgemm_grouped_swiglu_tensor_4")]] [[kernel]]
    decltype(qgemm_grouped_tensor<4, true>) qgemm_grouped_tensor<4, true>;
template [[host_name("qgemm_grouped_tensor_8")]] [[kernel]]
    decltype(qgemm_grouped_tensor<8, false>) qgemm_grouped_tensor<8, false>;
template [[host_name("qgemm_grouped_swiglu_tensor_8")]] [[kernel]]
    decltype(qgemm_grouped_tensor<8, true>) qgemm_grouped_tensor<8, true>;
