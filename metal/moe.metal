// The sparse MoE block of one token, after the router GEMV (8-bit, with the shared-expert gate in
// the same multi-projection dispatch):
//   moe_route           softmax over the router logits, top-k, renormalised weights (the
//                       decode step runs it inside moe_gate_up_swiglu instead; prefill alone);
//   moe_gate_up_swiglu  silu(gate_e x) * up_e x for the k chosen experts and the shared expert;
//   moe_down            sum_k w_k down_e(h_k) + sigmoid(shared gate) down_s(h_s), one pass.
// Expert weights are the stacked checkpoint tensors [experts, rows, ...], indexed on the device by
// the routed ids, so nothing returns to the host between the router and the output.
//
// The same kernels run a few tokens (grid z = token): each token's buffers follow the previous
// token's (x and out [tokens, hidden], ids and weights [tokens, top_k], router logits [tokens,
// experts] then the shared-expert gate logits [tokens], h [tokens, top_k * expert_rows +
// shared_rows]). Such a pass is bound by reading the weights, as decode is. A verify pass's
// tokens are consecutive tokens of one text, whose routing is correlated
// (benchmarks/verify_pass_model.py cites the published figures), so its routed gate/up runs over
// the union of the tokens' experts (moe_route_union, moe_gate_up_union, at the end of this file),
// each distinct expert's gate and up read once, at one level more. A batched pass's rows are
// unrelated sequences, whose experts barely overlap (4 rows choosing 8 of 256 at random share
// ~4%), which by benchmarks/batched_decode_model.py about pays for that level on a Mac; it runs
// over the union too, which also routes each row once instead of in every (row, expert)
// SIMD-group (what the sim, whose cost is SIMD-group collectives, pays for most).
#include "common.h"
#include "quantized.h"

constexpr constant uint MOE_MAX_EXPERTS_PER_LANE = 8;  // up to 256 experts
// Rows per SIMD-group; a threadgroup is one or two SIMD-groups, as the host chose for the
// dispatch (kernels/quantized.py, gemv_simdgroups).
constexpr constant uint MOE_ROWS_PER_SIMDGROUP = 4;

struct MoeRouteParams {
  uint experts;
  uint top_k;
  uint normalize;  // renormalise the top-k weights to sum to 1 (norm_topk_prob)
};

// Routing of one token by one SIMD-group. Lane l holds experts l, l + 32, ...; each round picks
// the largest remaining logit, ties to the lowest expert id. Runs `rounds` rounds (<= top_k) and
// returns the expert of the last one to every lane; when `write`, it runs all top_k and lane 0
// stores every id and its weight (softmax probability, renormalised over the top_k when
// `normalize`). Call from uniform control flow within the SIMD-group.
inline uint route_token(device const float* logits, uint experts, uint top_k, bool normalize,
                        uint rounds, bool write, device uint* expert_ids,
                        device float* expert_weights, uint lane) {
  float held[MOE_MAX_EXPERTS_PER_LANE];
  float lane_max = -INFINITY;
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    const uint e = lane + j * SIMD_WIDTH;
    held[j] = e < experts ? logits[e] : -INFINITY;
    lane_max = max(lane_max, held[j]);
  }
  // Softmax denominators are taken relative to the largest logit, which is also the top-1.
  const float top = simd_max(lane_max);
  float lane_sum = 0.0f;
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    if (lane + j * SIMD_WIDTH < experts) lane_sum += exp(held[j] - top);
  }
  const float all_sum = simd_sum(lane_sum);

  uint taken = 0;  // bit j: this lane's expert lane + 32 j is already chosen
  uint winner = 0;
  float chosen_sum = 0.0f;
  const uint last = write ? top_k : rounds;
  for (uint round = 0; round < last; ++round) {
    float best = -INFINITY;
    uint best_expert = 0xFFFFFFFFu;
    for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
      const uint e = lane + j * SIMD_WIDTH;
      if (e < experts && (taken & (1u << j)) == 0 && (best_expert == 0xFFFFFFFFu || held[j] > best)) {
        best = held[j];
        best_expert = e;
      }
    }
    // NaN logits have no argmax (simd_argmax then returns 0xFFFFFFFF); the clamp keeps the id
    // an expert of this layer, so a broken activation cannot index outside the expert tensors.
    const uint chosen = min(simd_argmax(best, best_expert), experts - 1);
    const float chosen_logit = simd_max(best);
    if (chosen % SIMD_WIDTH == lane) taken |= 1u << (chosen / SIMD_WIDTH);
    if (round + 1 == rounds) winner = chosen;
    const float weight = exp(chosen_logit - top);
    chosen_sum += weight;
    if (write && lane == 0) {
      expert_ids[round] = chosen;
      expert_weights[round] = weight;
    }
  }
  // Lane 0 wrote the unnormalised weights above; it alone rescales them.
  const float denominator = normalize ? chosen_sum : all_sum;
  if (write && lane == 0) {
    for (uint round = 0; round < top_k; ++round) expert_weights[round] /= denominator;
  }
  return winner;
}

