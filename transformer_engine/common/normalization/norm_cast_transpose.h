/* The norm forward's FP8 output with its transposed copy, from the statistics the norm kernels
 * wrote (norm_forward.cu runs them first): the tiled cast+transpose kernel of
 * cast/cast_transpose.cuh over the normalized values, each computed from x, its row's mean and
 * rsigma and its column's gamma (and beta) exactly as the norm kernels compute it, so the bytes,
 * the transposed copy and the amax equal those of the norm's high-precision output cast by
 * nvte_quantize. */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_CAST_TRANSPOSE_H_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_CAST_TRANSPOSE_H_

#include <cstddef>
#include <cstdint>

#include "transformer_engine/transformer_engine.h"
#include "util/device.h"

namespace transformer_engine {
namespace norm_detail {

struct NormCastParams {
  const void* x;        // [rows, H], the input's dtype
  const void* gamma;    // [H], float32 (w_fp32) or x's dtype
  const void* beta;     // [H], gamma's dtype; null: no shift
  const float* mean;    // [rows]; null: RMSNorm (no centering)
  const float* rsigma;  // [rows]
  uint8_t* y;           // [rows, H] FP8
  uint8_t* y_t;         // [H, rows] FP8
  const float* scale;
  float* amax;       // null, or max-accumulated with the rounded values' max |y|
  float* scale_inv;  // null, or receives 1 / scale
  size_t rows;
  int H;
  bool zero_centered;
  bool w_fp32;
  bool e5m2;
};

/* Launches on ctx's stream (rows * H > 0); x_dtype is the input's high-precision dtype. */
void launch_norm_cast_transpose(CallContext& ctx, NVTEDType x_dtype, const NormCastParams& p);

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_CAST_TRANSPOSE_H_
