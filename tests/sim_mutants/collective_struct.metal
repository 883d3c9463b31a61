// SIMD-group functions exchange scalars and vectors of MSL's integer and floating types only.
#include <metal_stdlib>
using namespace metal;

struct Pair {
  float value;
  uint index;
};

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  Pair mine{x[i], i};
  Pair other = mine;
  // legal: other.value = simd_shuffle_xor(mine.value, ushort(1));
  // rejected: simd_shuffle_xor: MSL exchanges only scalars and vectors
  other = simd_shuffle_xor(mine, ushort(1));
  x[i] = other.value;
}