// One SIMD-group per token.
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]]
void moe_route(constant MoeRouteParams& p [[buffer(0)]],
               device const float* logits [[buffer(1)]],
               device uint* expert_ids [[buffer(2)]],
               device float* expert_weights [[buffer(3)]],
               uint token [[threadgroup_position_in_grid]],
               uint lane [[thread_index_in_simdgroup]]) {
  route_token(logits + ulong(token) * p.experts, p.experts, p.top_k, p.normalize != 0, p.top_k,
              true, expert_ids + token * p.top_k, expert_weights + token * p.top_k, lane);
}

// The values a gate/up lane shares for its one reduction of a run of `tokens` tokens (lane_sum,
// quantized.h): its partial gate sums of every row for each token (token n's row r at n * R + r),
// then its up sums likewise, then, normed, each token's partial sum of squares; the kernels'
// threadgroup memory is SIMD_WIDTH such runs per SIMD-group (kernels/moe.py sizes it alike).
inline uint moe_gate_up_lane_stride(uint tokens, bool normed) {
  return lane_sums_stride((2 * MOE_ROWS_PER_SIMDGROUP + (normed ? 1 : 0)) * tokens);
}

struct MoeGateUpParams {
  uint in_dim;
  uint expert_rows;  // moe_intermediate_size
  uint shared_rows;  // shared_expert_intermediate_size
  uint top_k;
  float eps;         // the folded norm's epsilon (NORMED kernels only)
  uint experts;      // router logits (ROUTES kernels only)
  uint normalize;    // as MoeRouteParams (ROUTES kernels only)
  uint first_slot;   // the slot of grid row y = 0: a dispatch may take a contiguous run of slots
};

