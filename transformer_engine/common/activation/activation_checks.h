/* The activation entry points' argument checks (dtypes, shapes, the FP8 arguments, devices);
 * each throws with the operation's name, the offending value and what to pass instead. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_CHECKS_H_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_CHECKS_H_

#include <cstddef>

#include "cast/cast_transpose.cuh"
#include "transformer_engine/activation.h"
#include "transformer_engine/transformer_engine.h"
#include "util/device.h"

namespace transformer_engine {
namespace activation_detail {

/* A known kind, sigmoid and clamped SwiGLU gated only, clamped SwiGLU's limit >= 0. */
NVTEActivation check_activation(const char* op, const NVTEActivation& act);

struct ActivationShape {
  size_t rows, in_cols, cols;
};

/* `input` [rows, in_cols] and the activation's output width; throws on a bad shape. */
ActivationShape check_input(const char* op, const NVTEBuffer& in, bool gated);

/* A result buffer: [rows, cols], the input's dtype when high precision, and the FP8 arguments
 * present exactly when it is FP8; returns the kernels' pointers. */
cast_detail::CastArgs check_result(const char* op, const char* name, const NVTEBuffer& out,
                                   const NVTEBuffer& in, size_t rows, size_t cols,
                                   const NVTEBuffer* scale, NVTEBuffer* output_t,
                                   NVTEBuffer* amax, NVTEBuffer* scale_inv);

/* The FP8 arguments that are present are on ctx's device. */
void check_fp8_on_device(CallContext& ctx, const NVTEBuffer* scale, NVTEBuffer* output_t,
                         NVTEBuffer* amax, NVTEBuffer* scale_inv);

/* `grad` [rows, cols] in the input's dtype; throws otherwise. */
const NVTEBuffer& check_grad(const char* op, const NVTEBuffer* grad, const NVTEBuffer& in,
                             const ActivationShape& shape);

/* nvte_dactivation's bias gradient: `dbias` and `workspace` come with the transposed copy. */
void check_dactivation_dbias(const char* op, const ActivationShape& shape, const NVTEBuffer& g,
                             const NVTEBuffer* output_t, const NVTEBuffer* dbias,
                             const NVTEBuffer* workspace);

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_CHECKS_H_
