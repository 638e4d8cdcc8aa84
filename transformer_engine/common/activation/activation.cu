/* nvte_activation / nvte_dactivation: an activation's forward or backward in one pass over its
 * operands, writing the result in high precision or in FP8.
 *
 * Two kernel shapes, both fed by the loaders of activation_math.cuh:
 * - a flat, vectorised element-wise kernel writing one [rows, cols] result (high precision, or
 *   FP8 with its amax, row-wise only);
 * - the 64x64-tiled cast+transpose kernel of the casts (cast/cast_transpose.cuh), for FP8 with
 *   the transposed copy a GEMM's wgrad needs, and in backward the bias gradient's column sums. */
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "activation/activation_math.cuh"
#include "cast/cast_transpose.cuh"
#include "cast/dispatch.cuh"
#include "cast/launchers.h"
#include "transformer_engine/activation.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

using namespace activation_detail;
using cast_detail::CastArgs;
using cast_detail::kThreads;

/* Writes a high-precision result. */
template <typename OType>
struct HighPrecisionStore {
  OType* out;
  __device__ __forceinline__ void store_vec(size_t i, const float (&v)[kVecElems], float&) const {
    Vec<OType, kVecElems> y;
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) y.v[j] = from_float<OType>(v[j]);
    *reinterpret_cast<Vec<OType, kVecElems>*>(out + i) = y;
  }
  __device__ __forceinline__ void store(size_t i, float v, float&) const {
    out[i] = from_float<OType>(v);
  }
};

/* Writes an FP8 result with `scale`, tracking the amax of the unscaled values. */
template <bool kE4M3>
struct Fp8Store {
  uint8_t* out;
  float scale;
  __device__ __forceinline__ void store_vec(size_t i, const float (&v)[kVecElems],
                                            float& amax) const {
    Vec<uint16_t, kVecElems / 2> q;
    cast_detail::cast_floats<kE4M3>(v, scale, amax, q);
    *reinterpret_cast<Vec<uint16_t, kVecElems / 2>*>(out + i) = q;
  }
  __device__ __forceinline__ void store(size_t i, float v, float& amax) const {
    amax = amax_step(amax, v);
    out[i] = Fp8Format<kE4M3>::cast(v * scale);
  }
};

/* Writes nothing: only the amax of the values is wanted (current scaling's first pass). */
struct AmaxOnlyStore {
  __device__ __forceinline__ void store_vec(size_t, const float (&v)[kVecElems],
                                            float& amax) const {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) amax = amax_step(amax, v[j]);
  }
  __device__ __forceinline__ void store(size_t, float v, float& amax) const {
    amax = amax_step(amax, v);
  }
};

/* Result element i = r * cols + c, grid-stride. The vector path needs cols % kVecElems == 0,
 * so a vector never crosses a row. kFp8: the store casts with args.scale (and publishes
 * scale_inv); kAmax: the amax of the values is max-accumulated into args.amax. */
template <class Loader, class Store, bool kFp8, bool kAmax = kFp8>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(const Loader loader, Store store, size_t rows, size_t cols,
                       bool vectorized, CastArgs args) {
  float local_amax = 0.0f;
  if constexpr (kFp8) store.scale = cast_detail::load_scale(args);
  const size_t n = rows * cols;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  if (vectorized) {
    for (size_t vi = first; vi < n / kVecElems; vi += stride) {
      const size_t i = vi * kVecElems;
      float v[kVecElems];
      loader.load_vec(i / cols, i % cols, v);
      store.store_vec(i, v, local_amax);
    }
  } else {
    for (size_t i = first; i < n; i += stride) {
      store.store(i, loader.load(i / cols, i % cols), local_amax);
    }
  }
  if constexpr (kAmax) {
    if (args.amax != nullptr) block_amax_to_global<kThreads>(local_amax, args.amax);
  }
}

/* No element to write: 1/scale is still published, as the casts do. */
__global__ void publish_scale_inv(CastArgs args) { cast_detail::load_scale(args); }

