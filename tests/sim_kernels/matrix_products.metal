// Simdgroup-matrix products of each operand type, for the sim's product counter
// (tests/test_sim_matrix_products.py).
#include <metal_stdlib>
using namespace metal;

// Per SIMD-group and round: 1 float x float product, 2 half x half, 3 bfloat x bfloat and 1 half x
// float (counted as fp32: a float operand sets the rate), all of 8x8 ones into one accumulator,
// so each element of out ends at 7 * 8 * rounds.
[[kernel]] void test_matrix_products_by_type(constant uint& rounds [[buffer(0)]],
                                             device float* out [[buffer(1)]],
                                             uint group [[threadgroup_position_in_grid]],
                                             uint simdgroup [[simdgroup_index_in_threadgroup]],
                                             uint simdgroups [[simdgroups_per_threadgroup]]) {
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const simdgroup_float8x8 ones_float = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  const simdgroup_half8x8 ones_half = make_filled_simdgroup_matrix<half, 8, 8>(half(1.0f));
  const simdgroup_bfloat8x8 ones_bfloat = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(1.0f));
  for (uint r = 0; r < rounds; ++r) {
    simdgroup_multiply_accumulate(acc, ones_float, ones_float, acc);
    for (uint i = 0; i < 2; ++i) simdgroup_multiply_accumulate(acc, ones_half, ones_half, acc);
    for (uint i = 0; i < 3; ++i) simdgroup_multiply_accumulate(acc, ones_bfloat, ones_bfloat, acc);
    simdgroup_multiply_accumulate(acc, ones_half, ones_float, acc);
  }
  simdgroup_store(acc, out + (group * simdgroups + simdgroup) * 64, 8);
}
