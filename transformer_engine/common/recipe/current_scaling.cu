/* nvte_compute_scale_from_amax: the current-scaling scale, on the device (no host sync); and
 * nvte_compute_current_scale: a tensor's amax and that scale in one call (two launches). */
#include <cuda_runtime.h>

#include <cfloat>

#include "cast/launchers.h"
#include "transformer_engine/recipe.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

constexpr unsigned kSignAndExponentMask = 0xFF800000u;

constexpr int kBlockAmaxThreads = 256;

__device__ __forceinline__ float scale_from_amax(float a, float fp8_max, float epsilon,
                                                 bool force_pow_2_scales) {
  if (a < epsilon) a = epsilon;  // NaN compares false and passes through
  float s = (a == 0.0f || isinf(a) || isnan(a)) ? 1.0f : fp8_max / a;
  if (isinf(s) && s > 0.0f) s = FLT_MAX;
  if (force_pow_2_scales) s = __uint_as_float(__float_as_uint(s) & kSignAndExponentMask);
  return s;
}

__global__ void compute_scale_from_amax_kernel(const float* amax, float* scale, float fp8_max,
                                               float epsilon, bool force_pow_2_scales) {
  *scale = scale_from_amax(*amax, fp8_max, epsilon, force_pow_2_scales);
}

/* One block: the maximum of the per-block maxima (each >= 0, so the max over them in any order
 * is the amax the atomic path gives), then the scale from it. */
__global__ void __launch_bounds__(kBlockAmaxThreads)
    scale_from_block_amaxes_kernel(const float* block_maxima, size_t count, float* amax,
                                   float* scale, float fp8_max, float epsilon,
                                   bool force_pow_2_scales, const float* noop) {
  if (skip_requested(noop)) return;
  float m = 0.0f;
  for (size_t i = threadIdx.x; i < count; i += kBlockAmaxThreads) m = fmaxf(m, block_maxima[i]);
  m = block_max<kBlockAmaxThreads>(m);
  if (threadIdx.x == 0) {
    *amax = m;
    *scale = scale_from_amax(m, fp8_max, epsilon, force_pow_2_scales);
  }
}

}  // namespace
}  // namespace transformer_engine

namespace transformer_engine {
namespace cast_detail {

void check_scale_epsilon(const char* op, float epsilon) {
  if (!(epsilon >= 0.0f) || isinf(epsilon)) {
    throw_invalid(op, "epsilon=", epsilon, " must be a finite number >= 0");
  }
}

void launch_scale_from_amax(CallContext& ctx, const float* amax, float* scale, float fp8_max,
                            float epsilon, bool force_pow_2_scales) {
  compute_scale_from_amax_kernel<<<1, 1, 0, ctx.stream()>>>(amax, scale, fp8_max, epsilon,
                                                            force_pow_2_scales);
  ctx.check_launch("compute_scale_from_amax_kernel launch");
}

void launch_scale_from_block_amaxes(CallContext& ctx, const float* block_maxima, size_t count,
                                    float* amax, float* scale, float fp8_max, float epsilon,
                                    bool force_pow_2_scales, const float* noop) {
  scale_from_block_amaxes_kernel<<<1, kBlockAmaxThreads, 0, ctx.stream()>>>(
      block_maxima, count, amax, scale, fp8_max, epsilon, force_pow_2_scales, noop);
  ctx.check_launch("scale_from_block_amaxes_kernel launch");
}

}  // namespace cast_detail
}  // namespace transformer_engine

extern "C" void nvte_compute_scale_from_amax(const NVTEBuffer* amax, NVTEBuffer* scale,
                                             NVTEDType fp8_dtype, float epsilon,
                                             int force_pow_2_scales, int device,
                                             NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_compute_scale_from_amax";
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  const float max_value = fp8_max(op, fp8_dtype);
  cast_detail::check_scale_epsilon(op, epsilon);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("amax", *amax);
  ctx.check_on_device("scale", *scale);
  cast_detail::launch_scale_from_amax(ctx, static_cast<const float*>(amax->data),
                                      static_cast<float*>(scale->data), max_value, epsilon,
                                      force_pow_2_scales != 0);
}

extern "C" void nvte_compute_current_scale(const NVTEBuffer* input, NVTEBuffer* amax,
                                           NVTEBuffer* scale, NVTEDType fp8_dtype, float epsilon,
                                           int force_pow_2_scales, NVTEBuffer* amax_workspace,
                                           const NVTEBuffer* noop, int device,
                                           NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_compute_current_scale";
  // Every check runs before the first launch: a bad argument leaves every buffer untouched.
  const NVTEBuffer& in = require(op, "input", input);
  check_well_formed(op, "input", in);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  const NVTEBuffer& maxima = require(op, "amax_workspace", amax_workspace);
  cast_detail::check_amax_workspace(op, maxima);
  if (noop != nullptr) check_fp32_scalar(op, "noop", *noop);
  const float max_value = fp8_max(op, fp8_dtype);
  cast_detail::check_scale_epsilon(op, epsilon);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  ctx.check_on_device("scale", *scale);
  ctx.check_on_device("amax_workspace", maxima);
  if (noop != nullptr) ctx.check_on_device("noop", *noop);
  const float* noop_data = noop == nullptr ? nullptr : static_cast<const float*>(noop->data);
  auto* block_maxima = static_cast<float*>(maxima.data);
  const size_t count = cast_detail::launch_block_amaxes(ctx, in, block_maxima, noop_data);
  cast_detail::launch_scale_from_block_amaxes(
      ctx, block_maxima, count, static_cast<float*>(amax->data), static_cast<float*>(scale->data),
      max_value, epsilon, force_pow_2_scales != 0, noop_data);
}
