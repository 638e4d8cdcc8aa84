/* nvte_quantize: saturating FP8 cast with amax, scale_inv, optional transposed copy and no-op
 * flag. Two kernels: a flat vectorised one for the row-wise copy alone, and the 64x64-tiled one
 * of cast_transpose.cuh that writes both copies in the same pass (one read of the input). */
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cast/cast_transpose.cuh"
#include "cast/dispatch.cuh"
#include "cast/launchers.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

using namespace cast_detail;

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

}  // namespace
}  // namespace transformer_engine

namespace transformer_engine {
namespace cast_detail {

QuantizeShape check_quantize_args(const char* op, const NVTEBuffer* input, const NVTEBuffer* scale,
                                  NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                                  NVTEBuffer* scale_inv, const NVTEBuffer* noop) {
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  const NVTEBuffer& out = require(op, "output", output);
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
  return {n, rows, cols};
}

CastArgs checked_cast_args(CallContext& ctx, const NVTEBuffer* input, const NVTEBuffer* scale,
                           NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                           NVTEBuffer* scale_inv, const NVTEBuffer* noop) {
  ctx.check_on_device("input", *input);
  ctx.check_on_device("scale", *scale);
  ctx.check_on_device("output", *output);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);
  if (noop != nullptr) ctx.check_on_device("noop", *noop);
  return CastArgs{static_cast<const float*>(scale->data), optional_data(amax),
                  optional_data(scale_inv),
                  noop == nullptr ? nullptr : static_cast<const float*>(noop->data)};
}

void launch_quantize(CallContext& ctx, const NVTEBuffer& in, NVTEBuffer& out, NVTEBuffer* output_t,
                     const QuantizeShape& shape, const CastArgs& args) {
  const char* op = ctx.op();
  const size_t n = shape.n, rows = shape.rows, cols = shape.cols;
  auto* out_bytes = static_cast<uint8_t*>(out.data);
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    const auto* in_data = static_cast<const IType*>(in.data);
    dispatch_fp8(op, out.dtype, [&](auto is_e4m3) {
      constexpr bool kE4M3 = decltype(is_e4m3)::value;
      if (output_t != nullptr && n > 0) {
        launch_cast_transpose<IType, kE4M3, false>(in_data, out_bytes,
                                                   static_cast<uint8_t*>(output_t->data), rows,
                                                   cols, args, nullptr, ctx);
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

}  // namespace cast_detail
}  // namespace transformer_engine

extern "C" void nvte_quantize(const NVTEBuffer* input, const NVTEBuffer* scale, NVTEBuffer* output,
                              NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv,
                              const NVTEBuffer* noop, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::cast_detail;
  const char* op = "nvte_quantize";
  const QuantizeShape shape =
      check_quantize_args(op, input, scale, output, output_t, amax, scale_inv, noop);
  CallContext ctx(op, device, stream);
  const CastArgs args =
      checked_cast_args(ctx, input, scale, output, output_t, amax, scale_inv, noop);
  launch_quantize(ctx, *input, *output, output_t, shape, args);
}
