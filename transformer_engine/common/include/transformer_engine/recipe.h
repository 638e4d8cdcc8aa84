/*! \file recipe.h
 *  \brief Scaling-factor updates: current scaling and the fused delayed-scaling update.
 */
#ifndef TRANSFORMER_ENGINE_RECIPE_H_
#define TRANSFORMER_ENGINE_RECIPE_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief How the delayed-scaling update picks the amax a scale is computed from. */
typedef enum {
  kNVTEAmaxMax = 0,        /*!< maximum over the history window and the new amax */
  kNVTEAmaxMostRecent = 1, /*!< the new amax alone */
} NVTEAmaxComputeAlgo;

/*! \brief Current scaling: `scale = fp8_max / max(amax, epsilon)`.
 *
 *  A zero, infinite or NaN amax (after the epsilon clamp, which NaN passes) gives 1.0; a result of
 *  +Inf becomes FLT_MAX; with `force_pow_2_scales` the mantissa is cleared (rounds down to a
 *  power of 2).
 *
 *  \param[in]  amax               One Float32 element.
 *  \param[out] scale              One Float32 element.
 *  \param[in]  fp8_dtype          kNVTEFloat8E4M3 (max 448) or kNVTEFloat8E5M2 (max 57344).
 *  \param[in]  epsilon            Lower bound applied to amax (>= 0).
 *  \param[in]  force_pow_2_scales Non-zero to round the scale down to a power of 2.
 *  \param[in]  device             CUDA device index both buffers live on.
 *  \param[in]  stream             Stream of `device` to launch on.
 */
NVTE_API void nvte_compute_scale_from_amax(const NVTEBuffer* amax, NVTEBuffer* scale,
                                           NVTEDType fp8_dtype, float epsilon,
                                           int force_pow_2_scales, int device, NVTEStream stream);

/*! \brief Current scaling's scale of a tensor: `amax = max |input|` (float32, NaN ignored, 0
 *         for an empty input), then `scale` from it as nvte_compute_scale_from_amax computes it.
 *
 *  The same bits as nvte_compute_amax followed by nvte_compute_scale_from_amax, in two launches
 *  (the amax pass writes one maximum per block into `amax_workspace`, which the scale kernel
 *  reduces: no buffer to zero first).
 *
 *  \param[in]  input              Float32, Float16 or BFloat16 tensor.
 *  \param[out] amax               One Float32 element.
 *  \param[out] scale              One Float32 element.
 *  \param[in]  fp8_dtype          kNVTEFloat8E4M3 or kNVTEFloat8E5M2.
 *  \param[in]  epsilon            Lower bound applied to amax (finite, >= 0).
 *  \param[in]  force_pow_2_scales Non-zero to round the scale down to a power of 2.
 *  \param[out] amax_workspace     Float32 scratch of at least nvte_amax_workspace_elements().
 *  \param[in]  noop               Optional: one Float32 element; when it holds 1.0 on the device
 *                                 nothing is read or written (a CUDA graph's cached weight).
 *  \param[in]  device             CUDA device index all buffers live on.
 *  \param[in]  stream             Stream of `device` to launch on.
 */
NVTE_API void nvte_compute_current_scale(const NVTEBuffer* input, NVTEBuffer* amax,
                                         NVTEBuffer* scale, NVTEDType fp8_dtype, float epsilon,
                                         int force_pow_2_scales, NVTEBuffer* amax_workspace,
                                         const NVTEBuffer* noop, int device, NVTEStream stream);

/*! \brief Delayed scaling: roll many amax histories and update their scales in one launch.
 *
 *  For every slot `i` of every pair (history `H` of shape `[L, N]`, scale of shape `[N]`): `a` is
 *  the slot's entry of `amax_reduction_buffer` if that is given and non-zero, else `H[0, i]`. If
 *  `a == 0` the slot is left as it is (no roll, scale kept). Otherwise the candidate amax is
 *  `max(H[1:, i], a)` (NaN propagates) for kNVTEAmaxMax or `a` for kNVTEAmaxMostRecent; the
 *  history rolls so `a` is the last row and row 0 is 0; and if the candidate is finite and
 *  positive, `scale = (fp8_max * 2^-margin) / candidate` (+Inf becomes FLT_MAX), else the scale
 *  is kept. `fp8_max * 2^-margin` is computed in double on the host and rounded to float once.
 *
 *  \param[in]     amax_reduction_buffer Optional Float32 vector: row 0 of every history,
 *                                       concatenated in order (e.g. after an all-reduce).
 *  \param[in,out] amax_histories        `num_pairs` Float32 tensors of shape `[L, N_k]`.
 *  \param[in,out] scales                `num_pairs` Float32 tensors of shape `[N_k]`.
 *  \param[in]     num_pairs             Number of (history, scale) pairs.
 *  \param[in]     algo                  kNVTEAmaxMax or kNVTEAmaxMostRecent.
 *  \param[in]     fp8_dtype             kNVTEFloat8E4M3 or kNVTEFloat8E5M2.
 *  \param[in]     margin                Scale margin (exponent of 2), finite.
 *  \param[in]     device                CUDA device index all buffers live on.
 *  \param[in]     stream                Stream of `device` to launch on.
 */
NVTE_API void nvte_delayed_scaling_update(const NVTEBuffer* amax_reduction_buffer,
                                          NVTEBuffer* const* amax_histories,
                                          NVTEBuffer* const* scales, size_t num_pairs,
                                          NVTEAmaxComputeAlgo algo, NVTEDType fp8_dtype,
                                          double margin, int device, NVTEStream stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_RECIPE_H_
