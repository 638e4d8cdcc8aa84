/* nvte_dactivation_amax (activation_launch.cuh). */
#include "activation/activation_launch.cuh"

extern "C" void nvte_dactivation_amax(const NVTEBuffer* grad, const NVTEBuffer* input,
                                      NVTEActivation activation, NVTEBuffer* amax, int device,
                                      NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::activation_detail;
  const char* op = "nvte_dactivation_amax";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  const NVTEBuffer& g = check_grad(op, grad, in, shape);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  ctx.check_on_device("grad", g);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  with_backward_loader(op, g, in, act, shape, [&](const auto& loader) {
    launch_amax_only(ctx, loader, shape.rows, shape.cols, static_cast<float*>(amax->data));
  });
}
