// The Gated DeltaNet's short causal convolution, for one decoded token or a chunk of tokens.
//
// Each qkv channel is convolved over time with its own 4-tap filter (depthwise, no bias) and
// passed through SiLU. The state between calls is the window of the last 3 pre-conv rows; both
// kernels consume it and leave the rows the next call needs, so a prefilled chunk followed by
// decode steps sees the same history as decode steps alone.
#include "common.h"
#include "conv1d.h"

struct Conv1dStepParams {
  uint channels;
};

// One thread per channel. Threads touch only their own channel of the window, so the in-place
// update needs no synchronisation.
[[kernel]] void conv1d_step(
    constant Conv1dStepParams& params [[buffer(0)]],
    device const float* x [[buffer(1)]],        // [channels]: this step's pre-conv row
    device const bfloat* weight [[buffer(2)]],  // [channels, 4, 1] as stored in the checkpoint
    device float* window [[buffer(3)]],         // [3, channels]: oldest row first
    device float* out [[buffer(4)]],            // [channels]: SiLU(conv)
    uint channel [[thread_position_in_grid]]) {
  const uint channels = params.channels;
  if (channel >= channels) {
    return;
  }
  out[channel] = conv_step_channel(weight, window, channels, channel, x[channel]);
}

// A batched decode pass's conv steps in one dispatch: grid y is the pass's row, and row r steps
// its own x and out rows on the window of sequence slot row_slots[r], the windows of all slots
// lying one after another in one buffer.
[[kernel]] void conv1d_step_rows(
    constant Conv1dStepParams& params [[buffer(0)]],
    device const float* x [[buffer(1)]],        // [rows, channels]
    device const bfloat* weight [[buffer(2)]],  // [channels, 4, 1] as stored in the checkpoint
    device float* windows [[buffer(3)]],        // [slots, 3, channels]
    device float* out [[buffer(4)]],            // [rows, channels]
    device const uint* row_slots [[buffer(5)]],  // [rows]
    uint2 position [[thread_position_in_grid]]) {
  const uint channels = params.channels;
  const uint channel = position.x;
  if (channel >= channels) {
    return;
  }
  const ulong row = ulong(position.y) * channels;
  device float* window = windows + ulong(row_slots[position.y]) * kHistory * channels;
  out[row + channel] = conv_step_channel(weight, window, channels, channel, x[row + channel]);
}

struct Conv1dChunkParams {
  uint channels;
  uint tokens;
  // 0: the window is left after the last token. A verify pass's n > 0 (its candidates + 2, see
  // conv1d_commit): the window is left alone and the last n rows of "window, then the chunk" go
  // to `tail`, where conv1d_commit finds the window after any position the acceptance keeps.
  uint tail_rows;
};

// Tokens per thread in the chunk kernel: the 3 history rows a thread loads before its first
// token are amortised over this many outputs. At least kHistory, so only the first block of a
// channel ever reads the saved window (see conv1d_chunk).
constexpr constant uint kConvChunkTokensPerThread = 16;
static_assert(kConvChunkTokensPerThread >= kHistory, "later blocks must not read the window");

// Row `row` of the sequence "saved window, then the chunk" (rows 0..2 are the window).
inline float conv_input(device const float* x, thread const float* saved, uint channels,
                        uint channel, uint row) {
  return row < kHistory ? saved[row] : x[(row - kHistory) * channels + channel];
}

// Thread (channel, block) convolves tokens [16 block, 16 block + 16) of one channel. The window
// of a channel is read and rewritten by one thread only, that of block 0: it is the only block
// whose history reaches back into the window, and it reads the whole old window into registers
// before writing the new one. The new window is rows tokens..tokens+2 of the sequence above,
// which for a chunk of fewer than 3 tokens still holds old window rows.
[[kernel]] void conv1d_chunk(
    constant Conv1dChunkParams& params [[buffer(0)]],
    device const float* x [[buffer(1)]],        // [tokens, channels]: pre-conv rows
    device const bfloat* weight [[buffer(2)]],  // [channels, 4, 1] as stored in the checkpoint
    device float* window [[buffer(3)]],         // [3, channels]: oldest row first
    device float* out [[buffer(4)]],            // [tokens, channels]: SiLU(conv)
    device float* tail [[buffer(5)]],           // [tail_rows, channels]: when tail_rows > 0
    uint2 position [[thread_position_in_grid]]) {
  const uint channels = params.channels;
  const uint tokens = params.tokens;
  const uint channel = position.x;
  const uint first = position.y * kConvChunkTokensPerThread;
  if (channel >= channels || first >= tokens) {
    return;
  }
  const bool owns_window = first == 0;
  float saved[kHistory];
  for (uint t = 0; t < kHistory; ++t) {
    saved[t] = owns_window ? window[t * channels + channel] : 0.0f;
  }

  float history[kHistory];
  for (uint t = 0; t < kHistory; ++t) {
    history[t] = conv_input(x, saved, channels, channel, first + t);
  }
  device const bfloat* filter = weight + channel * kTaps;
  const uint end = min(first + kConvChunkTokensPerThread, tokens);
  for (uint token = first; token < end; ++token) {
    const float current = x[token * channels + channel];
    out[token * channels + channel] = causal_conv_silu(filter, history, current);
    for (uint t = 0; t + 1 < kHistory; ++t) {
      history[t] = history[t + 1];
    }
    history[kHistory - 1] = current;
  }

  if (!owns_window) {
    return;
  }
  if (params.tail_rows == 0) {
    for (uint t = 0; t < kHistory; ++t) {
      window[t * channels + channel] = conv_input(x, saved, channels, channel, tokens + t);
    }
  } else {
    const uint tail_first = tokens + kHistory - params.tail_rows;
    for (uint t = 0; t < params.tail_rows; ++t) {
      tail[t * channels + channel] = conv_input(x, saved, channels, channel, tail_first + t);
    }
  }
}

struct Conv1dCommitParams {
  uint channels;
  uint candidates;  // the verify pass's: its tail holds candidates + 2 rows
};

// After accept_drafts: the window after the verify pass's last waiting token and the accepted[0]
// drafts after it, rows accepted[0] .. accepted[0] + 2 of the tail conv1d_chunk left. One thread
// per channel.
[[kernel]] void conv1d_commit(
    constant Conv1dCommitParams& params [[buffer(0)]],
    device const uint* accepted [[buffer(1)]],  // accept_drafts' output: [0] the kept drafts
    device const float* tail [[buffer(2)]],     // [candidates + 2, channels]
    device float* window [[buffer(3)]],         // [3, channels]: oldest row first
    uint channel [[thread_position_in_grid]]) {
  const uint channels = params.channels;
  if (channel >= channels) {
    return;
  }
  const uint kept = min(accepted[0], params.candidates - 1);
  for (uint t = 0; t < kHistory; ++t) {
    window[t * channels + channel] = tail[(kept + t) * channels + channel];
  }
}
