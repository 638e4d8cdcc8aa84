/* The cast pieces nvte_quantize and nvte_quantize_dbias share: the per-kernel scale handling, the
 * 8-element vector cast, and the 64x64-tiled cast+transpose kernel, which can also produce the
 * per-tile column sums of its input (the first step of a bias gradient). */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_CUH_
#define TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "transformer_engine/transformer_engine.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace cast_detail {

constexpr int kThreads = 256;
constexpr int kVecElems = 8;  // 16 bytes of bf16/fp16 in, 8 bytes of FP8 out
constexpr int kTile = 64;
constexpr int kTilePad = 4;  // 68-byte rows: 4-byte aligned, few bank conflicts
constexpr int kRowsPerThreadT = 16;
constexpr int kChunksPerColumn = kTile / kRowsPerThreadT;       // 16-byte chunks per output row
constexpr int kLoadRowsPerPass = kThreads * kVecElems / kTile;  // 32 rows of a tile per pass

struct CastArgs {
  const float* scale;
  float* amax;
  float* scale_inv;
  const float* noop;
};

/* Scale once per kernel; block 0 publishes 1/scale (IEEE division). */
__device__ __forceinline__ float load_scale(const CastArgs& args) {
  const float scale = *args.scale;
  if (args.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *args.scale_inv = 1.0f / scale;
  }
  return scale;
}

template <typename IType, bool kE4M3>
__device__ __forceinline__ void cast_vector(const Vec<IType, kVecElems>& x, float scale,
                                            float& local_amax, Vec<uint16_t, kVecElems / 2>& q) {
#pragma unroll
  for (int j = 0; j < kVecElems / 2; ++j) {
    const float a = to_float(x.v[2 * j]);
    const float b = to_float(x.v[2 * j + 1]);
    local_amax = amax_step(amax_step(local_amax, a), b);
    q.v[j] = Fp8Format<kE4M3>::cast_pair(a * scale, b * scale);
  }
}

/* Eight float32 values cast at once; the amax sees them unscaled. */
template <bool kE4M3>
__device__ __forceinline__ void cast_floats(const float (&v)[kVecElems], float scale,
                                            float& local_amax, Vec<uint16_t, kVecElems / 2>& q) {
#pragma unroll
  for (int j = 0; j < kVecElems / 2; ++j) {
    local_amax = amax_step(amax_step(local_amax, v[2 * j]), v[2 * j + 1]);
    q.v[j] = Fp8Format<kE4M3>::cast_pair(v[2 * j] * scale, v[2 * j + 1] * scale);
  }
}

/* One row vector's share of every tiled cast+transpose kernel: cast the eight values, write
 * them row-wise at `row_out`, stage them as two 32-bit words of the shared tile at `tile_words`
 * (for the transposed store) and add them to the thread's column sums. */
template <bool kE4M3, bool kDbias>
__device__ __forceinline__ void cast_store_vector(const float (&x)[kVecElems], float scale,
                                                  float& local_amax, uint8_t* row_out,
                                                  uint32_t* tile_words,
                                                  float (&colsum)[kVecElems]) {
  Vec<uint16_t, kVecElems / 2> q;
  cast_floats<kE4M3>(x, scale, local_amax, q);
  *reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(row_out) = q;
  tile_words[0] = static_cast<uint32_t>(q.v[0]) | (static_cast<uint32_t>(q.v[1]) << 16);
  tile_words[1] = static_cast<uint32_t>(q.v[2]) | (static_cast<uint32_t>(q.v[3]) << 16);
  if constexpr (kDbias) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) colsum[j] += x[j];
  }
}

/* Where the tiled kernel's values come from: element (r, c) of a [rows, cols] matrix, as
 * float32. PlainLoad reads a high-precision tensor; the activation kernels pass loaders that
 * compute an activation (or its gradient) of their inputs on the fly, so the cast, transposed
 * copy, amax and bias-gradient sums below serve them unchanged. A loader's `load_vec(r, c, v)`
 * reads kVecElems consecutive columns starting at c (only called when its `vectorizable()` was
 * true on the host and c + kVecElems <= cols); `load(r, c)` reads one. `tile_fetch(r, c)` and
 * `tile_compute(raw, c, v)` are load_vec split into its loads and its arithmetic (same values),
 * so that the variant kernels (cast_transpose_variants.cuh) can keep loads in flight. */
