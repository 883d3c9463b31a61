// The step buffer's advance, shared by the end-of-pass dispatch (step.metal) and the sampler's
// finishing dispatch (sampling.metal), which advances it as soon as the token is known.
//
// The step buffer is uint32 [position, prompt_end, token]: `position` indexes the token being
// consumed, `token` is its id (read by the embedding), and positions below `prompt_end` come from
// the prompt already written to the token history; later ones are the model's own prediction.
#pragma once

#include <metal_stdlib>
using namespace metal;

// Words of one step buffer (lily.kernels.step.STEP_FIELDS): batched decode keeps its sequences'
// steps one after another in one buffer, this far apart.
constexpr constant uint kStepFields = 3;
// The word of a step buffer holding the id of the token at its position.
constexpr constant uint kStepToken = 2;

// position += count; the token at the new position is the prompt's inside the prompt, else
// `predicted`, which is appended to the history. One thread.
inline void advance_step(uint count, uint capacity, device uint* step, device uint* history,
                         uint predicted) {
  const uint next = step[0] + count;
  if (next >= capacity) {
    // The host never queues a step past the history; saturate rather than write outside it.
    step[0] = capacity;
    return;
  }
  const uint token = next < step[1] ? history[next] : predicted;
  history[next] = token;
  step[0] = next;
  step[kStepToken] = token;
}
