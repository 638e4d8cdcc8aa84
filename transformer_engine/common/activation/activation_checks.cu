/* The activation entry points' argument checks (activation_checks.h). Host code only. */
#include "activation/activation_checks.h"

#include "cast/launchers.h"
#include "util/buffer.h"
#include "util/errors.h"

namespace transformer_engine {
namespace activation_detail {

using cast_detail::CastArgs;

NVTEActivation check_activation(const char* op, const NVTEActivation& act) {
  if (act.kind < 0 || act.kind >= kNVTENumActivations) {
    throw_invalid(op, "unknown activation kind ", act.kind);
  }
  const bool gated = act.gated != 0;
  if ((act.kind == kNVTEActClampedSilu || act.kind == kNVTEActSigmoid) && !gated) {
    throw_invalid(op, "activation kind ", act.kind,
                  " exists only gated (GLU, clamped SwiGLU); set gated = 1");
  }
  if (act.kind == kNVTEActClampedSilu && !(act.limit >= 0.0f)) {
    throw_invalid(op, "clamped SwiGLU needs limit >= 0, got ", act.limit);
  }
  return act;
}

ActivationShape check_input(const char* op, const NVTEBuffer& in, bool gated) {
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  if (in.ndim == 0) throw_invalid(op, "input must have at least one dimension (the features)");
  const size_t in_cols = last_dim(in);
  if (gated && in_cols % 2 != 0) {
    throw_invalid(op, "a gated activation needs an even last extent (two halves), got ",
                  in_cols);
  }
  const size_t rows = in_cols == 0 ? leading_rows(in) : numel(in) / in_cols;
  return {rows, in_cols, gated ? in_cols / 2 : in_cols};
}

namespace {

void check_extent(const char* op, const char* name, const NVTEBuffer& buffer, size_t rows,
                  size_t cols) {
  check_well_formed(op, name, buffer);
  if (buffer.ndim == 0 || last_dim(buffer) != cols || numel(buffer) != rows * cols) {
    throw_invalid(op, name, " must hold [", rows, ", ", cols, "] elements with last extent ",
                  cols);
  }
}

/* The FP8 arguments: present exactly when `output` is FP8; returns the kernels' pointers. */
CastArgs check_fp8_args(const char* op, const NVTEBuffer& output, const char* output_name,
                        const NVTEBuffer* scale, NVTEBuffer* output_t, NVTEBuffer* amax,
                        NVTEBuffer* scale_inv, size_t rows, size_t cols) {
  if (!is_fp8(output.dtype)) {
    if (scale != nullptr || output_t != nullptr || amax != nullptr || scale_inv != nullptr) {
      throw_invalid(op, output_name, " is high precision (", dtype_name(output.dtype),
                    "); scale, output_t, amax and scale_inv apply to FP8 outputs only");
    }
    return CastArgs{nullptr, nullptr, nullptr, nullptr};
  }
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  if (output_t != nullptr) {
    check_well_formed(op, "output_t", *output_t);
    if (output_t->dtype != output.dtype) {
      throw_invalid(op, "output_t has dtype ", dtype_name(output_t->dtype), " but ", output_name,
                    " has ", dtype_name(output.dtype), "; both copies use one FP8 format");
    }
    if (output_t->ndim == 0 || output_t->shape[0] != cols || numel(*output_t) != rows * cols) {
      throw_invalid(op, "output_t must have shape [", cols, ", ", rows, "]");
    }
  }
  if (amax != nullptr) check_fp32_scalar(op, "amax", *amax);
  if (scale_inv != nullptr) check_fp32_scalar(op, "scale_inv", *scale_inv);
  return CastArgs{static_cast<const float*>(scale->data), cast_detail::optional_data(amax),
                  cast_detail::optional_data(scale_inv), nullptr};
}

}  // namespace

CastArgs check_result(const char* op, const char* name, const NVTEBuffer& out,
                      const NVTEBuffer& in, size_t rows, size_t cols, const NVTEBuffer* scale,
                      NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  check_extent(op, name, out, rows, cols);
  if (!is_fp8(out.dtype) && out.dtype != in.dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(out.dtype), " but input has ",
                  dtype_name(in.dtype), "; a high-precision ", name, " keeps the input's dtype");
  }
  return check_fp8_args(op, out, name, scale, output_t, amax, scale_inv, rows, cols);
}

void check_fp8_on_device(CallContext& ctx, const NVTEBuffer* scale, NVTEBuffer* output_t,
                         NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  if (scale != nullptr) ctx.check_on_device("scale", *scale);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);
}

const NVTEBuffer& check_grad(const char* op, const NVTEBuffer* grad, const NVTEBuffer& in,
                             const ActivationShape& shape) {
  const NVTEBuffer& g = require(op, "grad", grad);
  check_extent(op, "grad", g, shape.rows, shape.cols);
  if (g.dtype != in.dtype) {
    throw_invalid(op, "grad has dtype ", dtype_name(g.dtype), " but input has ",
                  dtype_name(in.dtype), "; pass both in the activation dtype");
  }
  return g;
}

void check_dactivation_dbias(const char* op, const ActivationShape& shape, const NVTEBuffer& g,
                             const NVTEBuffer* output_t, const NVTEBuffer* dbias,
                             const NVTEBuffer* workspace) {
  if (dbias == nullptr && workspace == nullptr) return;
  if (output_t == nullptr) {
    throw_invalid(op, "dbias comes with the transposed FP8 copy: pass output_t (and an FP8 "
                      "dinput) or compute the bias gradient separately");
  }
  const cast_detail::QuantizeShape qshape{shape.rows * shape.in_cols, shape.rows, shape.in_cols};
  cast_detail::check_dbias_args(op, qshape, g, dbias, workspace);
}

}  // namespace activation_detail
}  // namespace transformer_engine
