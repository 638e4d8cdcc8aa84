/*! \file activation.h
 *  \brief The MLP activations, forward and backward, in one pass each, optionally writing FP8.
 *
 *  Conventions (transformer_engine/pytorch/functional/activation.py holds the same formulas as
 *  PyTorch operations, the oracle of the tests):
 *  - The input is viewed as `[rows, in_cols]` with `in_cols` its last extent; the activation's
 *    output is `[rows, cols]` with `cols = in_cols` for a plain activation and
 *    `cols = in_cols / 2` for a gated one, whose *first* half goes through the activation and
 *    whose second half multiplies it: `y = act(x[:, :cols]) * x[:, cols:]`.
 *  - Everything is computed in float32 registers from the loaded values; each result is rounded
 *    once, to the output's dtype or (FP8 outputs) scaled, saturated and cast as nvte_quantize
 *    casts, with the amax taken over the unscaled float32 results.
 */
#ifndef TRANSFORMER_ENGINE_ACTIVATION_H_
#define TRANSFORMER_ENGINE_ACTIVATION_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief The activation functions. With `u` the activation's input:
 *  - kNVTEActGelu:    `0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))` (the tanh approximation)
 *  - kNVTEActQGelu:   `u sigmoid(1.702 u)`
 *  - kNVTEActRelu:    `max(u, 0)` (derivative 0 at 0)
 *  - kNVTEActSRelu:   `max(u, 0)^2`
 *  - kNVTEActSilu:    `u sigmoid(u)`
 *  - kNVTEActSigmoid: `sigmoid(u)` (gated: GLU)
 *  - kNVTEActClampedSilu (gated only, GPT-OSS's clamped SwiGLU): with `a = min(u, limit)` and
 *    `b = clamp(gate_input, -limit, limit)`, `y = a sigmoid(alpha a) (b + glu_linear_offset)`;
 *    the gradient passes where `u <= limit` and where `-limit <= gate_input <= limit`.
 */
typedef enum {
  kNVTEActGelu = 0,
  kNVTEActQGelu = 1,
  kNVTEActRelu = 2,
  kNVTEActSRelu = 3,
  kNVTEActSilu = 4,
  kNVTEActSigmoid = 5,
  kNVTEActClampedSilu = 6,
  kNVTENumActivations
} NVTEActivationKind;

/*! \brief One activation: its function, whether it is gated, and the clamped-SwiGLU
 *         parameters (ignored by the others). */
typedef struct {
  int kind;                /*!< An NVTEActivationKind. */
  int gated;               /*!< Non-zero: the input holds two halves (see the file comment). */
  float limit;             /*!< kNVTEActClampedSilu: the clamp limit. */
  float alpha;             /*!< kNVTEActClampedSilu: the sigmoid's slope. */
  float glu_linear_offset; /*!< kNVTEActClampedSilu: added to the clamped linear half. */
} NVTEActivation;

/*! \brief Forward: `output = act(input)`.
 *
 *  \param[in]     input      Float32, Float16 or BFloat16 tensor `[..., in_cols]`.
 *  \param[in]     activation The activation.
 *  \param[out]    output     `[..., cols]`: a high-precision dtype (scale, output_t, amax and
 *                            scale_inv must then be null), or FP8 (E4M3/E5M2), cast with `scale`.
 *  \param[in]     scale      FP8 output only: one Float32 element.
 *  \param[out]    output_t   FP8 output only, optional: the `[cols, rows]` copy, written in the
 *                            same pass.
 *  \param[in,out] amax       FP8 output only, optional: one Float32 element, max-accumulated
 *                            with `max |act(input)|`.
 *  \param[out]    scale_inv  FP8 output only, optional: receives `1 / scale`.
 *  \param[in]     device     CUDA device index all buffers live on.
 *  \param[in]     stream     Stream of `device` to launch on.
 */
NVTE_API void nvte_activation(const NVTEBuffer* input, NVTEActivation activation,
                              NVTEBuffer* output, const NVTEBuffer* scale, NVTEBuffer* output_t,
                              NVTEBuffer* amax, NVTEBuffer* scale_inv, int device,
                              NVTEStream stream);

/*! \brief Backward: `dinput = grad * d act / d input` (for a gated activation, the gradients
 *         of both halves: `grad * act'(a) * b` and `grad * act(a)`).
 *
 *  \param[in]     grad       `[..., cols]`, the gradient of the activation's output; the same
 *                            dtype as `input`.
 *  \param[in]     input      The forward's input `[..., in_cols]`.
 *  \param[in]     activation The activation of the forward.
 *  \param[out]    dinput     `[..., in_cols]`: high precision (then scale, output_t, amax,
 *                            scale_inv, dbias and workspace must be null) or FP8, cast with
 *                            `scale`.
 *  \param[in]     scale      FP8 only: one Float32 element.
 *  \param[out]    output_t   FP8 only, optional (required with dbias): `[in_cols, rows]`.
 *  \param[in,out] amax       FP8 only, optional: max-accumulated.
 *  \param[out]    scale_inv  FP8 only, optional: receives `1 / scale`.
 *  \param[out]    dbias      FP8 with output_t only, optional: `[in_cols]` of grad's dtype, the
 *                            column sums of dinput (float32, fixed order, as
 *                            nvte_quantize_dbias).
 *  \param[out]    workspace  With dbias: Float32 scratch of at least
 *                            nvte_quantize_dbias_workspace_elements(rows, in_cols) elements.
 *  \param[in]     device     CUDA device index all buffers live on.
 *  \param[in]     stream     Stream of `device` to launch on.
 */
NVTE_API void nvte_dactivation(const NVTEBuffer* grad, const NVTEBuffer* input,
                               NVTEActivation activation, NVTEBuffer* dinput,
                               const NVTEBuffer* scale, NVTEBuffer* output_t, NVTEBuffer* amax,
                               NVTEBuffer* scale_inv, NVTEBuffer* dbias, NVTEBuffer* workspace,
                               int device, NVTEStream stream);

/*! \brief `amax = max |act(input)|` over the float32 values nvte_activation would write,
 *         overwriting `amax` (one Float32 element); nothing else is written. Current scaling's
 *         first pass: the scale follows from this amax, then nvte_activation casts with it.
 */
NVTE_API void nvte_activation_amax(const NVTEBuffer* input, NVTEActivation activation,
                                   NVTEBuffer* amax, int device, NVTEStream stream);

/*! \brief The same for nvte_dactivation's values: `amax = max |dinput|`, overwritten. */
NVTE_API void nvte_dactivation_amax(const NVTEBuffer* grad, const NVTEBuffer* input,
                                    NVTEActivation activation, NVTEBuffer* amax, int device,
                                    NVTEStream stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_ACTIVATION_H_
