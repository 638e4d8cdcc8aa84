/* Compile-time dispatch over the element types the cast kernels take. */
#ifndef TRANSFORMER_ENGINE_COMMON_CAST_DISPATCH_CUH_
#define TRANSFORMER_ENGINE_COMMON_CAST_DISPATCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "transformer_engine/transformer_engine.h"
#include "util/errors.h"

namespace transformer_engine {

/* Calls `f(T{})` with T the C++ type of a high-precision dtype. */
template <typename F>
void dispatch_high_precision(const char* op, NVTEDType dtype, F&& f) {
  switch (dtype) {
    case kNVTEFloat32:
      f(float{});
      break;
    case kNVTEFloat16:
      f(__half{});
      break;
    case kNVTEBFloat16:
      f(__nv_bfloat16{});
      break;
    default:
      throw_invalid(op, "unsupported high-precision dtype code ", static_cast<int>(dtype));
  }
}

/* Calls `f(std::true_type{})` for E4M3 and `f(std::false_type{})` for E5M2. */
template <typename F>
void dispatch_fp8(const char* op, NVTEDType dtype, F&& f) {
  switch (dtype) {
    case kNVTEFloat8E4M3:
      f(std::true_type{});
      break;
    case kNVTEFloat8E5M2:
      f(std::false_type{});
      break;
    default:
      throw_invalid(op, "unsupported FP8 dtype code ", static_cast<int>(dtype));
  }
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_CAST_DISPATCH_CUH_
