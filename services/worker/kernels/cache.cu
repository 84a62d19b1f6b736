// reshape_and_cache: writes this step's keys and values into the paged KV cache.
//
// Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], keys then values,
// so token slot s (= block_id * block_size + offset) is one contiguous row of
// num_kv_heads * head_dim elements in each half. A negative slot means "padding, skip".
#include "common.cuh"

namespace spindle {

// grid: (num_tokens), block: up to 256 threads, each copying 16-byte chunks of the token's row.
template <typename T>
__global__ void reshape_and_cache(T* __restrict__ kv_cache,          // [2, num_slots, row]
                                  const T* __restrict__ key,         // [num_tokens, row] strided
                                  const T* __restrict__ value,       // [num_tokens, row] strided
                                  const long long* __restrict__ slot_mapping,  // [num_tokens]
                                  long long num_slots,               // num_blocks * block_size
                                  int row_elems,                     // num_kv_heads * head_dim
                                  long long key_token_stride,        // elements between tokens
                                  long long value_token_stride) {
  const int token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;  // the whole block leaves together: no barrier follows
  // uint4 = 16 bytes, the widest plain load; rows are 16-byte aligned (checked by the wrapper).
  const int chunk_elems = 16 / (int)sizeof(T);
  const int num_chunks = row_elems / chunk_elems;
  const uint4* k_src = reinterpret_cast<const uint4*>(key + token * key_token_stride);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + token * value_token_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(kv_cache + slot * row_elems);
  uint4* v_dst = reinterpret_cast<uint4*>(kv_cache + (num_slots + slot) * row_elems);
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) {
    k_dst[c] = k_src[c];
    v_dst[c] = v_src[c];
  }
}

}  // namespace spindle
