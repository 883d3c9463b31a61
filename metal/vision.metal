// The vision tower's kernels (docs/vision.md, "The encoder on the device"): LayerNorm with a bias,
// the position embedding's bilinear resampling, the linear maps (fp32 activations times the
// checkpoint's bf16 weights, plus the bias, with a GELU or a residual add as the epilogue), the
// 2-D rotary embedding, and bidirectional attention over the patches of one frame. Activations
// stay fp32 throughout; the numpy reference of each is in lily.engine.vision_reference.
#include "common.h"

// ---- LayerNorm --------------------------------------------------------------------------------

struct VisionLayerNormParams {
  uint dim;
  float eps;
};

// out = (x - mean) / sqrt(variance + eps) * weight + bias over each row; one threadgroup per row.
// The variance is taken of the centred values (two passes), as the reference computes it.
[[kernel]] void vision_layer_norm(constant VisionLayerNormParams& p [[buffer(0)]],
                                  device const float* x [[buffer(1)]],
                                  device const bfloat* weight [[buffer(2)]],
                                  device const bfloat* bias [[buffer(3)]],
                                  device float* out [[buffer(4)]],
                                  uint row [[threadgroup_position_in_grid]],
                                  uint thread_id [[thread_index_in_threadgroup]],
                                  uint threads [[threads_per_threadgroup]],
                                  uint simdgroup [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  // Two scratch arrays, so the second sum needs no barrier after the first one's reads.
  threadgroup float mean_scratch[SIMD_WIDTH];
  threadgroup float variance_scratch[SIMD_WIDTH];
  device const float* row_x = x + ulong(row) * p.dim;
  device float* result = out + ulong(row) * p.dim;

  float sum = 0.0f;
  for (uint i = thread_id; i < p.dim; i += threads) sum += row_x[i];
  const float mean =
      threadgroup_sum(sum, mean_scratch, threads, simdgroup, lane) / float(p.dim);
  float squares = 0.0f;
  for (uint i = thread_id; i < p.dim; i += threads) {
    const float centred = row_x[i] - mean;
    squares += centred * centred;
  }
  const float variance =
      threadgroup_sum(squares, variance_scratch, threads, simdgroup, lane) / float(p.dim);
  const float inv_std = rsqrt(variance + p.eps);
  for (uint i = thread_id; i < p.dim; i += threads)
    result[i] = (row_x[i] - mean) * inv_std * float(weight[i]) + float(bias[i]);
}

// ---- Position embedding ----------------------------------------------------------------------

struct VisionPositionParams {
  uint height;  // patches
  uint width;
  uint merge;  // rows are in merge-block order: merge x merge patches, then the next block
  uint side;   // the learned table is a side x side grid
  uint dim;
};

// out[row] = the learned [side x side, dim] grid resampled bilinearly at the row's patch, corners
// aligned (patch row i of `height` samples grid row i * (side - 1) / (height - 1)), for each frame
// alike. The four corners are weighed and summed in the reference's order; the fractions are
// computed in fp32 (the reference's linspace in fp64: they may differ by an ulp of the position).
// One threadgroup per row.
[[kernel]] void vision_position_embedding(constant VisionPositionParams& p [[buffer(0)]],
                                          device const bfloat* table [[buffer(1)]],
                                          device float* out [[buffer(2)]],
                                          uint row [[threadgroup_position_in_grid]],
                                          uint thread_id [[thread_index_in_threadgroup]],
                                          uint threads [[threads_per_threadgroup]]) {
  const uint patch = row % (p.height * p.width);
  const uint block = patch / (p.merge * p.merge);
  const uint within = patch % (p.merge * p.merge);
  const uint blocks_per_row = p.width / p.merge;
  const uint patch_row = (block / blocks_per_row) * p.merge + within / p.merge;
  const uint patch_col = (block % blocks_per_row) * p.merge + within % p.merge;
  const float last = float(p.side - 1);
  const float y = p.height > 1 ? float(patch_row) * last / float(p.height - 1) : 0.0f;
  const float x = p.width > 1 ? float(patch_col) * last / float(p.width - 1) : 0.0f;
  const uint y0 = uint(y);
  const uint x0 = uint(x);
  const uint y1 = min(y0 + 1, p.side - 1);
  const uint x1 = min(x0 + 1, p.side - 1);
  const float dy = y - float(y0);
  const float dx = x - float(x0);
  device const bfloat* t00 = table + ulong(y0 * p.side + x0) * p.dim;
  device const bfloat* t01 = table + ulong(y0 * p.side + x1) * p.dim;
  device const bfloat* t10 = table + ulong(y1 * p.side + x0) * p.dim;
  device const bfloat* t11 = table + ulong(y1 * p.side + x1) * p.dim;
  device float* target = out + ulong(row) * p.dim;
  for (uint i = thread_id; i < p.dim; i += threads) {
    target[i] = float(t00[i]) * (1.0f - dy) * (1.0f - dx) + float(t01[i]) * (1.0f - dy) * dx +
                float(t10[i]) * dy * (1.0f - dx) + float(t11[i]) * dy * dx;
  }
}

// ---- Linear maps ------------------------------------------------------------------------------

// What the epilogue does with y = x W^T + b (must match lily.kernels.vision.Epilogue).
constexpr constant uint EPILOGUE_STORE = 0;      // out = y
constexpr constant uint EPILOGUE_GELU_TANH = 1;  // out = gelu_tanh(y): the blocks' MLP
constexpr constant uint EPILOGUE_GELU_ERF = 2;   // out = gelu_erf(y): the merger's MLP
constexpr constant uint EPILOGUE_ADD = 3;        // out += y: the residual stream

constexpr constant uint LINEAR_TILE = 32;
constexpr constant uint LINEAR_DEPTH = 16;
constexpr constant uint LINEAR_THREADS = 128;

struct VisionLinearParams {
  uint m;  // rows of x
  uint n;  // output features (rows of W)
  uint k;  // input features
  uint epilogue;
};

// erf by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7, about one float32 ulp of
// values near 1): Metal's standard library has no erf.
inline float erf_approx(float x) {
  const float t = 1.0f / (1.0f + 0.3275911f * fabs(x));
  const float poly =
      ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t +
       0.254829592f) * t;
  const float magnitude = 1.0f - poly * precise::exp(-x * x);
  return x < 0.0f ? -magnitude : magnitude;
}

