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

/* Where the tiled kernel's values come from: position (r, c) of a [rows, cols] grid gives
 * kParts float32 values, the elements at columns c, cols + c, ... of a [rows, kParts * cols]
 * result (kParts = 2: a gated activation's backward, whose two input halves' gradients come
 * from one read of its operands). PlainLoad reads a high-precision tensor; the activation
 * kernels pass loaders that compute an activation (or its gradient) on the fly, so the cast,
 * transposed copy, amax and bias-gradient sums below serve them unchanged.
 *
 * `fetch(r, c)` issues the loads of kVecElems consecutive positions c.. of row r as a `Raw`
 * (only when `vectorizable()` held on the host, cols % kVecElems == 0 and c + kVecElems <=
 * cols); `compute(raw, v)` turns them into v[part][j]. Splitting the two lets a kernel put
 * several vectors' loads in flight before it uses the first. `load(r, c, v)` computes one
 * position element-wise (edges and unaligned buffers). */
template <typename IType>
struct PlainLoad {
  static constexpr int kParts = 1;
  struct Raw {
    Vec<IType, kVecElems> x;
  };
  const IType* in;
  size_t cols;

  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ Raw fetch(size_t r, size_t c) const {
    return Raw{load_readonly<IType, kVecElems>(in + r * cols + c)};
  }
  __device__ __forceinline__ void compute(const Raw& raw, float (&v)[1][kVecElems]) const {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) v[0][j] = to_float(raw.x.v[j]);
  }
  __device__ __forceinline__ void load(size_t r, size_t c, float (&v)[1]) const {
    v[0] = to_float(in[r * cols + c]);
  }
};

/* How the tiled kernel walks its [rows, cols] positions: 64x64 tiles, grouped into units of
 * one tile column and `tiles_per_chunk` consecutive tile rows (a chunk). Block b takes units
 * b, b + gridDim.x, ... and walks each unit's tiles top to bottom; with kDbias it sums its
 * columns over the whole unit in registers and writes one float32 partial sum per (chunk,
 * result column): column_sums[chunk * kParts * cols + column]. */
struct TileGrid {
  size_t rows, cols;
  size_t tiles_r, tiles_c;
  size_t tiles_per_chunk, chunks;
  __host__ __device__ size_t units() const { return chunks * tiles_c; }
};

/* One tile of a unit: its first row tile `tr`, the unit's end `tr_end`, and its column. */
struct TilePos {
  size_t unit, tr, tr_end, c0;
};

__device__ __forceinline__ bool start_unit(const TileGrid& g, size_t unit, TilePos& p) {
  if (unit >= g.units()) return false;
  const size_t chunk = unit / g.tiles_c;
  p.unit = unit;
  p.c0 = (unit - chunk * g.tiles_c) * kTile;
  p.tr = chunk * g.tiles_per_chunk;
  p.tr_end = p.tr + g.tiles_per_chunk < g.tiles_r ? p.tr + g.tiles_per_chunk : g.tiles_r;
  return true;
}

/* Resident blocks per SM the tiled kernel is compiled for: 3 (at most 80 registers a thread),
 * 2 for two-part loaders (a gated backward: 128 registers, and 3 x 2 vectors in flight per
 * thread); the grid is sm_count times that (or the number of units, if fewer). */
template <class Loader>
constexpr int kTileBlocksPerSm = Loader::kParts == 1 ? 3 : 2;
constexpr int kLoadPasses = kTile / kLoadRowsPerPass;

/* The element-wise load of up to kVecElems positions (r, c..) of a tile row: an edge tile or an
 * unaligned buffer. Out of line, so that it takes no registers from the vector path; returns
 * the updated amax. */
template <class Loader, bool kE4M3, bool kDbias>
__device__ __noinline__ float cast_positions(const Loader& loader, uint8_t* __restrict__ out,
                                             uint8_t (*tile)[kTile][kTile + kTilePad], int lr,
                                             int lc, size_t r, size_t c, size_t cols, float scale,
                                             float local_amax, float* my_sums) {
  constexpr int kParts = Loader::kParts;
  for (int j = 0; j < kVecElems && c + j < cols; ++j) {
    float a[kParts];
    loader.load(r, c + j, a);
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      local_amax = amax_step(local_amax, a[p]);
      const uint8_t q = Fp8Format<kE4M3>::cast(a[p] * scale);
      out[r * kParts * cols + p * cols + c + j] = q;
      tile[p][lr][lc + j] = q;
      if constexpr (kDbias) my_sums[p * kTile + j] += a[p];
    }
  }
  return local_amax;
}

