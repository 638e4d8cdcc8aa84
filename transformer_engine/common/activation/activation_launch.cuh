/* What the activation entry points share after their checks: the one switch on the element
 * type, gating and activation kind that picks a compiled loader (activation_math.cuh), and the
 * choice of kernel for a result:
 * - the element-wise kernel (activation_elementwise.cuh) for a high-precision result, an FP8
 *   result without a transposed copy, or the amax alone;
 * - the tiled cast+transpose kernels of the casts (cast/cast_transpose.cuh) for FP8 with the
 *   transposed copy a GEMM's wgrad needs, and in backward the bias gradient's column sums;
 *   a gated backward's through its own tiled kernel (gated_cast_transpose.cuh), which writes
 *   both halves of the result from one read of the inputs (NVTE_CAST_TRANSPOSE_VARIANT=0 or 1:
 *   the base kernel instead, cast_transpose_variants.cuh).
 * The entry points live in three translation units (activation_forward.cu,
 * activation_backward.cu, activation_backward_amax.cu) so that their kernels, one per element
 * type, gating, kind and result, compile in parallel. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_LAUNCH_CUH_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "activation/activation_checks.h"
#include "activation/activation_elementwise.cuh"
#include "activation/activation_math.cuh"
#include "activation/gated_cast_transpose.cuh"
#include "cast/cast_transpose.cuh"
#include "cast/dispatch.cuh"
#include "transformer_engine/activation.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"

namespace transformer_engine {
namespace activation_detail {

/* Calls f(std::integral_constant<int, kind>) for a kind check_activation accepted: the one
 * switch on the kind, at launch. Sigmoid and clamped SwiGLU exist gated only, so the
 * non-gated loaders are not compiled for them. */
template <bool kGated, typename F>
void dispatch_kind(int kind, F&& f) {
  switch (kind) {
    case kNVTEActGelu:
      f(std::integral_constant<int, kNVTEActGelu>{});
      return;
    case kNVTEActQGelu:
      f(std::integral_constant<int, kNVTEActQGelu>{});
      return;
    case kNVTEActRelu:
      f(std::integral_constant<int, kNVTEActRelu>{});
      return;
    case kNVTEActSRelu:
      f(std::integral_constant<int, kNVTEActSRelu>{});
      return;
    case kNVTEActSilu:
      f(std::integral_constant<int, kNVTEActSilu>{});
      return;
    default:
      if constexpr (kGated) {
        if (kind == kNVTEActSigmoid) {
          f(std::integral_constant<int, kNVTEActSigmoid>{});
        } else {
          f(std::integral_constant<int, kNVTEActClampedSilu>{});
        }
      }
      return;
  }
}

/* Calls f(std::integral_constant<bool, gated>). */
template <typename F>
void dispatch_gated(bool gated, F&& f) {
  if (gated) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

/* Calls f(loader) with the forward's loader for the input's dtype, the gating and the kind. */
template <typename F>
void with_forward_loader(const char* op, const NVTEBuffer& in, const NVTEActivation& act,
                         const ActivationShape& shape, F&& f) {
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_gated(act.gated != 0, [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      dispatch_kind<kGated>(act.kind, [&](auto kind) {
        constexpr int kKind = decltype(kind)::value;
        f(ActivationLoad<IType, kKind, kGated>{static_cast<const IType*>(in.data), shape.cols,
                                               act});
      });
    });
  });
}

/* Calls f(loader) with the backward's loader for the input's dtype, the gating and the kind. */
template <typename F>
void with_backward_loader(const char* op, const NVTEBuffer& g, const NVTEBuffer& in,
                          const NVTEActivation& act, const ActivationShape& shape, F&& f) {
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_gated(act.gated != 0, [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      dispatch_kind<kGated>(act.kind, [&](auto kind) {
        constexpr int kKind = decltype(kind)::value;
        f(DActivationLoad<IType, kKind, kGated>{static_cast<const IType*>(g.data),
                                                static_cast<const IType*>(in.data), shape.cols,
                                                act});
      });
    });
  });
}

/* The loader's result, [rows, Loader::kParts * cols], to `output` (+ `output_t`, + the bias
 * gradient's per-tile column sums when `column_sums`, backward only). The element-wise kernel
 * walks the loader's [rows, cols] positions; the tiled kernel reads the result matrix through
 * the loader's load_vec/load. A high-precision result has the input's dtype (check_result). */
template <bool kBackward, class Loader>
void launch_result(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                   NVTEBuffer& output, NVTEBuffer* output_t, const CastArgs& args,
                   float* column_sums) {
  using IType = typename Loader::InputType;
  if (!is_fp8(output.dtype)) {
    launch_elementwise<Loader, HighPrecisionStore<IType>, false>(
        ctx, loader, HighPrecisionStore<IType>{static_cast<IType*>(output.data)}, rows, cols,
        args);
    return;
  }
  auto* out = static_cast<uint8_t*>(output.data);
  const size_t result_cols = Loader::kParts * cols;
  dispatch_fp8(ctx.op(), output.dtype, [&](auto is_e4m3) {
    constexpr bool kE4M3 = decltype(is_e4m3)::value;
    if (output_t == nullptr || rows * cols == 0) {
      launch_elementwise<Loader, Fp8Store<kE4M3>, true>(ctx, loader, Fp8Store<kE4M3>{out, 1.0f},
                                                        rows, cols, args);
      return;
    }
    auto* out_t = static_cast<uint8_t*>(output_t->data);
    if constexpr (Loader::kParts == 2) {  // a gated backward: both halves a block
      if (cast_detail::gated_pair_kernel_enabled()) {
        if (column_sums != nullptr) {
          launch_gated_cast_transpose<Loader, kE4M3, true>(loader, out, out_t, rows, cols, args,
                                                           column_sums, ctx);
        } else {
          launch_gated_cast_transpose<Loader, kE4M3, false>(loader, out, out_t, rows, cols, args,
                                                            nullptr, ctx);
        }
        return;
      }
    }
    if constexpr (kBackward) {  // the bias gradient exists in backward only
      if (column_sums != nullptr) {
        cast_detail::launch_cast_transpose_from<Loader, kE4M3, true>(
            loader, out, out_t, rows, result_cols, args, column_sums, ctx);
        return;
      }
    }
    cast_detail::launch_cast_transpose_from<Loader, kE4M3, false>(loader, out, out_t, rows,
                                                                  result_cols, args, nullptr, ctx);
  });
}

/* The amax of the loader's results, overwriting `amax` (zeroed first). */
template <class Loader>
void launch_amax_only(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                      float* amax) {
  check_cuda(ctx.op(), cudaMemsetAsync(amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  const CastArgs args{nullptr, amax, nullptr, nullptr};
  launch_elementwise<Loader, AmaxOnlyStore, false, true>(ctx, loader, AmaxOnlyStore{}, rows, cols,
                                                         args);
}

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_LAUNCH_CUH_