template <class Loader, class Store, bool kFp8, bool kAmax = kFp8>
void launch_elementwise(CallContext& ctx, const Loader& loader, const Store& store, size_t rows,
                        size_t cols, bool out_aligned, const CastArgs& args) {
  const size_t n = rows * cols;
  if (n == 0) {
    if (kFp8 && args.scale_inv != nullptr) {
      publish_scale_inv<<<1, 1, 0, ctx.stream()>>>(args);
      ctx.check_launch("publish_scale_inv launch");
    }
    return;
  }
  const bool vectorized = cols % kVecElems == 0 && loader.vectorizable() && out_aligned;
  const size_t work = vectorized ? n / kVecElems : n;
  const size_t wanted = std::max<size_t>(1, (work + kThreads - 1) / kThreads);
  const size_t blocks = std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * 8);
  elementwise_kernel<Loader, Store, kFp8, kAmax>
      <<<blocks, kThreads, 0, ctx.stream()>>>(loader, store, rows, cols, vectorized, args);
  ctx.check_launch("activation elementwise_kernel launch");
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

/* The loader's [rows, cols] values to `output` (+ `output_t`, + dbias column sums). */
template <class Loader>
void launch_result(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                   NVTEBuffer& output, NVTEBuffer* output_t, const CastArgs& args,
                   float* column_sums) {
  const char* op = ctx.op();
  if (!is_fp8(output.dtype)) {
    dispatch_high_precision(op, output.dtype, [&](auto otype) {
      using OType = decltype(otype);
      auto* out = static_cast<OType*>(output.data);
      launch_elementwise<Loader, HighPrecisionStore<OType>, false>(
          ctx, loader, HighPrecisionStore<OType>{out}, rows, cols,
          aligned_to(out, sizeof(OType) * kVecElems), args);
    });
    return;
  }
  auto* out = static_cast<uint8_t*>(output.data);
  dispatch_fp8(op, output.dtype, [&](auto is_e4m3) {
    constexpr bool kE4M3 = decltype(is_e4m3)::value;
    if (output_t == nullptr || rows * cols == 0) {
      launch_elementwise<Loader, Fp8Store<kE4M3>, true>(ctx, loader, Fp8Store<kE4M3>{out, 1.0f},
                                                        rows, cols, aligned_to(out, kVecElems),
                                                        args);
      return;
    }
    auto* out_t = static_cast<uint8_t*>(output_t->data);
    if (column_sums != nullptr) {
      cast_detail::launch_cast_transpose_from<Loader, kE4M3, true>(loader, out, out_t, rows, cols,
                                                                   args, column_sums, ctx);
    } else {
      cast_detail::launch_cast_transpose_from<Loader, kE4M3, false>(loader, out, out_t, rows,
                                                                    cols, args, nullptr, ctx);
    }
  });
}

