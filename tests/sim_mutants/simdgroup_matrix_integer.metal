// simdgroup matrices hold float, half or bfloat; mixing those in a product is fine (as Apple's
// compiler allows), an integer matrix is not.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* out [[buffer(0)]]) {
  simdgroup_float8x8 d;
  // legal: simdgroup_half8x8 a = make_filled_simdgroup_matrix<half, 8, 8>(1.0h);
  // rejected: simdgroup_matrix: MSL's element types are float, half and bfloat
  simdgroup_matrix<int, 8, 8> a = make_filled_simdgroup_matrix<int, 8, 8>(1);
  simdgroup_multiply(d, a, a);
  simdgroup_store(d, out, 8);
}
