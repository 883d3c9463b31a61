// simd_and, simd_or and simd_xor take integers only.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float v = x[i];
  // legal: v = as_type<float>(simd_or(as_type<uint>(v)));
  // rejected: simd_or: MSL takes only scalars and vectors of char
  v = simd_or(v);
  x[i] = v;
}
