/* What the block-scaled cast kernels (block_quantize.cu, mxfp8_quantize.cu) share: the
 * 128x128 tiles of the input matrix [M, K], each held in registers by a thread block (which
 * walks several tiles, tile_pipeline.cuh), and the host side: the checks of their buffers and
 * the dispatch over input type, FP8 format and block shape.
 *
 * Thread layout: 256 threads; thread t owns the 8x8 sub-tile of rows `r0 + rg*8 + i` and
 * columns `c0 + cc*8 + j` (i, j in 0..7) with `cc = t % 16` and `rg = t / 16`. The 16 threads
 * of one row group are one half-warp, so a row of the tile is one half-warp's 16 x 8 elements
 * (shuffles reduce along rows), and a warp load reads two whole tile rows. Elements outside the
 * matrix load as zero (they change no amax) and are never stored. */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_BLOCK_TILE_CUH_
#define TRANSFORMER_ENGINE_COMMON_CAST_BLOCK_TILE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cast/dispatch.cuh"
#include "transformer_engine/transformer_engine.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace block_cast_detail {

constexpr int kThreads = 256;
constexpr int kTile = 128;
constexpr int kSub = 8;  // each thread: kSub x kSub elements
constexpr int kGroups = kTile / kSub;  // 16 column groups (cc) and 16 row groups (rg)
static_assert(kGroups * kGroups == kThreads, "one thread per 8x8 sub-tile");

/* A thread's 8x8 sub-tile in the input's own type (half the registers of float32 for 16-bit
 * inputs); values are converted to float32 where they are used. */
template <typename IType>
struct SubTile {
  Vec<IType, kSub> row[kSub];
  __device__ __forceinline__ float at(int i, int j) const { return to_float(row[i].v[j]); }
};

/* Where the tile is and whether whole 8-element row chunks may move as vectors. */
struct TileGeometry {
  size_t M, K;    // the matrix
  size_t tiles_k; // tiles along K
  bool vec_in;    // input row chunks are 16-byte aligned (K * sizeof(IType) % 16 == 0)
  bool vec_out;   // [M, K] FP8 outputs take 8-byte row chunks (K % 8 == 0, aligned bases)
};

struct TilePos {
  size_t r0, c0, tr, tc;
  int cc, rg;
};

/* Where tile `tile` (row-major over the tiles) is, and the thread's place in it. */
__device__ __forceinline__ TilePos tile_position(const TileGeometry& g, size_t tile) {
  TilePos p;
  p.tr = tile / g.tiles_k;
  p.tc = tile % g.tiles_k;
  p.r0 = p.tr * kTile;
  p.c0 = p.tc * kTile;
  p.cc = threadIdx.x % kGroups;
  p.rg = threadIdx.x / kGroups;
  return p;
}

template <typename IType>
__device__ __forceinline__ void load_sub_tile(const IType* __restrict__ in, const TileGeometry& g,
                                              const TilePos& p, SubTile<IType>& x) {
  const size_t c = p.c0 + p.cc * kSub;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const size_t r = p.r0 + p.rg * kSub + i;
    if (r < g.M && g.vec_in && c + kSub <= g.K) {
      x.row[i] = load_readonly<IType, kSub>(in + r * g.K + c);
    } else {
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        x.row[i].v[j] = (r < g.M && c + j < g.K) ? in[r * g.K + c + j] : from_float<IType>(0.0f);
      }
    }
  }
}

/* Byte j of a row of 8 cast values packed as 4 pairs. */
__device__ __forceinline__ uint8_t byte_of(const Vec<uint16_t, kSub / 2>& q, int j) {
  return static_cast<uint8_t>((q.v[j / 2] >> ((j % 2) * 8)) & 0xFFu);
}

/* Stores the 8 bytes of row i of the thread's sub-tile into an [M, K] FP8 output. */
__device__ __forceinline__ void store_row(uint8_t* __restrict__ out, const TileGeometry& g,
                                          const TilePos& p, int i,
                                          const Vec<uint16_t, kSub / 2>& q) {
  const size_t r = p.r0 + p.rg * kSub + i;
  const size_t c = p.c0 + p.cc * kSub;
  if (r >= g.M) return;
  if (g.vec_out && c + kSub <= g.K) {
    *reinterpret_cast<Vec<uint16_t, kSub / 2>*>(out + r * g.K + c) = q;
  } else {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if (c + j < g.K) out[r * g.K + c + j] = byte_of(q, j);
    }
  }
}

