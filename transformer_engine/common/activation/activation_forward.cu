/* nvte_activation and nvte_activation_amax (activation_launch.cuh). */
#include "activation/activation_launch.cuh"

extern "C" void nvte_activation(const NVTEBuffer* input, NVTEActivation activation,
                                NVTEBuffer* output, const NVTEBuffer* scale, NVTEBuffer* output_t,
                                NVTEBuffer* amax, NVTEBuffer* scale_inv, int device,
                                NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::activation_detail;
  const char* op = "nvte_activation";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  require(op, "output", output);
  NVTEBuffer& out = *output;
  const CastArgs args = check_result(op, "output", out, in, shape.rows, shape.cols, scale,
                                     output_t, amax, scale_inv);
  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("output", out);
  check_fp8_on_device(ctx, scale, output_t, amax, scale_inv);
  with_forward_loader(op, in, act, shape, [&](const auto& loader) {
    launch_result<false>(ctx, loader, shape.rows, shape.cols, out, output_t, args, nullptr);
  });
}

extern "C" void nvte_activation_amax(const NVTEBuffer* input, NVTEActivation activation,
                                     NVTEBuffer* amax, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::activation_detail;
  const char* op = "nvte_activation_amax";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  with_forward_loader(op, in, act, shape, [&](const auto& loader) {
    launch_amax_only(ctx, loader, shape.rows, shape.cols, static_cast<float*>(amax->data));
  });
}
