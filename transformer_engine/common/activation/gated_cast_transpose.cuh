/* The gated backward's FP8 cast+transpose: d loss / d input of a gated activation (SwiGLU,
 * GeGLU, ReGLU, ...), [rows, 2 cols], written in FP8 with its transposed copy [2 cols, rows],
 * its amax and optionally the bias gradient's per-64-row-tile column sums.
 *
 * Why not the tiled kernels of cast/cast_transpose.cuh: they read the result one 64-column
 * tile at a time through the loader's load_vec, and a gated backward's row vector in either
 * half needs the output gradient and both input halves. A first-half tile and its second-half
 * tile (cols columns apart, in different blocks) each load all three vectors and each compute
 * both halves' gradients to keep one: twice the loads an output byte and twice the arithmetic,
 * which at 16-bit inputs costs as much issue time as the memory traffic (H200, SwiGLU backward
 * with the bias gradient, 8192 x 2 x 14336 BF16: 0.52 of copy bandwidth there, 0.77 here). Here
 * a block owns activation columns [c0, c0 + 64) of 64 rows and writes both halves of the result
 * (columns c0 + [0, 64) and cols + c0 + [0, 64)): each thread's 48 bytes of loads (16-bit
 * inputs) give 16 results, through the loaders' element-wise contract (fetch / compute /
 * load_parts).
 *
 * It gives the same bits as the base kernel (tests/pytorch/kernels/
 * test_cast_transpose_variants_gpu.py checks): the same loader arithmetic per element, the same
 * casts, amax as a max (order-free), the same vector-or-element-wise choice (vectorised iff the
 * base kernel's vector_rows), and the bias gradient's float32 additions in the base kernel's
 * order (per 64-row tile and column: partial g = (0 + row g) + row g + 32, then the partials
 * g = 0..31 added from 0). The layout:
 *
 * - Thread t handles positions (g + 32 p, 8 (t % 8)), g = t / 8, p = 0, 1, of the tile: it issues
 *   both positions' loads (96 bytes at 16-bit) before it computes either.
 * - Registers are capped for 4 blocks an SM at 16-bit inputs (2 at float32, whose 192 bytes of
 *   loads need the registers): 1024 threads x 96 bytes in flight an SM.
 * - Both halves' FP8 tiles are staged in shared memory as 32-bit words, row stride 17 words
 *   (odd, so a warp's word reads hit 32 banks). The transposed store: threads 0-127, 64 a half,
 *   each read 16 rows x 1 word (16 rows x 4 columns), transpose them with __byte_perm and write
 *   4 columns x 16 bytes (one 16-byte store a column).
 * - Edge tiles (partial rows or columns) and inputs that are not vectorizable take bounds-checked
 *   paths: vectors where the base kernel has vectors, single elements otherwise. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_GATED_CAST_TRANSPOSE_CUH_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_GATED_CAST_TRANSPOSE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cast/cast_transpose.cuh"
#include "util/buffer.h"
#include "util/byte_transpose.cuh"
#include "util/device.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace activation_detail {

namespace gated_ct {

using cast_detail::CastArgs;
using cast_detail::kLoadRowsPerPass;  // 32 rows of a tile a pass (256 threads x 8 columns)
using cast_detail::kThreads;
using cast_detail::kTile;
using cast_detail::kVecElems;

constexpr int kHalves = 2;                         // the result's two halves
constexpr int kPasses = kTile / kLoadRowsPerPass;  // 2 positions a thread
constexpr int kWords = (kTile + 4) / 4;            // 17 words a shared row
constexpr int kRowsT = 16;                         // transposed store: 16 rows (bytes) a thread
constexpr int kWordColsT = kTile / 4;              // 16 word columns a half tile
constexpr int kStoreThreadsT = kHalves * kWordColsT * (kTile / kRowsT);  // 128
static_assert(kWords % 2 == 1, "an odd stride in words spreads the word reads over 32 banks");
static_assert(kPasses == 2, "a 64-row tile's column-sum partials are two passes");
static_assert(kStoreThreadsT <= kThreads && kStoreThreadsT % 32 == 0, "whole warps store");
static_assert(kWordColsT * 2 == 32, "a warp's word reads: 2 row groups x 16 word columns");

/* Blocks an SM the registers are capped for (65536 / (256 x blocks) a thread): 16-bit inputs
 * (48 bytes of loads a position) fit 64 registers without spills; float32 (96 bytes) gets 128. */