/* The amax of the loader's [rows, cols] values, overwriting `amax` (zeroed first). */
template <class Loader>
void launch_amax_only(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                      float* amax) {
  check_cuda(ctx.op(), cudaMemsetAsync(amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  const CastArgs args{nullptr, amax, nullptr, nullptr};
  launch_elementwise<Loader, AmaxOnlyStore, false, true>(ctx, loader, AmaxOnlyStore{}, rows, cols,
                                                         true, args);
}

NVTEActivation check_activation(const char* op, const NVTEActivation& act) {
  if (act.kind < 0 || act.kind >= kNVTENumActivations) {
    throw_invalid(op, "unknown activation kind ", act.kind);
  }
  const bool gated = act.gated != 0;
  if ((act.kind == kNVTEActClampedSilu || act.kind == kNVTEActSigmoid) && !gated) {
    throw_invalid(op, "activation kind ", act.kind,
                  " exists only gated (GLU, clamped SwiGLU); set gated = 1");
  }
  if (act.kind == kNVTEActClampedSilu && !(act.limit >= 0.0f)) {
    throw_invalid(op, "clamped SwiGLU needs limit >= 0, got ", act.limit);
  }
  return act;
}

struct ActivationShape {
  size_t rows, in_cols, cols;
};

/* `input` [rows, in_cols] and the activation's output width; throws on a bad shape. */
ActivationShape check_input(const char* op, const NVTEBuffer& in, bool gated) {
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  if (in.ndim == 0) throw_invalid(op, "input must have at least one dimension (the features)");
  const size_t in_cols = last_dim(in);
  if (gated && in_cols % 2 != 0) {
    throw_invalid(op, "a gated activation needs an even last extent (two halves), got ",
                  in_cols);
  }
  const size_t rows = in_cols == 0 ? leading_rows(in) : numel(in) / in_cols;
  return {rows, in_cols, gated ? in_cols / 2 : in_cols};
}

void check_extent(const char* op, const char* name, const NVTEBuffer& buffer, size_t rows,
                  size_t cols) {
  check_well_formed(op, name, buffer);
  if (buffer.ndim == 0 || last_dim(buffer) != cols || numel(buffer) != rows * cols) {
    throw_invalid(op, name, " must hold [", rows, ", ", cols, "] elements with last extent ",
                  cols);
  }
}

/* The FP8 arguments: present exactly when `output` is FP8; returns the kernels' pointers. */
CastArgs check_fp8_args(const char* op, const NVTEBuffer& output, const char* output_name,
                        const NVTEBuffer* scale, NVTEBuffer* output_t, NVTEBuffer* amax,
                        NVTEBuffer* scale_inv, size_t rows, size_t cols) {
  if (!is_fp8(output.dtype)) {
    if (scale != nullptr || output_t != nullptr || amax != nullptr || scale_inv != nullptr) {
      throw_invalid(op, output_name, " is high precision (", dtype_name(output.dtype),
                    "); scale, output_t, amax and scale_inv apply to FP8 outputs only");
    }
    return CastArgs{nullptr, nullptr, nullptr, nullptr};
  }
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  if (output_t != nullptr) {
    check_well_formed(op, "output_t", *output_t);
    if (output_t->dtype != output.dtype) {
      throw_invalid(op, "output_t has dtype ", dtype_name(output_t->dtype), " but ", output_name,
                    " has ", dtype_name(output.dtype), "; both copies use one FP8 format");
    }
    if (output_t->ndim == 0 || output_t->shape[0] != cols || numel(*output_t) != rows * cols) {
      throw_invalid(op, "output_t must have shape [", cols, ", ", rows, "]");
    }
  }
  if (amax != nullptr) check_fp32_scalar(op, "amax", *amax);
  if (scale_inv != nullptr) check_fp32_scalar(op, "scale_inv", *scale_inv);
  return CastArgs{static_cast<const float*>(scale->data), cast_detail::optional_data(amax),
                  cast_detail::optional_data(scale_inv), nullptr};
}

/* A result buffer: [rows, cols], the input's dtype when high precision, and the FP8 arguments
 * present exactly when it is FP8 (check_fp8_args); returns the kernels' pointers. */
CastArgs check_result(const char* op, const char* name, const NVTEBuffer& out,
                      const NVTEBuffer& in, size_t rows, size_t cols, const NVTEBuffer* scale,
                      NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  check_extent(op, name, out, rows, cols);
  if (!is_fp8(out.dtype) && out.dtype != in.dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(out.dtype), " but input has ",
                  dtype_name(in.dtype), "; a high-precision ", name, " keeps the input's dtype");
  }
  return check_fp8_args(op, out, name, scale, output_t, amax, scale_inv, rows, cols);
}

void check_fp8_on_device(CallContext& ctx, const NVTEBuffer* scale, NVTEBuffer* output_t,
                         NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  if (scale != nullptr) ctx.check_on_device("scale", *scale);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);
}

/* `grad` [rows, cols] in the input's dtype; throws otherwise. */
const NVTEBuffer& check_grad(const char* op, const NVTEBuffer* grad, const NVTEBuffer& in,
                             const ActivationShape& shape) {
  const NVTEBuffer& g = require(op, "grad", grad);
  check_extent(op, "grad", g, shape.rows, shape.cols);
  if (g.dtype != in.dtype) {
    throw_invalid(op, "grad has dtype ", dtype_name(g.dtype), " but input has ",
                  dtype_name(in.dtype), "; pass both in the activation dtype");
  }
  return g;
}

/* Calls f(loader) with the forward's loader for the input's dtype and the gating. */
template <typename F>
void with_forward_loader(const char* op, const NVTEBuffer& in, const NVTEActivation& act,
                         const ActivationShape& shape, F&& f) {
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_gated(act.gated != 0, [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      f(ActivationLoad<IType, kGated>{static_cast<const IType*>(in.data), shape.cols, act});
    });
  });
}

