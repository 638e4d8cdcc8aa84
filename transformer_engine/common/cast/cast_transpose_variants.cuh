/* The tall-tile cast+transpose kernel, which replaces cast_transpose_kernel for every loader of
 * up to 32 bytes a row vector (plain casts, activation forwards, non-gated activation
 * backwards). Measured on an H200 (benchmarks/mlp/benchmark_kernels.py, 8192 x 16384 BF16):
 * cast+transpose 0.69 -> 0.84 of copy bandwidth, GELU forward FP8+T 0.53 -> 0.61, GELU backward
 * FP8+T+dbias 0.57 -> 0.66, SwiGLU forward FP8+T 0.76 -> 0.85; a gated backward (48 bytes a row
 * vector) was slower with it (0.54 -> 0.47) and has a kernel of its own instead
 * (activation/gated_cast_transpose.cuh: 0.52 -> 0.77). A two-tile strip with the next tile's
 * loads in flight through the store phase was slower still and was dropped.
 * NVTE_CAST_TRANSPOSE_VARIANT (read once per process, below) picks the kernels for comparisons
 * (tests/pytorch/kernels/test_cast_transpose_variants_gpu.py checks the bits agree).
 *
 * It computes each value, FP8 byte, amax and per-64-row-tile column sum exactly as the base
 * kernel does: the same loader arithmetic, the same casts, and for the bias gradient the same
 * float32 additions in the same order (each 64-row tile's column sum adds its 32 row-group
 * partials g = 0..31, partial g being row g plus row g + 32, from 0). What changes is the layout:
 *
 * - A block owns a 128 x 64 tile (two 64-row tiles stacked). A thread issues its four 16-byte
 *   row vectors' loads before it converts any (the loaders' tile_fetch / tile_compute halves):
 *   twice the base kernel's loads in flight a thread. Half as many blocks, so half as many
 *   same-address amax atomics, barriers and block start-ups a byte.
 * - Registers are capped by the loader's weight (kMinBlocks) to keep 3-5 blocks an SM.
 * - Interior tiles take a path without bounds checks; edge tiles, and inputs that are not
 *   vectorizable, take the checked element-wise path of the base kernel.
 * - The transposed store reads the shared tile 4 bytes at a time: a thread reads 8 rows x 4
 *   columns with 8 word loads, transposes them with __byte_perm and writes 4 columns x 8 bytes
 *   (the base kernel makes 16 byte loads per 16 bytes written). The tile's row stride is 17
 *   words, odd, so the 32 lanes' word loads hit 32 different banks.
 *
 * The kernel keeps a kIters parameter (tiles a block walks, loads of the next one issued after
 * the current one's barrier); only kIters = 1 is launched. */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_VARIANTS_CUH_
#define TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_VARIANTS_CUH_

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cast/cast_transpose.cuh"
#include "util/byte_transpose.cuh"

