/* nvte_block_scaled_quantize: Float8BlockScaling's cast (1x128 tiles or 128x128 blocks, float32
 * scales), both copies and their scales in one pass. A persistent grid walks the 128x128 tiles
 * of the input (tile_pipeline.cuh: the next tiles' input is in flight while a tile is converted
 * from registers, block_tile.cuh's 8x8 sub-tile per thread): the row-wise bytes go straight from
 * registers to memory; the column-wise bytes (the transposed matrix [K, M]) are staged in shared
 * memory and written as whole 16-byte pieces of rows of the transposed output. The arithmetic is
 * reference_blocks.block_cast_1d/_2d's. */
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <type_traits>

#include "cast/block_tile.cuh"
#include "cast/dispatch.cuh"
#include "cast/tile_pipeline.cuh"
#include "transformer_engine/block_cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/device_set.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

using namespace block_cast_detail;

struct BlockCastParams {
  TileGeometry g;
  uint8_t* row_data;   // [M, K] or null
  float* row_si;       // its scale_inv
  uint8_t* col_data;   // [K, M] or null
  float* col_si;       // its scale_inv
  size_t row_si_cols;  // the scale tensors' row lengths (padded)
  size_t col_si_cols;
  size_t tiles_m;
  float epsilon;
  bool pow2;
  bool vec_col_out;  // the [K, M] output takes 16-byte row chunks (M % 16 == 0, aligned base)
  const float* noop;
};

/* The largest finite value of the input's dtype: what an infinite scale becomes. */
template <typename IType>
__device__ __forceinline__ float input_max_finite();
template <>
__device__ __forceinline__ float input_max_finite<float>() {
  return FLT_MAX;
}
template <>
__device__ __forceinline__ float input_max_finite<__half>() {
  return 65504.0f;
}
template <>
__device__ __forceinline__ float input_max_finite<__nv_bfloat16>() {
  return __uint_as_float(0x7F7F0000u);
}

/* reference_blocks.block_scale_from_amax, one block. */
template <typename IType, bool kE4M3>
__device__ __forceinline__ float block_scale(float amax, float epsilon, bool pow2) {
  const float a = epsilon > 0.0f ? fmaxf(amax, epsilon) : amax;
  float scale = __fdiv_rn(Fp8Format<kE4M3>::kMax, a);
  if (isinf(scale) && scale > 0.0f) scale = input_max_finite<IType>();
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  if (a == 0.0f) scale = 1.0f;
  return scale;
}

/* Reduce-scatter of 8 row maxima over the 16 lanes of a half-warp (lane cc holds its partial
 * maxima m[0..7] of rows 0..7): each step halves the rows a lane keeps and takes the partner's
 * maxima of them, so 4 + 2 + 1 + 1 shuffles leave lanes 2i and 2i+1 with row i's maximum over
 * all 16 lanes (instead of 8 full reductions of 4 shuffles each). Returns row cc/2's maximum.
 * Maxima of non-negative, NaN-free values: the order of the steps does not change the result. */
__device__ __forceinline__ float row_maxima(const float (&m)[kSub], int cc) {
  const bool b8 = (cc & 8) != 0, b4 = (cc & 4) != 0, b2 = (cc & 2) != 0;
  float w[4];  // rows (b8 ? 4 : 0) + k
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float send = b8 ? m[k] : m[k + 4];
    const float keep = b8 ? m[k + 4] : m[k];
    w[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 8));
  }
  float u[2];  // rows (b8 ? 4 : 0) + (b4 ? 2 : 0) + k
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float send = b4 ? w[k] : w[k + 2];
    const float keep = b4 ? w[k + 2] : w[k];
    u[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 4));
  }
  // row cc / 2 = (b8 ? 4 : 0) + (b4 ? 2 : 0) + (b2 ? 1 : 0)
  float t = fmaxf(b2 ? u[1] : u[0], __shfl_xor_sync(0xffffffffu, b2 ? u[0] : u[1], 2));
  return fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 1));
}

/* The column-wise staging tile: column `cl` of the input tile is row `cl` of the transposed
 * tile, 128 bytes, held as 8 pieces of 16 bytes (16 input rows each). Piece `pr` (rows
 * 16*pr..16*pr+15) sits at slot `pr ^ (cl / 8 % 8)`. Writes: a warp (row groups 2w and 2w+1,
 * cc = 0..15, columns cl = cc*8+j) stores 8 bytes per lane into 16 distinct 8-byte slots, each
 * twice: two wavefronts, the least 256 bytes take. Reads: write_transposed's warp reads whole
 * 16-byte pieces of 4 rows, each row's 8 pieces on 8 distinct slots: no bank conflicts. */
