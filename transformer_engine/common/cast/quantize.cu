/* nvte_quantize: saturating FP8 cast with amax, scale_inv, optional transposed copy and no-op
 * flag. Two kernels: a flat vectorised one for the row-wise copy alone, and a 64x64-tiled one
 * that writes both copies in the same pass (one read of the input). */
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cast/dispatch.cuh"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

constexpr int kThreads = 256;
constexpr int kVecElems = 8;  // 16 bytes of bf16/fp16 in, 8 bytes of FP8 out
constexpr int kTile = 64;
constexpr int kTilePad = 4;  // 68-byte rows: 4-byte aligned, few bank conflicts
constexpr int kRowsPerThreadT = 16;
constexpr int kChunksPerColumn = kTile / kRowsPerThreadT;  // 16-byte chunks per output row

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

template <typename IType, bool kE4M3, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const IType* __restrict__ in, uint8_t* __restrict__ out, size_t n, CastArgs args) {
  if (skip_requested(args.noop)) return;
  const float scale = load_scale(args);
  float local_amax = 0.0f;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  size_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const size_t num_vecs = n / kVecElems;
    const auto* vin = reinterpret_cast<const Vec<IType, kVecElems>*>(in);
    auto* vout = reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(out);
    for (size_t i = first; i < num_vecs; i += stride) {
      Vec<uint16_t, kVecElems / 2> q;
      cast_vector<IType, kE4M3>(vin[i], scale, local_amax, q);
      vout[i] = q;
    }
    scalar_begin = num_vecs * kVecElems;
  }
  for (size_t i = scalar_begin + first; i < n; i += stride) {
    const float a = to_float(in[i]);
    local_amax = amax_step(local_amax, a);
    out[i] = Fp8Format<kE4M3>::cast(a * scale);
  }
  if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
}

/* One block per 64x64 tile. Load: each thread casts 2 x 8 consecutive elements of a row and
 * writes them to the row-wise output and to shared memory. Store: each thread gathers 16
 * consecutive rows of one column from shared memory and writes them as one 16-byte vector of
 * the transposed output; the 4 threads of a column are adjacent lanes, so a warp writes whole
 * 32-byte sectors. Edge tiles fall back to element-wise, bounds-checked accesses. */
