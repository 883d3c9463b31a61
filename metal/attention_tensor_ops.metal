// Chunk attention on Metal 4 tensor ops (MSL 4.0, macOS 26): attention_chunk's causal, gated
// attention of a chunk's T queries over a bf16 cache (attention.metal; same parameters, same
// output), with its two products S = Q K^T and O += P V multiplied by mpp::tensor_ops::matmul2d,
// which on an M5 runs on the GPU's neural accelerators. The host compiles this file on its own at
// MSL 4.0, exactly as it compiles quantized_gemm_tensor_ops.metal (csrc/metal/metal_device.mm),
// only on macOS 26.2 with an Apple10 GPU; everywhere else, and for an int8 cache, chunks run
// attention_chunk. It keeps to what the GEMMs' tensor ops use and Apple's header documents (a
// 4-SIMD-group scope, static descriptors with M 64, N 32 or 256, K 256 or 32, fp32 destination
// cooperative tensors read through get_multidimensional_index) and adds a device-memory left
// operand (half) and a bfloat x bfloat product; every MetalPerformancePrimitives declaration it
// uses is listed in csrc/sim/tensor_ops_declarations.py. It has not been compiled by Apple's
// compiler. The sim runs this same source on its emulation (csrc/sim/include/lily_sim_tensor_ops.h).
//
// Two dispatches:
//
//   attention_chunk_queries  the chunk's queries times the scale, rounded to half, packed per kv
//                            head as [num_kv_heads, padded rows, 256]: row token * group_size +
//                            head_in_group, the rows padded with zeros to a multiple of 64, so
//                            that a threadgroup's 64 rows are one dense 64 x 256 tensor (the left
//                            operand of S, read from device memory: 32 KiB in half, all the
//                            threadgroup memory there is)
//   attention_chunk_tensor   per threadgroup 64 consecutive rows of one kv head (8 tokens of the
//                            real model's 8 query heads per kv head), 128 threads
//
// Per tile of 32 keys, K and V take turns in one 16 KiB buffer:
//   1. K staged as half, [key][dim] (16-byte loads of the cache, converted as stored); barrier;
//      V's loads of the same keys issued to registers;
//   2. S = matmul2d<64, 32, 256>(Q, K^T) into a cooperative tensor, stored to threadgroup memory
//      (its layout is known only through get_multidimensional_index); barrier;
//   3. V stored as bfloat, [key][dim] (bf16 bits as they are); the next tile's K loads issued;
//      the online softmax, two threads per row, 16 keys each: the row's running max over its
//      visible keys, P = exp(S - max) rounded to bfloat (and summed so), the rescale of the row's
//      earlier tiles; barrier;
//   4. O = O * rescale + matmul2d<64, 256, 32>(P, V), O's 64 x 256 fp32 accumulators a
//      cooperative tensor (128 per thread); barrier.
// The threadgroup stops at the last key its last token sees and each row masks the keys past its
// own position; keys past that are staged as zeros. Operands and rounding are attention_chunk's
// (Q and K in half, P and V in bfloat, S, the softmax and O in fp32), in tiles of 32 keys instead
// of 16 (reference.attention_in_tiles models both). Threadgroup memory: 16 KiB of K or V, 8 KiB
// of scores, 4 KiB of P and 256 bytes of per-row factors, 28.25 KiB.
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "attention_chunk.h"
#include "common.h"

constexpr constant uint kTensorChunkRows = 64;
constexpr constant uint kTensorChunkKeys = 32;
constexpr constant uint kTensorChunkSimdgroups = 4;
constexpr constant uint kTensorChunkThreads = kTensorChunkSimdgroups * SIMD_WIDTH;
// A staged piece is 16 bytes of a cache row: 8 bf16 dims.
constexpr constant uint kPieceDims = 8;
constexpr constant uint kPiecesPerRow = kHeadDim / kPieceDims;
constexpr constant uint kTensorStagePieces =
    kTensorChunkKeys * kPiecesPerRow / kTensorChunkThreads;