__device__ __forceinline__ int stage_offset(int cl, int rl) {
  return cl * kTile + ((((rl / 16) ^ ((cl / kSub) % 8)) * 16) | (rl % 16));
}

/* Writes the staged transposed tile to out_t [K, M]: rows c0..c0+127 of it, bytes r0..r0+127. */
__device__ __forceinline__ void write_transposed(const uint8_t* stage, const BlockCastParams& P,
                                                 const TilePos& p) {
  const size_t M = P.g.M, K = P.g.K;
  const size_t rows_here = M - p.r0 < kTile ? M - p.r0 : kTile;
  const size_t cols_here = K - p.c0 < kTile ? K - p.c0 : kTile;
  if (P.vec_col_out) {
    // 16-byte chunks: 8 per transposed row; rows_here is a multiple of 16 (M % 16 == 0).
    for (int q = threadIdx.x; q < kTile * (kTile / 16); q += kThreads) {
      const int cl = q / (kTile / 16);
      const int part = q % (kTile / 16);
      if (cl >= static_cast<int>(cols_here) || part * 16 >= static_cast<int>(rows_here)) continue;
      // Rows part*16..part*16+15 of transposed row cl, in order (stage_offset keeps a piece).
      *reinterpret_cast<uint4*>(P.col_data + (p.c0 + cl) * M + p.r0 + part * 16) =
          *reinterpret_cast<const uint4*>(stage + stage_offset(cl, part * 16));
    }
  } else {
    for (int q = threadIdx.x; q < kTile * kTile; q += kThreads) {
      const int cl = q / kTile;
      const int rl = q % kTile;
      if (cl < static_cast<int>(cols_here) && rl < static_cast<int>(rows_here)) {
        P.col_data[(p.c0 + cl) * M + p.r0 + rl] = stage[stage_offset(cl, rl)];
      }
    }
  }
}

/* The shared memory of one tile's cast besides the input ring. */
struct CastShared {
  alignas(16) uint8_t stage[kTile * kTile];  // the transposed bytes
  alignas(16) float colmax[kThreads / 32][kTile];  // per-warp column maxima (1-D)
  alignas(16) float colscale[kTile];  // the column blocks' scales (1-D)
  float warpmax[kThreads / 32];  // per-warp maxima (2-D)
};

/* The row scales of a 1x128 tile: lane cc of a half-warp computes row cc/2's scale once from the
 * reduced maxima (and writes its scale_inv) and returns it; row_scale gets row i's from it. */
template <typename IType, bool kE4M3>
__device__ __forceinline__ float row_scale_of_lane(const float (&row_max)[kSub],
                                                   const BlockCastParams& P, const TilePos& p) {
  const float mine = block_scale<IType, kE4M3>(row_maxima(row_max, p.cc), P.epsilon, P.pow2);
  const size_t r_mine = p.r0 + p.rg * kSub + p.cc / 2;
  if (p.cc % 2 == 0 && r_mine < P.row_si_cols) {
    // scale_inv [KB, roundup(M, 4)], entry [tile, row]; rows past M are padding. Lanes
    // 0, 2, .., 14 write 8 consecutive entries.
    P.row_si[p.tc * P.row_si_cols + r_mine] = r_mine < P.g.M ? __fdiv_rn(1.0f, mine) : 0.0f;
  }
  return mine;
}

/* The scale of the thread's row i (of its half-warp's 8 rows), from row_scale_of_lane's value:
 * fetched where it is used, so that the 8 scales are not all live at once. */
__device__ __forceinline__ float row_scale(float lane_scale, int i) {
  return __shfl_sync(0xffffffffu, lane_scale, (threadIdx.x & 16) | (2 * i));
}

/* The column scales of a 1x128 tile along M: a tile column spans all 16 row groups (2 per warp,
 * 8 warps). Each warp's maxima go to shared memory; then thread cl < 128 reduces column cl and
 * computes its scale once (and writes its scale_inv: 128 consecutive floats), and every thread
 * reads back the 8 scales of its columns. */
