/* nvte_mxfp8_quantize: MXFP8's cast (32-element blocks, E8M0 scales), row-wise and column-wise
 * copies (both [M, K]) and their scales in one pass. A persistent grid walks the 128x128 tiles
 * of the input (tile_pipeline.cuh, block_tile.cuh); a thread's 8x8 sub-tile is a quarter of a
 * 32-element row block (the 4 threads of a row block are adjacent lanes) and an eighth of a
 * column block (4 row groups, reduced through shared memory). The arithmetic is
 * reference_blocks.mxfp8_cast's. */
#include <cuda_runtime.h>

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

constexpr int kMxBlock = 32;
constexpr int kSubsPerBlock = kMxBlock / kSub;  // 4 sub-tiles along a block
constexpr int kBlocksPerTile = kTile / kMxBlock;  // 4

struct MxParams {
  TileGeometry g;
  uint8_t* row_data;   // [M, K] or null
  uint8_t* row_scale;  // [roundup(M, 128), roundup(ceil(K/32), 4)]
  uint8_t* col_data;   // [M, K] or null
  uint8_t* col_scale;  // [roundup(ceil(M/32), 4), roundup(K, 128)]
  size_t row_scale_cols;
  size_t col_scale_cols;
  const float* noop;
};

/* reference_blocks.mxfp8_scale_exponent, one block (amax is NaN-free and >= 0). */
template <bool kE4M3>
__device__ __forceinline__ uint32_t e8m0_exponent(float amax) {
  const float rcp = __fdiv_rn(1.0f, Fp8Format<kE4M3>::kMax);
  const float q = __fmul_rn(amax, rcp);
  const uint32_t bits = __float_as_uint(q);
  const uint32_t exponent = (bits >> 23) & 0xFFu;
  const uint32_t mantissa = bits & 0x7FFFFFu;
  const bool bump =
      mantissa > 0u && exponent != 0xFEu && !(exponent == 0u && mantissa <= 0x400000u);
  uint32_t e = exponent + (bump ? 1u : 0u);
  if (isinf(q) && q > 0.0f) e = 0xFEu;
  if (isnan(q)) e = 0xFFu;
  if (q == 0.0f) e = 0u;
  return e;
}

/* 2^(127 - e) by its bits (1 for e == 0), as reference_blocks._e8m0_multiplier. */
__device__ __forceinline__ float e8m0_multiplier(uint32_t e) {
  return e == 0u ? 1.0f : __uint_as_float((254u - e) << 23);
}

/* Casts a row of 8 values, each by its multiplier; kMayBeNaN as in Fp8Format::cast_pair_as. */
template <bool kE4M3, bool kMayBeNaN>
__device__ __forceinline__ Vec<uint16_t, kSub / 2> cast_row(const float (&v)[kSub],
                                                            const float (&mult)[kSub]) {
  Vec<uint16_t, kSub / 2> q;
#pragma unroll
  for (int k = 0; k < kSub / 2; ++k) {
    q.v[k] = Fp8Format<kE4M3>::template cast_pair_as<kMayBeNaN>(v[2 * k] * mult[2 * k],
                                                                v[2 * k + 1] * mult[2 * k + 1]);
  }
  return q;
}

/* The same, all by one multiplier. */
template <bool kE4M3, bool kMayBeNaN>
__device__ __forceinline__ Vec<uint16_t, kSub / 2> cast_row(const float (&v)[kSub], float mult) {
  Vec<uint16_t, kSub / 2> q;
#pragma unroll
  for (int k = 0; k < kSub / 2; ++k) {
    q.v[k] = Fp8Format<kE4M3>::template cast_pair_as<kMayBeNaN>(v[2 * k] * mult,
                                                                v[2 * k + 1] * mult);
  }
  return q;
}

/* Casts one tile, the thread's sub-tile `x` of it in registers. `part` holds per-sub-tile
 * partial maxima: [row group][column] (column blocks), [row group][cc] (2-D). */
