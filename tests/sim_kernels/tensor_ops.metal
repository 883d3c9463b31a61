// The sim's emulation of Metal 4 tensor ops (mpp::tensor_ops::matmul2d), one use per kernel
// (tests/test_sim_tensor_ops.py): a correct product and the misuses it must refuse.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

constexpr constant int TEST_M = 32;
constexpr constant int TEST_N = 64;
constexpr constant int TEST_K = 64;

struct TestTensorParams {
  uint mode;  // 0: correct; 1: B given as M rows, not N; 2: no barrier before the product;
              // 3: the accumulator never zeroed
};

// out [M, N] = a [M, K] * b^T (b [N, K]), half operands staged in threadgroup memory, fp32
// results; 128 threads (4 SIMD-groups).
[[kernel]] void test_tensor_matmul(constant TestTensorParams& p [[buffer(0)]],
                                   device const half* a [[buffer(1)]],
                                   device const half* b [[buffer(2)]],
                                   device float* out [[buffer(3)]],
                                   uint thread_id [[thread_index_in_threadgroup]],
                                   uint threads [[threads_per_threadgroup]]) {
  threadgroup half a_tile[TEST_M * TEST_K];
  threadgroup half b_tile[TEST_N * TEST_K];
  for (uint i = thread_id; i < uint(TEST_M * TEST_K); i += threads) a_tile[i] = a[i];
  for (uint i = thread_id; i < uint(TEST_N * TEST_K); i += threads) b_tile[i] = b[i];
  if (p.mode != 2) threadgroup_barrier(mem_flags::mem_threadgroup);

  constexpr auto desc = matmul2d_descriptor(TEST_M, TEST_N, TEST_K, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto a_tensor = tensor(a_tile, dextents<int32_t, 2>(TEST_K, TEST_M));
  // Mode 1 describes B as M rows of K: not the descriptor's N.
  auto b_tensor = p.mode == 1 ? tensor(b_tile, dextents<int32_t, 2>(TEST_K, TEST_M))
                              : tensor(b_tile, dextents<int32_t, 2>(TEST_K, TEST_N));
  auto acc =
      op.get_destination_cooperative_tensor<decltype(a_tensor), decltype(b_tensor), float>();
  if (p.mode != 3) {
    for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
      if (acc.is_valid_element(i)) acc[i] = 0.0f;
    }
  }
  op.run(a_tensor, b_tensor, acc);
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto at = acc.get_multidimensional_index(i);
    out[at[1] * TEST_N + at[0]] = acc[i];
  }
}
