/* The norm forward's transposed FP8 copy (norm_forward.cu): a block stages the FP8 bytes of a
 * group of rows in shared memory, then writes each column's run of rows to the transposed output
 * with one store per column and run. */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_TRANSPOSE_TILE_CUH_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_TRANSPOSE_TILE_CUH_

#include <cstddef>
#include <cstdint>

#include "util/byte_transpose.cuh"

namespace transformer_engine {
namespace norm_detail {

/* Rows per transposed store run: up to 16 (one 16-byte store per column and run). */
__host__ __device__ __forceinline__ int transposed_run(int group_rows) {
  return group_rows < 16 ? group_rows : 16;
}

/* The staged FP8 bytes of rows [r0, r0 + count) to out_t: column c's bytes are one contiguous
 * run of out_t. Fast path (vec_t: H % 4 == 0, runs of 8 or 16 rows, rows % run == 0, out_t
 * aligned to the run; a whole group): a thread reads a run's 4-byte words of 4 columns from the
 * tile (consecutive threads on consecutive words: no bank conflicts), transposes them 4x4 with
 * byte permutes and writes each column's run with one 8- or 16-byte store. Else a byte at a
 * time. `p` holds H, rows, group_rows, vec_t and y_t (the forward's FwdParams). */
template <int kThreads, class Params>
__device__ void write_transposed(const Params& p, const uint8_t* tile, size_t r0, int count) {
  const int H = p.H;
  const int run = transposed_run(p.group_rows);
  if (p.vec_t && count == p.group_rows) {
    const int quads = H / 4;
    const int runs = p.group_rows / run;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(tile);
    for (int i = threadIdx.x; i < quads * runs; i += kThreads) {
      const int q = i % quads;
      const int lr0 = (i / quads) * run;
      uint8_t* dst = p.y_t + static_cast<size_t>(4 * q) * p.rows + r0 + lr0;
      if (run == 16) {
        uint32_t w[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) w[k] = words[(lr0 + k) * quads + q];
        uint32_t c0[4], c1[4], c2[4], c3[4];
        transpose_4x4(w[0], w[1], w[2], w[3], c0);
        transpose_4x4(w[4], w[5], w[6], w[7], c1);
        transpose_4x4(w[8], w[9], w[10], w[11], c2);
        transpose_4x4(w[12], w[13], w[14], w[15], c3);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          *reinterpret_cast<uint4*>(dst + static_cast<size_t>(m) * p.rows) =
              make_uint4(c0[m], c1[m], c2[m], c3[m]);
        }
      } else {  // run == 8
        uint32_t w[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = words[(lr0 + k) * quads + q];
        uint32_t c0[4], c1[4];
        transpose_4x4(w[0], w[1], w[2], w[3], c0);
        transpose_4x4(w[4], w[5], w[6], w[7], c1);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          *reinterpret_cast<uint2*>(dst + static_cast<size_t>(m) * p.rows) =
              make_uint2(c0[m], c1[m]);
        }
      }
    }
    return;
  }
  const int runs = p.group_rows / run;
  for (int i = threadIdx.x; i < H * runs; i += kThreads) {
    const int c = i % H;
    const int lr0 = (i / H) * run;
    if (lr0 >= count) continue;
    uint8_t* dst = p.y_t + static_cast<size_t>(c) * p.rows + r0 + lr0;
    const int m = count - lr0 < run ? count - lr0 : run;
    for (int k = 0; k < m; ++k) dst[k] = tile[(lr0 + k) * H + c];
  }
}

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_TRANSPOSE_TILE_CUH_
