// What the two chunk-attention kernels share: attention.metal's attention_chunk (simdgroup
// matrices, every GPU) and attention_tensor_ops.metal's attention_chunk_tensor (Metal 4 tensor
// ops, M5), which take the same parameters and read the same bf16 cache rows.
#pragma once

#include "common.h"

// Every Qwen3.5/3.6 attention layer has 256-dim heads; a simdgroup covers one row (a head of one
// token, or one cached position) with 8 contiguous dims per lane, 8 * lane to 8 * lane + 7, so a
// lane reads its share of a bf16 cache row in one 16-byte load and of an fp32 row in two.
constexpr constant uint kHeadDim = 256;

// A bf16 cache row: 256 bf16 values.
constexpr constant uint kBf16RowBytes = 2 * kHeadDim;

// One of a word's two bf16 (the even dim in the low half) widened to float: a bf16 is the top
// half of the float it widens to, so the shifts are exact.
inline float bf16_low(uint word) { return as_type<float>(word << 16); }
inline float bf16_high(uint word) { return as_type<float>(word & 0xFFFF0000u); }

struct AttentionChunkParams {
  uint num_q_heads;
  uint num_kv_heads;
  uint cache_capacity;
  uint tokens;
  float scale;
};
