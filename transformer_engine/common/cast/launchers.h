/* The launch halves of the cast and scale entry points. Each nvte_* entry checks its arguments,
 * opens a CallContext, checks that every buffer is on its device, then calls one of these; a
 * fused entry (nvte_quantize_current_scaling) checks everything once and calls several in a row
 * on one context, so a bad argument is reported before anything runs. */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_LAUNCHERS_H_
#define TRANSFORMER_ENGINE_COMMON_CAST_LAUNCHERS_H_

#include "cast/cast_transpose.cuh"
#include "transformer_engine/transformer_engine.h"
#include "util/device.h"

namespace transformer_engine {
namespace cast_detail {

/* nvte_quantize's kernels: the tiled cast+transpose when `output_t` is given, else the flat
 * cast. */
void launch_quantize(CallContext& ctx, const NVTEBuffer& input, NVTEBuffer& output,
                     NVTEBuffer* output_t, const QuantizeShape& shape, const CastArgs& args);

/* nvte_quantize_dbias's checks of `dbias` and `workspace` (after check_quantize_args). */
void check_dbias_args(const char* op, const QuantizeShape& shape, const NVTEBuffer& input,
                      const NVTEBuffer* dbias, const NVTEBuffer* workspace);

/* nvte_quantize_dbias's kernels (buffers already checked, on ctx's device). */
void launch_quantize_dbias(CallContext& ctx, const NVTEBuffer& input, NVTEBuffer& output,
                           NVTEBuffer& output_t, const QuantizeShape& shape, const CastArgs& args,
                           NVTEBuffer& dbias, NVTEBuffer& workspace);

/* Adds the per-tile column sums of a [rows, cols] tiled cast up into `dbias` (its dtype). */
void launch_dbias_from_column_sums(CallContext& ctx, const float* column_sums, NVTEBuffer& dbias,
                                   size_t rows, size_t cols);

/* nvte_compute_amax's work: zero `amax`, then max-reduce |input| into it. */
void launch_amax(CallContext& ctx, const NVTEBuffer& input, float* amax);

/* The same pass writing one maximum per block into `block_maxima` (at least
 * nvte_amax_workspace_elements() floats; nothing to zero first). Returns how many it wrote (0
 * for an empty input). With `noop` (one float32 on the device) holding 1.0 the pass reads and
 * writes nothing. */
size_t launch_block_amaxes(CallContext& ctx, const NVTEBuffer& input, float* block_maxima,
                           const float* noop = nullptr);

/* Throws unless `workspace` is a well-formed Float32 buffer of at least
 * nvte_amax_workspace_elements() elements (launch_block_amaxes' `block_maxima`). */
void check_amax_workspace(const char* op, const NVTEBuffer& workspace);

/* Throws unless `epsilon` is finite and >= 0. */
void check_scale_epsilon(const char* op, float epsilon);

/* nvte_compute_scale_from_amax's kernel: `scale = fp8_max / max(amax, epsilon)` on the device. */
void launch_scale_from_amax(CallContext& ctx, const float* amax, float* scale, float fp8_max,
                            float epsilon, bool force_pow_2_scales);

/* The same scale from `count` per-block maxima (launch_block_amaxes), whose maximum it also
 * writes to `amax` (0 when count is 0); nothing written when `noop` holds 1.0. */
void launch_scale_from_block_amaxes(CallContext& ctx, const float* block_maxima, size_t count,
                                    float* amax, float* scale, float fp8_max, float epsilon,
                                    bool force_pow_2_scales, const float* noop = nullptr);

}  // namespace cast_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_LAUNCHERS_H_
