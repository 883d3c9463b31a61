// MSL6: threadgroup memory is never zeroed, and cannot carry an initializer.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void histogram(device const uint* x [[buffer(0)]], device uint* y [[buffer(1)]],
                          threadgroup uint* argument_scratch [[threadgroup(0)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  threadgroup uint counts[16] = {0};  // expect: MSL6
  threadgroup uint total = 0;  // expect: MSL6
  threadgroup uint fine[16];
  threadgroup uint* alias = fine;
  fine[tid % 16] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = counts[x[tid] % 16] + total + alias[0] + argument_scratch[0];
}