template <typename IType, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const IType* __restrict__ in, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, size_t rows, size_t cols, size_t tiles_c,
                          bool vector_rows, bool vector_cols, CastArgs args) {
  if (skip_requested(args.noop)) return;
  __shared__ alignas(4) uint8_t tile[kTile][kTile + kTilePad];
  const float scale = load_scale(args);
  const size_t r0 = (blockIdx.x / tiles_c) * kTile;
  const size_t c0 = (blockIdx.x % tiles_c) * kTile;
  const int t = threadIdx.x;
  float local_amax = 0.0f;

  const int lc = (t % (kTile / kVecElems)) * kVecElems;
#pragma unroll
  for (int pass = 0; pass < kTile * kTile / (kThreads * kVecElems); ++pass) {
    const int lr = pass * (kThreads * kVecElems / kTile) + t / (kTile / kVecElems);
    const size_t r = r0 + lr;
    const size_t c = c0 + lc;
    if (r >= rows) continue;
    if (vector_rows && c + kVecElems <= cols) {
      const auto x = *reinterpret_cast<const Vec<IType, kVecElems>*>(in + r * cols + c);
      Vec<uint16_t, kVecElems / 2> q;
      cast_vector<IType, kE4M3>(x, scale, local_amax, q);
      *reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(out + r * cols + c) = q;
      auto* tile_words = reinterpret_cast<uint32_t*>(&tile[lr][lc]);
      tile_words[0] = static_cast<uint32_t>(q.v[0]) | (static_cast<uint32_t>(q.v[1]) << 16);
      tile_words[1] = static_cast<uint32_t>(q.v[2]) | (static_cast<uint32_t>(q.v[3]) << 16);
    } else {
      for (int j = 0; j < kVecElems && c + j < cols; ++j) {
        const float a = to_float(in[r * cols + c + j]);
        local_amax = amax_step(local_amax, a);
        const uint8_t q = Fp8Format<kE4M3>::cast(a * scale);
        out[r * cols + c + j] = q;
        tile[lr][lc + j] = q;
      }
    }
  }
  __syncthreads();

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

float* optional_data(NVTEBuffer* buffer) {
  return buffer == nullptr ? nullptr : static_cast<float*>(buffer->data);
}

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_quantize(const NVTEBuffer* input, const NVTEBuffer* scale, NVTEBuffer* output,
                              NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv,
                              const NVTEBuffer* noop, int device, NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_quantize";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  NVTEBuffer& out = const_cast<NVTEBuffer&>(require(op, "output", output));
  check_dtype(op, "output", out, {kNVTEFloat8E4M3, kNVTEFloat8E5M2});
  check_same_numel(op, "output", out, "input", in);
  const size_t n = numel(in);
  const size_t cols = last_dim(in);
  const size_t rows = cols == 0 ? 0 : n / cols;
  if (output_t != nullptr) {
    check_well_formed(op, "output_t", *output_t);
    if (output_t->dtype != out.dtype) {
      throw_invalid(op, "output_t has dtype ", dtype_name(output_t->dtype), " but output has ",
                    dtype_name(out.dtype), "; both copies use one FP8 format");
    }
    check_same_numel(op, "output_t", *output_t, "input", in);
    if (output_t->ndim == 0 || output_t->shape[0] != cols) {
      throw_invalid(op, "output_t must have the input's last extent (", cols,
                    ") as its first extent");
    }
  }
  if (amax != nullptr) check_fp32_scalar(op, "amax", *amax);
  if (scale_inv != nullptr) check_fp32_scalar(op, "scale_inv", *scale_inv);
  if (noop != nullptr) check_fp32_scalar(op, "noop", *noop);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("scale", *scale);
  ctx.check_on_device("output", out);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);
  if (noop != nullptr) ctx.check_on_device("noop", *noop);

  const CastArgs args{static_cast<const float*>(scale->data), optional_data(amax),
                      optional_data(scale_inv),
                      noop == nullptr ? nullptr : static_cast<const float*>(noop->data)};
  auto* out_bytes = static_cast<uint8_t*>(out.data);
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    const auto* in_data = static_cast<const IType*>(in.data);
    dispatch_fp8(op, out.dtype, [&](auto is_e4m3) {
      constexpr bool kE4M3 = decltype(is_e4m3)::value;
      if (output_t != nullptr && n > 0) {
        const size_t tiles_c = (cols + kTile - 1) / kTile;
        const size_t tiles = tiles_c * ((rows + kTile - 1) / kTile);
        const bool vector_rows = cols % kVecElems == 0 &&
                                 aligned_to(in_data, sizeof(IType) * kVecElems) &&
                                 aligned_to(out_bytes, kVecElems);
        const bool vector_cols =
            rows % kRowsPerThreadT == 0 && aligned_to(output_t->data, kRowsPerThreadT);
        cast_transpose_kernel<IType, kE4M3><<<tiles, kThreads, 0, ctx.stream()>>>(
            in_data, out_bytes, static_cast<uint8_t*>(output_t->data), rows, cols, tiles_c,
            vector_rows, vector_cols, args);
        ctx.check_launch("cast_transpose_kernel launch");
        return;
      }
      const bool vectorized =
          aligned_to(in_data, sizeof(IType) * kVecElems) && aligned_to(out_bytes, kVecElems);
      const size_t work = vectorized ? n / kVecElems + n % kVecElems : n;
      const size_t wanted = std::max<size_t>(1, (work + kThreads - 1) / kThreads);
      const size_t blocks = std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * 8);
      if (vectorized) {
        cast_kernel<IType, kE4M3, true>
            <<<blocks, kThreads, 0, ctx.stream()>>>(in_data, out_bytes, n, args);
      } else {
        cast_kernel<IType, kE4M3, false>
            <<<blocks, kThreads, 0, ctx.stream()>>>(in_data, out_bytes, n, args);
      }
      ctx.check_launch("cast_kernel launch");
    });
  });
}
