// MSL1: every pointer and reference names its address space.
#include <metal_stdlib>
using namespace metal;

struct Params {
  uint n;
};

inline float first(float* values) {  // expect: MSL1
  return values[0];
}

inline void bump(thread float& value, const float& by) {  // expect: MSL1
  value += by;
}

inline float* pick(device float* a) {  // expect: MSL1
  return a;
}

[[kernel]] void scale(const Params& p [[buffer(0)]],  // expect: MSL1
                      device float* x [[buffer(1)]],
                      device const half* h [[buffer(2)]],
                      uint i [[thread_position_in_grid]]) {
  float* local = x;  // expect: MSL1
  device float** table = nullptr;  // expect: MSL1
  device float* thread* fine_table = nullptr;
  const device half4* hv = (const device half4*)h;
  const half4* bad_cast = reinterpret_cast<const half4*>(h);  // expect: MSL1
  vec<float, 4>* wide = nullptr;  // expect: MSL1
  auto& alias = x[i];  // expect: MSL1
  thread auto& good_alias = x[i];
  local[i] = float(hv[0].x) * x[i] * 2.0f + (p.n & 1) + good_alias;
}
