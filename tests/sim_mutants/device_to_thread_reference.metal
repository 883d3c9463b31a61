// A device element bound to a `thread float&` parameter: the reference names thread memory.
#include <metal_stdlib>
using namespace metal;

inline void bump(thread float& v) { v += 1.0f; }

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float local = x[i];
  // legal: bump(local);
  // rejected: no matching function for call to 'bump'
  bump(x[i]);
  x[i] = local;
}
