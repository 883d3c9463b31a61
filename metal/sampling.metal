// The last step of a decode when sampling is requested: choose the next token from the fp32
// logits with temperature, top-k, top-p and min-p, and report log-probabilities, on the device.
//
// The request's sampling parameters live in a small device buffer the host writes once per
// request, and the random numbers come from a counter-based generator keyed by (seed, position),
// so the recorded graph is the same for every request and a seed reproduces a run exactly with
// no generator state carried between steps.
//
// Definition (z is fp32, every comparison below is on fp32 values):
//   l_i = logits_i + bias_i, when the request adjusts logits; then, for a token in the prompt
//         or generated before (count_i > 0), l_i = l_i / r if l_i > 0 else l_i * r (the
//         repetition penalty r), and l_i -= frequency * count_i + (count_i > 0 ? presence : 0)
//   z_i = l_i * inverse_temperature                           (greedy argmax when it is 0)
//   order key: the fp32 bits of z mapped to a uint32 that sorts like the value (-0 as +0)
//   top-k:  t_k = the k-th largest key; keep key_i >= t_k      (ties at the k-th value all kept)
//   top-p:  mass_i = exp(z_i - max z); t_p = the largest key t with
//           sum(mass_i : key_i >= max(t, t_k)) >= top_p * sum(mass_i : key_i >= t_k)
//           keep key_i >= t_p                                 (ties at the boundary all kept)
//   min-p:  keep z_i - max z >= log(min_p)                    (log taken on the host)
//   sample: i with probability proportional to mass_i among the kept tokens, drawn as the
//           Gumbel-max argmax of z_i + G_i, G_i = -log(E_i), E_i ~ Exp(1) from Philox4x32-10
//           with key (seed_low, seed_high) and counter (i, position, 0, 0).
// The token holding the largest z is always kept, so at least one token survives. A row holding
// a NaN or +inf logit is refused: the draw is NO_TOKEN and no log-probabilities are written.
// A token mask (a constraint's allowed tokens, written by the host before the draw) applies
// first: a disallowed token's z is -inf, so it is neither the greedy choice, nor counted by the
// filters, nor drawn. The log-probabilities ignore the mask and the adjustments: they stay the
// model's own.
//
// Two dispatches per draw. `sample_slices` spreads the full-vocabulary work over many threadgroups,
// each reducing one slice of the vocabulary into a SlicePartial: its NaN/+inf count, its largest
// ranked and raw logits (lowest index), the log-probability normaliser's partial sum, its Gumbel-
// race winner when no top-k or top-p applies, its SLICE_CANDIDATES most likely tokens when a
// filter applies, and its most likely raw logits when alternatives are wanted. `sample_token`
// (one threadgroup per draw) finishes from the partials:
// - greedy, and the race without top-k or top-p, are reductions over the slices' results (the
//   race's argmax over all tokens is the argmax of the slices' winners; min-p alone only checks
//   that the winner passes it, since it wins the race over any subset holding it);
// - the filters run over the slices' candidates, gathered into threadgroup memory: every token
//   whose key is above the largest of the full slices' last candidate keys is among them, so a
//   threshold found above that key is the exact one (thresholds are found by bisection on the
//   order key, 32 passes each, never by sorting);
// - otherwise (a top-k larger than the candidates, a top-p needing more mass, thousands of
//   ties) the filters fall back to passes over the logits in device memory, as one threadgroup:
//   when top-k is on, the k-th largest candidate key (a lower bound on the k-th largest key)
//   selects the tokens the cut can keep, gathered when at most GATHER_CAPACITY.
// The top log-probabilities are the best of the slices' own best. The finishing dispatch can
// also count the drawn token for the penalties and advance the step buffer (step.h), so a
// decode step needs no further dispatch after it.
#include "common.h"
#include "step.h"

constexpr constant uint NO_TOKEN = 0xFFFFFFFFu;
// Entries per log-probability ring slot: the chosen token, then up to 20 alternatives.
constexpr constant uint MAX_TOP_LOGPROBS = 20;
constexpr constant uint LOGPROB_ENTRIES = 1 + MAX_TOP_LOGPROBS;
// Tokens gathered into threadgroup memory (8 bytes each): the slices' candidates, or the tokens
// a lower bound on the thresholds selects.
constexpr constant uint GATHER_CAPACITY = 2048;
// Candidates each slice lists for the filters, and so the most slices one draw may have.
constexpr constant uint SLICE_CANDIDATES = 16;
constexpr constant uint MAX_SLICES = GATHER_CAPACITY / SLICE_CANDIDATES;
// The bits of the lowest float, the host's log_min_p when min-p is off.
constexpr constant uint LOWEST_FLOAT_BITS = 0xFF7FFFFFu;
constexpr constant uint MINUS_INFINITY_BITS = 0xFF800000u;
constexpr constant float TWO_TO_MINUS_32 = 1.0f / 4294967296.0f;
constexpr constant float LARGEST_BELOW_ONE = 1.0f - 1.0f / 16777216.0f;
// Below this, -log(1 - u) = u + u^2/2 to fp32 precision.
constexpr constant float SERIES_LIMIT = 1.0f / 4096.0f;

// Written by the host once per request (lily.kernels.sampling.SamplingParams).
struct SamplingParams {
  float inverse_temperature;  // 1 / temperature; 0 selects greedy decoding
  uint top_k;                 // 0 (or >= vocab): off
  float top_p;                // in (0, 1]; 1: off
  float log_min_p;            // log(min_p); the lowest float when min-p is off
  uint seed_low;
  uint seed_high;
  uint want_logprobs;  // 0: skip the log-probability pass
  uint top_logprobs;   // alternatives to report, at most MAX_TOP_LOGPROBS
  float presence_penalty;
  float frequency_penalty;
  float repetition_penalty;  // 1: off
  uint adjusts;              // 1: read the bias, the counts and the prompt's tokens
};

// Fixed when the graph is recorded.
struct SampleShape {
  uint vocab;
  uint ring_slots;    // slots of the log-probability ring
  uint slices;        // slices of the vocabulary per draw, at most MAX_SLICES
  uint slice_tokens;  // tokens per slice (the last may hold fewer)
  uint capacity;      // the token history's length, for the step advance
  uint bookkeeping;   // 1: the finishing dispatch counts the token and advances the step buffer
  uint logits_stride;  // floats between draw g's logits row and the next's (0: one row for all)
  uint draft_counts;   // 1: draw g also counts the g drafted tokens the history holds after the
                       // step position, as generated before it (a verify pass's rows)
  uint mask_stride;    // words between draw g's token mask and the next's (0: one mask for all)
};

struct TokenValue {
  uint token;
  float value;
};

