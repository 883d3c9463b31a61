// The sparse MoE block of a chunk of T tokens (batched prefill). Routing (`moe_route` in moe.metal,
// one row per token) yields T * top_k (token, expert) assignments; the expert GEMMs want them
// grouped by expert, so that each expert's weights are read once for all of its tokens:
//   moe_sort_by_expert  a stable counting sort of the assignments by expert;
//   moe_chunk_swiglu    silu(gate) * up of the shared expert's dense projections, in place;
//   moe_chunk_combine   out[t] = sum_k w[t, k] down[slot(t, k)] + sigmoid(gate[t]) shared[t].
// Everything is integer counting or fixed-order float sums: no atomics, so the result does not
// depend on the order threads run in.
#include "common.h"

constexpr constant uint MOE_SORT_THREADS = 256;
constexpr constant uint MOE_SORT_SIMDGROUPS = MOE_SORT_THREADS / SIMD_WIDTH;

struct MoeSortParams {
  uint tokens;
  uint top_k;
  uint experts;
};

// Assignment a = t * top_k + k (token t's k-th choice) goes to expert e = expert_ids[a]. Sorted by
// expert, and within one expert in assignment order:
//   expert_offsets[e]  the first sorted position of expert e ([experts + 1], last = T * top_k);
//   row_index[s]       the token of the assignment at sorted position s;
//   slot_of[a]         the sorted position of assignment a.
// One threadgroup per expert, each reading all T * top_k ids twice: once to count the assignments
// of lower experts (its offset), then in token tiles with a prefix sum over the tile's threads to
// rank its own assignments. Redundant reads of a small, cached array buy a single dispatch with
// no cross-threadgroup communication.
[[kernel, max_total_threads_per_threadgroup(MOE_SORT_THREADS)]]
void moe_sort_by_expert(constant MoeSortParams& p [[buffer(0)]],
                        device const uint* expert_ids [[buffer(1)]],
                        device uint* expert_offsets [[buffer(2)]],
                        device uint* row_index [[buffer(3)]],
                        device uint* slot_of [[buffer(4)]],
                        uint expert [[threadgroup_position_in_grid]],
                        uint thread_id [[thread_index_in_threadgroup]],
                        uint simdgroup [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  // Two sets of per-SIMD-group counts, alternating between tiles, so a SIMD-group that starts the
  // next tile early never overwrites counts a slower one is still reading.
  threadgroup uint tile_counts[2][MOE_SORT_SIMDGROUPS];
  threadgroup uint lower_counts[MOE_SORT_SIMDGROUPS];

  const uint assignments = p.tokens * p.top_k;
  uint lower = 0;
  for (uint a = thread_id; a < assignments; a += MOE_SORT_THREADS) {
    lower += expert_ids[a] < expert ? 1u : 0u;
  }
  const uint lower_in_simdgroup = simd_sum(lower);
  if (lane == 0) lower_counts[simdgroup] = lower_in_simdgroup;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint offset = 0;
  for (uint s = 0; s < MOE_SORT_SIMDGROUPS; ++s) offset += lower_counts[s];
  if (thread_id == 0) {
    expert_offsets[expert] = offset;
    if (expert + 1 == p.experts) expert_offsets[p.experts] = assignments;
  }

  uint ranked = 0;  // this expert's assignments in the tiles before the current one
  for (uint tile = 0; tile * MOE_SORT_THREADS < p.tokens; ++tile) {
    const uint token = tile * MOE_SORT_THREADS + thread_id;
    uint mine = 0;
    if (token < p.tokens) {
      for (uint k = 0; k < p.top_k; ++k) {
        mine += expert_ids[token * p.top_k + k] == expert ? 1u : 0u;
      }
    }
    const uint before_in_simdgroup = simd_prefix_exclusive_sum(mine);
    const uint in_simdgroup = simd_sum(mine);
    threadgroup uint* counts = tile_counts[tile % 2];
    if (lane == 0) counts[simdgroup] = in_simdgroup;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint before = ranked + before_in_simdgroup;
    for (uint s = 0; s < MOE_SORT_SIMDGROUPS; ++s) {
      if (s < simdgroup) before += counts[s];
      ranked += counts[s];
    }
    if (mine != 0) {
      for (uint k = 0; k < p.top_k; ++k) {
        const uint a = token * p.top_k + k;
        if (expert_ids[a] != expert) continue;
        const uint sorted = offset + before++;
        row_index[sorted] = token;
        slot_of[a] = sorted;
      }
    }
  }
}

struct MoeSwigluParams {
  uint count;
};

// gate_then_hidden[i] = silu(gate[i]) * up[i] over `count` values: the shared expert's gate and up
// projections come from one dense GEMM with separate outputs.
[[kernel]] void moe_chunk_swiglu(constant MoeSwigluParams& p [[buffer(0)]],
                                 device float* gate_then_hidden [[buffer(1)]],
                                 device const float* up [[buffer(2)]],
                                 uint i [[thread_position_in_grid]]) {
  if (i < p.count) gate_then_hidden[i] = silu(gate_then_hidden[i]) * up[i];
}

struct MoeCombineParams {
  uint tokens;
  uint hidden;  // a multiple of 4
  uint top_k;
};

// out[t] = sum_k w[t, k] down[slot_of[t, k]] + sigmoid(shared_gate_logit[t]) shared_down[t], the
// k terms added in order. Rows of `down` are the expert outputs in sorted-assignment order.
// Grid: x over groups of 4 columns, y over tokens.
[[kernel]] void moe_chunk_combine(constant MoeCombineParams& p [[buffer(0)]],
                                  device const float4* down [[buffer(1)]],
                                  device const uint* slot_of [[buffer(2)]],
                                  device const float* expert_weights [[buffer(3)]],
                                  device const float* shared_gate_logit [[buffer(4)]],
                                  device const float4* shared_down [[buffer(5)]],
                                  device float4* out [[buffer(6)]],
                                  uint2 position [[thread_position_in_grid]]) {
  const uint columns = p.hidden / 4;
  const uint column = position.x;
  const uint token = position.y;
  if (column >= columns || token >= p.tokens) return;
  float4 total = float4(0.0f);
  for (uint k = 0; k < p.top_k; ++k) {
    const uint a = token * p.top_k + k;
    total += expert_weights[a] * down[ulong(slot_of[a]) * columns + column];
  }
  const ulong at = ulong(token) * columns + column;
  out[at] = total + sigmoid(shared_gate_logit[token]) * shared_down[at];
}
