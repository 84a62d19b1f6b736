// Paged attention over block tables, for a mixed batch of prefill chunks and decodes.
//
// One CTA of 128 threads handles one query token, up to GS query heads that share one KV head
// (GQA/MQA: the keys and values are read once for the whole group), and one partition of the
// token's keys. Keys are visited in tiles of 128 with an online softmax (running max m and sum l
// per head, the accumulator rescaled by exp(m_old - m_new) at each tile), as in FlashAttention.
// With several partitions (split-K, "flash-decoding") each CTA writes a normalised partial output
// plus its (m, l), and paged_attention_combine merges them: long contexts then fill the GPU even
// at small batch.
//
// Lines tagged [barrier:...] / [index:...] are named by the tests that break them on purpose.
#include "common.cuh"

namespace spindle {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kTile = kAttnThreads;  // keys per tile: one per thread in the score phase
// With a thread bound alone ptxas aims at full occupancy with ~40 registers and spills. Asking
// for 4 resident CTAs (512 threads per SM) allows 128 registers; groups of 4 and 8 heads carry
// 4-8x the accumulators and get 2 CTAs (255 registers).
template <int GS>
struct AttnMinBlocks {
  static constexpr int value = GS >= 4 ? 2 : 4;
};

// The request that owns flat token `token`: the last r with query_start_loc[r] <= token.
__device__ __forceinline__ int find_request(const long long* query_start_loc, int num_reqs, int token) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Keys visible to `token` (causal): every position up to and including its own.
__device__ __forceinline__ int num_visible_keys(const long long* query_start_loc, const long long* seq_lens,
                                                int num_reqs, int token) {
  const int req = find_request(query_start_loc, num_reqs, token);
  const long long query_len = query_start_loc[req + 1] - query_start_loc[req];
  const long long position = seq_lens[req] - query_len + (token - query_start_loc[req]);
  return (int)position + 1;
}

// grid: (num_tokens, num_kv_heads * ceil(group / GS), num_partitions), block: 128.
template <typename T, int HEAD_DIM, int GS>
__global__ void __launch_bounds__(kAttnThreads, AttnMinBlocks<GS>::value) paged_attention(
    T* __restrict__ out, long long out_token_stride,      // [num_tokens, num_heads * HEAD_DIM]
    float* __restrict__ part_out,                         // [num_tokens, num_heads, num_partitions, HEAD_DIM]
    float* __restrict__ part_ml,                          // [num_tokens, num_heads, num_partitions, 2]
    const T* __restrict__ query, long long query_token_stride,  // [num_tokens, num_heads, HEAD_DIM]
    const T* __restrict__ kv_cache,                       // [2, num_slots, num_kv_heads, HEAD_DIM]
    const long long* __restrict__ block_table, int block_table_stride,  // [num_reqs, stride]
    const long long* __restrict__ query_start_loc,        // [num_reqs + 1]
    const long long* __restrict__ seq_lens,               // [num_reqs]
    int num_reqs, int num_heads, int num_kv_heads, int block_size, long long num_slots,
    int partition_size, int num_partitions, float scale) {
  const int token = blockIdx.x;
  const int group = num_heads / num_kv_heads;
  const int num_chunks = (group + GS - 1) / GS;
  const int kv_head = blockIdx.y / num_chunks;
  const int first_head = kv_head * group + (blockIdx.y % num_chunks) * GS;
  const int heads_here = min(GS, (kv_head + 1) * group - first_head);
  const int req = find_request(query_start_loc, num_reqs, token);
  const int num_keys = num_visible_keys(query_start_loc, seq_lens, num_reqs, token);
  const int key_begin = blockIdx.z * partition_size;
  const int key_end = min(num_keys, key_begin + partition_size);
  // Only split-K launches have empty partitions; the combine kernel never reads them.
  if (key_begin >= key_end) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long* blocks = block_table + (long long)req * block_table_stride;
  const long long value_offset = num_slots * num_kv_heads * HEAD_DIM;

  __shared__ float q_s[GS][HEAD_DIM];          // this CTA's query heads, pre-scaled
  __shared__ float p_s[GS][kTile];             // a tile's scores, then its probabilities
  __shared__ long long row_s[kTile];           // a tile's cache rows (element offsets)
  __shared__ float m_s[GS], l_s[GS], alpha_s[GS];
  __shared__ float red_s[kAttnWarps][GS][HEAD_DIM];  // per-warp partial outputs

  for (int i = tid; i < GS * HEAD_DIM; i += kAttnThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    q_s[g][d] = g < heads_here
        ? to_float(query[token * query_token_stride + (long long)(first_head + g) * HEAD_DIM + d]) * scale
        : 0.0f;
  }
  if (tid < GS) {
    m_s[tid] = -__int_as_float(0x7f800000);
    l_s[tid] = 0.0f;
  }
  // Value phase layout: kChunks threads cover one value row 8 elements each, kKeyLanes rows at once.
  constexpr int kChunks = HEAD_DIM / 8;
  constexpr int kKeyLanes = kAttnThreads / kChunks;
  const int chunk = tid % kChunks, key_lane = tid / kChunks;
  float acc[GS][8];
#pragma unroll
  for (int g = 0; g < GS; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  __syncthreads();  // [barrier:q-ready]

  for (int tile = key_begin; tile < key_end; tile += kTile) {
    const int tile_len = min(kTile, key_end - tile);
    // 1. scores: thread tid scores key tile + tid against every head of the group.
    float s[GS];
    if (tid < tile_len) {
      const int k = tile + tid;
      const long long slot = blocks[k / block_size] * block_size + k % block_size;  // [index:slot]
      const long long row = (slot * num_kv_heads + kv_head) * HEAD_DIM;
      row_s[tid] = row;
#pragma unroll
      for (int g = 0; g < GS; ++g) s[g] = 0.0f;
      for (int d = 0; d < HEAD_DIM; d += 8) {
        float kv[8];
        Vec8<T>::load(kv_cache + row + d, kv);
#pragma unroll
        for (int g = 0; g < GS; ++g)
#pragma unroll
          for (int e = 0; e < 8; ++e) s[g] += q_s[g][d + e] * kv[e];
      }
    } else {
#pragma unroll
      for (int g = 0; g < GS; ++g) s[g] = -__int_as_float(0x7f800000);
    }
#pragma unroll
    for (int g = 0; g < GS; ++g) p_s[g][tid] = s[g];
    __syncthreads();  // [barrier:scores]

    // 2. online softmax: one warp per head; the tile always holds a valid key, so m stays finite.
    for (int g = warp; g < GS; g += kAttnWarps) {
      float x[kTile / 32];
      float tile_max = -__int_as_float(0x7f800000);
#pragma unroll
      for (int i = 0; i < kTile / 32; ++i) {
        x[i] = p_s[g][lane + 32 * i];
        tile_max = fmaxf(tile_max, x[i]);
      }
      tile_max = warp_max(tile_max);
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, tile_max);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kTile / 32; ++i) {
        const float p = expf(x[i] - m_new);  // exp(-inf) = 0 for padding keys
        p_s[g][lane + 32 * i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();  // [barrier:probs]

    // 3. values: rescale the accumulator, then add this tile's probability-weighted rows.
#pragma unroll
    for (int g = 0; g < GS; ++g) {
      const float alpha = alpha_s[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
    for (int j = key_lane; j < tile_len; j += kKeyLanes) {
      float v[8];
      Vec8<T>::load(kv_cache + value_offset + row_s[j] + chunk * 8, v);
#pragma unroll
      for (int g = 0; g < GS; ++g) {
        const float p = p_s[g][j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] += p * v[e];
      }
    }
    __syncthreads();  // [barrier:tile-done] the next tile overwrites p_s and row_s
  }

  // Reduce over key lanes: in a warp, lanes with the same chunk differ in the bits >= kChunks.
#pragma unroll
  for (int g = 0; g < GS; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int mask = kChunks; mask < 32; mask <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], mask);
  if (lane < kChunks) {
#pragma unroll
    for (int g = 0; g < GS; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) red_s[warp][g][chunk * 8 + e] = acc[g][e];
  }
  __syncthreads();  // [barrier:reduce]

  // Partial results and their (m, l) when split, else the final output.
  if (num_partitions > 1) {
    const long long first_part = ((long long)token * num_heads + first_head) * num_partitions + blockIdx.z;
    for (int i = tid; i < heads_here * HEAD_DIM; i += kAttnThreads) {
      const int g = i / HEAD_DIM, d = i % HEAD_DIM;
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) o += red_s[w][g][d];
      const long long part = first_part + (long long)g * num_partitions;
      part_out[part * HEAD_DIM + d] = o / l_s[g];
      if (d == 0) {
        part_ml[part * 2] = m_s[g];
        part_ml[part * 2 + 1] = l_s[g];
      }
    }
  } else {
    T* out_row = out + token * out_token_stride + (long long)first_head * HEAD_DIM;
    for (int i = tid; i < heads_here * HEAD_DIM; i += kAttnThreads) {
      const int g = i / HEAD_DIM, d = i % HEAD_DIM;
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) o += red_s[w][g][d];
      out_row[i] = from_float<T>(o / l_s[g]);
    }
  }
}

// Merges split-K partials: out = sum_p w_p o_p / sum_p w_p with w_p = l_p exp(m_p - max m).
// grid: (num_tokens, num_heads), block: HEAD_DIM (one thread per output element).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) paged_attention_combine(
    T* __restrict__ out, long long out_token_stride, const float* __restrict__ part_out,
    const float* __restrict__ part_ml, const long long* __restrict__ query_start_loc,
    const long long* __restrict__ seq_lens, int num_reqs, int num_heads, int partition_size,
    int num_partitions) {
  const int token = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int num_keys = num_visible_keys(query_start_loc, seq_lens, num_reqs, token);
  const int used = min(num_partitions, (num_keys + partition_size - 1) / partition_size);
  const long long base = ((long long)token * num_heads + head) * num_partitions;
  float m_max = -__int_as_float(0x7f800000);
  for (int p = 0; p < used; ++p) m_max = fmaxf(m_max, part_ml[(base + p) * 2]);
  float num = 0.0f, den = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float w = part_ml[(base + p) * 2 + 1] * expf(part_ml[(base + p) * 2] - m_max);
    num += w * part_out[(base + p) * HEAD_DIM + d];
    den += w;
  }
  out[token * out_token_stride + (long long)head * HEAD_DIM + d] = from_float<T>(num / den);
}

}  // namespace spindle