// The softmax's threads per row, and the keys of a tile each takes.
constexpr constant uint kSoftmaxThreads = kTensorChunkThreads / kTensorChunkRows;
constexpr constant uint kSoftmaxKeys = kTensorChunkKeys / kSoftmaxThreads;

static_assert(kTensorStagePieces == 8, "whole pieces per thread");
static_assert(kSoftmaxThreads == 2, "a row's two threads are lanes 2 r and 2 r + 1");
static_assert(2 * kTensorChunkKeys * kHeadDim + 4 * kTensorChunkRows * kTensorChunkKeys +
                      2 * kTensorChunkRows * kTensorChunkKeys + 4 * kTensorChunkRows <=
                  32 * 1024,
              "fits in 32 KiB of threadgroup memory");

// Rows of a kv head in the packed queries: the chunk's rows padded to whole threadgroups.
inline uint tensor_chunk_padded_rows(uint rows) {
  return (rows + kTensorChunkRows - 1) / kTensorChunkRows * kTensorChunkRows;
}

// Grid (padded rows, num_kv_heads), 32 threads: one row per threadgroup, 8 dims per lane.
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]] void attention_chunk_queries(
    constant AttentionChunkParams& params [[buffer(0)]],
    device const float* queries [[buffer(1)]],  // [T, Hq, head_dim]: normed, rotated
    device half* packed [[buffer(2)]],          // [Hkv, padded rows, head_dim]
    uint2 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group_id.x;
  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint token = row / group_size;
  const uint q_head = kv_head * group_size + row % group_size;
  const uint padded = tensor_chunk_padded_rows(params.tokens * group_size);
  device half4* to = reinterpret_cast<device half4*>(
      packed + (ulong(kv_head) * padded + row) * kHeadDim + kPieceDims * lane);
  if (token < params.tokens) {
    device const float4* from = reinterpret_cast<device const float4*>(
        queries + (ulong(token) * params.num_q_heads + q_head) * kHeadDim + kPieceDims * lane);
    to[0] = half4(from[0] * params.scale);
    to[1] = half4(from[1] * params.scale);
  } else {
    to[0] = half4(0.0h);
    to[1] = half4(0.0h);
  }
}

// A thread's share of one K or V tile as loaded from the cache: piece p is tile piece
// thread_id + p * kTensorChunkThreads, key piece / kPiecesPerRow, dims from
// (piece % kPiecesPerRow) * kPieceDims. Zeros past the context.
struct TensorChunkStage {
  uint4 piece[kTensorStagePieces];
};

inline void load_tensor_chunk_stage(device const uchar* rows, uint key0, uint context,
                                    uint thread_id, thread TensorChunkStage& s) {
  for (uint p = 0; p < kTensorStagePieces; ++p) {
    const uint piece = thread_id + p * kTensorChunkThreads;
    const uint key = key0 + piece / kPiecesPerRow;
    const ulong at = ulong(key) * kBf16RowBytes + (piece % kPiecesPerRow) * 16;
    s.piece[p] = key < context ? *reinterpret_cast<device const uint4*>(rows + at) : uint4(0);
  }
}

// K as half, [key][dim]: S's right operand, given transposed.
inline void store_tensor_chunk_keys(thread const TensorChunkStage& s, uint thread_id,
                                    threadgroup half* keys) {
  for (uint p = 0; p < kTensorStagePieces; ++p) {
    const uint piece = thread_id + p * kTensorChunkThreads;
    threadgroup half4* to = reinterpret_cast<threadgroup half4*>(
        keys + (piece / kPiecesPerRow) * kHeadDim + (piece % kPiecesPerRow) * kPieceDims);
    const uint4 w = s.piece[p];
    to[0] = half4(bf16_low(w[0]), bf16_high(w[0]), bf16_low(w[1]), bf16_high(w[1]));
    to[1] = half4(bf16_low(w[2]), bf16_high(w[2]), bf16_low(w[3]), bf16_high(w[3]));
  }
}

// V as bfloat, [key][dim]: the cache's bits as they are.
inline void store_tensor_chunk_values(thread const TensorChunkStage& s, uint thread_id,
                                      threadgroup bfloat* values) {
  for (uint p = 0; p < kTensorStagePieces; ++p) {
    const uint piece = thread_id + p * kTensorChunkThreads;
    *reinterpret_cast<threadgroup uint4*>(values + (piece / kPiecesPerRow) * kHeadDim +
                                          (piece % kPiecesPerRow) * kPieceDims) = s.piece[p];
  }
}

