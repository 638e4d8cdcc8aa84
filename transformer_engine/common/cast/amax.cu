/* nvte_compute_amax: amax = max |x| (float32, NaN ignored), overwriting the buffer. */
#include <cuda_runtime.h>

#include <algorithm>

#include "cast/dispatch.cuh"
#include "cast/launchers.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

constexpr int kAmaxThreads = 256;
constexpr int kAmaxVecElems = 8;
/* A read-only pass is bound by the loads in flight: each thread issues kAmaxUnroll 16-byte
 * loads before it reduces the first, and an SM holds kAmaxBlocksPerSm blocks (64 registers a
 * thread at most), 64 KiB of loads in flight an SM, as the activations' amax passes
 * (activation_elementwise.cuh). One load a thread at a time had read at about 0.76 of the copy
 * bandwidth on an H200. */
constexpr int kAmaxUnroll = 4;
constexpr int kAmaxBlocksPerSm = 4;

template <typename IType, bool kVectorized>
__global__ void __launch_bounds__(kAmaxThreads, kAmaxBlocksPerSm)
    amax_kernel(const IType* __restrict__ in, size_t n, float* __restrict__ amax) {
  using V = Vec<IType, kAmaxVecElems>;
  float local_amax = 0.0f;
  const size_t first = static_cast<size_t>(blockIdx.x) * kAmaxThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kAmaxThreads;
  size_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const size_t num_vecs = n / kAmaxVecElems;
    const auto* vin = reinterpret_cast<const V*>(in);
    size_t i = first;
    for (; i + (kAmaxUnroll - 1) * stride < num_vecs; i += kAmaxUnroll * stride) {
      V x[kAmaxUnroll];
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) x[u] = vin[i + u * stride];
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kAmaxVecElems; ++j) {
          local_amax = amax_step(local_amax, to_float(x[u].v[j]));
        }
      }
    }
    for (; i < num_vecs; i += stride) {  // fewer than kAmaxUnroll vectors left for this thread
      const V x = vin[i];
#pragma unroll
      for (int j = 0; j < kAmaxVecElems; ++j) local_amax = amax_step(local_amax, to_float(x.v[j]));
    }
    scalar_begin = num_vecs * kAmaxVecElems;
  }
  for (size_t i = scalar_begin + first; i < n; i += stride) {
    local_amax = amax_step(local_amax, to_float(in[i]));
  }
  block_amax_to_global<kAmaxThreads>(local_amax, amax);
}

}  // namespace
}  // namespace transformer_engine

namespace transformer_engine {
namespace cast_detail {

void launch_amax(CallContext& ctx, const NVTEBuffer& in, float* amax) {
  const char* op = ctx.op();
  check_cuda(op, cudaMemsetAsync(amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  const size_t n = numel(in);
  if (n == 0) return;
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    const auto* in_data = static_cast<const IType*>(in.data);
    const bool vectorized = aligned_to(in_data, sizeof(IType) * kAmaxVecElems);
    const size_t work = vectorized ? n / kAmaxVecElems + n % kAmaxVecElems : n;
    const size_t wanted = std::max<size_t>(1, (work + kAmaxThreads - 1) / kAmaxThreads);
    const size_t blocks =
        std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * kAmaxBlocksPerSm);
    if (vectorized) {
      amax_kernel<IType, true><<<blocks, kAmaxThreads, 0, ctx.stream()>>>(in_data, n, amax);
    } else {
      amax_kernel<IType, false><<<blocks, kAmaxThreads, 0, ctx.stream()>>>(in_data, n, amax);
    }
    ctx.check_launch("amax_kernel launch");
  });
}

}  // namespace cast_detail
}  // namespace transformer_engine

extern "C" void nvte_compute_amax(const NVTEBuffer* input, NVTEBuffer* amax, int device,
                                  NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_compute_amax";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_fp32_scalar(op, "amax", require(op, "amax", amax));

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  cast_detail::launch_amax(ctx, in, static_cast<float*>(amax->data));
}
