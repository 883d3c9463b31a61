// The sim device: lily::Device over the fiber runtime.
#pragma once

#include <memory>

#include "../device.h"
#include "runtime.h"

namespace lily {

std::shared_ptr<Device> open_sim_device(lily_sim::LaneOrder order, uint64_t seed,
                                        unsigned workers);

}  // namespace lily
