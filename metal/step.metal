// The last dispatch of a pass that samples nothing (a prefill chunk before the prompt's last
// token): advance the position by the tokens consumed, on the device, so that a replayed graph
// needs nothing from the host between passes. A pass that samples advances in the sampler's
// finishing dispatch instead (sampling.metal).
#include "step.h"

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
  advance_step(p.count, p.capacity, step, history, predicted[0]);
}