template <typename IType>
struct PlainLoad {
  const IType* in;
  size_t cols;

  bool vectorizable() const { return aligned_to(in, sizeof(IType) * kVecElems); }
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&v)[kVecElems]) const {
    tile_compute(tile_fetch(r, c), c, v);
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    return to_float(in[r * cols + c]);
  }

  // load_vec in two halves (the variant kernels issue several vectors' loads before converting).
  using TileRaw = Vec<IType, kVecElems>;
  __device__ __forceinline__ TileRaw tile_fetch(size_t r, size_t c) const {
    return load_readonly<IType, kVecElems>(in + r * cols + c);
  }
  __device__ __forceinline__ void tile_compute(const TileRaw& x, size_t,
                                               float (&v)[kVecElems]) const {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) v[j] = to_float(x.v[j]);
  }
};

/* One block per 64x64 tile. Load: each thread casts 2 x 8 consecutive elements of a row and
 * writes them to the row-wise output and to shared memory. Store: each thread gathers 16
 * consecutive rows of one column from shared memory and writes them as one 16-byte vector of
 * the transposed output; the 4 threads of a column are adjacent lanes, so a warp writes whole
 * 32-byte sectors. Edge tiles fall back to element-wise, bounds-checked accesses.
 *
 * kDbias: the tile's column sums of the unscaled values (float32, rows in a fixed order) go to
 * column_sums[tile_row * cols + column]; a second kernel adds the tile rows up. */
template <class Loader, bool kE4M3, bool kDbias>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const Loader loader, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, size_t rows, size_t cols, size_t tiles_c,
                          bool vector_rows, bool vector_cols, CastArgs args,
                          float* __restrict__ column_sums) {
  if (skip_requested(args.noop)) return;
  __shared__ alignas(4) uint8_t tile[kTile][kTile + kTilePad];
  __shared__ float sums[kDbias ? kLoadRowsPerPass : 1][kDbias ? kTile : 1];
  const float scale = load_scale(args);
  const size_t r0 = (blockIdx.x / tiles_c) * kTile;
  const size_t c0 = (blockIdx.x % tiles_c) * kTile;
  const int t = threadIdx.x;
  float local_amax = 0.0f;
  float colsum[kVecElems] = {};

  const int lc = (t % (kTile / kVecElems)) * kVecElems;
#pragma unroll
  for (int pass = 0; pass < kTile * kTile / (kThreads * kVecElems); ++pass) {
    const int lr = pass * kLoadRowsPerPass + t / (kTile / kVecElems);
    const size_t r = r0 + lr;
    const size_t c = c0 + lc;
    if (r >= rows) continue;
    if (vector_rows && c + kVecElems <= cols) {
      float x[kVecElems];
      loader.load_vec(r, c, x);
      cast_store_vector<kE4M3, kDbias>(x, scale, local_amax, out + r * cols + c,
                                       reinterpret_cast<uint32_t*>(&tile[lr][lc]), colsum);
    } else {
      for (int j = 0; j < kVecElems && c + j < cols; ++j) {
        const float a = loader.load(r, c + j);
        local_amax = amax_step(local_amax, a);
        const uint8_t q = Fp8Format<kE4M3>::cast(a * scale);
        out[r * cols + c + j] = q;
        tile[lr][lc + j] = q;
        if constexpr (kDbias) colsum[j] += a;
      }
    }
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sums[t / (kTile / kVecElems)][lc + j] = colsum[j];
  }
  __syncthreads();

  if constexpr (kDbias) {
    // Thread t < 64 adds up column t of the tile: its 32 row-group partials, in order.
    if (t < kTile && c0 + t < cols) {
      float total = 0.0f;
#pragma unroll
      for (int g = 0; g < kLoadRowsPerPass; ++g) total += sums[g][t];
      column_sums[(r0 / kTile) * cols + c0 + t] = total;
    }
  }

  const int tc = t / kChunksPerColumn;
  const int lr0 = (t % kChunksPerColumn) * kRowsPerThreadT;
  const size_t c = c0 + tc;
  const size_t rbase = r0 + lr0;
  if (c < cols) {
    if (vector_cols && rbase + kRowsPerThreadT <= rows) {
      Vec<uint8_t, kRowsPerThreadT> v;
#pragma unroll
      for (int i = 0; i < kRowsPerThreadT; ++i) v.v[i] = tile[lr0 + i][tc];
      *reinterpret_cast<Vec<uint8_t, kRowsPerThreadT>*>(out_t + c * rows + rbase) = v;
    } else {
      for (int i = 0; i < kRowsPerThreadT && rbase + i < rows; ++i) {
        out_t[c * rows + rbase + i] = tile[lr0 + i][tc];
      }
    }
  }
  if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
}

