// Word-for-word copies of device memory (the benchmarks' and tests' way to move data between
// buffers on the device, in order with the dispatches around them).
#include "common.h"

struct CopyShape {
  uint words;  // uint32 words to copy
};

// Each thread copies up to this many words, strided by the threadgroup so that neighbouring
// threads touch neighbouring words.
constexpr constant uint COPY_WORDS_PER_THREAD = 64;

[[kernel]] void copy_words(constant CopyShape& shape [[buffer(0)]],
                           device const uint* source [[buffer(1)]],
                           device uint* destination [[buffer(2)]],
                           uint group [[threadgroup_position_in_grid]],
                           uint thread_id [[thread_index_in_threadgroup]],
                           uint threads [[threads_per_threadgroup]]) {
  const uint span = threads * COPY_WORDS_PER_THREAD;
  const uint begin = group * span;
  const uint end = min(shape.words, begin + span);
  for (uint i = begin + thread_id; i < end; i += threads) destination[i] = source[i];
}

struct FlaggedRowsShape {
  uint words_per_row;
};

// rows[t] = staged[t] for each row t whose flag is set; the other rows keep their words. A chunk
// with image tokens puts the vision tower's rows in place of those tokens' embeddings this way,
// after the embedding lookup: the host stages them (and the flags) before it submits the pass.
// Grid (rows), any multiple of 32 threads.
[[kernel]] void copy_flagged_rows(constant FlaggedRowsShape& shape [[buffer(0)]],
                                  device const uint* flags [[buffer(1)]],
                                  device const uint* staged [[buffer(2)]],
                                  device uint* rows [[buffer(3)]],
                                  uint row [[threadgroup_position_in_grid]],
                                  uint thread_id [[thread_index_in_threadgroup]],
                                  uint threads [[threads_per_threadgroup]]) {
  if (flags[row] == 0) {
    return;
  }
  const ulong base = ulong(row) * shape.words_per_row;
  for (uint i = thread_id; i < shape.words_per_row; i += threads) {
    rows[base + i] = staged[base + i];
  }
}