template <typename IType, bool kE4M3>
__device__ __forceinline__ void column_scales_1d(const float (&col_max)[kSub],
                                                 const BlockCastParams& P, const TilePos& p,
                                                 CastShared& sh, float (&scales)[kSub]) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float m[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) m[j] = fmaxf(col_max[j], __shfl_xor_sync(0xffffffffu, col_max[j], 16));
  if (lane < 16) {
    float4* dst = reinterpret_cast<float4*>(&sh.colmax[warp][p.cc * kSub]);
    dst[0] = make_float4(m[0], m[1], m[2], m[3]);
    dst[1] = make_float4(m[4], m[5], m[6], m[7]);
  }
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int cl = threadIdx.x;
    float a = sh.colmax[0][cl];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) a = fmaxf(a, sh.colmax[w][cl]);
    const float scale = block_scale<IType, kE4M3>(a, P.epsilon, P.pow2);
    sh.colscale[cl] = scale;
    const size_t c = p.c0 + cl;
    if (c < P.col_si_cols) {
      // scale_inv [MB, roundup(K, 4)], entry [tile, column]; columns past K are padding.
      P.col_si[p.tr * P.col_si_cols + c] = c < P.g.K ? __fdiv_rn(1.0f, scale) : 0.0f;
    }
  }
  __syncthreads();
  const float4* src = reinterpret_cast<const float4*>(&sh.colscale[p.cc * kSub]);
  const float4 s0 = src[0], s1 = src[1];
  scales[0] = s0.x, scales[1] = s0.y, scales[2] = s0.z, scales[3] = s0.w;
  scales[4] = s1.x, scales[5] = s1.y, scales[6] = s1.z, scales[7] = s1.w;
}

/* Column j of the thread's sub-tile, cast, is 8 consecutive bytes of transposed row
 * c0 + cc*8 + j (input rows rg*8..rg*8+7): word h holds rows 4h..4h+3, added a pair of rows
 * (a cast pair, rows 2a and 2a + 1) at a time by put_pair. */
__device__ __forceinline__ void put_pair(uint32_t (&words)[2], int a, uint16_t pair) {
  if (a % 2 == 0) {
    words[a / 2] = pair;
  } else {
    words[a / 2] |= static_cast<uint32_t>(pair) << 16;
  }
}

__device__ __forceinline__ void stage_column(uint8_t* stage, const TilePos& p, int j,
                                             const uint32_t (&words)[2]) {
  *reinterpret_cast<uint2*>(stage + stage_offset(p.cc * kSub + j, p.rg * kSub)) =
      make_uint2(words[0], words[1]);
}

/* Casts one tile, the thread's sub-tile `x` of it in registers. Each path casts through a
 * generic lambda that cast_by_finiteness calls with the sub-tile's NaN-patching flag. */
