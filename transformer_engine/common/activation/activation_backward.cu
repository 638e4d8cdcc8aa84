/* nvte_dactivation (activation_launch.cuh). */
#include "activation/activation_launch.cuh"

#include "cast/launchers.h"

extern "C" void nvte_dactivation(const NVTEBuffer* grad, const NVTEBuffer* input,
                                 NVTEActivation activation, NVTEBuffer* dinput,
                                 const NVTEBuffer* scale, NVTEBuffer* output_t, NVTEBuffer* amax,
                                 NVTEBuffer* scale_inv, NVTEBuffer* dbias, NVTEBuffer* workspace,
                                 int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::activation_detail;
  const char* op = "nvte_dactivation";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  const NVTEBuffer& g = check_grad(op, grad, in, shape);
  require(op, "dinput", dinput);
  NVTEBuffer& dx = *dinput;
  const CastArgs args = check_result(op, "dinput", dx, in, shape.rows, shape.in_cols, scale,
                                     output_t, amax, scale_inv);
  check_dactivation_dbias(op, shape, g, output_t, dbias, workspace);
  CallContext ctx(op, device, stream);
  ctx.check_on_device("grad", g);
  ctx.check_on_device("input", in);
  ctx.check_on_device("dinput", dx);
  check_fp8_on_device(ctx, scale, output_t, amax, scale_inv);
  if (dbias != nullptr) {
    ctx.check_on_device("dbias", *dbias);
    ctx.check_on_device("workspace", *workspace);
  }
  float* column_sums = workspace == nullptr ? nullptr : static_cast<float*>(workspace->data);
  // The loaders walk the output gradient's [rows, cols]; a gated one gives both halves of
  // dinput's row at each position.
  with_backward_loader(op, g, in, act, shape, [&](const auto& loader) {
    launch_result<true>(ctx, loader, shape.rows, shape.cols, dx, output_t, args, column_sums);
  });
  if (dbias != nullptr && shape.in_cols > 0) {
    cast_detail::launch_dbias_from_column_sums(ctx, column_sums, *dbias, shape.rows,
                                               shape.in_cols);
  }
}
