// The Gated DeltaNet's short causal convolution for one decoded token.
//
// Each qkv channel is convolved over time with its own 4-tap filter (depthwise, no bias) and
// passed through SiLU. The decode state is the window of the last 3 pre-conv rows; this kernel
// consumes it and shifts the current row in, so the next step sees the right history.
#include "common.h"

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
  constexpr uint taps = 4;
  const uint channels = params.channels;
  if (channel >= channels) {
    return;
  }
  device const bfloat* filter = weight + channel * taps;

  float history[taps - 1];
  for (uint t = 0; t < taps - 1; ++t) {
    history[t] = window[t * channels + channel];
  }
  const float current = x[channel];

  float acc = float(filter[taps - 1]) * current;
  for (uint t = 0; t < taps - 1; ++t) {
    acc += float(filter[t]) * history[t];
  }
  out[channel] = silu(acc);

  for (uint t = 0; t + 1 < taps - 1; ++t) {
    window[t * channels + channel] = history[t + 1];
  }
  window[(taps - 2) * channels + channel] = current;
}
