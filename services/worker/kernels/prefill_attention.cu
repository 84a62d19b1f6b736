// Tiled paged attention for the prefill rows of a step (requests with more than one query token),
// FlashAttention-2 style, on tensor cores through nvcuda::wmma (m16n16k16, bf16/fp16 inputs,
// float32 accumulation).
//
// A request's query rows are packed by its KV head's group: row = token * group + head in the
// group, so every query head that shares a KV head reads the same K/V tile (GQA). A CTA of 4
// warps takes 64 packed rows of one request and one KV head (16 rows a warp; with group 1 that is
// 64 tokens). It streams the request's keys and values in tiles of kKeys from the paged cache
// through shared memory; per tile each warp computes S = Q K^T on tensor cores, an online softmax
// in float32 (running max m and sum l per row, the output rescaled by exp(m_old - m_new)), and
// O += P V with P rounded to the input type. The causal mask uses each token's position in its
// sequence: the chunk's query rows start at position seq_len - query_len, so a chunked prefill
// that continues mid-block sees its whole context and its own earlier tokens.
//
// Which accumulator element a lane holds is unspecified by CUDA, but it is one mapping per
// fragment type: loading a 16x16 matrix of row numbers into an accumulator tells each lane the
// row of each of its elements, which is what the per-row rescale needs.
//
// Lines tagged [barrier:...] / [index:...] are named by the tests that break them on purpose.
#include "common.cuh"
#include "wmma.cuh"

namespace spindle {

constexpr int kPrefillThreads = 128;
constexpr int kTileRows = 64;  // packed query rows per CTA, 16 per warp

template <int HEAD_DIM>
struct PrefillShape {
  // Keys per K/V tile: what fits the 48 KiB of static shared memory with the query tile.
  static constexpr int kKeys = HEAD_DIM == 64 ? 64 : 32;
  static constexpr int kChunks = HEAD_DIM / 8;        // 16-byte chunks per K/V/Q row
  static constexpr int kRowPitch = HEAD_DIM + 8;      // elements; 16 bytes of padding per row
  static constexpr int kScorePitch = kKeys + 4;       // floats
  static constexpr int kOutPitch = HEAD_DIM + 4;      // floats
  // Resident CTAs per SM asked of ptxas. Head 128: 3 (12 warps, at most 170 registers a thread,
  // which fits without spilling; the shared memory of 3 CTAs, 3 x ~45 KiB, fits A100 and H100).
  // Head 64 holds twice the scores per lane (64-key tiles): at 3 CTAs bf16 spills on sm_80, so 2.
  static constexpr int kMinBlocks = HEAD_DIM == 128 ? 3 : 2;
};

template <typename T>
struct WmmaInput;
template <>
struct WmmaInput<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct WmmaInput<f16> {
  using type = half;
};

template <typename T, int HEAD_DIM>
struct PrefillShared {
  using Shape = PrefillShape<HEAD_DIM>;
  union {
    struct {
      T q[kTileRows][Shape::kRowPitch];
      T k[Shape::kKeys][Shape::kRowPitch];
      T v[Shape::kKeys][Shape::kRowPitch];
    } in;
    float out[kTileRows][Shape::kOutPitch];  // after the last tile: the unnormalised output
  };
  // A tile's scores in float; then its probabilities as T in the first half of each row.
  float scores[kTileRows][Shape::kScorePitch];
  float alpha[kTileRows];  // this tile's rescale factor per row
  float l[kTileRows];      // the final sums
  float row_ids[16][16];   // row_ids[r][c] = r

