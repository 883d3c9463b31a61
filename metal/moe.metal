// The sparse MoE block of one token, after the router GEMV (8-bit, with the shared-expert gate in
// the same multi-projection dispatch):
//   moe_route           softmax over the router logits, top-k, renormalised weights;
//   moe_gate_up_swiglu  silu(gate_e x) * up_e x for the k chosen experts and the shared expert;
//   moe_down            sum_k w_k down_e(h_k) + sigmoid(shared gate) down_s(h_s), one pass.
// Expert weights are the stacked checkpoint tensors [experts, rows, ...], indexed on the device by
// the routed ids, so nothing returns to the host between the router and the output.
#include "common.h"
#include "quantized.h"

constexpr constant uint MOE_MAX_EXPERTS_PER_LANE = 8;  // up to 256 experts
constexpr constant uint MOE_ROWS_PER_SIMDGROUP = 4;
constexpr constant uint MOE_SIMDGROUPS = 2;

struct MoeRouteParams {
  uint experts;
  uint top_k;
  uint normalize;  // renormalise the top-k weights to sum to 1 (norm_topk_prob)
};

// One SIMD-group per token. Lane l holds experts l, l + 32, ...; k rounds each pick the largest
// remaining logit, ties to the lowest expert id.
[[kernel]] void moe_route(constant MoeRouteParams& p [[buffer(0)]],
                          device const float* logits [[buffer(1)]],
                          device uint* expert_ids [[buffer(2)]],
                          device float* expert_weights [[buffer(3)]],
                          uint token [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]]) {
  logits += ulong(token) * p.experts;
  float held[MOE_MAX_EXPERTS_PER_LANE];
  float lane_max = -INFINITY;
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    const uint e = lane + j * SIMD_WIDTH;
    held[j] = e < p.experts ? logits[e] : -INFINITY;
    lane_max = max(lane_max, held[j]);
  }
  // Softmax denominators are taken relative to the largest logit, which is also the top-1.
  const float top = simd_max(lane_max);
  float lane_sum = 0.0f;
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    if (lane + j * SIMD_WIDTH < p.experts) lane_sum += exp(held[j] - top);
  }
  const float all_sum = simd_sum(lane_sum);

  uint taken = 0;  // bit j: this lane's expert lane + 32 j is already chosen
  float chosen_sum = 0.0f;
  for (uint round = 0; round < p.top_k; ++round) {
    float best = -INFINITY;
    uint best_expert = 0xFFFFFFFFu;
    for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
      const uint e = lane + j * SIMD_WIDTH;
      if (e < p.experts && (taken & (1u << j)) == 0 && (best_expert == 0xFFFFFFFFu || held[j] > best)) {
        best = held[j];
        best_expert = e;
      }
    }
    // NaN logits have no argmax (simd_argmax then returns 0xFFFFFFFF); the clamp keeps the id
    // an expert of this layer, so a broken activation cannot index outside the expert tensors.
    const uint winner = min(simd_argmax(best, best_expert), p.experts - 1);
    const float winner_logit = simd_max(best);
    if (winner % SIMD_WIDTH == lane) taken |= 1u << (winner / SIMD_WIDTH);
    const float weight = exp(winner_logit - top);
    chosen_sum += weight;
    if (lane == 0) {
      expert_ids[token * p.top_k + round] = winner;
      expert_weights[token * p.top_k + round] = weight;
    }
  }
  // Lane 0 wrote the unnormalised weights above; it alone rescales them.
  const float denominator = p.normalize != 0 ? chosen_sum : all_sum;
  if (lane == 0) {
    for (uint round = 0; round < p.top_k; ++round) expert_weights[token * p.top_k + round] /= denominator;
  }
}

struct MoeGateUpParams {
  uint in_dim;
  uint expert_rows;  // moe_intermediate_size
  uint shared_rows;  // shared_expert_intermediate_size
  uint top_k;
};