namespace transformer_engine {
namespace cast_detail {

/* NVTE_CAST_TRANSPOSE_VARIANT, read once per process: launches are CUDA-graph captured, so the
 * choice must not change between them. "0": the base kernel everywhere. "1": the tall-tile
 * kernel where it replaces the base one, gated backwards on the base kernel. "2" (and anything
 * else, and the default): as "1", with gated backwards on the paired-halves kernel of
 * activation/gated_cast_transpose.cuh. */
inline int cast_transpose_variant() {
  static const int variant = [] {
    const char* value = std::getenv("NVTE_CAST_TRANSPOSE_VARIANT");
    if (value != nullptr && std::strcmp(value, "0") == 0) return 0;
    if (value != nullptr && std::strcmp(value, "1") == 0) return 1;
    return 2;
  }();
  return variant;
}

inline bool tall_tile_kernel_enabled() { return cast_transpose_variant() >= 1; }
inline bool gated_pair_kernel_enabled() { return cast_transpose_variant() >= 2; }

constexpr int kSubTiles = 2;                                 // 64-row tiles in a tall tile
constexpr int kTallRows = kSubTiles * kTile;                 // 128
constexpr int kTallPasses = kTallRows / kLoadRowsPerPass;    // 4 row vectors a thread
constexpr int kTileWords = (kTile + kTilePad) / 4;           // 17 words a shared row
constexpr int kWordRowsT = 8;                                // transposed store: 8 rows
constexpr int kWordColsT = kTile / 4 / (kThreads / 32 / 4);  // word columns a warp: 8
static_assert(kTileWords % 2 == 1, "an odd stride in words spreads the word reads over 32 banks");
static_assert(kTallRows * kTile == kThreads * kWordRowsT * 4, "the store covers the tile once");
static_assert(kTallPasses == 2 * kSubTiles, "a 64-row tile's partials are two passes");

/* The loads of a thread's kTallPasses row vectors of the tall tile at row r0. */
template <class Loader>
__device__ __forceinline__ void fetch_tall(const Loader& loader, size_t r0, size_t c, int g,
                                           typename Loader::TileRaw (&raw)[kTallPasses]) {
#pragma unroll
  for (int p = 0; p < kTallPasses; ++p)
    raw[p] = loader.tile_fetch(r0 + p * kLoadRowsPerPass + g, c);
}

/* Bytes of one row vector's loads (the loader's operands); a thread keeps four in registers,
 * plus the activation arithmetic. */
template <class Loader>
constexpr size_t kRawBytes = sizeof(typename Loader::TileRaw);

/* Blocks an SM must hold at once, so the cap on registers a thread (65536 / (256 x blocks)).
 * Unbounded, ptxas uses up to 128 registers (a gated backward), leaving 2 blocks an SM where a
 * plain cast could have 5; bounded too tightly, the heavy loaders spill. For one tile a block,
 * these caps fit every loader's unbounded use on sm_90 without spills; two tiles keep the next
 * tile's loads live through the store phase, so they get fewer blocks. */
template <class Loader, int kIters>
constexpr int kMinBlocksByWeight = kIters == 1 ? (kRawBytes<Loader> <= 16   ? 5
                                                  : kRawBytes<Loader> <= 32 ? 3
                                                                            : 2)
                                               : (kRawBytes<Loader> <= 16 ? 3 : 2);

/* A loader may name its own count (`static constexpr int kTallMinBlocks`), measured for it. */
template <class Loader, class = void>
struct TallMinBlocksOf {
  static constexpr int value = 0;
};
template <class Loader>
struct TallMinBlocksOf<Loader, std::void_t<decltype(Loader::kTallMinBlocks)>> {
  static constexpr int value = Loader::kTallMinBlocks;
};
template <class Loader, int kIters>
constexpr int kMinBlocks =
    kIters == 1 && TallMinBlocksOf<Loader>::value > 0 ? TallMinBlocksOf<Loader>::value
                                                      : kMinBlocksByWeight<Loader, kIters>;

/* Block b owns rows [s * kIters * 128, +kIters * 128) and columns [c * 64, +64), where
 * s = b / tiles_c and c = b % tiles_c. Per 128-row tile: thread t casts row vectors
 * (g + 32 p, 8 (t % 8)), g = t / 8, p = 0..3, as the base kernel's two passes over each of the
 * two 64-row tiles (passes 0, 1 are the first tile's, 2, 3 the second's). */
template <class Loader, bool kE4M3, bool kDbias, int kIters>
__global__ void __launch_bounds__(kThreads, kMinBlocks<Loader, kIters>)
    cast_transpose_tall_kernel(const Loader loader, uint8_t* __restrict__ out,
                               uint8_t* __restrict__ out_t, size_t rows, size_t cols,
                               size_t tiles_c, bool vector_rows, bool vector_cols, CastArgs args,
                               float* __restrict__ column_sums) {
  if (skip_requested(args.noop)) return;
  __shared__ uint32_t tile[kTallRows][kTileWords];
  __shared__ float sums[kDbias ? kSubTiles : 1][kDbias ? kLoadRowsPerPass : 1][kDbias ? kTile : 1];
  const float scale = load_scale(args);
  const size_t strip_r0 = (blockIdx.x / tiles_c) * (kIters * kTallRows);
  const size_t c0 = (blockIdx.x % tiles_c) * kTile;
  const int t = threadIdx.x;
  const int g = t / (kTile / kVecElems);
  const int lc = (t % (kTile / kVecElems)) * kVecElems;
  const bool full_cols = c0 + kTile <= cols;
  const bool fast_load = vector_rows && full_cols && strip_r0 + kIters * kTallRows <= rows;
  float local_amax = 0.0f;

  typename Loader::TileRaw raw[kTallPasses];
  if (fast_load) fetch_tall(loader, strip_r0, c0 + lc, g, raw);
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const size_t r0 = strip_r0 + it * kTallRows;
    if (r0 >= rows) break;  // the same for the whole block
    float colsum[kSubTiles][kVecElems] = {};
    if (fast_load) {
#pragma unroll
      for (int p = 0; p < kTallPasses; ++p) {
        const int lr = p * kLoadRowsPerPass + g;
        float x[kVecElems];
        loader.tile_compute(raw[p], c0 + lc, x);
        cast_store_vector<kE4M3, kDbias>(x, scale, local_amax, out + (r0 + lr) * cols + c0 + lc,
                                         &tile[lr][lc / 4], colsum[p / 2]);
      }
    } else {
      // Unrolled, so that colsum is indexed by constants (registers, not a local array).
      auto* bytes = reinterpret_cast<uint8_t*>(&tile[0][0]);
#pragma unroll
      for (int p = 0; p < kTallPasses; ++p) {
        const int lr = p * kLoadRowsPerPass + g;
        const size_t r = r0 + lr;
        const size_t c = c0 + lc;
        if (r >= rows) continue;
        if (vector_rows && c + kVecElems <= cols) {
          float x[kVecElems];
          loader.load_vec(r, c, x);
          cast_store_vector<kE4M3, kDbias>(x, scale, local_amax, out + r * cols + c,
                                           &tile[lr][lc / 4], colsum[p / 2]);
        } else {
#pragma unroll
          for (int j = 0; j < kVecElems && c + j < cols; ++j) {
            const float a = loader.load(r, c + j);
            local_amax = amax_step(local_amax, a);
            const uint8_t q = Fp8Format<kE4M3>::cast(a * scale);
            out[r * cols + c + j] = q;
            bytes[lr * kTileWords * 4 + lc + j] = q;
            if constexpr (kDbias) colsum[p / 2][j] += a;
          }
        }
      }
    }
    if constexpr (kDbias) {
#pragma unroll
      for (int s = 0; s < kSubTiles; ++s) {
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) sums[s][g][lc + j] = colsum[s][j];
      }
    }
    __syncthreads();
    // The next tile's loads go out now, to be in flight through the store phase below. Not
    // before the barrier: both tiles' loads would be live at once (twice the registers, spilled
    // under the cap). The compiler may move read-only loads across a barrier, so the row goes
    // through an opaque asm that stays after it.
    if (fast_load && it + 1 < kIters) {
      size_t next_r0 = r0 + kTallRows;
      asm volatile("" : "+l"(next_r0));
      fetch_tall(loader, next_r0, c0 + lc, g, raw);
    }