inline float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + precise::tanh(inner));
}

inline float gelu_erf(float x) { return 0.5f * x * (1.0f + erf_approx(x * 0.7071067811865476f)); }

// out [m, n] (fp32) = epilogue(x [m, k] (fp32) W [n, k]^T (bf16) + bias [n] (bf16)), any m, n, k.
// The tiling is gemm_nt's (metal/gemm.metal): a threadgroup of four SIMD-groups computes a 32x32
// tile of the output, each SIMD-group a 16x16 quarter of 8x8 fragments, with the operands staged
// through threadgroup memory as float and zero-padded past the edges. It is its own kernel
// because the operands differ in type (fp32 activations are not rounded to bf16) and the bias
// and epilogue are applied as the tile is written.
[[kernel, max_total_threads_per_threadgroup(LINEAR_THREADS)]]
void vision_linear(constant VisionLinearParams& p [[buffer(0)]],
                   device const float* x [[buffer(1)]],
                   device const bfloat* w [[buffer(2)]], device const bfloat* bias [[buffer(3)]],
                   device float* out [[buffer(4)]], uint2 tile [[threadgroup_position_in_grid]],
                   uint thread_id [[thread_index_in_threadgroup]],
                   uint simdgroup [[simdgroup_index_in_threadgroup]]) {
  threadgroup float x_tile[LINEAR_TILE * LINEAR_DEPTH];   // [row][depth]
  threadgroup float wt_tile[LINEAR_DEPTH * LINEAR_TILE];  // [depth][column]
  threadgroup float y_tile[LINEAR_TILE * LINEAR_TILE];

  const uint row0 = tile.y * LINEAR_TILE;
  const uint col0 = tile.x * LINEAR_TILE;
  const uint sg_row = (simdgroup / 2) * 16;
  const uint sg_col = (simdgroup % 2) * 16;

  simdgroup_float8x8 acc[2][2];
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < p.k; k0 += LINEAR_DEPTH) {
    for (uint e = thread_id; e < LINEAR_TILE * LINEAR_DEPTH; e += LINEAR_THREADS) {
      const uint r = e / LINEAR_DEPTH;
      const uint d = e % LINEAR_DEPTH;
      const bool inside_k = k0 + d < p.k;
      x_tile[r * LINEAR_DEPTH + d] =
          row0 + r < p.m && inside_k ? x[ulong(row0 + r) * p.k + k0 + d] : 0.0f;
      wt_tile[d * LINEAR_TILE + r] =
          col0 + r < p.n && inside_k ? float(w[ulong(col0 + r) * p.k + k0 + d]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint step = 0; step < LINEAR_DEPTH; step += 8) {
      simdgroup_float8x8 x_frag[2];
      simdgroup_float8x8 w_frag[2];
      for (uint i = 0; i < 2; ++i) {
        simdgroup_load(x_frag[i], x_tile + (sg_row + i * 8) * LINEAR_DEPTH + step, LINEAR_DEPTH);
        simdgroup_load(w_frag[i], wt_tile + step * LINEAR_TILE + sg_col + i * 8, LINEAR_TILE);
      }
      for (uint i = 0; i < 2; ++i)
        for (uint j = 0; j < 2; ++j)
          simdgroup_multiply_accumulate(acc[i][j], x_frag[i], w_frag[j], acc[i][j]);
    }
    // The next stage overwrites the tiles other SIMD-groups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j)
      simdgroup_store(acc[i][j], y_tile + (sg_row + i * 8) * LINEAR_TILE + sg_col + j * 8,
                      LINEAR_TILE);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint e = thread_id; e < LINEAR_TILE * LINEAR_TILE; e += LINEAR_THREADS) {
    const uint r = e / LINEAR_TILE;
    const uint col = e % LINEAR_TILE;
    if (row0 + r >= p.m || col0 + col >= p.n) continue;
    const float y = y_tile[e] + float(bias[col0 + col]);
    device float* target = out + ulong(row0 + r) * p.n + col0 + col;
    if (p.epilogue == EPILOGUE_GELU_TANH) {
      *target = gelu_tanh(y);
    } else if (p.epilogue == EPILOGUE_GELU_ERF) {
      *target = gelu_erf(y);
    } else if (p.epilogue == EPILOGUE_ADD) {
      *target += y;
    } else {
      *target = y;
    }
  }
}