template <typename IType, bool kE4M3, bool kTwoD>
__device__ __forceinline__ void cast_tile(const SubTile<IType>& x, const MxParams& P,
                                          const TilePos& p, float (&part)[kGroups][kTile]) {
  const TileGeometry& g = P.g;
  const size_t c_first = p.c0 + p.cc * kSub;  // the thread's first column
  const size_t r_first = p.r0 + p.rg * kSub;  // and first row
  // The 32-element blocks the thread's sub-tile lies in: column block along K, row block
  // along M, and whether each starts inside the matrix (else its scale entries are padding).
  const size_t kblock = p.c0 / kMxBlock + p.cc / kSubsPerBlock;
  const size_t mblock = p.r0 / kMxBlock + p.rg / kSubsPerBlock;
  const bool kblock_in = p.c0 + (p.cc / kSubsPerBlock) * kMxBlock < g.K;
  const bool mblock_in = p.r0 + (p.rg / kSubsPerBlock) * kMxBlock < g.M;

  if constexpr (kTwoD) {
    // 32x32 blocks: 4x4 sub-tiles.
    const SubTileMaxima mx = sub_tile_maxima<IType, true, false>(x);
    float m = mx.row[0];
#pragma unroll
    for (int i = 1; i < kSub; ++i) m = fmaxf(m, mx.row[i]);
    part[p.rg][p.cc] = m;
    __syncthreads();
    const int rg0 = p.rg / kSubsPerBlock * kSubsPerBlock;
    const int cc0 = p.cc / kSubsPerBlock * kSubsPerBlock;
    float a = 0.0f;
#pragma unroll
    for (int u = 0; u < kSubsPerBlock; ++u) {
#pragma unroll
      for (int w = 0; w < kSubsPerBlock; ++w) a = fmaxf(a, part[rg0 + u][cc0 + w]);
    }
    const uint32_t e = e8m0_exponent<kE4M3>(a);
    const float mult = e8m0_multiplier(e);
    auto cast = [&](auto may_be_nan) {
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        float v[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j) v[j] = x.at(i, j);
        const Vec<uint16_t, kSub / 2> q = cast_row<kE4M3, decltype(may_be_nan)::value>(v, mult);
        if (P.row_data != nullptr) store_row(P.row_data, g, p, i, q);
        if (P.col_data != nullptr) store_row(P.col_data, g, p, i, q);
      }
    };
    cast_by_finiteness(mx, cast);
    // Row-wise scales: the block's byte at each of its rows; column-wise: at each column.
    if (P.row_data != nullptr && p.cc % kSubsPerBlock == 0) {
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        const size_t r = r_first + i;
        P.row_scale[r * P.row_scale_cols + kblock] =
            static_cast<uint8_t>(r < g.M && kblock_in ? e : 0u);
      }
    }
    if (P.col_data != nullptr && p.rg % kSubsPerBlock == 0) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const size_t c = c_first + j;
        P.col_scale[mblock * P.col_scale_cols + c] =
            static_cast<uint8_t>(c < g.K && mblock_in ? e : 0u);
      }
    }
  } else {
    const bool rows = P.row_data != nullptr, cols = P.col_data != nullptr;
    SubTileMaxima mx;
    if (rows && cols) {
      mx = sub_tile_maxima<IType, true, true>(x);
    } else if (rows) {
      mx = sub_tile_maxima<IType, true, false>(x);
    } else {
      mx = sub_tile_maxima<IType, false, true>(x);
    }
    // 1x32 blocks along K: 4 adjacent lanes (cc = 4b..4b+3) per block.
    uint32_t row_e[kSub];
    if (rows) {
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        float m = mx.row[i];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        row_e[i] = e8m0_exponent<kE4M3>(m);
        if (p.cc % kSubsPerBlock == 0) {
          const size_t r = r_first + i;
          P.row_scale[r * P.row_scale_cols + kblock] =
              static_cast<uint8_t>(r < g.M && kblock_in ? row_e[i] : 0u);
        }
      }
    }
    // 32x1 blocks along M: 4 row groups per block, reduced through shared memory.
    // The thread's 8 column maxima as two 16-byte stores, read back the same way.
    float col_mult[kSub];
    if (cols) {
      float4* mine = reinterpret_cast<float4*>(&part[p.rg][p.cc * kSub]);
      mine[0] = make_float4(mx.col[0], mx.col[1], mx.col[2], mx.col[3]);
      mine[1] = make_float4(mx.col[4], mx.col[5], mx.col[6], mx.col[7]);
      __syncthreads();
      const int rg0 = p.rg / kSubsPerBlock * kSubsPerBlock;
      float a[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) a[j] = 0.0f;
#pragma unroll
      for (int u = 0; u < kSubsPerBlock; ++u) {
        const float4* row = reinterpret_cast<const float4*>(&part[rg0 + u][p.cc * kSub]);
        const float4 lo = row[0], hi = row[1];
        a[0] = fmaxf(a[0], lo.x), a[1] = fmaxf(a[1], lo.y);
        a[2] = fmaxf(a[2], lo.z), a[3] = fmaxf(a[3], lo.w);
        a[4] = fmaxf(a[4], hi.x), a[5] = fmaxf(a[5], hi.y);
        a[6] = fmaxf(a[6], hi.z), a[7] = fmaxf(a[7], hi.w);
      }
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const uint32_t e = e8m0_exponent<kE4M3>(a[j]);
        col_mult[j] = e8m0_multiplier(e);
        if (p.rg % kSubsPerBlock == 0) {
          const size_t c = c_first + j;
          P.col_scale[mblock * P.col_scale_cols + c] =
              static_cast<uint8_t>(c < g.K && mblock_in ? e : 0u);
        }
      }
    }
    // Both copies from one float32 conversion of each row.
    auto cast = [&](auto may_be_nan) {
      constexpr bool kNaN = decltype(may_be_nan)::value;
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        float v[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j) v[j] = x.at(i, j);
        if (rows) {
          store_row(P.row_data, g, p, i, cast_row<kE4M3, kNaN>(v, e8m0_multiplier(row_e[i])));
        }
        if (cols) store_row(P.col_data, g, p, i, cast_row<kE4M3, kNaN>(v, col_mult));
      }
    };
    cast_by_finiteness(mx, cast);
  }
}