template <typename IType, bool kE4M3, bool kTwoD>
__device__ __forceinline__ void cast_tile(const SubTile<IType>& x, const BlockCastParams& P,
                                          const TilePos& p, CastShared& sh) {
  using F = Fp8Format<kE4M3>;
  uint8_t* stage = sh.stage;
  const TileGeometry& g = P.g;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  if constexpr (kTwoD) {
    // One scale for the whole 128x128 block.
    const SubTileMaxima mx = sub_tile_maxima<IType, true, false>(x);
    float m = mx.row[0];
#pragma unroll
    for (int i = 1; i < kSub; ++i) m = fmaxf(m, mx.row[i]);
    m = half_warp_max(m);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    if (lane == 0) sh.warpmax[warp] = m;
    __syncthreads();
    m = sh.warpmax[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, sh.warpmax[w]);
    const float scale = block_scale<IType, kE4M3>(m, P.epsilon, P.pow2);
    auto cast = [&](auto may_be_nan) {
      constexpr bool kNaN = decltype(may_be_nan)::value;
      Vec<uint16_t, kSub / 2> q[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          q[i].v[k] = F::template cast_pair_as<kNaN>(x.at(i, 2 * k) * scale,
                                                     x.at(i, 2 * k + 1) * scale);
        }
        if (P.row_data != nullptr) store_row(P.row_data, g, p, i, q[i]);
      }
      if (P.col_data != nullptr) {
        // The same bytes, transposed: column j of the sub-tile is 8 consecutive staged bytes.
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          uint32_t words[2];
#pragma unroll
          for (int a = 0; a < kSub / 2; ++a) {
            put_pair(words, a, static_cast<uint16_t>(byte_of(q[2 * a], j) |
                                                     (byte_of(q[2 * a + 1], j) << 8)));
          }
          stage_column(stage, p, j, words);
        }
      }
    };
    cast_by_finiteness(mx, cast);
    if (threadIdx.x == 0) {
      const float scale_inv = __fdiv_rn(1.0f, scale);
      if (P.row_si != nullptr) {
        float* row = P.row_si + p.tr * P.row_si_cols;
        row[p.tc] = scale_inv;
        if (p.tc + 1 == g.tiles_k) {
          for (size_t k = p.tc + 1; k < P.row_si_cols; ++k) row[k] = 0.0f;
        }
      }
      if (P.col_si != nullptr) {
        float* row = P.col_si + p.tc * P.col_si_cols;
        row[p.tr] = scale_inv;
        if (p.tr + 1 == P.tiles_m) {
          for (size_t k = p.tr + 1; k < P.col_si_cols; ++k) row[k] = 0.0f;
        }
      }
    }
  } else if (P.row_data != nullptr && P.col_data != nullptr) {
    // Both 1x128 copies: each element is converted to float32 once and cast twice (row scale,
    // column scale), in 2x2 groups so that the row-wise pairs (i, 2b..2b+1) and the column-wise
    // pairs (2a..2a+1, j) come from the same four values.
    const SubTileMaxima mx = sub_tile_maxima<IType, true, true>(x);
    const float lane_scale = row_scale_of_lane<IType, kE4M3>(mx.row, P, p);
    float cs[kSub];
    column_scales_1d<IType, kE4M3>(mx.col, P, p, sh, cs);
    auto cast = [&](auto may_be_nan) {
      constexpr bool kNaN = decltype(may_be_nan)::value;
      uint32_t col_words[kSub][2];  // column j's staged bytes
#pragma unroll
      for (int a = 0; a < kSub / 2; ++a) {
        Vec<uint16_t, kSub / 2> q0, q1;  // rows 2a and 2a + 1
        const float rs0 = row_scale(lane_scale, 2 * a), rs1 = row_scale(lane_scale, 2 * a + 1);
#pragma unroll
        for (int b = 0; b < kSub / 2; ++b) {
          const float v00 = x.at(2 * a, 2 * b), v01 = x.at(2 * a, 2 * b + 1);
          const float v10 = x.at(2 * a + 1, 2 * b), v11 = x.at(2 * a + 1, 2 * b + 1);
          q0.v[b] = F::template cast_pair_as<kNaN>(v00 * rs0, v01 * rs0);
          q1.v[b] = F::template cast_pair_as<kNaN>(v10 * rs1, v11 * rs1);
          put_pair(col_words[2 * b], a,
                   F::template cast_pair_as<kNaN>(v00 * cs[2 * b], v10 * cs[2 * b]));
          put_pair(col_words[2 * b + 1], a,
                   F::template cast_pair_as<kNaN>(v01 * cs[2 * b + 1], v11 * cs[2 * b + 1]));
        }
        store_row(P.row_data, g, p, 2 * a, q0);
        store_row(P.row_data, g, p, 2 * a + 1, q1);
      }
#pragma unroll
      for (int j = 0; j < kSub; ++j) stage_column(stage, p, j, col_words[j]);
    };
    cast_by_finiteness(mx, cast);
  } else if (P.row_data != nullptr) {
    // 1x128 tiles along K: a tile row is one half-warp's 16 x 8 elements. The half-warp
    // reduces its 8 rows at once (row_maxima: lane cc ends with row cc/2's maximum), so each
    // lane computes one scale, and the 8 scales are then shuffled back to all 16 lanes.
    const SubTileMaxima mx = sub_tile_maxima<IType, true, false>(x);
    const float lane_scale = row_scale_of_lane<IType, kE4M3>(mx.row, P, p);
    auto cast = [&](auto may_be_nan) {
      constexpr bool kNaN = decltype(may_be_nan)::value;
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        Vec<uint16_t, kSub / 2> q;
        const float rs = row_scale(lane_scale, i);
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          q.v[k] = F::template cast_pair_as<kNaN>(x.at(i, 2 * k) * rs, x.at(i, 2 * k + 1) * rs);
        }
        store_row(P.row_data, g, p, i, q);
      }
    };
    cast_by_finiteness(mx, cast);
  } else {
    // The column-wise copy alone: 1x128 tiles along M.
    const SubTileMaxima mx = sub_tile_maxima<IType, false, true>(x);
    float cs[kSub];
    column_scales_1d<IType, kE4M3>(mx.col, P, p, sh, cs);
    auto cast = [&](auto may_be_nan) {
      constexpr bool kNaN = decltype(may_be_nan)::value;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        uint32_t words[2];
#pragma unroll
        for (int a = 0; a < kSub / 2; ++a) {
          put_pair(words, a, F::template cast_pair_as<kNaN>(x.at(2 * a, j) * cs[j],
                                                            x.at(2 * a + 1, j) * cs[j]));
        }
        stage_column(stage, p, j, words);
      }
    };
    cast_by_finiteness(mx, cast);
  }
  if (P.col_data != nullptr) {
    __syncthreads();
    write_transposed(stage, P, p);
  }
}