// Grid (ceil(tokens * group_size / 64), num_kv_heads), 128 threads per threadgroup. Bindings as
// attention_chunk's, but buffer 1 holds attention_chunk_queries' packed queries.
[[kernel, max_total_threads_per_threadgroup(kTensorChunkThreads)]] void attention_chunk_tensor(
    constant AttentionChunkParams& params [[buffer(0)]],
    device half* packed [[buffer(1)]],          // [Hkv, padded rows, head_dim], scaled
    device const float* q_proj [[buffer(2)]],   // [T, Hq, 2, head_dim]: the gate halves are read
    device const uchar* k_cache [[buffer(3)]],  // [Hkv, cache_capacity] bf16 rows
    device const uchar* v_cache [[buffer(4)]],  // [Hkv, cache_capacity] bf16 rows
    device const uint* step [[buffer(5)]],      // [position, ...]
    device float* out [[buffer(6)]],            // [T, Hq, head_dim]: attention * sigmoid(gate)
    uint2 group_id [[threadgroup_position_in_grid]],
    uint thread_id [[thread_index_in_threadgroup]]) {
  using namespace mpp::tensor_ops;
  // K (half) or V (bfloat) of one tile, 16-byte aligned for the uint4 / half4 stores.
  alignas(16) threadgroup ushort kv_bits[kTensorChunkKeys * kHeadDim];
  threadgroup half* keys = reinterpret_cast<threadgroup half*>(kv_bits);
  threadgroup bfloat* values = reinterpret_cast<threadgroup bfloat*>(kv_bits);
  threadgroup float scores[kTensorChunkRows * kTensorChunkKeys];           // [row][key]
  threadgroup bfloat probabilities[kTensorChunkRows * kTensorChunkKeys];   // [row][key]
  // Per row: the tile's rescale, then the softmax denominator.
  threadgroup float row_factor[kTensorChunkRows];

  const uint kv_head = group_id.y;
  const uint group_size = params.num_q_heads / params.num_kv_heads;
  const uint position = step[0];
  const uint rows = params.tokens * group_size;
  const uint first_row = group_id.x * kTensorChunkRows;
  const uint last_row = min(first_row + kTensorChunkRows, rows) - 1;
  const uint context = min(position + last_row / group_size + 1, params.cache_capacity);

  // The softmax's row of this thread and its half of a tile's keys. Rows past the chunk (in the
  // last threadgroup) hold zero queries and see the zeros staged past the context: finite, and
  // never stored.
  const uint softmax_row = thread_id / kSoftmaxThreads;
  const uint softmax_keys = (thread_id % kSoftmaxThreads) * kSoftmaxKeys;
  const uint last_visible = position + (first_row + softmax_row) / group_size;

  // Extents are (inner, outer): Q is 64 rows of 256 dims (M x K), K 32 keys of 256 dims (B^T,
  // hence transpose_right), P 64 rows of 32 keys (M x K), V 32 keys of 256 dims (K x N).
  auto q_tensor = metal::tensor(
      packed + (ulong(kv_head) * tensor_chunk_padded_rows(rows) + first_row) * kHeadDim,
      metal::dextents<int32_t, 2>(kHeadDim, kTensorChunkRows));
  auto k_tensor = metal::tensor(keys, metal::dextents<int32_t, 2>(kHeadDim, kTensorChunkKeys));
  auto p_tensor =
      metal::tensor(probabilities, metal::dextents<int32_t, 2>(kTensorChunkKeys, kTensorChunkRows));
  auto v_tensor = metal::tensor(values, metal::dextents<int32_t, 2>(kHeadDim, kTensorChunkKeys));
  constexpr auto score_desc = matmul2d_descriptor(
      kTensorChunkRows, kTensorChunkKeys, kHeadDim, /*transpose_left=*/false,
      /*transpose_right=*/true, /*relaxed_precision=*/false, matmul2d_descriptor::mode::multiply);
  constexpr auto value_desc = matmul2d_descriptor(
      kTensorChunkRows, kHeadDim, kTensorChunkKeys, /*transpose_left=*/false,
      /*transpose_right=*/false, /*relaxed_precision=*/false,
      matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<score_desc, metal::execution_simdgroups<kTensorChunkSimdgroups>> score_op;
  matmul2d<value_desc, metal::execution_simdgroups<kTensorChunkSimdgroups>> value_op;
  auto acc = value_op.template get_destination_cooperative_tensor<decltype(p_tensor),
                                                                  decltype(v_tensor), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
  }

  // Finite start value: fast math does not promise IEEE infinities. Key 0 is visible to every
  // row, so the first tile replaces it.
  float running_max = -1.0e30f;
  float partial_sum = 0.0f;  // this thread's share of its row's softmax denominator
  const ulong head_base = ulong(kv_head) * params.cache_capacity * kBf16RowBytes;
  device const uchar* k_rows = k_cache + head_base;
  device const uchar* v_rows = v_cache + head_base;
  TensorChunkStage stage;
  load_tensor_chunk_stage(k_rows, 0, context, thread_id, stage);
  for (uint key0 = 0; key0 < context; key0 += kTensorChunkKeys) {
    store_tensor_chunk_keys(stage, thread_id, keys);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    load_tensor_chunk_stage(v_rows, key0, context, thread_id, stage);

    auto s = score_op.template get_destination_cooperative_tensor<decltype(q_tensor),
                                                                  decltype(k_tensor), float>();
    score_op.run(q_tensor, k_tensor, s);
    for (uint16_t i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) continue;
      const auto at = s.get_multidimensional_index(i);
      scores[uint(at[1]) * kTensorChunkKeys + uint(at[0])] = s[i];
    }
    // Every SIMD-group has read K and written its scores.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    store_tensor_chunk_values(stage, thread_id, values);
    if (key0 + kTensorChunkKeys < context) {
      load_tensor_chunk_stage(k_rows, key0 + kTensorChunkKeys, context, thread_id, stage);
    }
    threadgroup const float* row_scores = scores + softmax_row * kTensorChunkKeys + softmax_keys;
    const uint first_key = key0 + softmax_keys;
    float tile_max = running_max;
    for (uint j = 0; j < kSoftmaxKeys; ++j) {
      tile_max = first_key + j <= last_visible ? max(tile_max, row_scores[j]) : tile_max;
    }
    const float new_max = max(tile_max, simd_shuffle_xor(tile_max, 1));
    const float rescale = exp(running_max - new_max);
    running_max = new_max;
    partial_sum *= rescale;
    threadgroup bfloat* row_p = probabilities + softmax_row * kTensorChunkKeys + softmax_keys;
    for (uint j = 0; j < kSoftmaxKeys; ++j) {
      const float p = first_key + j <= last_visible ? exp(row_scores[j] - running_max) : 0.0f;
      row_p[j] = bfloat(p);
      partial_sum += float(bfloat(p));
    }
    if (softmax_keys == 0) row_factor[softmax_row] = rescale;
    // P, V and the rescales are in place.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
      if (!acc.is_valid_element(i)) continue;
      acc[i] *= row_factor[uint(acc.get_multidimensional_index(i)[1])];
    }
    value_op.run(p_tensor, v_tensor, acc);
    // The next tile overwrites what the other SIMD-groups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float denominator = partial_sum + simd_shuffle_xor(partial_sum, 1);
  if (softmax_keys == 0) row_factor[softmax_row] = denominator;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto at = acc.get_multidimensional_index(i);
    const uint r = uint(at[1]);
    const uint row = first_row + r;
    if (row >= rows) continue;
    const uint dim = uint(at[0]);
    const ulong head = ulong(row / group_size) * params.num_q_heads + kv_head * group_size +
                       row % group_size;
    const float gate = q_proj[head * 2 * kHeadDim + kHeadDim + dim];
    out[head * kHeadDim + dim] = acc[i] / row_factor[r] * sigmoid(gate);
  }
}
