// MSL4: bfloat conversions are explicit, and metal math functions take float.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void activate(device const bfloat* x [[buffer(0)]], device bfloat* y [[buffer(1)]],
                         device const float* s [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  bfloat v = x[i];
  float e = exp(v);  // expect: MSL4
  float t = tanh(x[i]) + max(bfloat(1.0f), v);  // expect: MSL4 MSL4
  float good = exp(float(v)) * s[i];
  y[i] = good;  // expect: MSL4
  y[i] = s[i] * 2.0f;  // expect: MSL4
  bfloat w = 0.5f;  // expect: MSL4
  y[i] = bfloat(good + e + t) + w;
  y[i] = x[i];
  y[i] = good > 0.0f ? x[i] : bfloat(0.0f);
  y[i] = good > 0.0f ? x[i] : e;  // expect: MSL4
}
