// MSL2: vector conversions by constructor, bit casts by as_type.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void convert(device const half4* x [[buffer(0)]], device float4* y [[buffer(1)]],
                        device uint2* bits [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float4 a = (float4)x[i];  // expect: MSL2
  float4 b = static_cast<float4>(x[i]);  // expect: MSL2
  vec<float, 4> c = (vec<float, 4>)(x[i]);  // expect: MSL2
  float4 good = float4(x[i]);
  float scalar = (float)x[i].x + static_cast<float>(x[i].y);
  bits[i] = as_type<uint2>(x[i]);
  y[i] = a + b + c + good * scalar * float(sizeof(float4));
}
