// SIMD-group functions do not exchange bool (simd_ballot, simd_any and simd_all take it).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  bool positive = x[i] > 0.0f;
  // legal: positive = simd_broadcast(ushort(positive), ushort(0)) != 0;
  // rejected: simd_broadcast: MSL exchanges only scalars and vectors
  positive = simd_broadcast(positive, ushort(0));
  x[i] = positive ? 1.0f : 0.0f;
}