// h[slot * expert_rows + r] = silu(gate_e x)[r] * (up_e x)[r] for slot < top_k (expert e =
// expert_ids[slot]); slot top_k is the shared expert, at h[top_k * expert_rows + r].
// Grid: x over rows (4 per SIMD-group), y over a run of slots from first_slot: all top_k + 1, or
// (the decode step) the shared expert alone, beside the router, and the routed ones after it;
// z over tokens.
//
// The decode step folds its neighbours in. NORMED kernels take the un-normed residual as x and
// apply the post-attention RMSNorm themselves (see qgemv_rows_gained). ROUTES kernels take the
// router logits instead of routed ids: each SIMD-group of a routed slot runs the routing rounds
// up to its slot (a few hundred ALU operations on 1 KB of logits, against the 128 KB of weights
// it reads), and slot 0's first threadgroup also stores the ids and weights that moe_down reads,
// so routing is no dependent level of its own.
template <uint BITS, bool NORMED, bool ROUTES>
[[kernel]] void moe_gate_up_swiglu(
    constant MoeGateUpParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
    device uint* expert_ids [[buffer(2)]], device const uint* gate_w [[buffer(3)]],
    device const bfloat* gate_s [[buffer(4)]], device const bfloat* gate_b [[buffer(5)]],
    device const uint* up_w [[buffer(6)]], device const bfloat* up_s [[buffer(7)]],
    device const bfloat* up_b [[buffer(8)]], device const uint* shared_gate_w [[buffer(9)]],
    device const bfloat* shared_gate_s [[buffer(10)]],
    device const bfloat* shared_gate_b [[buffer(11)]], device const uint* shared_up_w [[buffer(12)]],
    device const bfloat* shared_up_s [[buffer(13)]], device const bfloat* shared_up_b [[buffer(14)]],
    device float* h [[buffer(15)]], device const bfloat* gain [[buffer(16)]],
    device const float* router_logits [[buffer(17)]], device float* expert_weights [[buffer(18)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint3 threadgroup_id [[threadgroup_position_in_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint token = threadgroup_id.z;
  x += ulong(token) * p.in_dim;
  expert_ids += token * p.top_k;
  router_logits += ulong(token) * p.experts;
  expert_weights += token * p.top_k;
  h += ulong(token) * (p.top_k * p.expert_rows + p.shared_rows);
  const uint slot = p.first_slot + threadgroup_id.y;
  const bool shared = slot == p.top_k;
  const uint rows = shared ? p.shared_rows : p.expert_rows;
  const uint row0 = threadgroup_id.x * (simdgroups * MOE_ROWS_PER_SIMDGROUP) +
                    simdgroup * MOE_ROWS_PER_SIMDGROUP;
  if (row0 >= rows) return;  // the whole SIMD-group leaves together (never the id writer: row0 0)
  const uint count = min(MOE_ROWS_PER_SIMDGROUP, rows - row0);

  QuantMatrix gate{shared_gate_w, shared_gate_s, shared_gate_b};
  QuantMatrix up{shared_up_w, shared_up_s, shared_up_b};
  if (!shared) {
    uint expert;
    if (ROUTES) {
      const bool writes = threadgroup_id.x == 0 && slot == 0 && simdgroup == 0;
      expert = route_token(router_logits, p.experts, p.top_k, p.normalize != 0, slot + 1, writes,
                           expert_ids, expert_weights, lane);
    } else {
      expert = expert_ids[slot];
    }
    gate = quant_expert(QuantMatrix{gate_w, gate_s, gate_b}, expert, rows, p.in_dim, BITS);
    up = quant_expert(QuantMatrix{up_w, up_s, up_b}, expert, rows, p.in_dim, BITS);
  }

  constexpr uint chunk = quant_chunk(BITS);
  float gate_acc[MOE_ROWS_PER_SIMDGROUP];
  float up_acc[MOE_ROWS_PER_SIMDGROUP];
  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
    gate_acc[r] = 0.0f;
    up_acc[r] = 0.0f;
  }
  float squares = 0.0f;
  for (uint k = lane * chunk; k < p.in_dim; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum =
        NORMED ? load_chunk_gained<BITS>(x, gain, k, xs, squares) : load_chunk<BITS>(x, k, xs);
    for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
      const uint row = clamped_row(row0, count, r);
      gate_acc[r] += qdot_chunk<BITS>(gate, p.in_dim, row, k, xs, xsum);
      up_acc[r] += qdot_chunk<BITS>(up, p.in_dim, row, k, xs, xsum);
    }
  }
  // One exchange (lane_sum, quantized.h) for the rows' gate and up sums and the norm's sum of
  // squares, laid out as moe_gate_up_union's run of one token, whose sums are these bit for bit.
  constexpr uint R = MOE_ROWS_PER_SIMDGROUP;
  const uint stride = moe_gate_up_lane_stride(1, NORMED);
  threadgroup float* mine = scratch + simdgroup * SIMD_WIDTH * stride;
  for (uint r = 0; r < R; ++r) {
    mine[lane * stride + r] = gate_acc[r];
    mine[lane * stride + R + r] = up_acc[r];
  }
  if (NORMED) mine[lane * stride + 2 * R] = squares;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lane >= count) return;
  const float scale = NORMED ? inv_rms_of(lane_sum(mine, stride, 2 * R), p.in_dim, p.eps) : 1.0f;
  const float g = lane_sum(mine, stride, lane) * scale;
  const float u = lane_sum(mine, stride, R + lane) * scale;
  h[slot * p.expert_rows + row0 + lane] = silu(g) * u;
}

template [[host_name("moe_gate_up_swiglu_4")]] [[kernel]]
decltype(moe_gate_up_swiglu<4, false, false>) moe_gate_up_swiglu<4, false, false>;
template [[host_name("moe_gate_up_swiglu_normed_4")]] [[kernel]]
decltype(moe_gate_up_swiglu<4, true, false>) moe_gate_up_swiglu<4, true, false>;
template [[host_name("moe_gate_up_swiglu_routed_4")]] [[kernel]]
decltype(moe_gate_up_swiglu<4, false, true>) moe_gate_up_swiglu<4, false, true>;
template [[host_name("moe_gate_up_swiglu_normed_routed_4")]] [[kernel]]
decltype(moe_gate_up_swiglu<4, true, true>) moe_gate_up_swiglu<4, true, true>;

struct MoeDownParams {
  uint expert_in;  // moe_intermediate_size
  uint shared_in;  // shared_expert_intermediate_size
  uint out_rows;   // hidden_size
  uint top_k;
  uint accumulate;  // out += the block's output (the residual add folded in) instead of out =
};

// out = sum_slot w[slot] down_{e(slot)} h_slot + sigmoid(shared_gate_logit) down_s h_shared.
// The k routed inputs are one contiguous vector of top_k * expert_in values, walked in chunks by
// all 32 lanes (a chunk never straddles two experts since expert_in is a multiple of 64), so a
// short expert input does not leave most lanes idle. Grid: x over rows, 4 per SIMD-group; y over
// tokens.
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
                         uint2 threadgroup_id [[threadgroup_position_in_grid]],
                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                         uint simdgroups [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  const uint token = threadgroup_id.y;
  h += ulong(token) * (p.top_k * p.expert_in + p.shared_in);
  expert_ids += token * p.top_k;
  expert_weights += token * p.top_k;
  shared_gate_logit += token;
  out += ulong(token) * p.out_rows;
  const uint row0 = threadgroup_id.x * (simdgroups * MOE_ROWS_PER_SIMDGROUP) +
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
    for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
      acc[r] += weight * qdot_chunk<BITS>(expert, p.expert_in, clamped_row(row0, count, r),
                                          k % p.expert_in, xs, xsum);
    }
  }

  const QuantMatrix shared{shared_w, shared_s, shared_b};
  const float shared_weight = sigmoid(shared_gate_logit[0]);
  device const float* h_shared = h + p.top_k * p.expert_in;
  for (uint k = lane * chunk; k < p.shared_in; k += SIMD_WIDTH * chunk) {
    float xs[chunk];
    const float xsum = load_chunk<BITS>(h_shared, k, xs);
    for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
      acc[r] += shared_weight *
                qdot_chunk<BITS>(shared, p.shared_in, clamped_row(row0, count, r), k, xs, xsum);
    }
  }

  const float4 totals = simd_sum_rows(acc);
  for (uint r = 0; r < MOE_ROWS_PER_SIMDGROUP; ++r) {
    const float total = totals[r];
    // Each row is read and written by the one lane that owns it, so accumulating is race-free.
    if (lane == 0 && r < count) out[row0 + r] = p.accumulate != 0 ? out[row0 + r] + total : total;
  }
}

