// The Gated DeltaNet's causal conv1d, the parts shared by its kernels (conv1d.metal) and by the
// GEMV that folds the decode step's conv into its epilogue (quantized_gemv.metal).
#pragma once

#include "common.h"

constexpr constant uint kTaps = 4;
constexpr constant uint kHistory = kTaps - 1;

// One output of the convolution. Every kernel goes through this one expression, in this order, so
// prefill and decode round alike and a chunk equals its tokens decoded one by one, bit for bit.
inline float causal_conv_silu(device const bfloat* filter, thread const float* history,
                              float current) {
  float acc = float(filter[kTaps - 1]) * current;
  for (uint t = 0; t < kHistory; ++t) {
    acc += float(filter[t]) * history[t];
  }
  return silu(acc);
}

// One decoded token of one channel: SiLU(conv(window ++ current)), and `current` shifted into the
// channel's window ([3, channels], oldest row first). Only the caller touches this channel of the
// window, so the in-place update needs no synchronisation.
inline float conv_step_channel(device const bfloat* weight, device float* window, uint channels,
                               uint channel, float current) {
  float history[kHistory];
  for (uint t = 0; t < kHistory; ++t) {
    history[t] = window[t * channels + channel];
  }
  const float out = causal_conv_silu(weight + channel * kTaps, history, current);
  for (uint t = 0; t + 1 < kHistory; ++t) {
    window[t * channels + channel] = history[t + 1];
  }
  window[(kHistory - 1) * channels + channel] = current;
  return out;
}
