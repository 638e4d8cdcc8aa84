/*! \file cast.h
 *  \brief FP8 casts: quantize (optionally with the transposed copy), dequantize, amax.
 *
 *  Conventions (the pure-PyTorch reference in transformer_engine/pytorch/reference.py is the
 *  executable specification and agrees bit for bit):
 *  - `q = fp8(clamp(x * scale, -max, max))` with the product in float32 and round-to-nearest-
 *    even; +-Inf saturates to +-max; NaN becomes the canonical byte 0x7F in both formats.
 *  - amax is `max |x|` of the unscaled input in float32; NaN elements are ignored.
 *  - Tensors are viewed as 2-D `[rows, cols]` with `cols` the last extent; the transposed copy
 *    has shape `[cols, rows]` (the caller may describe it as `(cols, *leading)`).
 */
#ifndef TRANSFORMER_ENGINE_CAST_H_
#define TRANSFORMER_ENGINE_CAST_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief Cast a high-precision tensor to FP8 with a given scale.
 *
 *  \param[in]     input     Float32, Float16 or BFloat16 tensor.
 *  \param[in]     scale     One Float32 element: the scale to multiply by before the cast.
 *  \param[out]    output    FP8 tensor (E4M3 or E5M2; its dtype selects the format) with
 *                           `input`'s number of elements.
 *  \param[out]    output_t  Optional (null): FP8 tensor of the same format with shape
 *                           `[cols, rows]`, written in the same pass (cast+transpose).
 *  \param[in,out] amax      Optional: one Float32 element; `max |input|` is max-accumulated into
 *                           it (never reset here).
 *  \param[out]    scale_inv Optional: one Float32 element that receives `1 / scale`.
 *  \param[in]     noop      Optional: one Float32 element; if it holds 1.0 the call writes
 *                           nothing (checked on the device, so no host synchronisation).
 *  \param[in]     device    CUDA device index all buffers live on.
 *  \param[in]     stream    Stream of `device` to launch on.
 */
NVTE_API void nvte_quantize(const NVTEBuffer* input, const NVTEBuffer* scale, NVTEBuffer* output,
                            NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv,
                            const NVTEBuffer* noop, int device, NVTEStream stream);

/*! \brief Float32 elements the workspace of nvte_quantize_dbias needs for a `[rows, cols]` input
 *         (one column sum per 64-row tile).
 */
NVTE_API size_t nvte_quantize_dbias_workspace_elements(size_t rows, size_t cols);

/*! \brief nvte_quantize with the transposed copy, plus the input's sum over its rows: the bias
 *         gradient of a linear layer, computed from its output gradient in the same pass.
 *
 *  `dbias[c] = sum_r input[r, c]`, accumulated in float32 in a fixed order (per 64-row tile,
 *  then over the tiles; deterministic, no atomics) and rounded once to `dbias`'s dtype. The
 *  cast, transposed copy, amax and scale_inv are exactly those of nvte_quantize.
 *
 *  \param[in]     input     Float32, Float16 or BFloat16 tensor, viewed as `[rows, cols]`.
 *  \param[in]     scale     One Float32 element.
 *  \param[out]    output    FP8 tensor with `input`'s number of elements.
 *  \param[out]    output_t  FP8 tensor of shape `[cols, rows]` (required).
 *  \param[in,out] amax      Optional: one Float32 element, max-accumulated.
 *  \param[out]    scale_inv Optional: one Float32 element that receives `1 / scale`.
 *  \param[out]    dbias     Tensor of `input`'s dtype and shape `[cols]`.
 *  \param[out]    workspace Float32 scratch with at least
 *                           nvte_quantize_dbias_workspace_elements(rows, cols) elements.
 *  \param[in]     device    CUDA device index all buffers live on.
 *  \param[in]     stream    Stream of `device` to launch on.
 */
NVTE_API void nvte_quantize_dbias(const NVTEBuffer* input, const NVTEBuffer* scale,
                                  NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                                  NVTEBuffer* scale_inv, NVTEBuffer* dbias, NVTEBuffer* workspace,
                                  int device, NVTEStream stream);

/*! \brief Current scaling's cast in one call: `amax = max |input|`, `scale` from it as
 *         nvte_compute_scale_from_amax computes it, then nvte_quantize with that scale (or
 *         nvte_quantize_dbias when `dbias` is given). Bitwise the same as those three calls.
 *
 *  Every argument is checked before anything is launched.
 *
 *  \param[in]  input     Float32, Float16 or BFloat16 tensor.
 *  \param[out] output    FP8 tensor (its dtype selects the format) with `input`'s elements.
 *  \param[out] output_t  Optional (null unless `dbias` is given): the `[cols, rows]` copy.
 *  \param[out] amax      One Float32 element, overwritten with `max |input|`.
 *  \param[out] scale     One Float32 element, overwritten with the scale.
 *  \param[out] scale_inv Optional: one Float32 element that receives `1 / scale`.
 *  \param[in]  epsilon   Lower bound on the amax the scale uses (finite, >= 0).
 *  \param[in]  force_pow_2_scales Non-zero: round the scale down to a power of 2.
 *  \param[out] dbias     Optional: the bias gradient, as in nvte_quantize_dbias.
 *  \param[out] workspace Required with `dbias`: as in nvte_quantize_dbias.
 *  \param[out] amax_workspace Optional: Float32 scratch of at least
 *                        nvte_amax_workspace_elements() elements for the amax pass's per-block
 *                        maxima (saves the launch that zeroes `amax` first; same bits).
 *  \param[in]  device    CUDA device index all buffers live on.
 *  \param[in]  stream    Stream of `device` to launch on.
 */
NVTE_API void nvte_quantize_current_scaling(const NVTEBuffer* input, NVTEBuffer* output,
                                            NVTEBuffer* output_t, NVTEBuffer* amax,
                                            NVTEBuffer* scale, NVTEBuffer* scale_inv, float epsilon,
                                            int force_pow_2_scales, NVTEBuffer* dbias,
                                            NVTEBuffer* workspace, NVTEBuffer* amax_workspace,
                                            int device, NVTEStream stream);

/*! \brief Float32 elements of nvte_quantize_current_scaling's `amax_workspace`. */
NVTE_API size_t nvte_amax_workspace_elements(void);

/*! \brief Dequantize FP8 to Float32, Float16 or BFloat16: `out = round(float(q) * scale_inv)`.
 *
 *  \param[in]  input     FP8 tensor (E4M3 or E5M2).
 *  \param[in]  scale_inv One Float32 element.
 *  \param[out] output    Float32, Float16 or BFloat16 tensor with `input`'s number of elements.
 *  \param[in]  device    CUDA device index all buffers live on.
 *  \param[in]  stream    Stream of `device` to launch on.
 */
NVTE_API void nvte_dequantize(const NVTEBuffer* input, const NVTEBuffer* scale_inv,
                              NVTEBuffer* output, int device, NVTEStream stream);

/*! \brief Overwrite `amax` with `max |input|` (float32, NaN ignored, 0 for an empty input).
 *
 *  \param[in]  input  Float32, Float16 or BFloat16 tensor.
 *  \param[out] amax   One Float32 element.
 *  \param[in]  device CUDA device index all buffers live on.
 *  \param[in]  stream Stream of `device` to launch on.
 */
NVTE_API void nvte_compute_amax(const NVTEBuffer* input, NVTEBuffer* amax, int device,
                                NVTEStream stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_CAST_H_
