/* nvte_compute_scale_from_amax: the current-scaling scale, on the device (no host sync). */
#include <cuda_runtime.h>

#include <cfloat>

#include "transformer_engine/recipe.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"

namespace transformer_engine {
namespace {

constexpr unsigned kSignAndExponentMask = 0xFF800000u;

__global__ void compute_scale_from_amax_kernel(const float* amax, float* scale, float fp8_max,
                                               float epsilon, bool force_pow_2_scales) {
  float a = *amax;
  if (a < epsilon) a = epsilon;  // NaN compares false and passes through
  float s = (a == 0.0f || isinf(a) || isnan(a)) ? 1.0f : fp8_max / a;
  if (isinf(s) && s > 0.0f) s = FLT_MAX;
  if (force_pow_2_scales) s = __uint_as_float(__float_as_uint(s) & kSignAndExponentMask);
  *scale = s;
}

}  // namespace
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
  if (!(epsilon >= 0.0f) || isinf(epsilon)) {
    throw_invalid(op, "epsilon=", epsilon, " must be a finite number >= 0");
  }

  CallContext ctx(op, device, stream);
  ctx.check_on_device("amax", *amax);
  ctx.check_on_device("scale", *scale);
  compute_scale_from_amax_kernel<<<1, 1, 0, ctx.stream()>>>(
      static_cast<const float*>(amax->data), static_cast<float*>(scale->data), max_value, epsilon,
      force_pow_2_scales != 0);
  ctx.check_launch("compute_scale_from_amax_kernel launch");
}
