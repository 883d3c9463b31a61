// constant memory is read-only.
#include <metal_stdlib>
using namespace metal;

struct Params {
  uint n;
};

[[kernel]] void mutant(constant Params& p [[buffer(0)]], device uint* out [[buffer(1)]],
                       uint i [[thread_position_in_grid]]) {
  Params copy = p;
  // legal: copy.n = i;
  // rejected: cannot assign to variable 'p' with const-qualified type
  p.n = i;
  out[i] = copy.n + p.n;
}