/* Load (per tile, per thread): 2 passes of kVecElems consecutive positions of a row, cast to
 * FP8 and written to the row-wise output and to shared memory. The next tile's loads are issued
 * as soon as the current ones are consumed, so they are in flight while the block writes the
 * transposed copy. Store: each thread gathers 16 consecutive rows of one column from shared
 * memory and writes them as one 16-byte vector of the transposed output; the 4 threads of a
 * column are adjacent lanes, so a warp writes whole 32-byte sectors. Edge tiles and unaligned
 * buffers fall back to element-wise, bounds-checked accesses. The amax is reduced once per
 * block, at its end. */
template <class Loader, bool kE4M3, bool kDbias>
__global__ void __launch_bounds__(kThreads, kTileBlocksPerSm<Loader>)
    cast_transpose_kernel(const Loader loader, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, TileGrid grid, bool vector_rows,
                          bool vector_cols, CastArgs args, float* __restrict__ column_sums) {
  constexpr int kParts = Loader::kParts;
  using Raw = typename Loader::Raw;
  if (skip_requested(args.noop)) return;
  __shared__ alignas(16) uint8_t tile[kParts][kTile][kTile + kTilePad];
  __shared__ float sums[kDbias ? kLoadRowsPerPass : 1][kDbias ? kParts * kTile : 1];
  const float scale = load_scale(args);
  const size_t rows = grid.rows, cols = grid.cols, out_cols = kParts * cols;
  const int t = threadIdx.x;
  const int lc = (t % (kTile / kVecElems)) * kVecElems;  // load: first column in the tile
  const int lr_first = t / (kTile / kVecElems);          // load: row in the tile, pass 0
  const int tc = t / kChunksPerColumn;                    // store: column in the tile
  const int lr0 = (t % kChunksPerColumn) * kRowsPerThreadT;  // store: first row in the tile
  float local_amax = 0.0f;
  // kDbias: this thread's running column sums over the unit, in its own slots of `sums`.
  float* my_sums = kDbias ? &sums[lr_first][lc] : nullptr;

  auto vector_at = [&](size_t r, size_t c) {
    return vector_rows && r < rows && c + kVecElems <= cols;
  };
  Raw raw[kLoadPasses];
  auto fetch_tile = [&](const TilePos& p) {
#pragma unroll
    for (int pass = 0; pass < kLoadPasses; ++pass) {
      const size_t r = p.tr * kTile + pass * kLoadRowsPerPass + lr_first;
      if (vector_at(r, p.c0 + lc)) raw[pass] = loader.fetch(r, p.c0 + lc);
    }
  };

  // Prefetching the next tile while this one is stored: single-part loaders only (a gated
  // backward already has 3 x 2 vectors in flight per thread and no registers to spare).
  constexpr bool kPrefetch = kParts == 1;
  TilePos pos;
  bool have = start_unit(grid, blockIdx.x, pos);
  bool unit_start = true;
  if (kPrefetch && have) fetch_tile(pos);
  while (have) {
    const size_t r0 = pos.tr * kTile, c0 = pos.c0;
    if (!kPrefetch) fetch_tile(pos);
    if constexpr (kDbias) {
      if (unit_start) {
#pragma unroll
        for (int p = 0; p < kParts; ++p) {
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) my_sums[p * kTile + j] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int pass = 0; pass < kLoadPasses; ++pass) {
      const int lr = pass * kLoadRowsPerPass + lr_first;
      const size_t r = r0 + lr, c = c0 + lc;
      if (vector_at(r, c)) {
        float x[kParts][kVecElems];
        loader.compute(raw[pass], x);
#pragma unroll
        for (int p = 0; p < kParts; ++p) {
          Vec<uint16_t, kVecElems / 2> q;
          cast_floats<kE4M3>(x[p], scale, local_amax, q);
          *reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(out + r * out_cols + p * cols + c) = q;
          auto* tile_words = reinterpret_cast<uint32_t*>(&tile[p][lr][lc]);
          tile_words[0] = static_cast<uint32_t>(q.v[0]) | (static_cast<uint32_t>(q.v[1]) << 16);
          tile_words[1] = static_cast<uint32_t>(q.v[2]) | (static_cast<uint32_t>(q.v[3]) << 16);
          if constexpr (kDbias) {
#pragma unroll
            for (int j = 0; j < kVecElems; ++j) my_sums[p * kTile + j] += x[p][j];
          }
        }
      } else if (r < rows) {
        local_amax = cast_positions<Loader, kE4M3, kDbias>(loader, out, tile, lr, lc, r, c, cols,
                                                           scale, local_amax, my_sums);
      }
    }

    // The next tile: the unit's next row tile, else the first tile of the block's next unit.
    TilePos next = pos;
    const bool unit_done = ++next.tr >= next.tr_end;
    const bool have_next = unit_done ? start_unit(grid, pos.unit + gridDim.x, next) : true;
    if (kPrefetch && have_next) fetch_tile(next);
    __syncthreads();

    if constexpr (kDbias) {
      // Thread t < kParts * 64 adds up one result column of the unit: its 32 row-group
      // partials, in order. The owners zero their slots again only after the next barrier.
      const int p = t / kTile, lcol = t % kTile;
      if (unit_done && t < kParts * kTile && c0 + lcol < cols) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < kLoadRowsPerPass; ++g) total += sums[g][t];
        const size_t chunk = pos.unit / grid.tiles_c;
        column_sums[chunk * out_cols + p * cols + c0 + lcol] = total;
      }
    }
    const size_t c = c0 + tc;
    const size_t rbase = r0 + lr0;
    if (c < cols) {
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        uint8_t* dst = out_t + (p * cols + c) * rows;
        if (vector_cols && rbase + kRowsPerThreadT <= rows) {
          Vec<uint8_t, kRowsPerThreadT> v;
#pragma unroll
          for (int i = 0; i < kRowsPerThreadT; ++i) v.v[i] = tile[p][lr0 + i][tc];
          *reinterpret_cast<Vec<uint8_t, kRowsPerThreadT>*>(dst + rbase) = v;
        } else {
          for (int i = 0; i < kRowsPerThreadT && rbase + i < rows; ++i) {
            dst[rbase + i] = tile[p][lr0 + i][tc];
          }
        }
      }
    }
    __syncthreads();  // the tile (and sums) are rewritten by the next iteration
    pos = next;
    have = have_next;
    unit_start = unit_done;
  }
  if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
}

