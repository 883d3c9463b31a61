// simdgroup_load reads the matrix's own element type: no half data into a float matrix.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device const half* x [[buffer(0)]], device const float* y [[buffer(1)]],
                       device float* out [[buffer(2)]]) {
  simdgroup_float8x8 m;
  simdgroup_half8x8 h;
  simdgroup_load(h, x, 8);
  // legal: simdgroup_load(m, y, 8);
  // rejected: no matching function for call to 'simdgroup_load'
  simdgroup_load(m, x, 8);
  simdgroup_multiply(m, h, m);
  simdgroup_store(m, out, 8);
}