// What `sample_slices` writes for one slice of one draw. A field is written whenever a later
// read of it can happen: the first five always, the rest when the parameters need them.
struct SlicePartial {
  uint unusable;        // NaN or +inf logits in the slice
  uint best_index;      // the largest ranked logit's lowest index; NO_TOKEN if none is allowed
  float best;           // that adjusted logit
  uint best_raw_index;  // the largest raw logit's lowest index
  float best_raw;
  float raw_exp_sum;    // sum of exp(logit - best_raw) over the slice (log-probabilities)
  float mass;           // sum of exp(z - best * inverse_temperature) (top-p without top-k)
  uint race_winner;     // the race's winner over the slice's finite z (no top-k, no top-p)
  uint candidate_count;
  uint candidate_bound;  // the last candidate's key when the slice holds more tokens, else 0
  TokenValue candidates[SLICE_CANDIDATES];  // the most likely by (z desc, id asc), with z
  TokenValue top_raw[MAX_TOP_LOGPROBS];     // the largest raw logits by (value desc, id asc)
};

struct LogprobEntry {
  uint token;
  float logprob;
};

// A token mask (lily.kernels.sampling.write_token_mask): word 0 is 1 when the mask applies to
// this draw, then bit i % 32 of word 1 + i / 32 is set when token i is allowed. Draw g reads the
// mask `mask_stride` * g words on: a verify pass's rows each have their own (a grammar's state
// differs after each draft).
constexpr constant uint MASK_HEADER_WORDS = 1;

// Philox4x32-10 (Salmon et al., SC'11): four 32-bit outputs from a 128-bit counter and a 64-bit
// key. Only the first output is used; the others are free for later uses of the same counter.
inline uint philox_first_word(uint4 counter, uint2 key) {
  for (uint round = 0; round < 10; ++round) {
    const ulong product0 = ulong(0xD2511F53u) * ulong(counter.x);
    const ulong product1 = ulong(0xCD9E8D57u) * ulong(counter.z);
    counter = uint4(uint(product1 >> 32) ^ counter.y ^ key.x, uint(product1),
                    uint(product0 >> 32) ^ counter.w ^ key.y, uint(product0));
    key += uint2(0x9E3779B9u, 0xBB67AE85u);
  }
  return counter.x;
}

// An Exp(1) variate from 32 random bits, -log(1 - u) with u in (0, 1). Small values are the ones
// that let unlikely tokens win the Gumbel race, so u keeps its full 2^-32 resolution near 0 and
// the log(1 - u) cancellation there is avoided by its series.
inline float exponential_variate(uint bits) {
  const float u = min((float(bits) + 0.5f) * TWO_TO_MINUS_32, LARGEST_BELOW_ONE);
  return u < SERIES_LIMIT ? u * (1.0f + 0.5f * u) : -log(1.0f - u);
}

// The race's score of token `id` at `position`: z_i + G_i (the definition above).
inline float race_score(float z, uint id, uint position, uint2 key) {
  const uint bits = philox_first_word(uint4(id, position, 0, 0), key);
  return z - log(exponential_variate(bits));
}

