// A `thread float*` pointing at device memory.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float local[4] = {x[i], 0.0f, 0.0f, 0.0f};
  // legal: thread float* p = local;
  // rejected: cannot initialize a variable of type 'float \*' with an lvalue of type 'device float \*'
  thread float* p = x;
  x[i] = p[0] + local[1];
}
