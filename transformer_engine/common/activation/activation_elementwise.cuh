/* The activation kernels' element-wise shape: one grid-stride pass over a loader's positions
 * (activation_math.cuh) writing one row-wise result, in high precision, in FP8 with its amax,
 * or nothing but the amax (current scaling's first pass). The FP8 result with a transposed
 * copy, and the bias gradient, go through the tiled kernel of cast/cast_transpose.cuh instead.
 *
 * The kernel is memory-bound once the arithmetic is specialised per activation, so it is built
 * for bandwidth: the grid is a fixed number of resident blocks per SM (not one thread per
 * vector), each thread issues the 16-byte loads of several positions before it computes the
 * first, and the grid-stride walk steps its (row, column) cursor without a division. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_ELEMENTWISE_CUH_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_ELEMENTWISE_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "activation/activation_math.cuh"
#include "cast/cast_transpose.cuh"
#include "util/buffer.h"
#include "util/device.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace activation_detail {

using cast_detail::CastArgs;
using cast_detail::kThreads;

/* Writes a high-precision result. */
template <typename OType>
struct HighPrecisionStore {
  OType* out;
  bool aligned() const { return aligned_to(out, sizeof(OType) * kVecElems); }
  __device__ __forceinline__ void store_vec(size_t i, const float (&v)[kVecElems], float&) const {
    Vec<OType, kVecElems> y;
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) y.v[j] = from_float<OType>(v[j]);
    *reinterpret_cast<Vec<OType, kVecElems>*>(out + i) = y;
  }
  __device__ __forceinline__ void store(size_t i, float v, float&) const {
    out[i] = from_float<OType>(v);
  }
};

/* Writes an FP8 result with `scale`, tracking the amax of the unscaled values. */
template <bool kE4M3>
struct Fp8Store {
  uint8_t* out;
  float scale;
  bool aligned() const { return aligned_to(out, kVecElems); }
  __device__ __forceinline__ void store_vec(size_t i, const float (&v)[kVecElems],
                                            float& amax) const {
    Vec<uint16_t, kVecElems / 2> q;
    cast_detail::cast_floats<kE4M3>(v, scale, amax, q);
    *reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(out + i) = q;
  }
  __device__ __forceinline__ void store(size_t i, float v, float& amax) const {
    amax = amax_step(amax, v);
    out[i] = Fp8Format<kE4M3>::cast(v * scale);
  }
};

/* Writes nothing: only the amax of the values is wanted. A kernel with this store walks its
 * positions from the last to the first: the cast that follows reads from the first row on, so
 * what the pass read last is what L2 still holds when the cast starts (an amax is the same in
 * any order). */
struct AmaxOnlyStore {
  bool aligned() const { return true; }
  __device__ __forceinline__ void store_vec(size_t, const float (&v)[kVecElems],
                                            float& amax) const {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) amax = amax_step(amax, v[j]);
  }
  __device__ __forceinline__ void store(size_t, float v, float& amax) const {
    amax = amax_step(amax, v);
  }
};

/* The amax-only pass of an activation bounded by its input (ActivationLoad::kBoundedByInput)
 * computes a position only when one of its inputs exceeds the largest amax its warp has found
 * so far, less a relative 2^-20 (which covers the approximate reciprocal's error in that
 * bound): any other position's values are at most that amax and cannot raise it. The result is
 * the amax of every value, bit for bit. On FC1 outputs (near-normal values) most positions are
 * skipped after a warp's first few, which takes GELU's pass from waiting on the special-function
 * unit to reading at the memory's speed; on inputs that keep growing along the walk (sorted
 * ascending) every position is computed, as before. */
__device__ __forceinline__ float warp_amax_bound(float local_amax) {
  unsigned bits = __float_as_uint(local_amax);  // amaxes are >= 0 (or +inf): uint order
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  bits = __reduce_max_sync(__activemask(), bits);
#endif
  return __uint_as_float(bits) * (1.0f - 0x1p-20f);
}

/* Resident blocks per SM the kernel is compiled for (__launch_bounds__ then caps a thread at
 * 64 registers) and launched with: sm_count * kBlocksPerSm blocks, fewer for small tensors. */
constexpr int kBlocksPerSm = 4;

/* Positions a thread fetches before it computes the first: four when a position's loads are
 * one 16-byte vector (a 16-bit forward), one when they are 48 bytes or more (a 16-bit gated
 * backward's three vectors, float32 with two or three), else two. That keeps 32-96 bytes of
 * loads in flight per thread, which the 1024 resident threads of an SM need to cover the
 * memory latency (a 16-bit GELU forward with two positions in flight read at 0.66 of the copy
 * bandwidth), within 64 registers: none of these spills. */
template <class Loader>
constexpr int kUnroll = sizeof(typename Loader::Raw) >= 48   ? 1
                        : sizeof(typename Loader::Raw) <= 16 ? 4
                                                             : 2;

/* A vector position of the walk, stepped through the grid-stride sequence without dividing:
 * the grid's thread count is (step_r rows, step_c vectors), step_c < vecs_per_row, so one
 * carry at most. */
