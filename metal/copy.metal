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
