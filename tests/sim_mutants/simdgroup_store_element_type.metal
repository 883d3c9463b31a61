// simdgroup_store writes the matrix's own element type: no float matrix into half memory.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device const float* x [[buffer(0)]], device half* out [[buffer(1)]],
                       device float* out_float [[buffer(2)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, x, 8);
  out[0] = half(1.0f);
  // legal: simdgroup_store(m, out_float, 8);
  // rejected: no matching function for call to 'simdgroup_store'
  simdgroup_store(m, out, 8);
}
