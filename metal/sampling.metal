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
// One threadgroup per draw. The thresholds are found by bisection on the order key (32 passes,
// each a threadgroup reduction), never by sorting. When top_k <= threads, a cheap lower bound
// on the k-th largest key (the k-th largest of the threads' own maxima) selects the tokens
// top-k can keep; if at most GATHER_CAPACITY, they are gathered into threadgroup memory and
// the bisections and the race read only them. Otherwise (top-k off, or thousands of ties)
// every pass reads the logits, which for the 248320-token vocabulary stay in the GPU's cache.
// The top log-probabilities are gathered the same way.
#include "common.h"

constexpr constant uint NO_TOKEN = 0xFFFFFFFFu;
// Entries per log-probability ring slot: the chosen token, then up to 20 alternatives.
constexpr constant uint MAX_TOP_LOGPROBS = 20;
constexpr constant uint LOGPROB_ENTRIES = 1 + MAX_TOP_LOGPROBS;
// Tokens gathered into threadgroup memory when top-k bounds them (8 bytes each).
constexpr constant uint GATHER_CAPACITY = 2048;
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
  uint ring_slots;  // slots of the log-probability ring
};

struct LogprobEntry {
  uint token;
  float logprob;
};

// The token mask buffer (lily.kernels.sampling.write_token_mask): word 0 is 1 when the mask
// applies to this draw, then bit i % 32 of word 1 + i / 32 is set when token i is allowed.
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

// An order-preserving uint32 image of a float (NaN excluded): larger floats give larger keys.
// -0 is folded into +0 on the integer side, where fast math cannot drop the test.
inline uint order_key(float value) {
  const uint raw = as_type<uint>(value);
  const uint bits = raw == 0x80000000u ? 0u : raw;
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

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
};

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
  const uint count = logits.adjustments.counts[i];
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