static_assert(kTile * kTile == kThreads * kVecElems * 2, "load phase assumes two passes");
static_assert(kTile * kTile == kThreads * kRowsPerThreadT, "store phase covers the tile once");

inline size_t tile_rows(size_t rows) { return (rows + kTile - 1) / kTile; }

inline float* optional_data(NVTEBuffer* buffer) {
  return buffer == nullptr ? nullptr : static_cast<float*>(buffer->data);
}

struct QuantizeShape {
  size_t n, rows, cols;  // the input viewed as [rows, cols], cols its last extent
};

/* nvte_quantize's argument checks (dtypes, shapes, the transposed copy's layout); throws. */
QuantizeShape check_quantize_args(const char* op, const NVTEBuffer* input, const NVTEBuffer* scale,
                                  NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                                  NVTEBuffer* scale_inv, const NVTEBuffer* noop);

/* Every buffer on ctx's device (throws otherwise), then the kernels' pointer bundle. */
CastArgs checked_cast_args(CallContext& ctx, const NVTEBuffer* input, const NVTEBuffer* scale,
                           NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                           NVTEBuffer* scale_inv, const NVTEBuffer* noop);

/* cast_transpose_variants.cuh (included at the end): launches the tall-tile kernel where it
 * replaces the base one, or returns false for the base kernel. */
template <class Loader, bool kE4M3, bool kDbias>
bool launch_cast_transpose_variant(const Loader& loader, uint8_t* out, uint8_t* out_t, size_t rows,
                                   size_t cols, bool vector_rows, bool vector_cols,
                                   const CastArgs& args, float* column_sums, CallContext& ctx);

/* Launches cast_transpose_kernel over the [rows, cols] values of `loader` (rows * cols > 0). */
template <class Loader, bool kE4M3, bool kDbias>
void launch_cast_transpose_from(const Loader& loader, uint8_t* out, uint8_t* out_t, size_t rows,
                                size_t cols, const CastArgs& args, float* column_sums,
                                CallContext& ctx) {
  const size_t tiles_c = (cols + kTile - 1) / kTile;
  const size_t tiles = tiles_c * tile_rows(rows);
  const bool vector_rows =
      cols % kVecElems == 0 && loader.vectorizable() && aligned_to(out, kVecElems);
  const bool vector_cols = rows % kRowsPerThreadT == 0 && aligned_to(out_t, kRowsPerThreadT);
  if (launch_cast_transpose_variant<Loader, kE4M3, kDbias>(
          loader, out, out_t, rows, cols, vector_rows, vector_cols, args, column_sums, ctx)) {
    return;
  }
  cast_transpose_kernel<Loader, kE4M3, kDbias><<<tiles, kThreads, 0, ctx.stream()>>>(
      loader, out, out_t, rows, cols, tiles_c, vector_rows, vector_cols, args, column_sums);
  ctx.check_launch("cast_transpose_kernel launch");
}

/* The same over a plain high-precision [rows, cols] input. */
template <typename IType, bool kE4M3, bool kDbias>
void launch_cast_transpose(const IType* in, uint8_t* out, uint8_t* out_t, size_t rows, size_t cols,
                           const CastArgs& args, float* column_sums, CallContext& ctx) {
  launch_cast_transpose_from<PlainLoad<IType>, kE4M3, kDbias>(PlainLoad<IType>{in, cols}, out,
                                                              out_t, rows, cols, args,
                                                              column_sums, ctx);
}

}  // namespace cast_detail
}  // namespace transformer_engine

#include "cast/cast_transpose_variants.cuh"

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_CUH_
