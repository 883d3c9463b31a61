// Apple's MetalPerformancePrimitives (Metal 4 tensor ops); the sim emulates the part Lily uses in
// lily_sim_tensor_ops.h, which <metal_stdlib> includes.
#pragma once
#include <metal_stdlib>