// A lower bound on the k-th largest key of all tokens: the k-th largest of the threads' own
// largest keys (those are k distinct tokens), 0 when k exceeds the threads. Every token a
// top-k cut keeps lies at or above it.
inline uint kth_largest_thread_key(uint own_key, uint k, threadgroup uint* scratch,
                                   uint simdgroups, uint simdgroup, uint lane) {
  uint found = 0;
  for (uint bit = 32; bit-- > 0;) {
    const uint candidate = found | (1u << bit);
    const uint above = own_key >= candidate ? 1u : 0u;
    if (group_count(above, scratch, simdgroups, simdgroup, lane) >= k) found = candidate;
  }
  return found;
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

[[kernel]] void sample_token(constant SampleShape& shape [[buffer(0)]],
                             device const SamplingParams& params [[buffer(1)]],
                             device const float* logits [[buffer(2)]],
                             device const uint* position [[buffer(3)]],
                             device uint* predicted [[buffer(4)]],
                             device LogprobEntry* logprob_ring [[buffer(5)]],
                             device const uint* token_mask [[buffer(6)]],
                             device const float* bias [[buffer(7)]],
                             device const uint* counts [[buffer(8)]],
                             device const uint* prompt_tokens [[buffer(9)]],
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
  const uint simdgroups = (threads + SIMD_WIDTH - 1) / SIMD_WIDTH;
  // Threadgroup g draws for position + g: one dispatch can draw many samples (the tests do).
  const uint step_position = position[0] + draw;

  const Adjustments adjustments = Adjustments{bias, counts, prompt_tokens};
  const Logits raw = Logits{logits, token_mask, false, false, adjustments, &params};
  const Logits ranked =
      Logits{logits, token_mask, token_mask[0] != 0, params.adjusts != 0, adjustments, &params};

  // The largest allowed logit; its lowest index is the greedy choice. The largest logit of all
  // normalises the log-probabilities. Each thread scans its indices in increasing order, so a
  // strict > keeps the lowest index on ties.
  float best = 0.0f;
  uint best_index = NO_TOKEN;
  float best_raw = 0.0f;
  uint best_raw_index = NO_TOKEN;
  uint unusable = 0;
  for (uint i = thread_id; i < vocab; i += threads) {
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
  // A NaN or +inf logit means the model's arithmetic broke down: no token can be drawn from it
  // (and a NaN row has no argmax at all). The host sees NO_TOKEN and refuses the step.
  if (group_count(unusable, uint_scratch, simdgroups, simdgroup, lane) != 0) {
    if (thread_id == 0) predicted[draw] = NO_TOKEN;
    return;
  }
  // Every index below is clamped to the vocabulary, so no value, however wrong, can make the
  // kernel read outside the logits.
  // A mask allowing no token (which the host refuses before the draw) leaves the clamped index.
  const uint argmax_index = min(
      group_argmax(best, best_index, float_scratch, uint_scratch, simdgroups, simdgroup, lane),
      vocab - 1);
  const float max_logit = logit(ranked, argmax_index);

  uint chosen = argmax_index;
  const float inverse_temperature = params.inverse_temperature;
  if (inverse_temperature != 0.0f) {
    // Multiplication by a positive number is monotonic in fp32, so this is the largest z.
    const float max_z = max_logit * inverse_temperature;
    const bool top_k_on = params.top_k != 0 && params.top_k < vocab;

    const uint own_key = best_index == NO_TOKEN ? 0u : order_key(best * inverse_temperature);
    uint bound = 0;
    if (top_k_on && params.top_k <= threads) {
      bound = kth_largest_thread_key(own_key, params.top_k, uint_scratch, simdgroups, simdgroup,
                                     lane);
    }
    // Without a bound only a small vocabulary can fit, so the counting pass is skipped.
    const Tokens tokens = gather_tokens(ranked, vocab, inverse_temperature, bound,
                                        bound != 0 || vocab <= GATHER_CAPACITY, gathered_z,
                                        gathered_ids, uint_scratch, thread_id, threads,
                                        simdgroups, simdgroup, lane);

    uint threshold = 0;
    if (top_k_on) {
      threshold = kth_largest_key(tokens, params.top_k, uint_scratch, thread_id, threads,
                                  simdgroups, simdgroup, lane);
    }
    if (params.top_p < 1.0f) {
      const float kept_mass = mass_above(tokens, max_z, threshold, float_scratch, thread_id,
                                         threads, simdgroups, simdgroup, lane);
      threshold = top_p_key(tokens, max_z, threshold, params.top_p * kept_mass, float_scratch,
                            thread_id, threads, simdgroups, simdgroup, lane);
    }
    // Keeps the most likely token even if rounding (or a denormal top_p) pushed the key past it.
    threshold = min(threshold, order_key(max_z));

    // The Gumbel race. Gathered tokens are not in id order, so ties compare ids explicitly.
    const uint2 key = uint2(params.seed_low, params.seed_high);
    float best_score = 0.0f;
    uint winner = NO_TOKEN;
    for (uint j = thread_id; j < tokens.count; j += threads) {
      const float z = token_z(tokens, j);
      if (order_key(z) < threshold || !(z - max_z >= params.log_min_p)) continue;
      const uint id = token_id(tokens, j);
      const uint bits = philox_first_word(uint4(id, step_position, 0, 0), key);
      const float score = z - log(exponential_variate(bits));
      if (winner == NO_TOKEN || score > best_score || (score == best_score && id < winner)) {
        best_score = score;
        winner = id;
      }
    }
    const uint sampled =
        group_argmax(best_score, winner, float_scratch, uint_scratch, simdgroups, simdgroup, lane);
    // Only an all -inf row keeps nothing; fall back to the greedy choice.
    if (sampled < vocab) chosen = sampled;
  }
  if (thread_id == 0) predicted[draw] = chosen;

  if (params.want_logprobs == 0) return;
  // Log-probabilities of the model's own distribution: log_softmax of the raw logits, before
  // the mask, temperature and filtering (what OpenAI's API reports).
  const uint raw_argmax = min(group_argmax(best_raw, best_raw_index, float_scratch, uint_scratch,
                                           simdgroups, simdgroup, lane),
                              vocab - 1);
  const float max_raw_logit = logits[raw_argmax];
  float exp_sum = 0.0f;
  for (uint i = thread_id; i < vocab; i += threads) exp_sum += exp(logits[i] - max_raw_logit);
  const float log_normalizer =
      log(group_sum(exp_sum, float_scratch, simdgroups, simdgroup, lane));
  device LogprobEntry* slot =
      logprob_ring + ulong(step_position % shape.ring_slots) * LOGPROB_ENTRIES;
  if (thread_id == 0) {
    slot[0] = LogprobEntry{chosen, (logits[chosen] - max_raw_logit) - log_normalizer};
  }

  // The alternatives, most likely first (ties to the lowest id): gathered like top-k (with the
  // threads' largest raw logits as the bound), then each pass takes the best token ordered
  // after the previous one in (logit descending, id ascending).
  const uint wanted = min(params.top_logprobs, min(MAX_TOP_LOGPROBS, vocab));
  if (wanted == 0) return;
  const uint own_key = best_raw_index == NO_TOKEN ? 0u : order_key(best_raw);
  const uint bound =
      kth_largest_thread_key(own_key, wanted, uint_scratch, simdgroups, simdgroup, lane);
  const Tokens tokens = gather_tokens(raw, vocab, 1.0f, bound, true, gathered_z, gathered_ids,
                                      uint_scratch, thread_id, threads, simdgroups, simdgroup,
                                      lane);
  float previous_value = 0.0f;
  uint previous_id = NO_TOKEN;
  for (uint n = 0; n < wanted; ++n) {
    float value = 0.0f;
    uint index = NO_TOKEN;
    for (uint j = thread_id; j < tokens.count; j += threads) {
      const float v = token_z(tokens, j);
      const uint id = token_id(tokens, j);
      const bool after_previous = previous_id == NO_TOKEN || v < previous_value ||
                                  (v == previous_value && id > previous_id);
      if (after_previous && (index == NO_TOKEN || v > value || (v == value && id < index))) {
        value = v;
        index = id;
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

// After a draw, when the request adjusts logits: one more occurrence of the drawn token, which
// the frequency and presence penalties of the next draws read. One thread.
[[kernel]] void count_token(constant SampleShape& shape [[buffer(0)]],
                            device const SamplingParams& params [[buffer(1)]],
                            device const uint* predicted [[buffer(2)]],
                            device uint* counts [[buffer(3)]]) {
  const uint token = predicted[0];
  if (params.adjusts != 0 && token != NO_TOKEN) counts[min(token, shape.vocab - 1)] += 1;
}
