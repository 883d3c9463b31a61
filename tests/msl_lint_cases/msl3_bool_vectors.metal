// MSL3: no boolN values; vector comparisons go straight into select, any or all.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void clamp_negative(device float4* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float4 v = x[i];
  float4 zero = float4(0.0f);
  bool4 negative = v < zero;  // expect: MSL3
  auto positive = v > zero;  // expect: MSL3
  vec<bool, 2> pair = bool2(true);  // expect: MSL3
  if (any(v.xy != zero.xy) && all(v >= 0.0f)) {
    v = select(v, zero, v < zero);
  }
  x[i] = v + float(negative.x) + float(positive.y) + float(pair.x) + float(v.x < 1.0f);
}