// ---- 2-D rotary embedding ---------------------------------------------------------------------

struct VisionRotaryParams {
  uint heads;
  uint head_dim;
  uint row_stride;  // floats between patch rows of qkv: 3 x heads x head_dim
};

// Rotates q and k (the first two thirds of each fused qkv row) in place: within each head, the
// pair (i, i + head_dim / 2) by the patch's angle i, given as cos and sin tables [rows,
// head_dim / 2] (the host computes them from the grid alone: lily.kernels.vision). One
// threadgroup per patch row, one thread per rotated pair.
[[kernel]] void vision_rotary(constant VisionRotaryParams& p [[buffer(0)]],
                              device float* qkv [[buffer(1)]],
                              device const float* cos_table [[buffer(2)]],
                              device const float* sin_table [[buffer(3)]],
                              uint row [[threadgroup_position_in_grid]],
                              uint thread_id [[thread_index_in_threadgroup]],
                              uint threads [[threads_per_threadgroup]]) {
  const uint half_dim = p.head_dim / 2;
  device float* x = qkv + ulong(row) * p.row_stride;
  device const float* cos_row = cos_table + ulong(row) * half_dim;
  device const float* sin_row = sin_table + ulong(row) * half_dim;
  // q and k are the first 2 x heads heads of the row.
  for (uint pair = thread_id; pair < 2 * p.heads * half_dim; pair += threads) {
    const uint head = pair / half_dim;
    const uint i = pair % half_dim;
    device float* h = x + head * p.head_dim;
    const float first = h[i];
    const float second = h[i + half_dim];
    const float c = cos_row[i];
    const float s = sin_row[i];
    h[i] = first * c - second * s;
    h[i + half_dim] = second * c + first * s;
  }
}