struct RowCursor {
  size_t r, c;
  __device__ __forceinline__ void advance(size_t step_r, size_t step_c, size_t vecs_per_row) {
    r += step_r;
    c += step_c;
    if (c >= vecs_per_row) {
      c -= vecs_per_row;
      ++r;
    }
  }
  /* The same sequence walked back (the amax-only passes walk the tensor from its end). */
  __device__ __forceinline__ void retreat(size_t step_r, size_t step_c, size_t vecs_per_row) {
    r -= step_r;
    if (c >= step_c) {
      c -= step_c;
    } else {
      c += vecs_per_row - step_c;
      --r;
    }
  }
};

struct ElementwiseShape {
  size_t rows, cols;      // the loader's positions
  size_t vecs_per_row;    // cols / kVecElems (vectorised launches)
  size_t step_r, step_c;  // the grid's thread count in rows and vectors of a row
};

/* The loader's [rows, cols] positions; part p of position (r, c) goes to result element
 * r * kParts * cols + p * cols + c. Vectorised (cols % kVecElems == 0, aligned buffers): a
 * thread fetches kUnroll positions, then computes and stores them. kFp8: the store casts with
 * args.scale (and publishes scale_inv); kAmax: the amax of the values is max-accumulated into
 * args.amax. */
template <class Loader, class Store, bool kFp8, bool kAmax = kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    elementwise_kernel(const Loader loader, Store store, ElementwiseShape shape, bool vectorized,
                       CastArgs args) {
  constexpr int kParts = Loader::kParts;
  constexpr int kU = kUnroll<Loader>;
  constexpr bool kSkipBelowAmax =
      std::is_same<Store, AmaxOnlyStore>::value && Loader::kBoundedByInput;
  float local_amax = 0.0f;
  if constexpr (kFp8) store.scale = cast_detail::load_scale(args);
  const size_t cols = shape.cols;
  const size_t out_cols = kParts * cols;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  constexpr bool kReverse = std::is_same<Store, AmaxOnlyStore>::value;  // see AmaxOnlyStore
  if (vectorized) {
    const size_t vpr = shape.vecs_per_row;
    const size_t n = shape.rows * vpr;
    auto put = [&](const RowCursor& p, const typename Loader::Raw& raw) {
      float x[kParts][kVecElems];
      loader.compute(raw, x);
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        store.store_vec(p.r * out_cols + part * cols + p.c * kVecElems, x[part], local_amax);
      }
    };
    const size_t start = kReverse ? n - 1 - first : first;  // unused when first >= n
    RowCursor at{start / vpr, start % vpr};
    auto step = [&] {
      if constexpr (kReverse) {
        at.retreat(shape.step_r, shape.step_c, vpr);
      } else {
        at.advance(shape.step_r, shape.step_c, vpr);
      }
    };
    size_t v = first;
    for (; v + (kU - 1) * stride < n; v += kU * stride) {
      RowCursor pos[kU];
      typename Loader::Raw raw[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        pos[u] = at;
        raw[u] = loader.fetch(at.r, at.c * kVecElems);
        step();
      }
      if constexpr (kSkipBelowAmax) {
        const float bound = warp_amax_bound(local_amax);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!loader.inputs_within(raw[u], bound)) put(pos[u], raw[u]);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u) put(pos[u], raw[u]);
      }
    }
    for (; v < n; v += stride) {  // fewer than kU positions left for this thread
      put(at, loader.fetch(at.r, at.c * kVecElems));
      step();
    }
  } else {
    const size_t total = shape.rows * cols;
    for (size_t i = first; i < total; i += stride) {
      const size_t at = kReverse ? total - 1 - i : i;
      const size_t r = at / cols, c = at % cols;
      float x[kParts];
      loader.load_parts(r, c, x);
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        store.store(r * out_cols + part * cols + c, x[part], local_amax);
      }
    }
  }
  if constexpr (kAmax) {
    if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
  }
}

/* No element to write: 1/scale is still published, as the casts do. */
static __global__ void publish_scale_inv(CastArgs args) { cast_detail::load_scale(args); }

/* Launches elementwise_kernel over the loader's [rows, cols] positions. */
template <class Loader, class Store, bool kFp8, bool kAmax = kFp8>
void launch_elementwise(CallContext& ctx, const Loader& loader, const Store& store, size_t rows,
                        size_t cols, const CastArgs& args) {
  if (rows * cols == 0) {
    if (kFp8 && args.scale_inv != nullptr) {
      publish_scale_inv<<<1, 1, 0, ctx.stream()>>>(args);
      ctx.check_launch("publish_scale_inv launch");
    }
    return;
  }
  const bool vectorized = cols % kVecElems == 0 && loader.vectorizable() && store.aligned();
  const size_t work = vectorized ? rows * (cols / kVecElems) : rows * cols;
  const size_t wanted = (work + kThreads - 1) / kThreads;
  const size_t blocks =
      std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * kBlocksPerSm);
  ElementwiseShape shape{rows, cols, cols / kVecElems, 0, 0};
  if (vectorized) {
    const size_t threads = blocks * kThreads;
    shape.step_r = threads / shape.vecs_per_row;
    shape.step_c = threads % shape.vecs_per_row;
  }
  elementwise_kernel<Loader, Store, kFp8, kAmax>
      <<<blocks, kThreads, 0, ctx.stream()>>>(loader, store, shape, vectorized, args);
  ctx.check_launch("activation elementwise_kernel launch");
}

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_ELEMENTWISE_CUH_
