/*! \file block_cast.h
 *  \brief Block-scaled FP8 casts: Float8BlockScaling (1x128 tiles or 128x128 blocks, float32
 *         scales) and MXFP8 (32-element blocks, E8M0 scales), each copy with its scales in one
 *         pass over the input.
 *
 *  Conventions (transformer_engine/pytorch/reference.py, `block_cast_1d`, `block_cast_2d` and
 *  `mxfp8_cast`, is the executable specification; the kernels agree with it bit for bit):
 *  - The input of shape `(d0, ..., dn)` is the matrix `[M, K]` with `K = dn` and
 *    `M = d0 * ... * d(n-1)` (a 0-d tensor is one element). Partial blocks at the edges count as
 *    zero-padded (zeros change no amax).
 *  - A block's amax is `max |x|` over the block in float32; NaN is ignored, +-Inf counts.
 *  - Values are multiplied by the block's scale in float32, clamped to `+-fp8_max` and rounded
 *    to nearest even; NaN becomes the canonical byte 0x7F in both formats.
 *  - Scale tensors are written whole, their padding entries as zeros, so a cast into existing
 *    buffers leaves exactly what a cast into new ones would.
 */
#ifndef TRANSFORMER_ENGINE_BLOCK_CAST_H_
#define TRANSFORMER_ENGINE_BLOCK_CAST_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief Float8BlockScaling's cast.
 *
 *  Per block: `a = max(amax, epsilon)`; `scale = fp8_max / a` (IEEE float32 division), `+inf`
 *  replaced by the largest finite value of the *input's* dtype; with `force_pow_2_scales` the
 *  mantissa bits are cleared (rounds down to a power of 2); `a == 0` gives scale 1 (an infinite
 *  amax gives 0); `scale_inv = 1 / scale`.
 *
 *  Layouts (`MB = ceil(M/128)`, `KB = ceil(K/128)`, `r4(n) = roundup(n, 4)`):
 *  - block_scaling_dim 1, row-wise: 1x128 tiles along `K`; data `[M, K]`; scale_inv
 *    `[KB, r4(M)]`, entry `[tile, row]`.
 *  - block_scaling_dim 1, column-wise: the transposed matrix `[K, M]` cast with 1x128 tiles along
 *    `M` (from the input, not from the row-wise bytes); data `[K, M]` (any shape whose first
 *    extent is `K`); scale_inv `[MB, r4(K)]`, entry `[tile, column]`.
 *  - block_scaling_dim 2: 128x128 blocks; row-wise data `[M, K]`, scale_inv `[MB, r4(KB)]`
 *    (entry `[block row, block column]`); column-wise data the transposed bytes `[K, M]`,
 *    scale_inv `[KB, r4(MB)]`, the transposed block scales.
 *
 *  \param[in]  input                Float32, Float16 or BFloat16 tensor.
 *  \param[out] rowwise_data         Optional: FP8 tensor (E4M3 or E5M2) with `input`'s elements.
 *  \param[out] rowwise_scale_inv    With rowwise_data: Float32 `[.., ..]` as above.
 *  \param[out] columnwise_data      Optional: FP8 tensor with `input`'s elements, first extent
 *                                   `K`; the same format as rowwise_data when both are given.
 *  \param[out] columnwise_scale_inv With columnwise_data: Float32 as above.
 *  \param[in]  block_scaling_dim    1 (1x128 tiles) or 2 (128x128 blocks).
 *  \param[in]  epsilon              Lower bound of every block's amax (finite, >= 0).
 *  \param[in]  force_pow_2_scales   Non-zero: round every scale down to a power of 2.
 *  \param[in]  noop                 Optional: one Float32 element; when it holds 1.0 the call
 *                                   writes nothing (read on the device).
 *  \param[in]  device               CUDA device index all buffers live on.
 *  \param[in]  stream               Stream of `device` to launch on.
 */
NVTE_API void nvte_block_scaled_quantize(const NVTEBuffer* input, NVTEBuffer* rowwise_data,
                                         NVTEBuffer* rowwise_scale_inv,
                                         NVTEBuffer* columnwise_data,
                                         NVTEBuffer* columnwise_scale_inv, int block_scaling_dim,
                                         float epsilon, int force_pow_2_scales,
                                         const NVTEBuffer* noop, int device, NVTEStream stream);

/*! \brief MXFP8's cast: one E8M0 scale byte `e` per 32 elements.
 *
 *  Per block: `q = amax * (1 / fp8_max)` in float32; `e` is `q`'s exponent field, plus one when
 *  its mantissa is non-zero, except that exponent 254 is not bumped and a denormal `q <= 2^-127`
 *  keeps exponent 0; `q == 0` gives 0, an infinite `q` 254. Values are multiplied by `2^(127-e)`
 *  (1 when `e == 0`) in float32 and cast.
 *
 *  Layouts (`MB = ceil(M/32)`, `KB = ceil(K/32)`; both copies keep the shape `[M, K]`; scales
 *  are compact, row-major, padding zero):
 *  - row-wise: blocks of 32 along `K`; scale `[roundup(M, 128), roundup(KB, 4)]`, entry
 *    `[row, block]`.
 *  - column-wise: blocks of 32 along `M`; scale `[roundup(MB, 4), roundup(K, 128)]`, entry
 *    `[block, column]`.
 *  - `two_d`: 32x32 blocks shared by both copies (equal bytes); each copy's scale tensor holds
 *    its block's byte at every row (row-wise) or column (column-wise) the block covers.
 *
 *  \param[in]  input                Float32, Float16 or BFloat16 tensor.
 *  \param[out] rowwise_data         Optional: FP8 tensor (E4M3 or E5M2) with `input`'s elements.
 *  \param[out] rowwise_scale_inv    With rowwise_data: Byte (or Float8E8M0) as above.
 *  \param[out] columnwise_data      Optional: FP8 tensor with `input`'s elements; the same
 *                                   format as rowwise_data when both are given.
 *  \param[out] columnwise_scale_inv With columnwise_data: Byte (or Float8E8M0) as above.
 *  \param[in]  two_d                Non-zero: 32x32 blocks.
 *  \param[in]  noop                 Optional: one Float32 element; 1.0 means write nothing.
 *  \param[in]  device               CUDA device index all buffers live on.
 *  \param[in]  stream               Stream of `device` to launch on.
 */
NVTE_API void nvte_mxfp8_quantize(const NVTEBuffer* input, NVTEBuffer* rowwise_data,
                                  NVTEBuffer* rowwise_scale_inv, NVTEBuffer* columnwise_data,
                                  NVTEBuffer* columnwise_scale_inv, int two_d,
                                  const NVTEBuffer* noop, int device, NVTEStream stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_BLOCK_CAST_H_
