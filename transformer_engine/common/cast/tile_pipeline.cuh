/* The persistent tile loop of the block-scaled cast kernels (block_quantize.cu,
 * mxfp8_quantize.cu): a grid of kBlocksPerSm blocks per multiprocessor walks the 128x128 tiles
 * with a stride of the grid size, and each block keeps the input of its next tile(s) in flight
 * in shared memory (cp.async) while it converts the current one from registers.
 *
 * Why: with one block per tile, every block loads its tile, waits, converts and stores; at the
 * two blocks per SM their registers allow, an SM often has no load in flight at all while both
 * blocks convert, and the casts reached only 37-52% of a device copy's bandwidth. Here the
 * loads of the next tiles are issued before the current tile is converted, so the memory system
 * always has about kStages tiles per block to fetch.
 *
 * Shared input ring: kStages buffers of one 128x128 input tile each, row-major (the tile's row
 * r, columns 0..127, at r * 128 elements). Chunks of the tile outside the matrix are zero-filled
 * (they change no amax and are never stored), as load_sub_tile's element loads do. Inputs whose
 * rows are not whole 16-byte chunks (g.vec_in false) skip the ring: each thread loads its 8x8
 * sub-tile directly with load_sub_tile, as before. */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_TILE_PIPELINE_CUH_
#define TRANSFORMER_ENGINE_COMMON_CAST_TILE_PIPELINE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cast/block_tile.cuh"
#include "util/cp_async.cuh"
#include "util/device.h"
#include "util/device_set.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace block_cast_detail {

/* Resident blocks per SM the kernels are built for (their __launch_bounds__): the persistent
 * grid has this many blocks per SM, so every block is resident from the start. */
constexpr int kBlocksPerSm = 2;

/* Input tiles in flight per block: two for 16-bit inputs (2 x 32 KiB), one for float32 (one
 * 64 KiB tile); either way 64 KiB of loads per block, and the shared memory of two blocks fits
 * an SM (2 x (64 + 20) KiB of 228 KiB). */
template <typename IType>
constexpr int ring_stages() {
  return sizeof(IType) >= 4 ? 1 : 2;
}

template <typename IType>
constexpr size_t ring_bytes() {
  return static_cast<size_t>(ring_stages<IType>()) * kTile * kTile * sizeof(IType);
}

/* ---- the ring --------------------------------------------------------------------------- */

/* Issues the loads of tile `tile` into ring buffer `buf` (every thread issues its share: 16-byte
 * chunk q = threadIdx.x + k * kThreads, so a warp's chunks are 512 consecutive bytes of the
 * tile, two whole rows for 16-bit inputs; a thread's chunks are one column chunk every kRowStep
 * rows). Only for g.vec_in (16-byte aligned rows). */
template <typename IType>
__device__ __forceinline__ void issue_tile_load(const IType* __restrict__ in, const TileGeometry& g,
                                                size_t tile, IType* buf) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(IType));  // elements per chunk
  constexpr int kChunksPerRow = kTile / kPerChunk;
  constexpr int kChunks = kTile * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "whole rounds of chunks");
  constexpr int kRowStep = kThreads / kChunksPerRow;  // rows between a thread's chunks
  static_assert(kThreads % kChunksPerRow == 0, "a thread keeps one column chunk");
  const int rl0 = threadIdx.x / kChunksPerRow;
  const int cl = (threadIdx.x % kChunksPerRow) * kPerChunk;
  const size_t r0 = (tile / g.tiles_k) * kTile + rl0;
  const size_t c = (tile % g.tiles_k) * kTile + cl;
  // vec_in: K is a multiple of kPerChunk, so a chunk is wholly inside or wholly outside.
  const bool col_inside = c < g.K;
  const IType* src = in + r0 * g.K + c;
  IType* dst = buf + rl0 * kTile + cl;
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const bool inside = col_inside && r0 + k * kRowStep < g.M;
    cp_async_16(dst + k * kRowStep * kTile, inside ? src + k * kRowStep * g.K : in,
                inside ? 16 : 0);
  }
}

/* Reads the thread's 8x8 sub-tile (rows rg*8+i, columns cc*8..cc*8+7) from a ring buffer:
 * a warp reads two whole 256-byte tile rows (16-bit inputs) per row i, without bank conflicts. */