/* Max over the 16 lanes of a half-warp (one tile row); every lane gets the result. */
__device__ __forceinline__ float half_warp_max(float value) {
#pragma unroll
  for (int offset = kGroups / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

/* ---- the sub-tile's absolute maxima ------------------------------------------------------
 * 16-bit inputs keep two elements in each 32-bit register, and the maxima are taken on those
 * pairs as they are (PTX max.bf16x2 / max.f16x2, sm_80+): one instruction serves two elements,
 * the sign bits cleared once serve the row and the column maxima alike, and nothing is converted
 * to float32 before the maxima are known (the maximum of 16-bit values is exact in either type).
 * Float32 inputs take the scalar amax_step. */

/* Elementwise maximum of two packed pairs, NaN-propagating (.NaN): a sub-tile holding a NaN ends
 * with a NaN maximum, which is how sub_tile_maxima notices it. */
template <typename IType>
__device__ __forceinline__ uint32_t max_nan_x2(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t max_nan_x2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <>
__device__ __forceinline__ uint32_t max_nan_x2<__half>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

/* The low (element 2k) and high (element 2k + 1) halves of a packed pair, as float32. */
template <typename IType>
__device__ __forceinline__ float low_as_float(uint32_t pair) {
  if constexpr (std::is_same_v<IType, __nv_bfloat16>) {
    return __uint_as_float(pair << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(pair & 0xFFFFu)));
  }
}
template <typename IType>
__device__ __forceinline__ float high_as_float(uint32_t pair) {
  if constexpr (std::is_same_v<IType, __nv_bfloat16>) {
    return __uint_as_float(pair & 0xFFFF0000u);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(pair >> 16)));
  }
}

/* Magnitude bits (sign cleared) from which a 16-bit value is Inf or NaN. */
template <typename IType>
constexpr uint32_t non_finite_bits() {
  return std::is_same_v<IType, __nv_bfloat16> ? 0x7F80u : 0x7C00u;
}

/* Pair k (elements 2k, 2k + 1) of row i of a 16-bit sub-tile, as the 32 bits it is held in. */
template <typename IType>
__device__ __forceinline__ uint32_t pair_bits(const SubTile<IType>& x, int i, int k) {
  static_assert(sizeof(IType) == 2, "packed pairs of 16-bit values");
  return reinterpret_cast<const uint32_t*>(&x.row[i])[k];
}

/* The absolute maxima of a thread's sub-tile: of each row (kRows) and of each column (kCols),
 * NaN ignored (amax_step's rule); and whether the sub-tile holds Inf or NaN. Only such an
 * element's cast can produce a NaN (a product of finite values by a finite scale is finite or
 * saturates; an infinite amax gives the scale 0, and Inf * 0 is NaN), so a sub-tile without one
 * casts with Fp8Format::cast_pair_not_nan. Float32 inputs report non_finite always (they keep
 * the NaN-patching cast). */
struct SubTileMaxima {
  float row[kSub];
  float col[kSub];
  bool non_finite;
};

template <typename IType, bool kRows, bool kCols>
__device__ __forceinline__ SubTileMaxima sub_tile_maxima(const SubTile<IType>& x) {
  SubTileMaxima m;
  if constexpr (sizeof(IType) == 2) {
    uint32_t col[kSub / 2];
    uint32_t all = 0;  // the maximum over the sub-tile, per half
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      uint32_t a[kSub / 2];
#pragma unroll
      for (int k = 0; k < kSub / 2; ++k) {
        a[k] = pair_bits(x, i, k) & 0x7FFF7FFFu;
        if constexpr (kCols) col[k] = i == 0 ? a[k] : max_nan_x2<IType>(col[k], a[k]);
      }
      if constexpr (kRows) {
        const uint32_t r =
            max_nan_x2<IType>(max_nan_x2<IType>(a[0], a[1]), max_nan_x2<IType>(a[2], a[3]));
        m.row[i] = fmaxf(low_as_float<IType>(r), high_as_float<IType>(r));
        all = i == 0 ? r : max_nan_x2<IType>(all, r);
      }
    }
    if constexpr (kCols) {
#pragma unroll
      for (int k = 0; k < kSub / 2; ++k) {
        m.col[2 * k] = low_as_float<IType>(col[k]);
        m.col[2 * k + 1] = high_as_float<IType>(col[k]);
        if constexpr (!kRows) all = k == 0 ? col[k] : max_nan_x2<IType>(all, col[k]);
      }
    }
    // The canonical NaN the .NaN maximum returns has magnitude bits above Inf's.
    m.non_finite = max(all >> 16, all & 0xFFFFu) >= non_finite_bits<IType>();
    if (!m.non_finite) return m;
    // Rare: a NaN maximum above must become the maximum of the other values. Scalar, as below.
  } else {
    m.non_finite = true;
  }