template <typename IType, bool kE4M3, bool kTwoD>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    block_quantize_kernel(const IType* __restrict__ in, const BlockCastParams P, size_t tiles) {
  if (skip_requested(P.noop)) return;
  extern __shared__ uint4 ring_words[];  // the input ring (dynamic, ring_bytes<IType>())
  __shared__ CastShared sh;
  for_each_tile(in, P.g, tiles, reinterpret_cast<IType*>(ring_words),
                [&](const SubTile<IType>& x, const TilePos& p) {
                  cast_tile<IType, kE4M3, kTwoD>(x, P, p, sh);
                });
}

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_block_scaled_quantize(const NVTEBuffer* input, NVTEBuffer* rowwise_data,
                                           NVTEBuffer* rowwise_scale_inv,
                                           NVTEBuffer* columnwise_data,
                                           NVTEBuffer* columnwise_scale_inv, int block_scaling_dim,
                                           float epsilon, int force_pow_2_scales,
                                           const NVTEBuffer* noop, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::block_cast_detail;
  const char* op = "nvte_block_scaled_quantize";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  if (block_scaling_dim != 1 && block_scaling_dim != 2) {
    throw_invalid(op, "block_scaling_dim=", block_scaling_dim,
                  " is not supported; pass 1 (1x128 tiles) or 2 (128x128 blocks)");
  }
  if (!(epsilon >= 0.0f) || std::isinf(epsilon)) {
    throw_invalid(op, "epsilon=", static_cast<double>(epsilon), " must be finite and >= 0");
  }
  const CastBuffers b{input, rowwise_data, rowwise_scale_inv, columnwise_data,
                      columnwise_scale_inv, noop};
  const size_t M = leading_rows(in), K = last_dim(in), n = numel(in);
  const size_t MB = ceil_div(M, kTile), KB = ceil_div(K, kTile);
  const bool two_d = block_scaling_dim == 2;
  const size_t row_si_rows = two_d ? MB : KB, row_si_cols = two_d ? round_up(KB, 4) : round_up(M, 4);
  const size_t col_si_rows = two_d ? KB : MB, col_si_cols = two_d ? round_up(MB, 4) : round_up(K, 4);
  check_cast_buffers(op, b, K, n, {kNVTEFloat32}, {row_si_rows, row_si_cols},
                     {col_si_rows, col_si_cols}, /*col_transposed=*/true);
  const unsigned int tiles = tile_count(op, M, K);

  CallContext ctx(op, device, stream);
  check_cast_on_device(ctx, b);
  if (tiles == 0) return;  // an empty input has empty scale tensors: nothing to write

  BlockCastParams P{};
  P.g = make_geometry(in, M, K, {rowwise_data});
  P.row_data = b.row_bytes();
  P.row_si = b.row_scales<float>();
  P.col_data = b.col_bytes();
  P.col_si = b.col_scales<float>();
  P.row_si_cols = row_si_cols;
  P.col_si_cols = col_si_cols;
  P.tiles_m = MB;
  P.epsilon = epsilon;
  P.pow2 = force_pow_2_scales != 0;
  P.vec_col_out = M % 16 == 0 && P.col_data != nullptr && aligned_to(P.col_data, 16);
  P.noop = b.noop_flag();

  dispatch_block_cast(op, in.dtype, b.fp8_dtype(), two_d,
                      [&](auto itype, auto is_e4m3, auto is_two_d) {
                        using IType = decltype(itype);
                        auto kernel = block_quantize_kernel<IType, decltype(is_e4m3)::value,
                                                            decltype(is_two_d)::value>;
                        static DeviceSet allowed;  // per instantiation
                        allow_ring(ctx, kernel, ring_bytes<IType>(), allowed);
                        kernel<<<persistent_grid(ctx, tiles), kThreads, ring_bytes<IType>(),
                                 ctx.stream()>>>(static_cast<const IType*>(in.data), P, tiles);
                        ctx.check_launch("block_quantize_kernel launch");
                      });
}
