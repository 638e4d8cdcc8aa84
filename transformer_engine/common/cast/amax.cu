/* nvte_compute_amax: amax = max |x| (float32, NaN ignored), overwriting the buffer. */
#include <cuda_runtime.h>

#include <algorithm>

#include "cast/dispatch.cuh"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

constexpr int kThreads = 256;
constexpr int kVecElems = 8;

template <typename IType, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const IType* __restrict__ in, size_t n, float* __restrict__ amax) {
  float local_amax = 0.0f;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  size_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const size_t num_vecs = n / kVecElems;
    const auto* vin = reinterpret_cast<const Vec<IType, kVecElems>*>(in);
    for (size_t i = first; i < num_vecs; i += stride) {
      const Vec<IType, kVecElems> x = vin[i];
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) local_amax = amax_step(local_amax, to_float(x.v[j]));
    }
    scalar_begin = num_vecs * kVecElems;
  }
  for (size_t i = scalar_begin + first; i < n; i += stride) {
    local_amax = amax_step(local_amax, to_float(in[i]));
  }
  block_amax_to_global<kThreads>(local_amax, amax);
}

}  // namespace
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
  auto* amax_data = static_cast<float*>(amax->data);
  check_cuda(op, cudaMemsetAsync(amax_data, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  const size_t n = numel(in);
  if (n == 0) return;

  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    const auto* in_data = static_cast<const IType*>(in.data);
    const bool vectorized = aligned_to(in_data, sizeof(IType) * kVecElems);
    const size_t work = vectorized ? n / kVecElems + n % kVecElems : n;
    const size_t wanted = std::max<size_t>(1, (work + kThreads - 1) / kThreads);
    const size_t blocks = std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * 8);
    if (vectorized) {
      amax_kernel<IType, true><<<blocks, kThreads, 0, ctx.stream()>>>(in_data, n, amax_data);
    } else {
      amax_kernel<IType, false><<<blocks, kThreads, 0, ctx.stream()>>>(in_data, n, amax_data);
    }
    ctx.check_launch("amax_kernel launch");
  });
}
