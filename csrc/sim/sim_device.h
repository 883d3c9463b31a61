// The sim device: lily::Device over the fiber runtime.
#pragma once

#include <memory>

#include "../device.h"
#include "check.h"
#include "runtime.h"

namespace lily {

// `execute` false: graphs are checked and retired without running any kernel, which times the
// host's side of a step alone (benchmarks/bench_decode_graph.py). `mode`: count traffic, or
// check every access as well (check.h); both run the checked kernel build. `tensor_ops`: the
// prefill GEMMs run the Metal 4 tensor-op kernels (Device::gemm_path), as on an M5.
// `matrix_lanes`: the simdgroup_matrix layout, Apple's unless a test plays a GPU whose layout
// differs (Lane::matrix_lanes). `mirror_wrapped`: wrapped host memory that is not a file mapping
// is mirrored as the metal device mirrors it (host_mirror.h), instead of used in place.
std::shared_ptr<Device> open_sim_device(
    lily_sim::LaneOrder order, uint64_t seed, unsigned workers, bool execute = true,
    lily_sim::CheckMode mode = lily_sim::CheckMode::off, bool tensor_ops = false,
    const lily_sim::MatrixLanes& matrix_lanes = lily_sim::kAppleMatrixLanes,
    bool mirror_wrapped = false);

}  // namespace lily
