// MSL has no double.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  // legal: float wide = x[i];
  // rejected: MSL_has_no_double
  double wide = x[i];
  x[i] = float(wide * 2.0f);
}
