/* nvte_quantize_current_scaling: current scaling's whole cast in one call: amax of the input,
 * the scale from it, then the cast (optionally with the transposed copy and the bias gradient).
 * The same bits as nvte_compute_amax + nvte_compute_scale_from_amax + nvte_quantize (or
 * nvte_quantize_dbias), with one argument check and one device context instead of three: the
 * host cost of a cast is what limits an FP8 step at the sizes of one GPU's layer. With
 * `amax_workspace` the amax pass writes one maximum per block there and the scale kernel
 * reduces them, which saves the memset that zeroes the atomics' target: three launches (four
 * with the bias gradient) instead of four. */
#include <cuda_runtime.h>

#include "cast/launchers.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"

extern "C" void nvte_quantize_current_scaling(const NVTEBuffer* input, NVTEBuffer* output,
                                              NVTEBuffer* output_t, NVTEBuffer* amax,
                                              NVTEBuffer* scale, NVTEBuffer* scale_inv,
                                              float epsilon, int force_pow_2_scales,
                                              NVTEBuffer* dbias, NVTEBuffer* workspace,
                                              NVTEBuffer* amax_workspace, int device,
                                              NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::cast_detail;
  const char* op = "nvte_quantize_current_scaling";
  // Every check runs before the first launch: a bad argument leaves every buffer untouched.
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  const QuantizeShape shape =
      check_quantize_args(op, input, scale, output, output_t, nullptr, scale_inv, nullptr);
  const bool with_dbias = dbias != nullptr || workspace != nullptr;
  if (with_dbias) {
    if (output_t == nullptr) {
      throw_invalid(op,
                    "output_t is required with dbias: the bias gradient comes with the "
                    "transposed copy");
    }
    check_dbias_args(op, shape, *input, dbias, workspace);
  }
  if (amax_workspace != nullptr) check_amax_workspace(op, *amax_workspace);
  const float max_value = fp8_max(op, output->dtype);
  check_scale_epsilon(op, epsilon);

  CallContext ctx(op, device, stream);
  const CastArgs args =
      checked_cast_args(ctx, input, scale, output, output_t, nullptr, scale_inv, nullptr);
  ctx.check_on_device("amax", *amax);
  if (with_dbias) {
    ctx.check_on_device("dbias", *dbias);
    ctx.check_on_device("workspace", *workspace);
  }
  if (amax_workspace != nullptr) ctx.check_on_device("amax_workspace", *amax_workspace);
  auto* amax_data = static_cast<float*>(amax->data);
  auto* scale_data = static_cast<float*>(scale->data);
  if (amax_workspace != nullptr) {
    auto* block_maxima = static_cast<float*>(amax_workspace->data);
    const size_t count = launch_block_amaxes(ctx, *input, block_maxima);
    launch_scale_from_block_amaxes(ctx, block_maxima, count, amax_data, scale_data, max_value,
                                   epsilon, force_pow_2_scales != 0);
  } else {
    launch_amax(ctx, *input, amax_data);
    launch_scale_from_amax(ctx, amax_data, scale_data, max_value, epsilon,
                           force_pow_2_scales != 0);
  }
  if (with_dbias) {
    launch_quantize_dbias(ctx, *input, *output, *output_t, shape, args, *dbias, *workspace);
  } else {
    launch_quantize(ctx, *input, *output, output_t, shape, args);
  }
}