template <class Loader>
constexpr int kMinBlocks = sizeof(typename Loader::Raw) <= 48 ? 4 : 2;

/* Block b owns rows [64 (b / tiles_c), +64) and activation columns [64 (b % tiles_c), +64);
 * `cols` is the activation's width (the output gradient's), the result has 2 cols columns.
 * vector_rows: the loader is vectorizable and `out` 8-byte aligned (the base kernel's
 * vector_rows for the result); vector_cols: rows % 16 == 0 and `out_t` 16-byte aligned. */
template <class Loader, bool kE4M3, bool kDbias>
__global__ void __launch_bounds__(kThreads, kMinBlocks<Loader>)
    gated_cast_transpose_kernel(const Loader loader, uint8_t* __restrict__ out,
                                uint8_t* __restrict__ out_t, size_t rows, size_t cols,
                                size_t tiles_c, bool vector_rows, bool vector_cols, CastArgs args,
                                float* __restrict__ column_sums) {
  static_assert(Loader::kParts == kHalves, "a gated backward's loader gives both halves");
  if (skip_requested(args.noop)) return;
  __shared__ uint32_t tile[kHalves][kTile][kWords];
  // The column-sum partials (float4 stores, so 16-byte aligned); one float without kDbias.
  constexpr int kSumHalves = kDbias ? kHalves : 1;
  constexpr int kSumGroups = kDbias ? kLoadRowsPerPass : 1;
  constexpr int kSumCols = kDbias ? kTile : 1;
  __shared__ alignas(16) float sums[kSumHalves][kSumGroups][kSumCols];
  const float scale = cast_detail::load_scale(args);
  const size_t r0 = (blockIdx.x / tiles_c) * kTile;
  const size_t c0 = (blockIdx.x % tiles_c) * kTile;
  const size_t out_cols = kHalves * cols;
  const int t = threadIdx.x;
  const int g = t / (kTile / kVecElems);
  const int lc = (t % (kTile / kVecElems)) * kVecElems;
  const bool full_cols = c0 + kTile <= cols;
  const bool full_rows = r0 + kTile <= rows;
  float local_amax = 0.0f;
  float colsum[kHalves][kVecElems] = {};

  if (vector_rows && full_cols && full_rows) {
    typename Loader::Raw raw[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) raw[p] = loader.fetch(r0 + p * kLoadRowsPerPass + g, c0 + lc);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int lr = p * kLoadRowsPerPass + g;
      float x[kHalves][kVecElems];
      loader.compute(raw[p], x);
      uint8_t* row_out = out + (r0 + lr) * out_cols + c0 + lc;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        cast_detail::cast_store_vector<kE4M3, kDbias>(x[h], scale, local_amax, row_out + h * cols,
                                                      &tile[h][lr][lc / 4], colsum[h]);
      }
    }
  } else {
    // Unrolled, so that colsum is indexed by constants (registers, not a local array).
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int lr = p * kLoadRowsPerPass + g;
      const size_t r = r0 + lr;
      const size_t c = c0 + lc;
      if (r >= rows || c >= cols) continue;
      if (vector_rows) {  // cols % 8 == 0, so the vector at c is inside the row
        float x[kHalves][kVecElems];
        loader.compute(loader.fetch(r, c), x);
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          cast_detail::cast_store_vector<kE4M3, kDbias>(x[h], scale, local_amax,
                                                        out + r * out_cols + h * cols + c,
                                                        &tile[h][lr][lc / 4], colsum[h]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) {
          if (c + j >= cols) break;
          float x[kHalves];
          loader.load_parts(r, c + j, x);
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            local_amax = amax_step(local_amax, x[h]);
            const uint8_t q = Fp8Format<kE4M3>::cast(x[h] * scale);
            out[r * out_cols + h * cols + c + j] = q;
            reinterpret_cast<uint8_t*>(&tile[h][lr][0])[lc + j] = q;
            if constexpr (kDbias) colsum[h][j] += x[h];
          }
        }
      }
    }
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      auto* dst = reinterpret_cast<float4*>(&sums[h][g][lc]);
      dst[0] = make_float4(colsum[h][0], colsum[h][1], colsum[h][2], colsum[h][3]);
      dst[1] = make_float4(colsum[h][4], colsum[h][5], colsum[h][6], colsum[h][7]);
    }
  }
  __syncthreads();

  if constexpr (kDbias) {
    // Thread t < 128 adds up column t % 64 of half t / 64: its 32 partials, in the base order.
    const int h = t / kTile;
    const int col = t % kTile;
    if (h < kHalves && c0 + col < cols) {
      float total = 0.0f;
#pragma unroll
      for (int gi = 0; gi < kLoadRowsPerPass; ++gi) total += sums[h][gi][col];
      column_sums[(r0 / kTile) * out_cols + h * cols + c0 + col] = total;
    }
  }

  if (vector_cols && full_cols && full_rows) {
    if (t < kStoreThreadsT) {
      // Warps 0-1 store the first half, 2-3 the second; warp w % 2 rows 32 (w % 2) + [0, 32).
      // Lane l reads the 16 rows from 16 (l / 16) of word column l % 16: banks
      // 16 (l / 16) + l % 16 (+ 17 i), all 32 distinct.
      const int h = t / (kStoreThreadsT / kHalves);
      const int lane = t % 32;
      const int cw = lane % kWordColsT;
      const int lr0 = ((t / 32) % 2) * 32 + (lane / kWordColsT) * kRowsT;
      uint32_t w[kRowsT];
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) w[i] = tile[h][lr0 + i][cw];
      uint32_t col[kRowsT / 4][4];
#pragma unroll
      for (int q = 0; q < kRowsT / 4; ++q) {
        transpose_4x4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3], col[q]);
      }
      uint8_t* dst = out_t + (h * cols + c0 + 4 * cw) * rows + r0 + lr0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        *reinterpret_cast<uint4*>(dst + k * rows) =
            make_uint4(col[0][k], col[1][k], col[2][k], col[3][k]);
      }
    }
  } else {
    // Edge tile: one byte at a time, consecutive threads on consecutive rows of a column.
    for (int i = t; i < kHalves * kTile * kTile; i += kThreads) {
      const int h = i / (kTile * kTile);
      const int lr = i % kTile;
      const int tc = (i / kTile) % kTile;
      if (r0 + lr < rows && c0 + tc < cols) {
        out_t[(h * cols + c0 + tc) * rows + r0 + lr] =
            reinterpret_cast<const uint8_t*>(&tile[h][lr][0])[tc];
      }
    }
  }
  if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
}

}  // namespace gated_ct

