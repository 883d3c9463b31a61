// A device pointer assigned to a threadgroup pointer: different address spaces.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float shared[32];
  shared[i % 32] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // legal: threadgroup float* t = shared;
  // rejected: cannot initialize a variable of type 'threadgroup float \*' with an lvalue of type 'device float \*'
  threadgroup float* t = x;
  x[i] = t[(i + 1) % 32];
}