template <typename IType>
__device__ __forceinline__ void read_sub_tile(const IType* buf, const TilePos& p,
                                              SubTile<IType>& x) {
  // As 16-byte pieces: the dynamic shared memory is only promised 16-byte alignment, which
  // Vec<float, 8> (32-byte aligned) would exceed.
  constexpr int kPieces = static_cast<int>(sizeof(Vec<IType, kSub>) / sizeof(uint4));
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const uint4* src =
        reinterpret_cast<const uint4*>(buf + (p.rg * kSub + i) * kTile + p.cc * kSub);
    uint4* dst = reinterpret_cast<uint4*>(&x.row[i]);
#pragma unroll
    for (int k = 0; k < kPieces; ++k) dst[k] = src[k];
  }
}

/* The persistent loop: calls `body(x, p)` for each tile of this block with the tile's position
 * and the thread's sub-tile in registers. `body` may use shared memory and __syncthreads freely:
 * every iteration starts with a barrier, so no thread reaches the next tile's shared-memory
 * writes while another still reads the previous tile's. The no-op flag is the caller's. */
template <typename IType, typename Body>
__device__ __forceinline__ void for_each_tile(const IType* __restrict__ in, const TileGeometry& g,
                                              size_t tiles, IType* ring, Body&& body) {
  constexpr int kStages = ring_stages<IType>();
  const size_t stride = gridDim.x;
  if (g.vec_in) {
    // Prologue: the first kStages tiles of this block (a group per tile, empty past the end,
    // so that "wait until kStages - 1 groups remain" always means "this tile has landed").
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const size_t t = blockIdx.x + s * stride;
      if (t < tiles) issue_tile_load(in, g, t, ring + s * kTile * kTile);
      cp_async_commit();
    }
  }
  int buf = 0;
  for (size_t tile = blockIdx.x; tile < tiles; tile += stride) {
    const TilePos p = tile_position(g, tile);
    SubTile<IType> x;
    if (g.vec_in) {
      IType* slot = ring + buf * kTile * kTile;
      cp_async_wait<kStages - 1>();  // this thread's chunks of `tile` have landed
      __syncthreads();                // and everyone else's; the previous tile is done
      read_sub_tile(slot, p, x);
      __syncthreads();  // the slot is read: refill it with the tile kStages ahead
      const size_t ahead = tile + kStages * stride;
      if (ahead < tiles) issue_tile_load(in, g, ahead, slot);
      cp_async_commit();
      buf = buf + 1 == kStages ? 0 : buf + 1;
    } else {
      __syncthreads();  // the previous tile's shared-memory reads are done
      load_sub_tile(in, g, p, x);
    }
    body(x, p);
  }
  if (g.vec_in) cp_async_wait<0>();  // nothing left in flight when the block exits
}

/* ---- host side ---------------------------------------------------------------------------- */

/* Blocks of a persistent launch over `tiles` tiles: kBlocksPerSm per SM, at most one per tile. */
inline unsigned int persistent_grid(const CallContext& ctx, unsigned int tiles) {
  const size_t resident = static_cast<size_t>(kBlocksPerSm) * ctx.sm_count();
  return static_cast<unsigned int>(tiles < resident ? tiles : resident);
}

/* Lets `kernel` take `dynamic_bytes` of dynamic shared memory (more than the default 48 KiB for
 * float32 inputs) and asks for the largest shared-memory carveout, so that kBlocksPerSm blocks
 * fit an SM. Done once per kernel and device (`done`: the kernel's own set); the first call of a
 * kernel on a device is normally an eager one, before any graph capture, and
 * cudaFuncSetAttribute is not a stream operation, so capture does not refuse it. */
template <typename Kernel>
void allow_ring(const CallContext& ctx, Kernel kernel, size_t dynamic_bytes, DeviceSet& done) {
  if (done.contains(ctx.device())) return;
  check_cuda(ctx.op(),
             cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(dynamic_bytes)),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  check_cuda(ctx.op(),
             cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  static_cast<int>(cudaSharedmemCarveoutMaxShared)),
             "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  done.insert(ctx.device());
}

}  // namespace block_cast_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_TILE_PIPELINE_CUH_