  // wmma loads and stores need 32-byte aligned pointers and a leading dimension of 16 bytes'
  // multiple. Every member's size is a multiple of 32 bytes (so each starts on 32 bytes in the
  // 32-byte aligned struct), and so is every 16-row block and every 16-column offset used.
  static_assert(16 * Shape::kRowPitch * sizeof(T) % 32 == 0 && Shape::kRowPitch % 8 == 0, "Q/K/V pitch");
  static_assert(16 * Shape::kScorePitch * sizeof(float) % 32 == 0 && Shape::kScorePitch % 4 == 0, "S pitch");
  static_assert(16 * Shape::kOutPitch * sizeof(float) % 32 == 0 && Shape::kOutPitch % 4 == 0, "O pitch");
  static_assert(kTileRows * Shape::kRowPitch * sizeof(T) % 32 == 0 && Shape::kKeys % 16 == 0, "Q/K/V tiles");
};

template <typename T>
__device__ __forceinline__ uint4 pack8(const float* v) {
  unsigned int w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (unsigned int)from_float<T>(v[2 * i]).bits | ((unsigned int)from_float<T>(v[2 * i + 1]).bits << 16);
  uint4 out;
  out.x = w[0]; out.y = w[1]; out.z = w[2]; out.w = w[3];
  return out;
}

// grid: (num_tiles, num_kv_heads), block: 128. tile_plan[2 * tile] is the tile's request (a row
// of query_start_loc / seq_lens / block_table), tile_plan[2 * tile + 1] its first packed row.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads, PrefillShape<HEAD_DIM>::kMinBlocks) prefill_attention(
    T* __restrict__ out, long long out_token_stride,              // [num_tokens, num_heads * HEAD_DIM]
    const T* __restrict__ query, long long query_token_stride,    // [num_tokens, num_heads, HEAD_DIM]
    const T* __restrict__ kv_cache,                               // [2, num_slots, num_kv_heads, HEAD_DIM]
    const long long* __restrict__ block_table, int block_table_stride,  // [num_reqs, stride]
    const long long* __restrict__ query_start_loc,                // [num_reqs + 1]
    const long long* __restrict__ seq_lens,                       // [num_reqs]
    const int* __restrict__ tile_plan,                            // [num_tiles, 2]
    int num_heads, int num_kv_heads, int block_size, long long num_slots, float scale) {
  namespace wmma = nvcuda::wmma;
  using Shape = PrefillShape<HEAD_DIM>;
  using WT = typename WmmaInput<T>::type;
  constexpr int kKeys = Shape::kKeys, kChunks = Shape::kChunks, kPitch = Shape::kRowPitch;
  constexpr int kDimTiles = HEAD_DIM / 16, kKeyTiles = kKeys / 16, kHalf = kKeys / 2;
  __shared__ __align__(32) PrefillShared<T, HEAD_DIM> sm;

  const int req = tile_plan[2 * blockIdx.x], row0 = tile_plan[2 * blockIdx.x + 1];
  const int kv_head = blockIdx.y;
  const int group = num_heads / num_kv_heads;
  const int q_begin = (int)query_start_loc[req];
  const int query_len = (int)query_start_loc[req + 1] - q_begin;
  const int context_len = (int)seq_lens[req] - query_len;  // [index:causal-offset]
  // Keys this tile needs: up to the position of its last real token.
  const int num_keys = context_len + min(query_len - 1, (row0 + kTileRows - 1) / group) + 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long* blocks = block_table + (long long)req * block_table_stride;
  const long long value_offset = num_slots * num_kv_heads * HEAD_DIM;

  // 1. the tile's query rows (zero past the request's last token) and the row-number matrix
  for (int i = tid; i < kTileRows * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, c = i % kChunks, t = (row0 + r) / group, h = (row0 + r) % group;
    uint4 v = {0u, 0u, 0u, 0u};
    if (t < query_len)
      v = *reinterpret_cast<const uint4*>(query + (long long)(q_begin + t) * query_token_stride +
                                          (long long)(kv_head * group + h) * HEAD_DIM + c * 8);
    *reinterpret_cast<uint4*>(&sm.in.q[r][c * 8]) = v;
  }
  for (int i = tid; i < 256; i += kPrefillThreads) sm.row_ids[i / 16][i % 16] = (float)(i / 16);
  __syncthreads();  // [barrier:q-loaded]

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[kDimTiles];
  int row_of[8];  // the warp-local row of each accumulator element
  {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> rows;
    wmma::load_matrix_sync(rows, &sm.row_ids[0][0], 16, wmma::mem_row_major);
#pragma unroll
    for (int i = 0; i < 8; ++i) row_of[i] = (int)rows.x[i];
  }
#pragma unroll
  for (int j = 0; j < kDimTiles; ++j) wmma::fill_fragment(o[j], 0.0f);

  // Softmax layout: lanes 2r and 2r + 1 share row r of the warp's 16, half the keys each.
  const int my_row = warp * 16 + lane / 2, my_half = lane & 1;
  const int my_position = context_len + min((row0 + my_row) / group, query_len - 1);
  float m_run = -__int_as_float(0x7f800000), l_run = 0.0f;
  const WT* q_warp = reinterpret_cast<const WT*>(&sm.in.q[warp * 16][0]);
  const WT* p_warp = reinterpret_cast<const WT*>(&sm.scores[warp * 16][0]);

  for (int tile = 0; tile < num_keys; tile += kKeys) {
    // 2. keys and values tile .. tile + kKeys - 1 from their blocks (zero past the last key)
    for (int i = tid; i < kKeys * kChunks; i += kPrefillThreads) {
      const int j = i / kChunks, c = i % kChunks, key = tile + j;
      uint4 kc = {0u, 0u, 0u, 0u}, vc = {0u, 0u, 0u, 0u};
      if (key < num_keys) {
        const long long slot = blocks[key / block_size] * block_size + key % block_size;
        const long long row = (slot * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
        kc = *reinterpret_cast<const uint4*>(kv_cache + row);
        vc = *reinterpret_cast<const uint4*>(kv_cache + value_offset + row);
      }
      *reinterpret_cast<uint4*>(&sm.in.k[j][c * 8]) = kc;
      *reinterpret_cast<uint4*>(&sm.in.v[j][c * 8]) = vc;
    }
    __syncthreads();  // [barrier:kv-loaded]

    // 3. S = Q K^T for the warp's 16 rows (K row-major in shared memory is K^T column-major)
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s[kKeyTiles];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) wmma::fill_fragment(s[n], 0.0f);
#pragma unroll
      for (int kk = 0; kk < kDimTiles; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, WT, wmma::row_major> qf;
        wmma::load_matrix_sync(qf, q_warp + kk * 16, kPitch);
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, WT, wmma::col_major> kf;
          wmma::load_matrix_sync(kf, reinterpret_cast<const WT*>(&sm.in.k[n * 16][kk * 16]), kPitch);
          wmma::mma_sync(s[n], qf, kf, s[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
        wmma::store_matrix_sync(&sm.scores[warp * 16][n * 16], s[n], Shape::kScorePitch, wmma::mem_row_major);
    }
    __syncwarp();  // [barrier:scores]

    // 4. online softmax over this tile, causal by position; P replaces S in place
    float x[kHalf];
    float tile_max = -__int_as_float(0x7f800000);
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = my_half * kHalf + c;
      x[c] = tile + col <= my_position ? sm.scores[my_row][col] * scale : -__int_as_float(0x7f800000);
      tile_max = fmaxf(tile_max, x[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    // Finite from the first tile on: key 0 is visible to every row.
    const float m_new = fmaxf(m_run, tile_max);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      x[c] = expf(x[c] - m_new);  // exp(-inf) = 0 for masked keys
      sum += x[c];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = expf(m_run - m_new);  // 0 on the first tile (m_run = -inf)
    l_run = l_run * alpha + sum;
    m_run = m_new;
    __syncwarp();  // every lane has read its scores before the probabilities overwrite them
    T* p_row = reinterpret_cast<T*>(&sm.scores[my_row][0]);
#pragma unroll
    for (int c = 0; c < kHalf; ++c) p_row[my_half * kHalf + c] = from_float<T>(x[c]);
    if (my_half == 0) sm.alpha[my_row] = alpha;
    __syncwarp();  // [barrier:probs]

    // 5. O = diag(alpha) O + P V
#pragma unroll
    for (int j = 0; j < kDimTiles; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[j].x[i] *= sm.alpha[warp * 16 + row_of[i]];
#pragma unroll
    for (int kk = 0; kk < kKeyTiles; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, WT, wmma::row_major> pf;
      wmma::load_matrix_sync(pf, p_warp + kk * 16, 2 * Shape::kScorePitch);
#pragma unroll
      for (int j = 0; j < kDimTiles; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, WT, wmma::row_major> vf;
        wmma::load_matrix_sync(vf, reinterpret_cast<const WT*>(&sm.in.v[kk * 16][j * 16]), kPitch);
        wmma::mma_sync(o[j], pf, vf, o[j]);
      }
    }
    __syncthreads();  // [barrier:kv-consumed] the next tile overwrites k and v
  }

  // 6. the output through shared memory (Q/K/V are dead), normalised, in 16-byte stores
  if (my_half == 0) sm.l[my_row] = l_run;
#pragma unroll
  for (int j = 0; j < kDimTiles; ++j)
    wmma::store_matrix_sync(&sm.out[warp * 16][j * 16], o[j], Shape::kOutPitch, wmma::mem_row_major);
  __syncthreads();  // [barrier:out-staged]
  for (int i = tid; i < kTileRows * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, c = i % kChunks, t = (row0 + r) / group, h = (row0 + r) % group;
    if (t >= query_len) continue;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = sm.out[r][c * 8 + e] / sm.l[r];
    *reinterpret_cast<uint4*>(out + (long long)(q_begin + t) * out_token_stride +
                              (long long)(kv_head * group + h) * HEAD_DIM + c * 8) = pack8<T>(v);
  }
}

}  // namespace spindle