/* Calls f(loader) with the backward's loader for the input's dtype and the gating. */
template <typename F>
void with_backward_loader(const char* op, const NVTEBuffer& g, const NVTEBuffer& in,
                          const NVTEActivation& act, const ActivationShape& shape, F&& f) {
  dispatch_high_precision(op, in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_gated(act.gated != 0, [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      f(DActivationLoad<IType, kGated>{static_cast<const IType*>(g.data),
                                       static_cast<const IType*>(in.data), shape.cols, act});
    });
  });
}

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_activation(const NVTEBuffer* input, NVTEActivation activation,
                                NVTEBuffer* output, const NVTEBuffer* scale, NVTEBuffer* output_t,
                                NVTEBuffer* amax, NVTEBuffer* scale_inv, int device,
                                NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_activation";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  require(op, "output", output);
  NVTEBuffer& out = *output;
  const CastArgs args = check_result(op, "output", out, in, shape.rows, shape.cols, scale,
                                     output_t, amax, scale_inv);
  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("output", out);
  check_fp8_on_device(ctx, scale, output_t, amax, scale_inv);
  with_forward_loader(op, in, act, shape, [&](const auto& loader) {
    launch_result(ctx, loader, shape.rows, shape.cols, out, output_t, args, nullptr);
  });
}

extern "C" void nvte_dactivation(const NVTEBuffer* grad, const NVTEBuffer* input,
                                 NVTEActivation activation, NVTEBuffer* dinput,
                                 const NVTEBuffer* scale, NVTEBuffer* output_t, NVTEBuffer* amax,
                                 NVTEBuffer* scale_inv, NVTEBuffer* dbias, NVTEBuffer* workspace,
                                 int device, NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_dactivation";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  const NVTEBuffer& g = check_grad(op, grad, in, shape);
  require(op, "dinput", dinput);
  NVTEBuffer& dx = *dinput;
  const CastArgs args = check_result(op, "dinput", dx, in, shape.rows, shape.in_cols, scale,
                                     output_t, amax, scale_inv);
  if (dbias != nullptr || workspace != nullptr) {
    if (output_t == nullptr) {
      throw_invalid(op, "dbias comes with the transposed FP8 copy: pass output_t (and an FP8 "
                        "dinput) or compute the bias gradient separately");
    }
    const cast_detail::QuantizeShape qshape{shape.rows * shape.in_cols, shape.rows,
                                            shape.in_cols};
    cast_detail::check_dbias_args(op, qshape, g, dbias, workspace);
  }
  CallContext ctx(op, device, stream);
  ctx.check_on_device("grad", g);
  ctx.check_on_device("input", in);
  ctx.check_on_device("dinput", dx);
  check_fp8_on_device(ctx, scale, output_t, amax, scale_inv);
  if (dbias != nullptr) {
    ctx.check_on_device("dbias", *dbias);
    ctx.check_on_device("workspace", *workspace);
  }
  float* column_sums = workspace == nullptr ? nullptr : static_cast<float*>(workspace->data);
  with_backward_loader(op, g, in, act, shape, [&](const auto& loader) {
    launch_result(ctx, loader, shape.rows, shape.in_cols, dx, output_t, args, column_sums);
  });
  if (dbias != nullptr && shape.in_cols > 0) {
    cast_detail::launch_dbias_from_column_sums(ctx, column_sums, *dbias, shape.rows,
                                               shape.in_cols);
  }
}

extern "C" void nvte_activation_amax(const NVTEBuffer* input, NVTEActivation activation,
                                     NVTEBuffer* amax, int device, NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_activation_amax";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  with_forward_loader(op, in, act, shape, [&](const auto& loader) {
    launch_amax_only(ctx, loader, shape.rows, shape.cols, static_cast<float*>(amax->data));
  });
}

extern "C" void nvte_dactivation_amax(const NVTEBuffer* grad, const NVTEBuffer* input,
                                      NVTEActivation activation, NVTEBuffer* amax, int device,
                                      NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_dactivation_amax";
  const NVTEActivation act = check_activation(op, activation);
  const bool gated = act.gated != 0;
  const NVTEBuffer& in = require(op, "input", input);
  const ActivationShape shape = check_input(op, in, gated);
  const NVTEBuffer& g = check_grad(op, grad, in, shape);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  ctx.check_on_device("grad", g);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  with_backward_loader(op, g, in, act, shape, [&](const auto& loader) {
    launch_amax_only(ctx, loader, shape.rows, shape.in_cols, static_cast<float*>(amax->data));
  });
}
