/*! \file normalization.h
 *  \brief LayerNorm and RMSNorm, forward (optionally writing FP8) and backward.
 *
 *  Conventions (transformer_engine/pytorch/cpp_extensions/normalization.py states the same
 *  formulas as PyTorch operations):
 *  - The input x is viewed as `[rows, H]`, H its last extent (H >= 1). gamma (and beta) hold H
 *    elements in float32 or x's dtype. The effective scale is `g = gamma`, or `g = 1 + gamma`
 *    with zero_centered_gamma (formed in float32).
 *  - Everything is computed in float32 registers; x is read once per pass.
 *  - LayerNorm: `mean = sum(x) / H`, `var = sum((x - mean)^2) / H` (two passes over the row held
 *    in registers, biased variance), `rsigma = rsqrtf(var + eps)` (the hardware reciprocal
 *    square root, as PyTorch's CUDA kernels), `y = (x - mean) * rsigma * g + beta`.
 *    RMSNorm: `rsigma = rsqrtf(sum(x^2) / H + eps)`, `y = x * rsigma * g`.
 *  - FP8 output: each y is first rounded to x's dtype, then multiplied by `scale` and cast as
 *    nvte_quantize casts (saturating, NaN kept), so the bytes equal "norm in x's dtype, then
 *    nvte_quantize"; the amax is taken over the rounded, unscaled values.
 */
#ifndef TRANSFORMER_ENGINE_NORMALIZATION_H_
#define TRANSFORMER_ENGINE_NORMALIZATION_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief Forward LayerNorm (`rms == 0`) or RMSNorm (`rms != 0`).
 *
 *  \param[in]     input     Float32, Float16 or BFloat16 `[..., H]`.
 *  \param[in]     gamma     `[H]`, Float32 or input's dtype.
 *  \param[in]     beta      LayerNorm only, optional (null: no shift): `[H]`, gamma's dtype.
 *  \param[in]     epsilon   Added to the variance (finite, >= 0).
 *  \param[out]    output    input's shape: input's dtype, or FP8 (E4M3/E5M2) cast with `scale`.
 *  \param[in]     scale     FP8 output only: one Float32 element.
 *  \param[out]    output_t  FP8 output only, optional: the `[H, rows]` transposed copy (then
 *                           rsigma, and mean for LayerNorm, are required: the call writes
 *                           them, then both FP8 copies from them, as
 *                           nvte_norm_forward_from_stats).
 *  \param[in,out] amax      FP8 output only, optional: max-accumulated with `max |y|`.
 *  \param[out]    scale_inv FP8 output only, optional: receives `1 / scale`.
 *  \param[out]    mean      LayerNorm only, optional: `[rows]` Float32.
 *  \param[out]    rsigma    Optional: `[rows]` Float32.
 */
NVTE_API void nvte_norm_forward(const NVTEBuffer* input, const NVTEBuffer* gamma,
                                const NVTEBuffer* beta, float epsilon, int zero_centered_gamma,
                                int rms, NVTEBuffer* output, const NVTEBuffer* scale,
                                NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv,
                                NVTEBuffer* mean, NVTEBuffer* rsigma, int device,
                                NVTEStream stream);

/*! \brief `amax = max |y|` over the values nvte_norm_forward would cast (y rounded to the
 *         input's dtype), overwriting `amax` (one Float32 element), and the statistics where
 *         `mean` (LayerNorm) and `rsigma` are given; no output. Current scaling's first pass
 *         (its second: nvte_norm_forward_from_stats). Arguments as nvte_norm_forward.
 */
NVTE_API void nvte_norm_amax(const NVTEBuffer* input, const NVTEBuffer* gamma,
                             const NVTEBuffer* beta, float epsilon, int zero_centered_gamma,
                             int rms, NVTEBuffer* amax, NVTEBuffer* mean, NVTEBuffer* rsigma,
                             int device, NVTEStream stream);

/*! \brief nvte_norm_forward's FP8 output and its transposed copy from the statistics an earlier
 *         nvte_norm_forward or nvte_norm_amax wrote for the same input, gamma and epsilon: the
 *         same bytes, amax and scale_inv, reading x once (a tiled cast+transpose that
 *         normalizes as it reads).
 *
 *  \param[in]     mean      LayerNorm: `[rows]` Float32; null for RMSNorm.
 *  \param[in]     rsigma    `[rows]` Float32.
 *  \param[out]    output    FP8 (E4M3/E5M2), input's shape.
 *  \param[in]     scale     One Float32 element.
 *  \param[out]    output_t  The `[H, rows]` transposed copy, output's dtype.
 *  \param[in,out] amax      Optional: max-accumulated with `max |y|`.
 *  \param[out]    scale_inv Optional: receives `1 / scale`.
 *  Other arguments as nvte_norm_forward.
 */
NVTE_API void nvte_norm_forward_from_stats(const NVTEBuffer* input, const NVTEBuffer* gamma,
                                           const NVTEBuffer* beta, int zero_centered_gamma, int rms,
                                           const NVTEBuffer* mean, const NVTEBuffer* rsigma,
                                           NVTEBuffer* output, const NVTEBuffer* scale,
                                           NVTEBuffer* output_t, NVTEBuffer* amax,
                                           NVTEBuffer* scale_inv, int device, NVTEStream stream);

/*! \brief Backward: with `xhat = (x - mean) * rsigma` (RMSNorm: `x * rsigma`), `dy = dz * g`
 *         and row means over H: `dx = rsigma * (dy - mean(dy) - xhat * mean(dy * xhat))`
 *         (RMSNorm without `mean(dy)`), `dgamma = sum_rows(dz * xhat)`,
 *         `dbeta = sum_rows(dz)`. The column sums are per-block float32 partials in `workspace`,
 *         added up in a fixed order (deterministic), written in gamma's dtype.
 *
 *  \param[in]  dz        `[..., H]`, input's dtype.
 *  \param[in]  input     The forward's input.
 *  \param[in]  mean      LayerNorm only: the forward's `[rows]` Float32 mean (null for RMSNorm).
 *  \param[in]  rsigma    The forward's `[rows]` Float32 rsigma.
 *  \param[in]  gamma     The forward's gamma.
 *  \param[out] dx        input's shape and dtype.
 *  \param[out] dgamma    `[H]`, gamma's dtype.
 *  \param[out] dbeta     Optional (LayerNorm with a bias): `[H]`, gamma's dtype.
 *  \param[out] workspace Float32 scratch of at least
 *                        nvte_norm_backward_workspace_elements(rows, H, device) elements.
 */
NVTE_API void nvte_norm_backward(const NVTEBuffer* dz, const NVTEBuffer* input,
                                 const NVTEBuffer* mean, const NVTEBuffer* rsigma,
                                 const NVTEBuffer* gamma, int zero_centered_gamma, int rms,
                                 NVTEBuffer* dx, NVTEBuffer* dgamma, NVTEBuffer* dbeta,
                                 NVTEBuffer* workspace, int device, NVTEStream stream);

/*! \brief Float32 elements of nvte_norm_backward's workspace for `[rows, H]` on `device`:
 *         `2 * H * min(rows, 2 * SM count)` (one dgamma and one dbeta partial row per block).
 */
NVTE_API size_t nvte_norm_backward_workspace_elements(size_t rows, size_t H, int device);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_NORMALIZATION_H_
