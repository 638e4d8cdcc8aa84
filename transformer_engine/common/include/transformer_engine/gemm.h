/*! \file gemm.h
 *  \brief The block-scaled FP8 GEMM (Float8BlockScaling) on cuBLASLt.
 *
 *  The per-tensor FP8 and high-precision GEMMs run on PyTorch's (`torch._scaled_mm`,
 *  `torch.mm`). This one is native because PyTorch's blockwise `torch._scaled_mm` takes only
 *  1x128 by 1x128 scales on Hopper, and cuBLASLt's 128x128-block weight kernels are about a
 *  third faster. cuBLASLt is not linked: the library loads the copy PyTorch loaded (12.9 or
 *  later; see gemm/cublaslt_loader.h).
 */
#ifndef TRANSFORMER_ENGINE_GEMM_H_
#define TRANSFORMER_ENGINE_GEMM_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief `out = x @ y^T (+ bias)` for block-scaled FP8 operands, accumulated in float32.
 *
 *  Operands hold the reduction dimension innermost: `x` is `[M, K]`, `y` is `[N, K]`, FP8 (E4M3
 *  or E5M2, each its own). Each comes with float32 scale-inverses in the layout
 *  `nvte_block_scaled_quantize` writes (block_cast.h), `R` being the operand's rows and
 *  `KB = K / 128`:
 *  - 1x128 tiles (`*_block_2d` = 0): `[KB, roundup(R, 4)]`, entry `[tile, row]`;
 *  - 128x128 blocks (`*_block_2d` != 0): `[ceil(R / 128), roundup(KB, 4)]`.
 *  At most one operand may use 128x128 blocks. Every element is multiplied by its tile's or
 *  block's scale-inverse; products are summed in float32 and rounded once to `out`'s dtype.
 *
 *  \param[in]  x, x_scale_inv, x_block_2d  The `[M, K]` operand and its scales.
 *  \param[in]  y, y_scale_inv, y_block_2d  The `[N, K]` operand and its scales.
 *  \param[in]  bias        Optional: `N` elements of `out`'s dtype (BFloat16 or Float16 only),
 *                          added in float32 before the rounding.
 *  \param[out] out         `[M, N]`, BFloat16, Float16 or Float32, `N` a multiple of 16.
 *  \param[in]  workspace   Optional: Byte scratch for cuBLASLt (32 MiB is plenty; 256-byte
 *                          aligned); its contents are not kept between calls.
 *  \param[in]  device      CUDA device index all buffers live on.
 *  \param[in]  stream      Stream of `device` to launch on.
 *  \return 1 when the GEMM was launched; 0 when this cuBLASLt has no kernel for the problem on
 *          this device (nothing was launched; the caller takes another path). cuBLASLt 13.1 on
 *          an H200 has none when M is not a multiple of 4. Bad arguments and
 *          CUDA or cuBLASLt failures throw, as everywhere in the library; a missing or too old
 *          cuBLASLt throws too (ask `nvte_cublaslt_version` first).
 *
 *  K must be a positive multiple of 128, M and N positive.
 */
NVTE_API int nvte_block_scaled_gemm(const NVTEBuffer* x, const NVTEBuffer* x_scale_inv,
                                    int x_block_2d, const NVTEBuffer* y,
                                    const NVTEBuffer* y_scale_inv, int y_block_2d,
                                    const NVTEBuffer* bias, NVTEBuffer* out, NVTEBuffer* workspace,
                                    int device, NVTEStream stream);

/*! \brief The version of the cuBLASLt the library loaded for the block-scaled GEMM (`major *
 *  10000 + minor * 100 + patch`), or 0 when none could be loaded or it is older than 12.9.
 *  Loads it on the first call; never throws. */
NVTE_API size_t nvte_cublaslt_version(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_GEMM_H_
