// The last dispatch of a decode step or prefill chunk: choose the token the next pass consumes
// and advance the position by the tokens consumed, on the device, so that a replayed graph needs nothing from the host between steps and
// step N+1 can be queued before step N's token has been read.
//
// The step buffer is uint32 [position, prompt_end, token]: `position` indexes the token being
// consumed, `token` is its id (read by the embedding), and positions below `prompt_end` come from
// the prompt already written to the token history; later ones are the model's own prediction.
#include <metal_stdlib>
using namespace metal;

struct StepParams {
  uint capacity;  // length of the token history
  uint count;     // tokens consumed since the position was last advanced
};

[[kernel]] void step_advance(constant StepParams& p [[buffer(0)]],
                             device uint* step [[buffer(1)]],
                             device uint* history [[buffer(2)]],
                             device const uint* predicted [[buffer(3)]],
                             uint thread_id [[thread_position_in_grid]]) {
  if (thread_id != 0) return;
  const uint next = step[0] + p.count;
  if (next >= p.capacity) {
    // The host never queues a step past the history; saturate rather than write outside it.
    step[0] = p.capacity;
    return;
  }
  const uint token = next < step[1] ? history[next] : predicted[0];
  history[next] = token;
  step[0] = next;
  step[2] = token;
}