template [[host_name("moe_down_4")]] [[kernel]] decltype(moe_down<4>) moe_down<4>;

// ---- a verify pass's MoE over the union of its tokens' experts ---------------------------------
//
// The T tokens of a verify pass are consecutive tokens of one text, whose routing is correlated
// (docs/architecture.md, the verify pass), so their T x top_k (token, expert) pairs often name
// the same expert more than once. These two kernels read each chosen expert's gate and up
// weights once for all the tokens that chose it; moe_down still runs per token (why: record_moe
// in kernels/moe.py).
//
// The union, as moe_route_union writes it ([MoeUnionParams::entries] is min(T x top_k, experts),
// [pairs] is T x top_k: a NaN logit can make a token choose one expert twice):
//   union[0]                                   the number of distinct experts D
//   union[1 + u], u < D                        entry u's expert, ascending
//   union[1 + entries + u]                     entry u's pair count n_u
//   union[1 + 2 entries + u * pairs + i], i < n_u   its i-th pair, token * top_k + slot, in
//                                              (token, slot) order
constexpr constant uint MOE_UNION_MAX_TOKENS = 9;  // a verify pass: the last token and 8 drafts
constexpr constant uint MOE_UNION_MAX_TOP_K = 8;

struct MoeUnionParams {
  uint experts;
  uint top_k;
  uint normalize;
  uint tokens;
  uint entries;  // min(tokens * top_k, experts)
};