    if constexpr (kDbias) {
      // Thread t < 128 adds up column t % 64 of 64-row tile t / 64, in the base kernel's order.
      const int s = t / kTile;
      const int col = t % kTile;
      if (s < kSubTiles && c0 + col < cols && r0 + s * kTile < rows) {
        float total = 0.0f;
#pragma unroll
        for (int gi = 0; gi < kLoadRowsPerPass; ++gi) total += sums[s][gi][col];
        column_sums[(r0 / kTile + s) * cols + c0 + col] = total;
      }
    }

    if (vector_cols && full_cols && r0 + kTallRows <= rows) {
      // Warp w reads rows 32 (w % 4) + [0, 32) and word columns 8 (w / 4) + [0, 8): lane l the
      // 8 rows from 8 (l / 8) of word column l % 8, so a word load's 32 lanes hit 32 banks.
      const int warp = t / 32;
      const int lane = t % 32;
      const int cw = (warp / 4) * kWordColsT + lane % kWordColsT;
      const int lr0 = (warp % 4) * 32 + (lane / kWordColsT) * kWordRowsT;
      uint32_t w[kWordRowsT];
#pragma unroll
      for (int i = 0; i < kWordRowsT; ++i) w[i] = tile[lr0 + i][cw];
      uint32_t lo[4], hi[4];
      transpose_4x4(w[0], w[1], w[2], w[3], lo);
      transpose_4x4(w[4], w[5], w[6], w[7], hi);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        *reinterpret_cast<uint2*>(out_t + (c0 + 4 * cw + k) * rows + r0 + lr0) =
            make_uint2(lo[k], hi[k]);
      }
    } else {
      // Edge tile: one byte at a time, consecutive threads on consecutive rows of a column.
      const auto* bytes = reinterpret_cast<const uint8_t*>(&tile[0][0]);
      for (int i = t; i < kTallRows * kTile; i += kThreads) {
        const int lr = i % kTallRows;
        const int tc = i / kTallRows;
        if (r0 + lr < rows && c0 + tc < cols) {
          out_t[(c0 + tc) * rows + r0 + lr] = bytes[lr * kTileWords * 4 + tc];
        }
      }
    }
    if (it + 1 < kIters) __syncthreads();  // the tile and sums are rewritten next
  }
  if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
}

template <class Loader, bool kE4M3, bool kDbias, int kIters>
void launch_cast_transpose_tall(const Loader& loader, uint8_t* out, uint8_t* out_t, size_t rows,
                                size_t cols, bool vector_rows, bool vector_cols,
                                const CastArgs& args, float* column_sums, CallContext& ctx) {
  constexpr size_t kStripRows = kIters * kTallRows;
  const size_t tiles_c = (cols + kTile - 1) / kTile;
  const size_t blocks = tiles_c * ((rows + kStripRows - 1) / kStripRows);
  cast_transpose_tall_kernel<Loader, kE4M3, kDbias, kIters><<<blocks, kThreads, 0, ctx.stream()>>>(
      loader, out, out_t, rows, cols, tiles_c, vector_rows, vector_cols, args, column_sums);
  ctx.check_launch("cast_transpose_tall_kernel launch");
}

/* Launches the tall-tile kernel (true) for loaders of up to 32 bytes a row vector unless
 * NVTE_CAST_TRANSPOSE_VARIANT=0, else nothing (false: the caller launches the base kernel). */
template <class Loader, bool kE4M3, bool kDbias>
bool launch_cast_transpose_variant(const Loader& loader, uint8_t* out, uint8_t* out_t, size_t rows,
                                   size_t cols, bool vector_rows, bool vector_cols,
                                   const CastArgs& args, float* column_sums, CallContext& ctx) {
  if constexpr (kRawBytes<Loader> <= 32) {
    if (tall_tile_kernel_enabled()) {
      launch_cast_transpose_tall<Loader, kE4M3, kDbias, 1>(
          loader, out, out_t, rows, cols, vector_rows, vector_cols, args, column_sums, ctx);
      return true;
    }
  }
  return false;
}

}  // namespace cast_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_CAST_TRANSPOSE_VARIANTS_CUH_