#pragma unroll
  for (int k = 0; k < kSub; ++k) {
    m.row[k] = 0.0f;
    m.col[k] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if constexpr (kRows) m.row[i] = amax_step(m.row[i], x.at(i, j));
      if constexpr (kCols) m.col[j] = amax_step(m.col[j], x.at(i, j));
    }
  }
  return m;
}

/* Calls `cast(std::true_type{})` (the NaN-patching conversion) where the sub-tile holds Inf or
 * NaN, else `cast(std::false_type{})`: the casts take the answer as a compile-time flag. */
template <typename Cast>
__device__ __forceinline__ void cast_by_finiteness(const SubTileMaxima& m, Cast&& cast) {
  if (m.non_finite) {
    cast(std::true_type{});
  } else {
    cast(std::false_type{});
  }
}

/* ---- host side ---------------------------------------------------------------------------- */

/* Throws unless `buffer` is a 2-D tensor of exactly `rows x cols` with one of `dtypes`. */
inline void check_scale_buffer(const char* op, const char* name, const NVTEBuffer& buffer,
                               std::initializer_list<NVTEDType> dtypes, size_t rows,
                               size_t cols) {
  check_well_formed(op, name, buffer);
  check_dtype(op, name, buffer, dtypes);
  if (buffer.ndim != 2 || buffer.shape[0] != rows || buffer.shape[1] != cols) {
    std::string got;
    for (size_t d = 0; d < buffer.ndim; ++d) {
      got += (d == 0 ? "" : ", ") + std::to_string(buffer.shape[d]);
    }
    throw_invalid(op, name, " has shape (", got, ") but this cast needs (", rows, ", ", cols,
                  ")");
  }
}

/* Throws unless `data` is an FP8 tensor with `numel` elements. */
inline void check_fp8_data(const char* op, const char* name, const NVTEBuffer& data,
                           size_t numel_expected) {
  check_well_formed(op, name, data);
  check_dtype(op, name, data, {kNVTEFloat8E4M3, kNVTEFloat8E5M2});
  if (numel(data) != numel_expected) {
    throw_invalid(op, name, " has ", numel(data), " elements but the input has ",
                  numel_expected);
  }
}

/* The geometry of a launch over `input` (M * K > 0) with FP8 outputs `outs` ([M, K] layout). */
inline TileGeometry make_geometry(const NVTEBuffer& input, size_t M, size_t K,
                                  std::initializer_list<const NVTEBuffer*> outs) {
  TileGeometry g{};
  g.M = M;
  g.K = K;
  g.tiles_k = ceil_div(K, kTile);
  g.vec_in = aligned_to(input.data, 16) && (K * element_size(input.dtype)) % 16 == 0;
  g.vec_out = K % kSub == 0;
  for (const NVTEBuffer* out : outs) {
    if (out != nullptr && !aligned_to(out->data, kSub)) g.vec_out = false;
  }
  return g;
}

/* Number of tiles of an [M, K] launch, checked against the grid limit. */
inline unsigned int tile_count(const char* op, size_t M, size_t K) {
  const size_t tiles = ceil_div(M, kTile) * ceil_div(K, kTile);
  if (tiles > 0x7FFFFFFFull) {
    throw_invalid(op, "the input [", M, ", ", K, "] needs ", tiles,
                  " 128x128 tiles, more than one launch can hold (2^31 - 1)");
  }
  return static_cast<unsigned int>(tiles);
}

/* The buffers of one block-scaled cast call (the C ABI's arguments): the input, the row-wise and
 * column-wise copies with their scales (a copy is requested when its data is non-null), and the
 * optional no-op flag. */
struct CastBuffers {
  const NVTEBuffer* input;
  NVTEBuffer* row_data;
  NVTEBuffer* row_scale;
  NVTEBuffer* col_data;
  NVTEBuffer* col_scale;
  const NVTEBuffer* noop;

