/* nvte_dequantize: out = round_to_out_dtype(float(q) * scale_inv). */
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
constexpr int kVecElems = 8;

template <typename OType, bool kE4M3, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ in, OType* __restrict__ out, size_t n,
                      const float* __restrict__ scale_inv_ptr) {
  const float scale_inv = *scale_inv_ptr;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  size_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const size_t num_vecs = n / kVecElems;
    const auto* vin = reinterpret_cast<const Vec<uint8_t, kVecElems>*>(in);
    auto* vout = reinterpret_cast<Vec<OType, kVecElems>*>(out);
    for (size_t i = first; i < num_vecs; i += stride) {
      const Vec<uint8_t, kVecElems> q = vin[i];
      Vec<OType, kVecElems> y;
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        y.v[j] = from_float<OType>(Fp8Format<kE4M3>::to_float(q.v[j]) * scale_inv);
      }
      vout[i] = y;
    }
    scalar_begin = num_vecs * kVecElems;
  }
  for (size_t i = scalar_begin + first; i < n; i += stride) {
    out[i] = from_float<OType>(Fp8Format<kE4M3>::to_float(in[i]) * scale_inv);
  }
}

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_dequantize(const NVTEBuffer* input, const NVTEBuffer* scale_inv,
                                NVTEBuffer* output, int device, NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_dequantize";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat8E4M3, kNVTEFloat8E5M2});
  check_fp32_scalar(op, "scale_inv", require(op, "scale_inv", scale_inv));
  const NVTEBuffer& out = require(op, "output", output);
  check_dtype(op, "output", out, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_same_numel(op, "output", out, "input", in);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("scale_inv", *scale_inv);
  ctx.check_on_device("output", out);
  const size_t n = numel(in);
  if (n == 0) return;

  const auto* in_bytes = static_cast<const uint8_t*>(in.data);
  const auto* scale_inv_data = static_cast<const float*>(scale_inv->data);
  dispatch_high_precision(op, out.dtype, [&](auto otype) {
    using OType = decltype(otype);
    auto* out_data = static_cast<OType*>(out.data);
    dispatch_fp8(op, in.dtype, [&](auto is_e4m3) {
      constexpr bool kE4M3 = decltype(is_e4m3)::value;
      const bool vectorized =
          aligned_to(in_bytes, kVecElems) && aligned_to(out_data, sizeof(OType) * kVecElems);
      const size_t work = vectorized ? n / kVecElems + n % kVecElems : n;
      const size_t wanted = std::max<size_t>(1, (work + kThreads - 1) / kThreads);
      const size_t blocks = std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * 8);
      if (vectorized) {
        dequantize_kernel<OType, kE4M3, true>
            <<<blocks, kThreads, 0, ctx.stream()>>>(in_bytes, out_data, n, scale_inv_data);
      } else {
        dequantize_kernel<OType, kE4M3, false>
            <<<blocks, kThreads, 0, ctx.stream()>>>(in_bytes, out_data, n, scale_inv_data);
      }
      ctx.check_launch("dequantize_kernel launch");
    });
  });
}