// ---- Bidirectional attention over a frame's patches ------------------------------------------

constexpr constant uint ATTENTION_THREADS = 128;
constexpr constant uint ATTENTION_ROWS = 32;  // query rows of a threadgroup: 8 per SIMD-group
constexpr constant uint ATTENTION_KEYS = 32;  // keys per staged tile: 4 fragments of 8
// Head dims that are multiples of 8 up to 80 (the real tower's is 72, the tiny one's 16).
constexpr constant uint ATTENTION_MAX_HEAD_DIM = 80;
constexpr constant uint ATTENTION_MAX_FRAGMENTS = ATTENTION_MAX_HEAD_DIM / 8;

struct VisionAttentionParams {
  uint frame;  // patches per frame: every patch attends to all of its frame's, none other
  uint heads;
  uint head_dim;
  float scale;  // 1 / sqrt(head_dim)
  // The dispatch's first query row in each frame (a multiple of 32): a large image's attention
  // is split by query rows across command buffers, each short enough for macOS's watchdog.
  uint first_query;
};

// The softmax works on a lane's own elements of the score fragments (fragment_row, fragment_col
// in common.h): the four lanes holding a row's elements differ in lane bits 0 and 3.
inline float vision_row_max(float value) {
  value = max(value, simd_shuffle_xor(value, 1));
  return max(value, simd_shuffle_xor(value, 8));
}

inline float vision_row_sum(float value) {
  value += simd_shuffle_xor(value, 1);
  return value + simd_shuffle_xor(value, 8);
}