/* Launches gated_cast_transpose_kernel over a gated backward loader's [rows, cols] positions
 * (rows * cols > 0): the result [rows, 2 cols] to out, its transpose to out_t. */
template <class Loader, bool kE4M3, bool kDbias>
void launch_gated_cast_transpose(const Loader& loader, uint8_t* out, uint8_t* out_t, size_t rows,
                                 size_t cols, const cast_detail::CastArgs& args, float* column_sums,
                                 CallContext& ctx) {
  using gated_ct::kTile;
  const size_t tiles_c = (cols + kTile - 1) / kTile;
  const size_t blocks = tiles_c * ((rows + kTile - 1) / kTile);
  // The base kernel's conditions over the result's [rows, 2 cols] (vectorizable() implies
  // cols % 8 == 0, hence 2 cols % 8 == 0).
  const bool vector_rows = loader.vectorizable() && aligned_to(out, gated_ct::kVecElems);
  const bool vector_cols = rows % gated_ct::kRowsT == 0 && aligned_to(out_t, gated_ct::kRowsT);
  gated_ct::gated_cast_transpose_kernel<Loader, kE4M3, kDbias>
      <<<blocks, gated_ct::kThreads, 0, ctx.stream()>>>(
          loader, out, out_t, rows, cols, tiles_c, vector_rows, vector_cols, args, column_sums);
  ctx.check_launch("gated_cast_transpose_kernel launch");
}

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_GATED_CAST_TRANSPOSE_CUH_
