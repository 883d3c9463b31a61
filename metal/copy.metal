// Word-for-word copies of device memory, for a verify pass's rollback of the recurrent state
// (conv windows and GDN state, updated in place): the pass copies the state into a backup
// before its layers, and after its acceptance copies the backup back when a draft was
// rejected, so the state is the one after the last token the pass did not speculate on.
#include "common.h"

struct CopyShape {
  uint words;   // uint32 words to copy
  uint drafts;  // restore_if_rejected: the verify pass's drafted tokens
};

// Each thread copies up to this many words, strided by the threadgroup so that neighbouring
// threads touch neighbouring words.
constexpr constant uint COPY_WORDS_PER_THREAD = 64;

// `accepted` (accept_drafts' output, its first word the accepted count) is read only when
// `IF_REJECTED`: the copy then happens only if fewer than all the drafts were accepted.
template <bool IF_REJECTED>
[[kernel]] void copy_words(constant CopyShape& shape [[buffer(0)]],
                           device const uint* source [[buffer(1)]],
                           device uint* destination [[buffer(2)]],
                           device const uint* accepted [[buffer(3)]],
                           uint group [[threadgroup_position_in_grid]],
                           uint thread_id [[thread_index_in_threadgroup]],
                           uint threads [[threads_per_threadgroup]]) {
  if (IF_REJECTED && accepted[0] >= shape.drafts) return;
  const uint span = threads * COPY_WORDS_PER_THREAD;
  const uint begin = group * span;
  const uint end = min(shape.words, begin + span);
  for (uint i = begin + thread_id; i < end; i += threads) destination[i] = source[i];
}

template [[host_name("copy_words")]] [[kernel]] decltype(copy_words<false>) copy_words<false>;
template [[host_name("restore_if_rejected")]] [[kernel]] decltype(copy_words<true>)
    copy_words<true>;