inline uint union_pair_base(uint entries, uint pairs, uint entry) {
  return 1 + 2 * entries + entry * pairs;
}

// One threadgroup of `tokens` SIMD-groups: SIMD-group t routes token t as moe_route does (its
// ids and weights, which moe_down reads); then SIMD-group 0 builds the union. Its lane l holds
// experts l, l + 32, ... (as routing does); each entry's rank is the number of chosen experts
// below it, from two prefix sums of per-lane bit counts packed four to a word.
[[kernel, max_total_threads_per_threadgroup(MOE_UNION_MAX_TOKENS * SIMD_WIDTH)]]
void moe_route_union(constant MoeUnionParams& p [[buffer(0)]],
                     device const float* logits [[buffer(1)]],
                     device uint* expert_ids [[buffer(2)]],
                     device float* expert_weights [[buffer(3)]],
                     device uint* expert_union [[buffer(4)]],
                     uint token [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint chosen[MOE_UNION_MAX_TOKENS * MOE_UNION_MAX_TOP_K];
  route_token(logits + ulong(token) * p.experts, p.experts, p.top_k, p.normalize != 0, p.top_k,
              true, expert_ids + token * p.top_k, expert_weights + token * p.top_k, lane);
  // Lane 0 wrote the ids; it copies them (its own writes, in program order) for SIMD-group 0.
  if (lane == 0) {
    for (uint slot = 0; slot < p.top_k; ++slot) {
      chosen[token * p.top_k + slot] = expert_ids[token * p.top_k + slot];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (token != 0) return;  // SIMD-group 0 alone builds the union

  const uint pairs = p.tokens * p.top_k;
  uint owned = 0;  // bit j: expert lane + 32 j is chosen by some token
  for (uint i = 0; i < pairs; ++i) {
    const uint e = chosen[i];
    if (e % SIMD_WIDTH == lane) owned |= 1u << (e / SIMD_WIDTH);
  }
  // Bit j of `owned` in byte j % 4 of counts[j / 4]: a lane's share of each j, summed over lanes
  // (at most 32 per byte) in one prefix sum per word.
  uint counts[2] = {0, 0};
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    counts[j / 4] |= ((owned >> j) & 1u) << (8 * (j % 4));
  }
  const uint below[2] = {simd_prefix_exclusive_sum(counts[0]), simd_prefix_exclusive_sum(counts[1])};
  const uint totals[2] = {simd_sum(counts[0]), simd_sum(counts[1])};
  uint before_j = 0;  // chosen experts with a smaller j (all lanes)
  for (uint j = 0; j < MOE_MAX_EXPERTS_PER_LANE; ++j) {
    const uint shift = 8 * (j % 4);
    if ((owned >> j) & 1u) {
      const uint entry = before_j + ((below[j / 4] >> shift) & 0xFFu);
      const uint e = lane + j * SIMD_WIDTH;
      expert_union[1 + entry] = e;
      const uint base = union_pair_base(p.entries, pairs, entry);
      uint count = 0;
      for (uint i = 0; i < pairs; ++i) {
        if (chosen[i] == e) expert_union[base + count++] = i;
      }
      expert_union[1 + p.entries + entry] = count;
    }
    before_j += (totals[j / 4] >> shift) & 0xFFu;
  }
  if (lane == 0) expert_union[0] = before_j;
}

struct MoeGateUpUnionParams {
  uint in_dim;
  uint expert_rows;
  uint shared_rows;
  uint top_k;
  float eps;     // the folded norm's epsilon (NORMED only)
  uint tokens;
  uint entries;  // as MoeUnionParams
};

// h[token][slot * expert_rows + r] = silu(gate_e x_token)[r] * (up_e x_token)[r] for every pair
// (token, slot) of union entry u = grid y (expert e): moe_gate_up_swiglu's rows over the union.
// A SIMD-group decodes a chunk of its 4 rows' codes once (the gate's, then the up's) and walks
// the entry's tokens over them; each token's sums are moe_gate_up_swiglu's, in its order, so h is
// the per-token kernel's bit for bit. Threadgroups of entries past D leave at once. Grid: x over
// rows (4 per SIMD-group), y over `entries`.
template <uint BITS, bool NORMED>
[[kernel]] void moe_gate_up_union(
    constant MoeGateUpUnionParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
    device const uint* expert_union [[buffer(2)]], device const uint* gate_w [[buffer(3)]],
    device const bfloat* gate_s [[buffer(4)]], device const bfloat* gate_b [[buffer(5)]],
    device const uint* up_w [[buffer(6)]], device const bfloat* up_s [[buffer(7)]],
    device const bfloat* up_b [[buffer(8)]], device float* h [[buffer(9)]],
    device const bfloat* gain [[buffer(10)]], threadgroup float* scratch [[threadgroup(0)]],
    uint2 threadgroup_id [[threadgroup_position_in_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint entry = threadgroup_id.y;
  if (entry >= expert_union[0]) return;  // fewer distinct experts than the grid's worst case
  const uint rows = p.expert_rows;
  const uint row0 = threadgroup_id.x * (simdgroups * MOE_ROWS_PER_SIMDGROUP) +
                    simdgroup * MOE_ROWS_PER_SIMDGROUP;
  if (row0 >= rows) return;  // the whole SIMD-group leaves together
  const uint count = min(MOE_ROWS_PER_SIMDGROUP, rows - row0);
  const uint expert = expert_union[1 + entry];
  const uint pair_count = expert_union[1 + p.entries + entry];
  device const uint* pairs =
      expert_union + union_pair_base(p.entries, p.tokens * p.top_k, entry);
  const QuantMatrix gate =
      quant_expert(QuantMatrix{gate_w, gate_s, gate_b}, expert, rows, p.in_dim, BITS);
  const QuantMatrix up = quant_expert(QuantMatrix{up_w, up_s, up_b}, expert, rows, p.in_dim, BITS);

  constexpr uint R = MOE_ROWS_PER_SIMDGROUP;
  constexpr uint N = MOE_UNION_MAX_TOKENS;
  constexpr uint chunk = quant_chunk(BITS);
  const uint words_per_row = p.in_dim * BITS / 32;
  const uint groups_per_row = p.in_dim / QUANT_GROUP_SIZE;
  // An entry has at most one pair per token unless NaN logits made a token choose an expert
  // twice; then its pairs run `tokens` at a time (what the threadgroup memory holds), the
  // weights read again per run.
  const uint most = min(N, p.tokens);
  threadgroup float* mine =
      scratch + simdgroup * SIMD_WIDTH * moe_gate_up_lane_stride(most, NORMED);
  for (uint first = 0; first < pair_count; first += most) {
    const uint run = min(most, pair_count - first);
    float gate_acc[R][N], up_acc[R][N], squares[N];
    for (uint n = 0; n < N; ++n) {
      squares[n] = 0.0f;
      for (uint r = 0; r < R; ++r) gate_acc[r][n] = up_acc[r][n] = 0.0f;
    }
    for (uint k = lane * chunk; k < p.in_dim; k += SIMD_WIDTH * chunk) {
      float gains[chunk];
      if (NORMED) load_gains<BITS>(gain, k, gains);
      for (uint matrix = 0; matrix < 2; ++matrix) {
        const QuantMatrix m = matrix == 0 ? gate : up;
        float decoded[R][chunk];
        float scales[R], biases[R];
        for (uint r = 0; r < R; ++r) {
          const ulong row = clamped_row(row0, count, r);
          decode_codes<BITS>(
              *reinterpret_cast<device const uint4*>(m.weight + row * words_per_row + k * BITS / 32),
              decoded[r]);
          const ulong group = row * groups_per_row + k / QUANT_GROUP_SIZE;
          scales[r] = float(m.scales[group]);
          biases[r] = float(m.biases[group]);
        }
        for (uint n = 0; n < N; ++n) {
          if (n >= run) break;
          device const float* token_x = x + ulong(pairs[first + n] / p.top_k) * p.in_dim;
          float xs[chunk];
          // The squares of a token's x are summed once, with its gate.
          float unused = 0.0f;
          thread float& sum_of_squares = matrix == 0 ? squares[n] : unused;
          const float xsum = NORMED ? load_chunk_gained<BITS>(token_x, gains, k, xs, sum_of_squares)
                                    : load_chunk<BITS>(token_x, k, xs);
          for (uint r = 0; r < R; ++r) {
            const float dot = qdot_decoded<BITS>(decoded[r], scales[r], biases[r], xs, xsum);
            if (matrix == 0) {
              gate_acc[r][n] += dot;
            } else {
              up_acc[r][n] += dot;
            }
          }
        }
      }
    }
    // The run's gate and up sums of every row and token, and their norms' sums of squares, in
    // one exchange (moe_gate_up_swiglu's sums, bit for bit): value i = n * R + r by lanes i,
    // i + 32, ...
    const uint stride = moe_gate_up_lane_stride(run, NORMED);
    const uint values = R * run;
    if (first > 0) simdgroup_barrier(mem_flags::mem_threadgroup);  // the last run's reads done
    for (uint n = 0; n < N; ++n) {
      if (n >= run) break;
      for (uint r = 0; r < R; ++r) {
        mine[lane * stride + n * R + r] = gate_acc[r][n];
        mine[lane * stride + values + n * R + r] = up_acc[r][n];
      }
      if (NORMED) mine[lane * stride + 2 * values + n] = squares[n];
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = lane; i < values; i += SIMD_WIDTH) {
      const uint n = i / R, r = i % R;
      if (r >= count) continue;
      const float scale =
          NORMED ? inv_rms_of(lane_sum(mine, stride, 2 * values + n), p.in_dim, p.eps) : 1.0f;
      const float g = lane_sum(mine, stride, i) * scale;
      const float u = lane_sum(mine, stride, values + i) * scale;
      const uint pair = pairs[first + n];
      device float* out = h + ulong(pair / p.top_k) * (p.top_k * rows + p.shared_rows) +
                          (pair % p.top_k) * rows + row0;
      out[r] = silu(g) * u;
    }
  }
}

template [[host_name("moe_gate_up_union_4")]] [[kernel]]
decltype(moe_gate_up_union<4, false>) moe_gate_up_union<4, false>;
template [[host_name("moe_gate_up_union_normed_4")]] [[kernel]]
decltype(moe_gate_up_union<4, true>) moe_gate_up_union<4, true>;