static_assert(kTile * kTile == kThreads * kVecElems * kLoadPasses, "load passes cover the tile");
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

/* The tiled kernel's walk over [rows, cols] positions (rows, cols > 0) with `blocks` resident
 * blocks. Without kDbias every unit is one tile. With it, a unit is a chunk of tile rows sized
 * for about 16 units per block (the blocks finish within a few percent of each other) and at
 * most tile_rows(rows) chunks, so the partial sums fit nvte_quantize_dbias's workspace. */
inline TileGrid make_tile_grid(size_t rows, size_t cols, size_t blocks, bool dbias) {
  TileGrid g{rows, cols, tile_rows(rows), (cols + kTile - 1) / kTile, 1, 0};
  if (dbias) {
    const size_t wanted_chunks = (16 * blocks + g.tiles_c - 1) / g.tiles_c;
    const size_t chunks = wanted_chunks < g.tiles_r ? wanted_chunks : g.tiles_r;
    g.tiles_per_chunk = (g.tiles_r + chunks - 1) / chunks;
  }
  g.chunks = (g.tiles_r + g.tiles_per_chunk - 1) / g.tiles_per_chunk;
  return g;
}

/* Launches cast_transpose_kernel over the [rows, cols] positions of `loader` (rows * cols > 0;
 * the results are [rows, kParts * cols], the transposed copy [kParts * cols, rows]). Returns
 * the number of partial-sum rows written to column_sums (kDbias), for
 * launch_dbias_from_column_sums. */
template <class Loader, bool kE4M3, bool kDbias>
size_t launch_cast_transpose_from(const Loader& loader, uint8_t* out, uint8_t* out_t,
                                  size_t rows, size_t cols, const CastArgs& args,
                                  float* column_sums, CallContext& ctx) {
  const size_t max_blocks = static_cast<size_t>(ctx.sm_count()) * kTileBlocksPerSm<Loader>;
  const TileGrid grid = make_tile_grid(rows, cols, max_blocks, kDbias);
  const size_t blocks = grid.units() < max_blocks ? grid.units() : max_blocks;
  const bool vector_rows =
      cols % kVecElems == 0 && loader.vectorizable() && aligned_to(out, kVecElems);
  const bool vector_cols = rows % kRowsPerThreadT == 0 && aligned_to(out_t, kRowsPerThreadT);
  cast_transpose_kernel<Loader, kE4M3, kDbias><<<blocks, kThreads, 0, ctx.stream()>>>(
      loader, out, out_t, grid, vector_rows, vector_cols, args, column_sums);
  ctx.check_launch("cast_transpose_kernel launch");
  return grid.chunks;
}

/* The same over a plain high-precision [rows, cols] input. */
template <typename IType, bool kE4M3, bool kDbias>
size_t launch_cast_transpose(const IType* in, uint8_t* out, uint8_t* out_t, size_t rows,
                             size_t cols, const CastArgs& args, float* column_sums,
                             CallContext& ctx) {
  return launch_cast_transpose_from<PlainLoad<IType>, kE4M3, kDbias>(
      PlainLoad<IType>{in, cols}, out, out_t, rows, cols, args, column_sums, ctx);
}

}  // namespace cast_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_CUH_
