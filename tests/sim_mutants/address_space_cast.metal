// A cast cannot move a pointer to another address space (clang C++ allows a C-style one).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void mutant(device float* x [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float shared[32];
  shared[i % 32] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // legal: threadgroup float4* t = (threadgroup float4*)shared;
  // rejected: cast from 'device float \*' to 'threadgroup float4 \*' converts between address spaces
  threadgroup float4* t = (threadgroup float4*)x;
  x[i] = t[i % 8].x;
}