template <typename IType, bool kE4M3, bool kTwoD>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    mxfp8_quantize_kernel(const IType* __restrict__ in, const MxParams P, size_t tiles) {
  if (skip_requested(P.noop)) return;
  extern __shared__ uint4 ring_words[];  // the input ring (dynamic, ring_bytes<IType>())
  __shared__ alignas(16) float part[kGroups][kTile];
  for_each_tile(in, P.g, tiles, reinterpret_cast<IType*>(ring_words),
                [&](const SubTile<IType>& x, const TilePos& p) {
                  cast_tile<IType, kE4M3, kTwoD>(x, P, p, part);
                });
}

static_assert(kBlocksPerTile * kSubsPerBlock == kGroups, "a tile is whole 32-element blocks");

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_mxfp8_quantize(const NVTEBuffer* input, NVTEBuffer* rowwise_data,
                                    NVTEBuffer* rowwise_scale_inv, NVTEBuffer* columnwise_data,
                                    NVTEBuffer* columnwise_scale_inv, int two_d,
                                    const NVTEBuffer* noop, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::block_cast_detail;
  const char* op = "nvte_mxfp8_quantize";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  const CastBuffers b{input, rowwise_data, rowwise_scale_inv, columnwise_data,
                      columnwise_scale_inv, noop};
  const size_t M = leading_rows(in), K = last_dim(in), n = numel(in);
  const size_t MB = ceil_div(M, kMxBlock), KB = ceil_div(K, kMxBlock);
  const size_t row_scale_cols = round_up(KB, 4), col_scale_cols = round_up(K, kTile);
  check_cast_buffers(op, b, K, n, {kNVTEByte, kNVTEFloat8E8M0},
                     {round_up(M, kTile), row_scale_cols}, {round_up(MB, 4), col_scale_cols},
                     /*col_transposed=*/false);
  const unsigned int tiles = tile_count(op, M, K);

  CallContext ctx(op, device, stream);
  check_cast_on_device(ctx, b);
  // An empty input has empty scale tensors (roundup(0, n) == 0): nothing to write. Otherwise
  // the tiles cover every scale entry, padding included (ceil(M/128) * 128 rows and
  // ceil(K/128) * 4 column blocks, and the same column-wise).
  if (tiles == 0) return;

  MxParams P{};
  P.g = make_geometry(in, M, K, {rowwise_data, columnwise_data});
  P.row_data = b.row_bytes();
  P.row_scale = b.row_scales<uint8_t>();
  P.col_data = b.col_bytes();
  P.col_scale = b.col_scales<uint8_t>();
  P.row_scale_cols = row_scale_cols;
  P.col_scale_cols = col_scale_cols;
  P.noop = b.noop_flag();

  dispatch_block_cast(op, in.dtype, b.fp8_dtype(), two_d != 0,
                      [&](auto itype, auto is_e4m3, auto is_two_d) {
                        using IType = decltype(itype);
                        auto kernel = mxfp8_quantize_kernel<IType, decltype(is_e4m3)::value,
                                                            decltype(is_two_d)::value>;
                        static DeviceSet allowed;  // per instantiation
                        allow_ring(ctx, kernel, ring_bytes<IType>(), allowed);
                        kernel<<<persistent_grid(ctx, tiles), kThreads, ring_bytes<IType>(),
                                 ctx.stream()>>>(static_cast<const IType*>(in.data), P, tiles);
                        ctx.check_launch("mxfp8_quantize_kernel launch");
                      });
}
