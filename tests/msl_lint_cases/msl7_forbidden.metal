// MSL7: no double, standard library, exceptions, new/delete, virtual or Apple-internal intrinsics.
#include <metal_stdlib>
#include <metal_simdgroup>
#include "local_helpers.h"
#include <cmath>  // expect: MSL7
using namespace metal;

struct Base {
  virtual float value() const;  // expect: MSL7
};

[[kernel]] void forbidden(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  double wide = x[i];  // expect: MSL7
  float* p = new float[4];  // expect: MSL1 MSL7
  delete[] p;  // expect: MSL7
  try {  // expect: MSL7
    throw 1;  // expect: MSL7
  } catch (...) {  // expect: MSL7
  }
  x[i] = std::sqrt(float(wide)) + __metal_fast_exp(x[i]);  // expect: MSL7 MSL7
}
