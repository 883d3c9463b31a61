// Embedding lookup: the rows of an MLX-quantized table for a run of token ids, dequantized to
// fp32. The ids and the index of the first one are read from device buffers (the token history
// and the step buffer's position), so one recorded graph serves every position and a replayed
// graph can feed back its own output.
#include "common.h"
#include "embedding.h"
#include "quantized.h"
#include "step.h"

struct EmbeddingParams {
  uint dim;   // row length, a multiple of 64
  uint rows;  // vocabulary size
};

// Word `word` of table row `row`, dequantized into its place in `dst` (fp32 [dim]).
template <uint BITS>
inline void embed_word(constant EmbeddingParams& p, uint row, uint word, device const uint* weight,
                       device const bfloat* scales, device const bfloat* biases,
                       device float* dst) {
  constexpr uint per_word = 32 / BITS;
  const uint packed = weight[ulong(row) * (p.dim / per_word) + word];
  const ulong group = ulong(row) * (p.dim / QUANT_GROUP_SIZE) + word * per_word / QUANT_GROUP_SIZE;
  const float scale = float(scales[group]);
  const float bias = float(biases[group]);
  for (uint j = 0; j < per_word; ++j) {
    dst[word * per_word + j] = dequantize_code<BITS>(packed, j, scale, bias);
  }
}

// Grid: x covers a row in words of codes (one word per thread), y is the token. The position and
// size built-ins are all uint2: MSL requires one dimension for all of a kernel's.
template <uint BITS>
[[kernel]] void embedding(constant EmbeddingParams& p [[buffer(0)]],
                          device const uint* tokens [[buffer(1)]],
                          device const uint* weight [[buffer(2)]],
                          device const bfloat* scales [[buffer(3)]],
                          device const bfloat* biases [[buffer(4)]],
                          device float* out [[buffer(5)]],
                          device const uint* first [[buffer(6)]],
                          uint2 threadgroup_id [[threadgroup_position_in_grid]],
                          uint thread_id [[thread_index_in_threadgroup]],
                          uint2 threads [[threads_per_threadgroup]]) {
  constexpr uint per_word = 32 / BITS;
  const uint words_per_row = p.dim / per_word;
  const uint word = threadgroup_id.x * threads.x + thread_id;
  if (word >= words_per_row) return;
  const uint row = embedding_row(tokens[first[0] + threadgroup_id.y], p.rows);

  embed_word<BITS>(p, row, word, weight, scales, biases, out + ulong(threadgroup_id.y) * p.dim);
}

// A batched decode pass's lookups in one dispatch: grid y is the pass's row, and row r embeds
// the token of sequence slot row_slots[r], the token field of its step buffer (the steps of all
// slots lying one after another, kStepFields words each), which names the token the row consumes.
template <uint BITS>
[[kernel]] void embedding_rows(constant EmbeddingParams& p [[buffer(0)]],
                               device const uint* steps [[buffer(1)]],
                               device const uint* weight [[buffer(2)]],
                               device const bfloat* scales [[buffer(3)]],
                               device const bfloat* biases [[buffer(4)]],
                               device float* out [[buffer(5)]],
                               device const uint* row_slots [[buffer(6)]],
                               uint2 threadgroup_id [[threadgroup_position_in_grid]],
                               uint thread_id [[thread_index_in_threadgroup]],
                               uint2 threads [[threads_per_threadgroup]]) {
  constexpr uint per_word = 32 / BITS;
  const uint words_per_row = p.dim / per_word;
  const uint word = threadgroup_id.x * threads.x + thread_id;
  if (word >= words_per_row) return;
  const uint step = row_slots[threadgroup_id.y] * kStepFields;
  const uint row = embedding_row(steps[step + kStepToken], p.rows);

  embed_word<BITS>(p, row, word, weight, scales, biases, out + ulong(threadgroup_id.y) * p.dim);
}

template [[host_name("embedding_4")]] [[kernel]] decltype(embedding<4>) embedding<4>;
template [[host_name("embedding_8")]] [[kernel]] decltype(embedding<8>) embedding<8>;
template [[host_name("embedding_rows_4")]] [[kernel]] decltype(embedding_rows<4>) embedding_rows<4>;
template [[host_name("embedding_rows_8")]] [[kernel]] decltype(embedding_rows<8>) embedding_rows<8>;