// h[slot * expert_rows + r] = silu(gate_e x)[r] * (up_e x)[r] for slot < top_k (expert e =
// expert_ids[slot]); slot top_k is the shared expert, at h[top_k * expert_rows + r].
// Grid: x over rows (8 per threadgroup), y over the top_k + 1 slots.
template <uint BITS>
[[kernel]] void moe_gate_up_swiglu(
    constant MoeGateUpParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
    device const uint* expert_ids [[buffer(2)]], device const uint* gate_w [[buffer(3)]],
    device const bfloat* gate_s [[buffer(4)]], device const bfloat* gate_b [[buffer(5)]],
    device const uint* up_w [[buffer(6)]], device const bfloat* up_s [[buffer(7)]],
    device const bfloat* up_b [[buffer(8)]], device const uint* shared_gate_w [[buffer(9)]],
    device const bfloat* shared_gate_s [[buffer(10)]],
    device const bfloat* shared_gate_b [[buffer(11)]], device const uint* shared_up_w [[buffer(12)]],
    device const bfloat* shared_up_s [[buffer(13)]], device const bfloat* shared_up_b [[buffer(14)]],
    device float* h [[buffer(15)]], uint2 threadgroup_id [[threadgroup_position_in_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint slot = threadgroup_id.y;
  const bool shared = slot == p.top_k;
  const uint rows = shared ? p.shared_rows : p.expert_rows;
  QuantMatrix gate{shared_gate_w, shared_gate_s, shared_gate_b};
  QuantMatrix up{shared_up_w, shared_up_s, shared_up_b};
  if (!shared) {
    const uint expert = expert_ids[slot];
    gate = quant_expert(QuantMatrix{gate_w, gate_s, gate_b}, expert, rows, p.in_dim, BITS);
    up = quant_expert(QuantMatrix{up_w, up_s, up_b}, expert, rows, p.in_dim, BITS);
  }
  const uint row0 = threadgroup_id.x * (MOE_SIMDGROUPS * MOE_ROWS_PER_SIMDGROUP) +
                    simdgroup * MOE_ROWS_PER_SIMDGROUP;
  if (row0 >= rows) return;  // the whole SIMD-group leaves together
  const uint count = min(MOE_ROWS_PER_SIMDGROUP, rows - row0);

  constexpr uint chunk = quant_chunk(BITS);
  float gate_acc[MOE_ROWS_PER_SIMDGROUP];
  float up_acc[MOE_ROWS_PER_SIMDGROUP];
  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
    gate_acc[r] = 0.0f;
    up_acc[r] = 0.0f;
  }
  for (uint k = lane * chunk; k < p.in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk<BITS>(x, k, xs);
    for (uint r = 0; r < count; ++r) {
      gate_acc[r] += qdot_chunk<BITS>(gate, p.in_dim, row0 + r, k, xs, xsum);
      up_acc[r] += qdot_chunk<BITS>(up, p.in_dim, row0 + r, k, xs, xsum);
    }
  }
  device float* out = h + slot * p.expert_rows + row0;
  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
    const float g = simd_sum(gate_acc[r]);
    const float u = simd_sum(up_acc[r]);
    if (lane == 0 && r < count) out[r] = silu(g) * u;
  }
}

template [[host_name("moe_gate_up_swiglu_4")]] [[kernel]] decltype(moe_gate_up_swiglu<4>)
    moe_gate_up_swiglu<4>;

struct MoeDownParams {
  uint expert_in;  // moe_intermediate_size
  uint shared_in;  // shared_expert_intermediate_size
  uint out_rows;   // hidden_size
  uint top_k;
};

// out = sum_slot w[slot] down_{e(slot)} h_slot + sigmoid(shared_gate_logit) down_s h_shared.
// The k routed inputs are one contiguous vector of top_k * expert_in values, walked in chunks by
// all 32 lanes (a chunk never straddles two experts since expert_in is a multiple of 64), so a
// short expert input does not leave most lanes idle. Grid: x over rows, 8 per threadgroup.
template <uint BITS>
[[kernel]] void moe_down(constant MoeDownParams& p [[buffer(0)]], device const float* h [[buffer(1)]],
                         device const uint* expert_ids [[buffer(2)]],
                         device const float* expert_weights [[buffer(3)]],
                         device const float* shared_gate_logit [[buffer(4)]],
                         device const uint* down_w [[buffer(5)]],
                         device const bfloat* down_s [[buffer(6)]],
                         device const bfloat* down_b [[buffer(7)]],
                         device const uint* shared_w [[buffer(8)]],
                         device const bfloat* shared_s [[buffer(9)]],
                         device const bfloat* shared_b [[buffer(10)]],
                         device float* out [[buffer(11)]],
                         uint threadgroup_id [[threadgroup_position_in_grid]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint row0 = threadgroup_id * (MOE_SIMDGROUPS * MOE_ROWS_PER_SIMDGROUP) +
                    simdgroup * MOE_ROWS_PER_SIMDGROUP;
  if (row0 >= p.out_rows) return;  // the whole SIMD-group leaves together
  const uint count = min(MOE_ROWS_PER_SIMDGROUP, p.out_rows - row0);

  constexpr uint chunk = quant_chunk(BITS);
  float acc[MOE_ROWS_PER_SIMDGROUP];
  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) acc[r] = 0.0f;

  const QuantMatrix down{down_w, down_s, down_b};
  for (uint k = lane * chunk; k < p.top_k * p.expert_in; k += SIMD_WIDTH * chunk) {
    const uint slot = k / p.expert_in;
    const QuantMatrix expert = quant_expert(down, expert_ids[slot], p.out_rows, p.expert_in, BITS);
    const float weight = expert_weights[slot];
    float xs[chunk];
    const float xsum = load_chunk<BITS>(h, k, xs);
    for (uint r = 0; r < count; ++r) {
      acc[r] += weight * qdot_chunk<BITS>(expert, p.expert_in, row0 + r, k % p.expert_in, xs, xsum);
    }
  }

  const QuantMatrix shared{shared_w, shared_s, shared_b};
  const float shared_weight = sigmoid(shared_gate_logit[0]);
  device const float* h_shared = h + p.top_k * p.expert_in;
  for (uint k = lane * chunk; k < p.shared_in; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk<BITS>(h_shared, k, xs);
    for (uint r = 0; r < count; ++r) {
      acc[r] += shared_weight * qdot_chunk<BITS>(shared, p.shared_in, row0 + r, k, xs, xsum);
    }
  }

  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
    const float total = simd_sum(acc[r]);
    if (lane == 0 && r < count) out[row0 + r] = total;
  }
}

template [[host_name("moe_down_4")]] [[kernel]] decltype(moe_down<4>) moe_down<4>;