  /* The FP8 format of the copies (one is requested). */
  NVTEDType fp8_dtype() const { return row_data != nullptr ? row_data->dtype : col_data->dtype; }
  /* The device pointers of the requested copies and their scales; null for a copy not requested. */
  uint8_t* row_bytes() const {
    return row_data == nullptr ? nullptr : static_cast<uint8_t*>(row_data->data);
  }
  template <typename ScaleT>
  ScaleT* row_scales() const {
    return row_data == nullptr ? nullptr : static_cast<ScaleT*>(row_scale->data);
  }
  uint8_t* col_bytes() const {
    return col_data == nullptr ? nullptr : static_cast<uint8_t*>(col_data->data);
  }
  template <typename ScaleT>
  ScaleT* col_scales() const {
    return col_data == nullptr ? nullptr : static_cast<ScaleT*>(col_scale->data);
  }
  const float* noop_flag() const {
    return noop == nullptr ? nullptr : static_cast<const float*>(noop->data);
  }
};

/* The shape the scales of one copy must have. */
struct ScaleShape {
  size_t rows, cols;
};

/* Throws unless the requested copies fit the input of `n` elements and last extent `K`: at least
 * one copy, FP8 data of the input's size, scales of `scale_dtypes` and exactly the given shapes,
 * one FP8 format for both; with `col_transposed`, the column-wise copy's first extent is K (it
 * holds the transposed matrix). Then checks the no-op flag, if any. */
inline void check_cast_buffers(const char* op, const CastBuffers& b, size_t K, size_t n,
                               std::initializer_list<NVTEDType> scale_dtypes, ScaleShape row,
                               ScaleShape col, bool col_transposed) {
  if (b.row_data == nullptr && b.col_data == nullptr) {
    throw_invalid(op, "rowwise_data and columnwise_data are both null; request at least one copy");
  }
  if (b.row_data != nullptr) {
    check_fp8_data(op, "rowwise_data", *b.row_data, n);
    check_scale_buffer(op, "rowwise_scale_inv", require(op, "rowwise_scale_inv", b.row_scale),
                       scale_dtypes, row.rows, row.cols);
  }
  if (b.col_data != nullptr) {
    check_fp8_data(op, "columnwise_data", *b.col_data, n);
    if (col_transposed && b.col_data->ndim > 0 && b.col_data->shape[0] != K) {
      throw_invalid(op, "columnwise_data must have the input's last extent (", K,
                    ") as its first extent (it holds the transposed matrix)");
    }
    check_scale_buffer(op, "columnwise_scale_inv",
                       require(op, "columnwise_scale_inv", b.col_scale), scale_dtypes, col.rows,
                       col.cols);
    if (b.row_data != nullptr && b.row_data->dtype != b.col_data->dtype) {
      throw_invalid(op, "rowwise_data is ", dtype_name(b.row_data->dtype),
                    " but columnwise_data is ", dtype_name(b.col_data->dtype),
                    "; both copies use one FP8 format");
    }
  }
  if (b.noop != nullptr) check_fp32_scalar(op, "noop", *b.noop);
}

/* Throws unless every buffer of the call is on its device (the checks capture skips). */
inline void check_cast_on_device(const CallContext& ctx, const CastBuffers& b) {
  ctx.check_on_device("input", *b.input);
  if (b.row_data != nullptr) {
    ctx.check_on_device("rowwise_data", *b.row_data);
    ctx.check_on_device("rowwise_scale_inv", *b.row_scale);
  }
  if (b.col_data != nullptr) {
    ctx.check_on_device("columnwise_data", *b.col_data);
    ctx.check_on_device("columnwise_scale_inv", *b.col_scale);
  }
  if (b.noop != nullptr) ctx.check_on_device("noop", *b.noop);
}

/* Calls `launch(IType{}, is_e4m3, is_two_d)` with the input's type and std::true_type or
 * std::false_type for the FP8 format and the block shape, for one kernel instantiation. */
template <typename Launch>
void dispatch_block_cast(const char* op, NVTEDType input_dtype, NVTEDType fp8, bool two_d,
                         Launch&& launch) {
  dispatch_high_precision(op, input_dtype, [&](auto itype) {
    dispatch_fp8(op, fp8, [&](auto is_e4m3) {
      if (two_d) {
        launch(itype, is_e4m3, std::true_type{});
      } else {
        launch(itype, is_e4m3, std::false_type{});
      }
    });
  });
}

}  // namespace block_cast_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_BLOCK_TILE_CUH_
