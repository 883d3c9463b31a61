// simdgroup_load reads device or threadgroup memory, not thread memory.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device const float* x [[buffer(0)]], device float* out [[buffer(1)]]) {
  float local[64];
  for (uint j = 0; j < 64; ++j) local[j] = x[j] + 1.0f;
  simdgroup_float8x8 m;
  // legal: simdgroup_load(m, x, 8);
  // rejected: no matching function for call to 'simdgroup_load'
  simdgroup_load(m, local, 8);
  simdgroup_store(m, out, 8);
}