// An order-preserving uint32 image of a float (NaN excluded): larger floats give larger keys.
// -0 is folded into +0 on the integer side, where fast math cannot drop the test.
inline uint order_key(float value) {
  const uint raw = as_type<uint>(value);
  const uint bits = raw == 0x80000000u ? 0u : raw;
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// The float whose order key is `key` (+0 for the key of -0).
inline float key_value(uint key) {
  return as_type<float>((key & 0x80000000u) != 0 ? key & 0x7FFFFFFFu : ~key);
}

inline bool is_minus_infinity(float value) { return as_type<uint>(value) == MINUS_INFINITY_BITS; }

// Tested on the bits, since fast math may assume isnan and isinf are false. -inf is a token the
// logits rule out; NaN and +inf are values no token can be drawn from.
inline bool is_nan_or_plus_infinity(float value) {
  const uint raw = as_type<uint>(value);
  return (raw & 0x7F800000u) == 0x7F800000u && raw != 0xFF800000u;
}

// Threadgroup reductions. Each ends with a barrier, so the scratch arrays can be reused by the
// next call at once. Call from uniform control flow only.
inline float group_sum(float value, threadgroup float* scratch, uint simdgroups, uint simdgroup,
                       uint lane) {
  const float partial = simd_sum(value);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < simdgroups; ++s) total += scratch[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

inline uint group_count(uint value, threadgroup uint* scratch, uint simdgroups, uint simdgroup,
                        uint lane) {
  const uint partial = simd_sum(value);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint total = 0;
  for (uint s = 0; s < simdgroups; ++s) total += scratch[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

inline uint group_max(uint value, threadgroup uint* scratch, uint simdgroups, uint simdgroup,
                      uint lane) {
  const uint partial = simd_max(value);
  if (lane == 0) scratch[simdgroup] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint largest = 0;
  for (uint s = 0; s < simdgroups; ++s) largest = max(largest, scratch[s]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return largest;
}

// The candidate with the largest value, ties to the lowest index, over the threadgroup; a
// thread without a candidate passes index NO_TOKEN. Returns NO_TOKEN when no thread has one.
inline uint group_argmax(float value, uint index, threadgroup float* values,
                         threadgroup uint* indices, uint simdgroups, uint simdgroup, uint lane) {
  const float candidate = index == NO_TOKEN ? -INFINITY : value;
  const uint simd_winner = simd_argmax(candidate, index);
  const float simd_winner_value = simd_max(candidate);
  if (lane == 0) {
    values[simdgroup] = simd_winner_value;
    indices[simdgroup] = simd_winner;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float best = values[0];
  uint winner = indices[0];
  for (uint s = 1; s < simdgroups; ++s) {
    const uint i = indices[s];
    if (i != NO_TOKEN &&
        (winner == NO_TOKEN || values[s] > best || (values[s] == best && i < winner))) {
      best = values[s];
      winner = i;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return winner;
}

// The per-token inputs of the adjustments (lily.kernels.sampling.write_logit_adjustments).
struct Adjustments {
  device const float* bias;         // [vocab]
  device const uint* counts;        // [vocab]: times generated so far in this completion
  device const uint* prompt_tokens;  // bitmask: the tokens the prompt holds
  // A verify pass's row g counts the g drafted tokens before it too: they would have been
  // generated by the time plain decoding drew that row's token.
  device const uint* drafted;
  uint drafted_count;
};

inline uint generated_count(thread const Adjustments& adjustments, uint i) {
  uint count = adjustments.counts[i];
  for (uint j = 0; j < adjustments.drafted_count; ++j) {
    count += adjustments.drafted[j] == i ? 1u : 0u;
  }
  return count;
}

// The adjustments of draw `draw`: the drafts it counts start after the step position.
inline Adjustments draw_adjustments(constant SampleShape& shape, device const float* bias,
                                    device const uint* counts, device const uint* prompt_tokens,
                                    device const uint* history, uint first_position, uint draw) {
  if (shape.draft_counts == 0) return Adjustments{bias, counts, prompt_tokens, counts, 0u};
  return Adjustments{bias, counts, prompt_tokens, history + first_position + 1u, draw};
}

// The logits a draw ranks tokens by: the model's, adjusted when `adjusted`, with the tokens the
// mask rules out at -inf when `masked` (the log-probabilities read the model's own).
struct Logits {
  device const float* values;
  device const uint* mask;
  bool masked;
  bool adjusted;
  Adjustments adjustments;
  device const SamplingParams* params;
};

inline bool allowed(thread const Logits& logits, uint i) {
  return !logits.masked || ((logits.mask[MASK_HEADER_WORDS + (i >> 5)] >> (i & 31u)) & 1u) != 0;
}

// Token i's logit l_i adjusted by the bias and the penalties (the definition above).
inline float adjusted_logit(thread const Logits& logits, uint i) {
  float value = logits.values[i];
  if (!logits.adjusted) return value;
  value += logits.adjustments.bias[i];
  const uint count = generated_count(logits.adjustments, i);
  const bool in_prompt = ((logits.adjustments.prompt_tokens[i >> 5] >> (i & 31u)) & 1u) != 0;
  if (count != 0 || in_prompt) {
    const float penalty = logits.params->repetition_penalty;
    value = value > 0.0f ? value / penalty : value * penalty;
  }
  value -= logits.params->frequency_penalty * float(count);
  value -= count != 0 ? logits.params->presence_penalty : 0.0f;
  return value;
}

inline float logit(thread const Logits& logits, uint i) {
  return allowed(logits, i) ? adjusted_logit(logits, i) : -INFINITY;
}

// The tokens the filters and the race run over: either every token, read from the logits, or
// the ones gathered into threadgroup memory when top-k bounds them (then every later pass reads
// a few hundred values instead of the whole vocabulary).
struct Tokens {
  Logits logits;
  threadgroup const float* gathered_z;
  threadgroup const uint* gathered_ids;
  float inverse_temperature;
  uint count;
  bool gathered;
};

inline float token_z(thread const Tokens& tokens, uint j) {
  return tokens.gathered ? tokens.gathered_z[j]
                         : logit(tokens.logits, j) * tokens.inverse_temperature;
}

inline uint token_id(thread const Tokens& tokens, uint j) {
  return tokens.gathered ? tokens.gathered_ids[j] : j;
}

// The largest key t with count(key >= t) >= k among `tokens`: their k-th largest key.
inline uint kth_largest_key(thread const Tokens& tokens, uint k, threadgroup uint* scratch,
                            uint thread_id, uint threads, uint simdgroups, uint simdgroup,
                            uint lane) {
  uint found = 0;
  for (uint bit = 32; bit-- > 0;) {
    const uint candidate = found | (1u << bit);
    uint count = 0;
    for (uint j = thread_id; j < tokens.count; j += threads) {
      count += order_key(token_z(tokens, j)) >= candidate ? 1u : 0u;
    }
    if (group_count(count, scratch, simdgroups, simdgroup, lane) >= k) found = candidate;
  }
  return found;
}

// Sum of exp(z - max_z) over the tokens with key >= threshold.
inline float mass_above(thread const Tokens& tokens, float max_z, uint threshold,
                        threadgroup float* scratch, uint thread_id, uint threads,
                        uint simdgroups, uint simdgroup, uint lane) {
  float mass = 0.0f;
  for (uint j = thread_id; j < tokens.count; j += threads) {
    const float z = token_z(tokens, j);
    if (order_key(z) >= threshold) mass += exp(z - max_z);
  }
  return group_sum(mass, scratch, simdgroups, simdgroup, lane);
}

// The largest key t with mass_above(max(t, floor)) >= target, given mass_above(floor) >= target.
inline uint top_p_key(thread const Tokens& tokens, float max_z, uint floor, float target,
                      threadgroup float* scratch, uint thread_id, uint threads, uint simdgroups,
                      uint simdgroup, uint lane) {
  uint found = 0;
  for (uint bit = 32; bit-- > 0;) {
    const uint candidate = found | (1u << bit);
    if (mass_above(tokens, max_z, max(candidate, floor), scratch, thread_id, threads, simdgroups,
                   simdgroup, lane) >= target) {
      found = candidate;
    }
  }
  // The caller's mass_above(floor) may have been compiled with other contractions than these
  // passes; never let a rounding difference undo the top-k cut.
  return max(found, floor);
}

// The tokens whose key of logits * scale is at least `bound`, gathered into threadgroup memory
// if `try_gather` and they fit (each thread's in one block, placed by a prefix sum of the
// threads' counts), else a view of every token in the logits.
inline Tokens gather_tokens(thread const Logits& logits, uint vocab, float scale, uint bound,
                            bool try_gather, threadgroup float* gathered_z,
                            threadgroup uint* gathered_ids, threadgroup uint* scratch,
                            uint thread_id, uint threads, uint simdgroups, uint simdgroup,
                            uint lane) {
  const uint scanned = try_gather ? vocab : 0;
  uint own = 0;
  for (uint i = thread_id; i < scanned; i += threads) {
    own += order_key(logit(logits, i) * scale) >= bound ? 1u : 0u;
  }
  const uint own_offset = simd_prefix_exclusive_sum(own);
  const uint simd_total = simd_sum(own);
  if (lane == 0) scratch[simdgroup] = simd_total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint offset = own_offset;
  uint count = 0;
  for (uint s = 0; s < simdgroups; ++s) {
    offset += s < simdgroup ? scratch[s] : 0u;
    count += scratch[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const bool gathered = try_gather && count <= GATHER_CAPACITY;
  for (uint i = thread_id; gathered && i < vocab; i += threads) {
    const float z = logit(logits, i) * scale;
    if (order_key(z) >= bound) {
      gathered_z[offset] = z;
      gathered_ids[offset] = i;
      ++offset;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return Tokens{logits, gathered_z, gathered_ids, scale, gathered ? count : vocab, gathered};
}

// The `count` largest of logit * scale over tokens [begin, end) in (value desc, id asc) order,
// written to `out` by thread 0, count <= end - begin. Returns the last one's value.
inline float slice_top(thread const Logits& logits, float scale, uint begin, uint end, uint count,
                       device TokenValue* out, threadgroup float* values,
                       threadgroup uint* indices, uint thread_id, uint threads, uint simdgroups,
                       uint simdgroup, uint lane) {
  float previous_value = 0.0f;
  uint previous_id = NO_TOKEN;
  for (uint n = 0; n < count; ++n) {
    float value = 0.0f;
    uint index = NO_TOKEN;
    // Each thread scans its ids in increasing order, so a strict > keeps the lowest on ties.
    for (uint i = begin + thread_id; i < end; i += threads) {
      const float v = logit(logits, i) * scale;
      const bool after_previous = previous_id == NO_TOKEN || v < previous_value ||
                                  (v == previous_value && i > previous_id);
      if (after_previous && (index == NO_TOKEN || v > value)) {
        value = v;
        index = i;
      }
    }
    previous_id =
        min(group_argmax(value, index, values, indices, simdgroups, simdgroup, lane), end - 1);
    previous_value = logit(logits, previous_id) * scale;
    if (thread_id == 0) out[n] = TokenValue{previous_id, previous_value};
  }
  return previous_value;
}

// The tokens every slice listed as candidates, gathered into threadgroup memory (at most
// MAX_SLICES * SLICE_CANDIDATES = GATHER_CAPACITY). `complete_above` is set to the largest of the
// full slices' last candidate keys: every token with a larger key is among the gathered ones.
inline Tokens gather_candidates(thread const Logits& logits, float scale,
                                device const SlicePartial* partials, uint slices,
                                thread uint& complete_above, threadgroup float* gathered_z,
                                threadgroup uint* gathered_ids, threadgroup uint* scratch,
                                uint thread_id, uint threads, uint simdgroups, uint simdgroup,
                                uint lane) {
  uint own = 0;
  uint bound = 0;
  for (uint s = thread_id; s < slices; s += threads) {
    own += min(partials[s].candidate_count, SLICE_CANDIDATES);
    bound = max(bound, partials[s].candidate_bound);
  }
  complete_above = group_max(bound, scratch, simdgroups, simdgroup, lane);
  const uint own_offset = simd_prefix_exclusive_sum(own);
  const uint simd_total = simd_sum(own);
  if (lane == 0) scratch[simdgroup] = simd_total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint offset = own_offset;
  uint count = 0;
  for (uint s = 0; s < simdgroups; ++s) {
    offset += s < simdgroup ? scratch[s] : 0u;
    count += scratch[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = thread_id; s < slices; s += threads) {
    const uint listed = min(partials[s].candidate_count, SLICE_CANDIDATES);
    for (uint j = 0; j < listed; ++j) {
      gathered_z[offset] = partials[s].candidates[j].value;
      gathered_ids[offset] = partials[s].candidates[j].token;
      ++offset;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return Tokens{logits, gathered_z, gathered_ids, scale, count, true};
}

// sum(exp(z_i - max_z)) over every allowed token, from the slices' sums relative to their own
// largest z.
inline float slices_mass(device const SlicePartial* partials, uint slices, float max_z,
                         float inverse_temperature, threadgroup float* scratch, uint thread_id,
                         uint threads, uint simdgroups, uint simdgroup, uint lane) {
  float mass = 0.0f;
  for (uint s = thread_id; s < slices; s += threads) {
    const float slice_max = partials[s].best * inverse_temperature;
    if (!is_minus_infinity(slice_max)) mass += partials[s].mass * exp(slice_max - max_z);
  }
  return group_sum(mass, scratch, simdgroups, simdgroup, lane);
}

// The Gumbel race over the tokens with key >= threshold that pass min-p. Gathered tokens are not
// in id order, so ties compare ids explicitly.
inline uint race(thread const Tokens& tokens, uint threshold, float max_z, float log_min_p,
                 uint2 key, uint position, threadgroup float* float_scratch,
                 threadgroup uint* uint_scratch, uint thread_id, uint threads, uint simdgroups,
                 uint simdgroup, uint lane) {
  float best_score = 0.0f;
  uint winner = NO_TOKEN;
  for (uint j = thread_id; j < tokens.count; j += threads) {
    const float z = token_z(tokens, j);
    if (order_key(z) < threshold || !(z - max_z >= log_min_p)) continue;
    const uint id = token_id(tokens, j);
    const float score = race_score(z, id, position, key);
    if (winner == NO_TOKEN || score > best_score || (score == best_score && id < winner)) {
      best_score = score;
      winner = id;
    }
  }
  return group_argmax(best_score, winner, float_scratch, uint_scratch, simdgroups, simdgroup,
                      lane);
}

// The sampled token (NO_TOKEN when every allowed z is -inf) from the slices' partials, max_z the
// largest z.
inline uint sample_from_partials(thread const Logits& ranked, uint vocab, float max_z,
                                 device const SamplingParams& params,
                                 device const SlicePartial* partials, uint slices, uint position,
                                 threadgroup float* gathered_z, threadgroup uint* gathered_ids,
                                 threadgroup float* float_scratch, threadgroup uint* uint_scratch,
                                 uint thread_id, uint threads, uint simdgroups, uint simdgroup,
                                 uint lane) {
  const float inverse_temperature = params.inverse_temperature;
  const uint2 key = uint2(params.seed_low, params.seed_high);
  const bool top_k_on = params.top_k != 0 && params.top_k < vocab;
  const bool top_p_on = params.top_p < 1.0f;
  const bool min_p_on = as_type<uint>(params.log_min_p) != LOWEST_FLOAT_BITS;

  if (!top_k_on && !top_p_on) {
    // The race over every token is won by the best of the slices' winners; it also wins over
    // the tokens min-p keeps whenever it is one of them.
    float best_score = 0.0f;
    uint winner = NO_TOKEN;
    for (uint s = thread_id; s < slices; s += threads) {
      const uint id = partials[s].race_winner;
      if (id >= vocab) continue;
      const float score =
          race_score(logit(ranked, id) * inverse_temperature, id, position, key);
      if (winner == NO_TOKEN || score > best_score) {  // later slices hold larger ids
        best_score = score;
        winner = id;
      }
    }
    const uint sampled = group_argmax(best_score, winner, float_scratch, uint_scratch,
                                      simdgroups, simdgroup, lane);
    if (sampled == NO_TOKEN) return NO_TOKEN;
    if (logit(ranked, sampled) * inverse_temperature - max_z >= params.log_min_p) return sampled;
  }

  uint bound = 0;
  if (top_k_on || top_p_on || min_p_on) {
    uint complete_above = 0;
    const Tokens listed =
        gather_candidates(ranked, inverse_temperature, partials, slices, complete_above,
                          gathered_z, gathered_ids, uint_scratch, thread_id, threads, simdgroups,
                          simdgroup, lane);
    // A threshold above complete_above counts and sums the same tokens over the candidates as
    // over the whole vocabulary, so it is the exact one.
    bool exact = true;
    uint threshold = 0;
    if (top_k_on) {
      const uint kth = kth_largest_key(listed, params.top_k, uint_scratch, thread_id, threads,
                                       simdgroups, simdgroup, lane);
      if (kth > complete_above) {
        threshold = kth;
      } else {
        // The candidates are some of the tokens: their k-th largest key is at most the k-th
        // largest of all, a lower bound for the passes over the logits.
        exact = false;
        bound = kth;
      }
    }
    if (exact && top_p_on) {
      const float kept_mass =
          top_k_on ? mass_above(listed, max_z, threshold, float_scratch, thread_id, threads,
                                simdgroups, simdgroup, lane)
                   : slices_mass(partials, slices, max_z, inverse_temperature, float_scratch,
                                 thread_id, threads, simdgroups, simdgroup, lane);
      const uint top_p = top_p_key(listed, max_z, threshold, params.top_p * kept_mass,
                                   float_scratch, thread_id, threads, simdgroups, simdgroup, lane);
      if (top_k_on || top_p > complete_above) {
        threshold = top_p;
      } else {
        exact = false;
      }
    }
    if (!top_k_on && !top_p_on) {
      // min-p alone: the tokens left out all fail it when a token at complete_above does.
      exact = complete_above == 0 || !(key_value(complete_above) - max_z >= params.log_min_p);
    }
    if (exact) {
      // Keeps the most likely token even if rounding (or a denormal top_p) pushed the key past it.
      return race(listed, min(threshold, order_key(max_z)), max_z, params.log_min_p, key,
                  position, float_scratch, uint_scratch, thread_id, threads, simdgroups,
                  simdgroup, lane);
    }
  }

  // Passes over the logits in device memory. Without a bound only a small vocabulary can fit,
  // so the counting pass is skipped.
  const Tokens tokens = gather_tokens(ranked, vocab, inverse_temperature, bound,
                                      bound != 0 || vocab <= GATHER_CAPACITY, gathered_z,
                                      gathered_ids, uint_scratch, thread_id, threads, simdgroups,
                                      simdgroup, lane);
  uint threshold = 0;
  if (top_k_on) {
    threshold = kth_largest_key(tokens, params.top_k, uint_scratch, thread_id, threads,
                                simdgroups, simdgroup, lane);
  }
  if (top_p_on) {
    const float kept_mass = mass_above(tokens, max_z, threshold, float_scratch, thread_id,
                                       threads, simdgroups, simdgroup, lane);
    threshold = top_p_key(tokens, max_z, threshold, params.top_p * kept_mass, float_scratch,
                          thread_id, threads, simdgroups, simdgroup, lane);
  }
  return race(tokens, min(threshold, order_key(max_z)), max_z, params.log_min_p, key, position,
              float_scratch, uint_scratch, thread_id, threads, simdgroups, simdgroup, lane);
}

// Log-probabilities of the model's own distribution: log_softmax of the raw logits, before the
// mask, temperature and filtering (what OpenAI's API reports), for the chosen token and the
// wanted alternatives, most likely first (ties to the lowest id), into the ring slot.
inline void write_logprobs(device const float* logits, uint vocab, uint slice_tokens,
                           device const SamplingParams& params,
                           device const SlicePartial* partials, uint slices, uint chosen,
                           device LogprobEntry* slot, threadgroup float* float_scratch,
                           threadgroup uint* uint_scratch, uint thread_id, uint threads,
                           uint simdgroups, uint simdgroup, uint lane) {
  float best_raw = 0.0f;
  uint best_raw_index = NO_TOKEN;
  for (uint s = thread_id; s < slices; s += threads) {
    if (best_raw_index == NO_TOKEN || partials[s].best_raw > best_raw) {
      best_raw = partials[s].best_raw;
      best_raw_index = partials[s].best_raw_index;
    }
  }
  const uint raw_argmax = min(group_argmax(best_raw, best_raw_index, float_scratch, uint_scratch,
                                           simdgroups, simdgroup, lane),
                              vocab - 1);
  const float max_raw_logit = logits[raw_argmax];
  float exp_sum = 0.0f;
  for (uint s = thread_id; s < slices; s += threads) {
    const float slice_max = partials[s].best_raw;
    if (!is_minus_infinity(slice_max)) {
      exp_sum += partials[s].raw_exp_sum * exp(slice_max - max_raw_logit);
    }
  }
  const float log_normalizer =
      log(group_sum(exp_sum, float_scratch, simdgroups, simdgroup, lane));
  if (thread_id == 0) {
    slot[0] = LogprobEntry{chosen, (logits[chosen] - max_raw_logit) - log_normalizer};
  }

  // Every one of the most likely tokens is among its own slice's most likely ones, so each pass
  // takes the best listed token ordered after the previous one in (logit desc, id asc).
  const uint wanted = min(params.top_logprobs, min(MAX_TOP_LOGPROBS, vocab));
  float previous_value = 0.0f;
  uint previous_id = NO_TOKEN;
  for (uint n = 0; n < wanted; ++n) {
    float value = 0.0f;
    uint index = NO_TOKEN;
    for (uint s = thread_id; s < slices; s += threads) {
      const uint begin = s * slice_tokens;
      const uint listed = begin < vocab ? min(wanted, min(vocab - begin, slice_tokens)) : 0u;
      for (uint j = 0; j < listed; ++j) {
        const float v = partials[s].top_raw[j].value;
        const uint id = partials[s].top_raw[j].token;
        const bool after_previous = previous_id == NO_TOKEN || v < previous_value ||
                                    (v == previous_value && id > previous_id);
        if (after_previous && (index == NO_TOKEN || v > value || (v == value && id < index))) {
          value = v;
          index = id;
        }
      }
    }
    previous_id = min(
        group_argmax(value, index, float_scratch, uint_scratch, simdgroups, simdgroup, lane),
        vocab - 1);
    previous_value = logits[previous_id];
    if (thread_id == 0) {
      slot[1 + n] = LogprobEntry{previous_id, (previous_value - max_raw_logit) - log_normalizer};
    }
  }
}

// A batched decode pass's draw g (the kernels' kRows entry points, sample_slices_rows and
// sample_token_rows) is the newest token of sequence slot row_slots[g], and each per-sequence
// buffer (settings, step, mask, bias, counts, prompt tokens, history, log-probability ring,
// predicted token) holds the slots one after another: the draw reads and writes its slot's part
// of each, at these offsets in elements of each. Draw g's logits row and partials are the pass's
// row g, as any draw's. One sequence's draws (kRows false) are all slot 0's.
struct SlotParts {
  uint slot;
  ulong step;
  ulong tokens;        // bias, counts
  ulong prompt_words;  // the prompt tokens' bitmask
  ulong history;
  ulong ring_entries;
};

inline SlotParts slot_parts(constant SampleShape& shape, uint slot) {
  return SlotParts{slot,
                   ulong(slot) * kStepFields,
                   ulong(slot) * shape.vocab,
                   ulong(slot) * ((shape.vocab + 31) / 32),
                   ulong(slot) * shape.capacity,
                   ulong(slot) * shape.ring_slots * LOGPROB_ENTRIES};
}

// The first dispatch of a draw: grid (slices, draws), each threadgroup reducing one slice of
// the vocabulary into its SlicePartial.
template <bool kRows>
[[kernel]] void sample_slices(constant SampleShape& shape [[buffer(0)]],
                              device const SamplingParams* all_params [[buffer(1)]],
                              device const float* all_logits [[buffer(2)]],
                              device const uint* step [[buffer(3)]],
                              device SlicePartial* partials [[buffer(4)]],
                              device const uint* all_masks [[buffer(6)]],
                              device const float* bias [[buffer(7)]],
                              device const uint* counts [[buffer(8)]],
                              device const uint* prompt_tokens [[buffer(9)]],
                              device const uint* history [[buffer(11)]],
                              device const uint* row_slots [[buffer(12)]],  // [draws], kRows only
                              uint2 group [[threadgroup_position_in_grid]],
                              uint thread_id [[thread_index_in_threadgroup]],
                              uint2 threadgroup_size [[threads_per_threadgroup]],
                              uint simdgroup [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float float_scratch[SIMD_WIDTH];
  threadgroup uint uint_scratch[SIMD_WIDTH];
  // 2D like the threadgroup's position (MSL: the position and size built-ins of one kernel have
  // one dimension); threadgroups are (threads, 1).
  const uint threads = threadgroup_size.x;
  const uint vocab = shape.vocab;
  const uint simdgroups = (threads + SIMD_WIDTH - 1) / SIMD_WIDTH;
  const uint slice = group.x;
  const uint draw = group.y;
  const SlotParts part = slot_parts(shape, kRows ? row_slots[draw] : 0);
  device const SamplingParams& params = all_params[part.slot];
  step += part.step;
  bias += part.tokens;
  counts += part.tokens;
  prompt_tokens += part.prompt_words;
  const uint begin = min(slice * shape.slice_tokens, vocab - 1);
  const uint end = min(begin + shape.slice_tokens, vocab);
  device SlicePartial& out = partials[draw * min(shape.slices, MAX_SLICES) + slice];
  // One sequence's draw g is for position + g: one dispatch can draw many samples (the tests
  // do); a batched pass's draws are each for its own slot's position.
  const uint step_position = step[0] + (kRows ? 0 : draw);
  device const float* logits = all_logits + ulong(draw) * shape.logits_stride;
  device const uint* mask = all_masks + ulong(kRows ? part.slot : draw) * shape.mask_stride;

  const Adjustments adjustments =
      draw_adjustments(shape, bias, counts, prompt_tokens, history, step[0], draw);
  const Logits raw = Logits{logits, mask, false, false, adjustments, &params};
  const Logits ranked =
      Logits{logits, mask, mask[0] != 0, params.adjusts != 0, adjustments, &params};

  // The largest allowed logit (lowest index on ties: each thread scans its indices in
  // increasing order, so a strict > keeps the first), and the largest logit of all.
  float best = 0.0f;
  uint best_index = NO_TOKEN;
  float best_raw = 0.0f;
  uint best_raw_index = NO_TOKEN;
  uint unusable = 0;
  for (uint i = begin + thread_id; i < end; i += threads) {
    const float v = logits[i];
    unusable += is_nan_or_plus_infinity(v) ? 1u : 0u;
    if (best_raw_index == NO_TOKEN || v > best_raw) {
      best_raw = v;
      best_raw_index = i;
    }
    if (allowed(ranked, i)) {
      const float a = adjusted_logit(ranked, i);
      if (best_index == NO_TOKEN || a > best) {
        best = a;
        best_index = i;
      }
    }
  }
  const uint unusable_count = group_count(unusable, uint_scratch, simdgroups, simdgroup, lane);
  const uint slice_best =
      group_argmax(best, best_index, float_scratch, uint_scratch, simdgroups, simdgroup, lane);
  const uint slice_raw_best = min(group_argmax(best_raw, best_raw_index, float_scratch,
                                               uint_scratch, simdgroups, simdgroup, lane),
                                  end - 1);
  const float max_logit = slice_best == NO_TOKEN ? -INFINITY : logit(ranked, slice_best);
  const float max_raw_logit = logits[slice_raw_best];
  if (thread_id == 0) {
    out.unusable = unusable_count;
    out.best_index = slice_best;
    out.best = max_logit;
    out.best_raw_index = slice_raw_best;
    out.best_raw = max_raw_logit;
  }
  // The finishing dispatch refuses the row without reading more.
  if (unusable_count != 0) return;

  const float inverse_temperature = params.inverse_temperature;
  if (inverse_temperature != 0.0f) {
    const bool top_k_on = params.top_k != 0 && params.top_k < vocab;
    const bool top_p_on = params.top_p < 1.0f;
    const bool min_p_on = as_type<uint>(params.log_min_p) != LOWEST_FLOAT_BITS;
    if (!top_k_on && !top_p_on) {
      const uint2 key = uint2(params.seed_low, params.seed_high);
      float best_score = 0.0f;
      uint winner = NO_TOKEN;
      for (uint i = begin + thread_id; i < end; i += threads) {
        const float z = logit(ranked, i) * inverse_temperature;
        if (is_minus_infinity(z)) continue;
        const float score = race_score(z, i, step_position, key);
        if (winner == NO_TOKEN || score > best_score) {
          best_score = score;
          winner = i;
        }
      }
      const uint slice_winner = group_argmax(best_score, winner, float_scratch, uint_scratch,
                                             simdgroups, simdgroup, lane);
      if (thread_id == 0) out.race_winner = slice_winner;
    }
    if (top_k_on || top_p_on || min_p_on) {
      const uint listed = min(SLICE_CANDIDATES, end - begin);
      const float last =
          slice_top(ranked, inverse_temperature, begin, end, listed, out.candidates,
                    float_scratch, uint_scratch, thread_id, threads, simdgroups, simdgroup, lane);
      if (thread_id == 0) {
        out.candidate_count = listed;
        out.candidate_bound = end - begin > listed ? order_key(last) : 0u;
      }
    }
    if (top_p_on && !top_k_on) {
      // The mass relative to the slice's largest z; the finish rescales it to the largest of all.
      const float slice_max_z = max_logit * inverse_temperature;
      float mass = 0.0f;
      for (uint i = begin + thread_id; i < end && !is_minus_infinity(slice_max_z); i += threads) {
        mass += exp(logit(ranked, i) * inverse_temperature - slice_max_z);
      }
      const float slice_mass = group_sum(mass, float_scratch, simdgroups, simdgroup, lane);
      if (thread_id == 0) out.mass = slice_mass;
    }
  }

  if (params.want_logprobs != 0) {
    float exp_sum = 0.0f;
    for (uint i = begin + thread_id; i < end && !is_minus_infinity(max_raw_logit); i += threads) {
      exp_sum += exp(logits[i] - max_raw_logit);
    }
    const float slice_exp_sum = group_sum(exp_sum, float_scratch, simdgroups, simdgroup, lane);
    if (thread_id == 0) out.raw_exp_sum = slice_exp_sum;
    const uint wanted = min(params.top_logprobs, min(MAX_TOP_LOGPROBS, end - begin));
    slice_top(raw, 1.0f, begin, end, wanted, out.top_raw, float_scratch, uint_scratch,
              thread_id, threads, simdgroups, simdgroup, lane);
  }
}

template [[host_name("sample_slices")]] [[kernel]] decltype(sample_slices<false>)
    sample_slices<false>;
template [[host_name("sample_slices_rows")]] [[kernel]] decltype(sample_slices<true>)
    sample_slices<true>;

// The second dispatch of a draw, one threadgroup each: the token from the slices' partials,
// written to predicted[draw] (a batched pass's: to its slot's), then the log-probabilities and,
// when `shape.bookkeeping` is set (one draw, or each of a batched pass's on its own slot), the
// token's count for the penalties and the step buffer's advance.
template <bool kRows>
[[kernel]] void sample_token(constant SampleShape& shape [[buffer(0)]],
                             device const SamplingParams* all_params [[buffer(1)]],
                             device const float* all_logits [[buffer(2)]],
                             device uint* step [[buffer(3)]],
                             device const SlicePartial* all_partials [[buffer(4)]],
                             device uint* predicted [[buffer(5)]],
                             device const uint* all_masks [[buffer(6)]],
                             device const float* bias [[buffer(7)]],
                             device uint* counts [[buffer(8)]],
                             device const uint* prompt_tokens [[buffer(9)]],
                             device LogprobEntry* logprob_ring [[buffer(10)]],
                             device uint* history [[buffer(11)]],
                             device const uint* row_slots [[buffer(12)]],  // [draws], kRows only
                             uint draw [[threadgroup_position_in_grid]],
                             uint thread_id [[thread_index_in_threadgroup]],
                             uint threads [[threads_per_threadgroup]],
                             uint simdgroup [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float float_scratch[SIMD_WIDTH];
  threadgroup uint uint_scratch[SIMD_WIDTH];
  threadgroup float gathered_z[GATHER_CAPACITY];
  threadgroup uint gathered_ids[GATHER_CAPACITY];
  const uint vocab = shape.vocab;
  const uint slices = min(shape.slices, MAX_SLICES);
  const uint simdgroups = (threads + SIMD_WIDTH - 1) / SIMD_WIDTH;
  const SlotParts part = slot_parts(shape, kRows ? row_slots[draw] : 0);
  device const SamplingParams& params = all_params[part.slot];
  step += part.step;
  bias += part.tokens;
  counts += part.tokens;
  prompt_tokens += part.prompt_words;
  logprob_ring += part.ring_entries;
  if (kRows) {
    history += part.history;  // bound with the bookkeeping a batched pass always has
  }
  const uint step_position = step[0] + (kRows ? 0 : draw);
  device const SlicePartial* partials = all_partials + draw * slices;
  device const float* logits = all_logits + ulong(draw) * shape.logits_stride;
  device const uint* mask = all_masks + ulong(kRows ? part.slot : draw) * shape.mask_stride;

  const Adjustments adjustments =
      draw_adjustments(shape, bias, counts, prompt_tokens, history, step[0], draw);
  const Logits ranked =
      Logits{logits, mask, mask[0] != 0, params.adjusts != 0, adjustments, &params};

  uint unusable = 0;
  float best = 0.0f;
  uint best_index = NO_TOKEN;
  for (uint s = thread_id; s < slices; s += threads) {
    unusable += partials[s].unusable;
    // Later slices hold larger ids, so a strict > keeps the lowest index on ties.
    if (partials[s].best_index != NO_TOKEN && (best_index == NO_TOKEN || partials[s].best > best)) {
      best = partials[s].best;
      best_index = partials[s].best_index;
    }
  }
  // A NaN or +inf logit means the model's arithmetic broke down: no token can be drawn from it
  // (and a NaN row has no argmax at all). The host sees NO_TOKEN and refuses the step.
  uint chosen = NO_TOKEN;
  if (group_count(unusable, uint_scratch, simdgroups, simdgroup, lane) == 0) {
    // Every index below is clamped to the vocabulary, so no value, however wrong, can make the
    // kernel read outside the logits. A mask allowing no token (which the host refuses before
    // the draw) leaves the clamped index.
    chosen = min(
        group_argmax(best, best_index, float_scratch, uint_scratch, simdgroups, simdgroup, lane),
        vocab - 1);
    if (params.inverse_temperature != 0.0f) {
      // Multiplication by a positive number is monotonic in fp32, so this is the largest z.
      const float max_z = logit(ranked, chosen) * params.inverse_temperature;
      const uint sampled = sample_from_partials(
          ranked, vocab, max_z, params, partials, slices, step_position, gathered_z,
          gathered_ids, float_scratch, uint_scratch, thread_id, threads, simdgroups, simdgroup,
          lane);
      // Only an all -inf row keeps nothing; fall back to the greedy choice.
      if (sampled < vocab) chosen = sampled;
    }
    if (params.want_logprobs != 0) {
      device LogprobEntry* slot =
          logprob_ring + ulong(step_position % shape.ring_slots) * LOGPROB_ENTRIES;
      write_logprobs(logits, vocab, shape.slice_tokens, params, partials, slices, chosen, slot,
                     float_scratch, uint_scratch, thread_id, threads, simdgroups, simdgroup,
                     lane);
    }
  }
  if (thread_id == 0) predicted[kRows ? part.slot : draw] = chosen;

  if (shape.bookkeeping != 0) {
    // Every thread has read the step buffer and the counts by now.
    threadgroup_barrier(mem_flags::mem_device);
    if (thread_id == 0 && (kRows || draw == 0)) {
      // One more occurrence of the drawn token, which the penalties of the next draws read.
      if (params.adjusts != 0 && chosen != NO_TOKEN) counts[min(chosen, vocab - 1)] += 1;
      advance_step(1, shape.capacity, step, history, chosen);
    }
  }
}

template [[host_name("sample_token")]] [[kernel]] decltype(sample_token<false>)
    sample_token<false>;
template [[host_name("sample_token_rows")]] [[kernel]] decltype(sample_token<true>)
    sample_token<true>;

struct AcceptShape {
  uint drafts;         // k: the verify pass drew k + 1 tokens, one per row
  uint vocab;          // ids the sampler draws from (NO_TOKEN, a refused row's draw, is not one)
  uint capacity;       // the token history's length
  uint outcome_slots;  // entries of the outcome ring
  uint outcome_words;  // words of one entry (1 + the most drafts + the most tokens)
};

// The acceptance of a verify pass, after `sample_token` drew one token per row (row g with the
// counter position + g and the drafts before it counted as generated): the accepted drafts are
// the longest prefix equal to the rows' draws, and the draw of the first other row (or of the
// row after the last draft) follows them. Greedy, a draw is the row's argmax, so this is the
// longest prefix matching the argmaxes. Sampling, it is the rejection rule for a draft that
// proposes x with probability 1: x is accepted with probability p(x), the chance the row's draw
// is x, and a rejected row yields its draw, which is then distributed as p with x removed and
// renormalised. Writes accepted[0] = the count n and accepted[1..n+1] = the tokens, puts the
// model's own token into the history after the accepted drafts, and counts the tokens for the
// penalties when the request has them.
//
// It also writes what the next pass reads, so that one can be queued before the host has read
// this one: the position (and the sequence's step) moves to the model's own token, the only
// one the state has not consumed. And it writes the outcome the host reads (n, the drafts, the
// tokens) into a ring entry keyed by this pass's position: a pass queued behind it, which
// rewrites `accepted` and the history past the kept tokens, starts n + 1 <= 9 positions on, so
// with 16 entries it never overwrites the entry of the pass before it. One thread: at most 9
// tokens.
[[kernel]] void accept_drafts(constant AcceptShape& shape [[buffer(0)]],
                              device const SamplingParams& params [[buffer(1)]],
                              device uint* position [[buffer(2)]],
                              device const uint* drawn [[buffer(3)]],
                              device uint* history [[buffer(4)]],
                              device uint* counts [[buffer(5)]],
                              device uint* accepted [[buffer(6)]],
                              device uint* step [[buffer(7)]],
                              device uint* outcomes [[buffer(8)]],
                              uint thread_id [[thread_position_in_grid]]) {
  if (thread_id != 0) return;
  // The first draft's position: the step position is the token row 0 consumed.
  const uint first = position[0] + 1u;
  device uint* outcome =
      outcomes + ulong((first - 1u) % shape.outcome_slots) * shape.outcome_words;
  for (uint i = 0; i < shape.drafts; ++i) {
    outcome[1 + i] = history[min(first + i, shape.capacity - 1)];
  }
  uint count = 0;
  while (count < shape.drafts && drawn[count] == history[min(first + count, shape.capacity - 1)]) {
    ++count;
  }
  const uint own = drawn[count];
  for (uint i = 0; i < count; ++i) accepted[1 + i] = drawn[i];
  accepted[1 + count] = own;
  accepted[0] = count;
  for (uint i = 0; i <= count; ++i) outcome[1 + shape.drafts + i] = accepted[1 + i];
  outcome[0] = count;
  if (first + count < shape.capacity) history[first + count] = own;
  if (params.adjusts != 0) {
    for (uint i = 0; i <= count; ++i) {
      if (drawn[i] < shape.vocab) counts[drawn[i]] += 1u;
    }
  }
  // The model's own token waits for the next pass (the one after it is predicted).
  const uint next = first + count;
  position[0] = next;
  step[0] = next;
  step[1] = next + 1u;
  step[kStepToken] = own;
}

struct DraftShape {
  uint vocab;     // ids a draft may be (the logits past them pad the lm_head's rows)
  uint rows;      // rows of the MTP pass that wrote the logits: its last one drafts
  uint capacity;  // the token history's length
  uint index;     // which draft of the pass's chain this is: its slot in `drafts`
};

// The MTP head's greedy draft, on the device, so that the head's passes for several drafts run
// in one command buffer with no host round trip between them: the argmax of the head's logits
// (ties to the lowest id, as the host's np.argmax breaks them; NaNs are never chosen, and logits
// that are all NaN draft token 0: a draft only costs a verify row, it never changes the output)
// goes into the history after the pass's newest token (and into drafts[index], which the host
// reads after a verify pass that overwrote the history's rejected drafts), and the head's step
// moves to that token, where the next chained pass (one row: the head's own output and the
// draft's embedding) starts.
[[kernel]] void draft_argmax(constant DraftShape& shape [[buffer(0)]],
                             device const float* logits [[buffer(1)]],
                             device uint* step [[buffer(2)]],
                             device uint* history [[buffer(3)]],
                             device uint* drafts [[buffer(4)]],
                             uint thread_id [[thread_index_in_threadgroup]],
                             uint threads [[threads_per_threadgroup]],
                             uint simdgroup [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float values[SIMD_WIDTH];
  threadgroup uint indices[SIMD_WIDTH];
  const uint simdgroups = (threads + SIMD_WIDTH - 1) / SIMD_WIDTH;
  float best = -INFINITY;
  uint index = NO_TOKEN;
  // Each thread's ids ascend, so a later equal value never replaces an earlier one.
  for (uint i = thread_id; i < shape.vocab; i += threads) {
    const float value = logits[i];
    if (!isnan(value) && (index == NO_TOKEN || value > best)) {
      best = value;
      index = i;
    }
  }
  const uint winner = group_argmax(best, index, values, indices, simdgroups, simdgroup, lane);
  if (thread_id == 0) {
    // The newest token is the pass's last row's next one: position step + rows.
    const uint newest = step[0] + shape.rows;
    const uint draft = winner == NO_TOKEN ? 0u : winner;
    if (newest + 1 < shape.capacity) history[newest + 1] = draft;
    drafts[shape.index] = draft;
    step[0] = newest;
  }
}

struct FollowShape {
  uint hidden;    // floats in a hidden-state row
  uint kept_row;  // 1: copy the kept row and point the head at it; 0: at the pass's first row
};

// The MTP head's catch-up over a verify pass the host has not read (the next pass drafting
// ahead): after `accept_drafts` moved `position` to the model's own token p + n + 1 (the pass
// consumed p, accepted[0] = n), points the head's step at the pass's first position p (before
// the head runs over all its rows), or (`kept_row`) at the kept row's position p + n and copies
// that row of the pass's hidden states to `kept`, which the head's next pass reads as its own
// output: it drafts from the row the acceptance kept. One threadgroup.
[[kernel]] void follow_kept_row(constant FollowShape& shape [[buffer(0)]],
                                device const uint* position [[buffer(1)]],
                                device const uint* accepted [[buffer(2)]],
                                device const float* rows [[buffer(3)]],
                                device float* kept [[buffer(4)]],
                                device uint* head_step [[buffer(5)]],
                                uint thread_id [[thread_index_in_threadgroup]],
                                uint threads [[threads_per_threadgroup]]) {
  const uint count = accepted[0];
  if (shape.kept_row != 0) {
    device const float* row = rows + ulong(count) * shape.hidden;
    for (uint i = thread_id; i < shape.hidden; i += threads) kept[i] = row[i];
  }
  if (thread_id == 0) head_step[0] = position[0] - 1u - (shape.kept_row != 0 ? 0u : count);
}