// out [rows, heads x head_dim] = softmax(q k^T * scale) v per head and frame, with q, k and v
// read from the fused qkv rows [rows, 3 x heads x head_dim]. A threadgroup takes 32 query rows of
// one head in one frame (grid: query blocks from first_query x heads x frames), each SIMD-group 8
// of them as fragments held in registers, and streams the frame's keys and values through
// threadgroup memory 32 at a time with an online softmax: no score matrix is ever stored, so a
// frame of thousands of patches needs no more memory than a small one, and every key and value
// read serves 32 queries. Both products run on 8x8 fp32 simdgroup matrices.
[[kernel, max_total_threads_per_threadgroup(ATTENTION_THREADS)]]
void vision_attention(constant VisionAttentionParams& p [[buffer(0)]],
                      device const float* qkv [[buffer(1)]], device float* out [[buffer(2)]],
                      uint3 group [[threadgroup_position_in_grid]],
                      uint thread_id [[thread_index_in_threadgroup]],
                      uint simdgroup [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  // Keys transposed ([dim][key]) so that both operands load as plain fragments; the q rows are
  // staged through the value tile before the first keys arrive, the output through the key tile
  // after the last.
  threadgroup float kt_tile[ATTENTION_MAX_HEAD_DIM * ATTENTION_KEYS];
  threadgroup float v_tile[ATTENTION_KEYS * ATTENTION_MAX_HEAD_DIM];

  const uint width = p.heads * p.head_dim;
  const ulong row_stride = 3 * ulong(width);
  const ulong frame_start = ulong(group.z) * p.frame;
  const uint query0 = p.first_query + group.x * ATTENTION_ROWS;
  const uint column = group.y * p.head_dim;
  const uint fragments = p.head_dim / 8;
  const uint own_rows = simdgroup * 8 * ATTENTION_MAX_HEAD_DIM;  // this SIMD-group's staged rows

  // The scale goes on q once rather than on every score; rows past the frame are zeros, scored
  // but never written.
  for (uint e = thread_id; e < ATTENTION_ROWS * p.head_dim; e += ATTENTION_THREADS) {
    const uint r = e / p.head_dim;
    const uint d = e % p.head_dim;
    v_tile[r * ATTENTION_MAX_HEAD_DIM + d] =
        query0 + r < p.frame ? qkv[(frame_start + query0 + r) * row_stride + column + d] * p.scale
                             : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 q[ATTENTION_MAX_FRAGMENTS];
  simdgroup_float8x8 acc[ATTENTION_MAX_FRAGMENTS];
  for (uint f = 0; f < fragments; ++f) {
    simdgroup_load(q[f], v_tile + own_rows + f * 8, ATTENTION_MAX_HEAD_DIM);
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  // The first value tile overwrites the staged queries other SIMD-groups may still be loading.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint col = fragment_col(lane);
  float running_max = -INFINITY;  // of this lane's row
  float lane_sum = 0.0f;          // of this lane's own elements' weights
  for (uint key0 = 0; key0 < p.frame; key0 += ATTENTION_KEYS) {
    const uint keys = min(ATTENTION_KEYS, p.frame - key0);
    // Keys past the frame are staged as zeros: their scores are masked, their values weigh 0.
    for (uint e = thread_id; e < ATTENTION_KEYS * p.head_dim; e += ATTENTION_THREADS) {
      const uint j = e / p.head_dim;
      const uint d = e % p.head_dim;
      device const float* source = qkv + (frame_start + key0 + j) * row_stride + column + d;
      kt_tile[d * ATTENTION_KEYS + j] = j < keys ? source[width] : 0.0f;
      v_tile[j * ATTENTION_MAX_HEAD_DIM + d] = j < keys ? source[2 * width] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_float8x8 scores[4];
    for (uint kf = 0; kf < 4; ++kf) {
      scores[kf] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint f = 0; f < fragments; ++f) {
        simdgroup_float8x8 k_frag;
        simdgroup_load(k_frag, kt_tile + f * 8 * ATTENTION_KEYS + kf * 8, ATTENTION_KEYS);
        simdgroup_multiply_accumulate(scores[kf], q[f], k_frag, scores[kf]);
      }
    }
    // Every row has a lane holding the tile's first key, inside the frame: the maximum is finite.
    float tile_max = running_max;
    for (uint kf = 0; kf < 4; ++kf)
      for (uint e = 0; e < 2; ++e)
        tile_max = kf * 8 + col + e < keys ? max(tile_max, scores[kf].thread_elements()[e])
                                           : tile_max;
    const float new_max = vision_row_max(tile_max);
    const float rescale = exp(running_max - new_max);
    running_max = new_max;
    lane_sum *= rescale;
    for (uint kf = 0; kf < 4; ++kf) {
      for (uint e = 0; e < 2; ++e) {
        const float weight =
            kf * 8 + col + e < keys ? exp(scores[kf].thread_elements()[e] - new_max) : 0.0f;
        scores[kf].thread_elements()[e] = weight;
        lane_sum += weight;
      }
    }
    for (uint f = 0; f < fragments; ++f) {
      acc[f].thread_elements() *= rescale;
      for (uint kf = 0; kf < 4; ++kf) {
        simdgroup_float8x8 v_frag;
        simdgroup_load(v_frag, v_tile + kf * 8 * ATTENTION_MAX_HEAD_DIM + f * 8,
                       ATTENTION_MAX_HEAD_DIM);
        simdgroup_multiply_accumulate(acc[f], scores[kf], v_frag, acc[f]);
      }
    }
    // The next tile overwrites keys and values other SIMD-groups may still be reading.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float inv_sum = 1.0f / vision_row_sum(lane_sum);
  for (uint f = 0; f < fragments; ++f) {
    acc[f].thread_elements() *= inv_sum;
    simdgroup_store(acc[f], kt_tile + own_rows + f * 8, ATTENTION_MAX_HEAD_DIM);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = lane; e < 8 * p.head_dim; e += SIMD_WIDTH) {
    const uint r = e / p.head_dim;
    const uint d = e % p.head_dim;
    const uint query = query0 + simdgroup * 8 + r;
    if (query < p.frame)
      out[(frame_start + query) * width + column + d] =
          kt_tile[own_rows + r * ATTENTION_MAX_HEAD_DIM + d];
  }
}
