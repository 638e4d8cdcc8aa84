/* The launch code shared by the activation entry points (activation_forward.cu,
 * activation_backward.cu, activation_backward_amax.cu): split over three translation units
 * so that the many kernel instantiations compile in parallel.
 *
 * nvte_activation / nvte_dactivation: an activation's forward or backward in one pass over its
 * operands, writing the result in high precision or in FP8.
 *
 * Two kernel shapes, both fed by the loaders of activation_math.cuh (one compiled kernel per
 * element type, gating and activation kind; the kind is switched on once, at launch):
 * - a grid-stride, vectorised element-wise kernel writing one result (high precision, or FP8
 *   with its amax, row-wise only, or the amax alone), sized to the SM count;
 * - the 64x64-tiled cast+transpose kernel of the casts (cast/cast_transpose.cuh), for FP8 with
 *   the transposed copy a GEMM's wgrad needs, and in backward the bias gradient's column sums.
 * Both walk the output gradient's [rows, cols] positions in backward: a gated activation's
 * thread reads grad, u and v once and writes both halves' gradients. */
#pragma once

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
  bool aligned() const { return aligned_to(out, sizeof(OType) * kVecElems); }
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
  bool aligned() const { return aligned_to(out, kVecElems); }
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
  bool aligned() const { return true; }
  __device__ __forceinline__ void store_vec(size_t, const float (&v)[kVecElems],
                                            float& amax) const {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) amax = amax_step(amax, v[j]);
  }
  __device__ __forceinline__ void store(size_t, float v, float& amax) const {
    amax = amax_step(amax, v);
  }
};

/* Resident blocks per SM the element-wise kernel is compiled for (at most 64 registers a
 * thread); its grid is sm_count * kBlocksPerSm blocks (fewer for small tensors). */
constexpr int kBlocksPerSm = 4;

/* Vectors a thread loads before it computes the first: about 64 bytes of operands in flight
 * per thread (4 vectors of one 16-bit operand, 1 of a gated backward's three). */
template <class Loader>
constexpr int kUnroll = sizeof(typename Loader::Raw) >= 64   ? 1
                        : sizeof(typename Loader::Raw) >= 32 ? 2
                                                             : 4;

/* Where a vector position v = r * vecs_per_row + c lies, stepped through the grid-stride
 * sequence without a division per step: `step` is the grid's thread count as (rows, vectors). */
struct RowCursor {
  size_t r, c;
  __device__ __forceinline__ void advance(size_t step_r, size_t step_c, size_t vecs_per_row) {
    r += step_r;
    c += step_c;
    if (c >= vecs_per_row) {
      c -= vecs_per_row;
      ++r;
    }
  }
};

struct ElementwiseShape {
  size_t rows, cols;              // the loader's positions
  size_t vecs_per_row;            // cols / kVecElems (vectorized launches)
  size_t step_r, step_c;          // the grid's thread count as rows and vectors of a row
};

/* The loader's [rows, cols] positions, result element r * kParts * cols + p * cols + c
 * (part p), grid-stride. Vectorized (cols % kVecElems == 0, aligned buffers): each thread
 * issues kUnroll vectors' loads, then computes and stores them. kFp8: the store casts with
 * args.scale (and publishes scale_inv); kAmax: the amax of the values is max-accumulated into
 * args.amax. */
template <class Loader, class Store, bool kFp8, bool kAmax = kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    elementwise_kernel(const Loader loader, Store store, ElementwiseShape shape, bool vectorized,
                       CastArgs args) {
  constexpr int kParts = Loader::kParts;
  constexpr int kU = kUnroll<Loader>;
  float local_amax = 0.0f;
  if constexpr (kFp8) store.scale = cast_detail::load_scale(args);
  const size_t cols = shape.cols, out_cols = kParts * cols;
  const size_t first = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  if (vectorized) {
    const size_t vpr = shape.vecs_per_row;
    const size_t n = shape.rows * vpr;
    RowCursor at{first / vpr, first % vpr};
    size_t v = first;
    auto put = [&](const RowCursor& p, const typename Loader::Raw& raw) {
      float x[kParts][kVecElems];
      loader.compute(raw, x);
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        store.store_vec(p.r * out_cols + part * cols + p.c * kVecElems, x[part], local_amax);
      }
    };
    for (; v + (kU - 1) * stride < n; v += kU * stride) {
      RowCursor pos[kU];
      typename Loader::Raw raw[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        pos[u] = at;
        raw[u] = loader.fetch(at.r, at.c * kVecElems);
        at.advance(shape.step_r, shape.step_c, vpr);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) put(pos[u], raw[u]);
    }
    for (; v < n; v += stride) {
      put(at, loader.fetch(at.r, at.c * kVecElems));
      at.advance(shape.step_r, shape.step_c, vpr);
    }
  } else {
    for (size_t i = first; i < shape.rows * cols; i += stride) {
      const size_t r = i / cols, c = i % cols;
      float x[kParts];
      loader.load(r, c, x);
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        store.store(r * out_cols + part * cols + c, x[part], local_amax);
      }
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
                        size_t cols, const CastArgs& args) {
  if (rows * cols == 0) {
    if (kFp8 && args.scale_inv != nullptr) {
      publish_scale_inv<<<1, 1, 0, ctx.stream()>>>(args);
      ctx.check_launch("publish_scale_inv launch");
    }
    return;
  }
  const bool vectorized = cols % kVecElems == 0 && loader.vectorizable() && store.aligned();
  const size_t work = vectorized ? rows * (cols / kVecElems) : rows * cols;
  const size_t wanted = (work + kThreads - 1) / kThreads;
  const size_t blocks =
      std::min<size_t>(wanted, static_cast<size_t>(ctx.sm_count()) * kBlocksPerSm);
  const size_t threads = blocks * kThreads;
  ElementwiseShape shape{rows, cols, cols / kVecElems, 0, 0};
  if (vectorized) {
    shape.step_r = threads / shape.vecs_per_row;
    shape.step_c = threads % shape.vecs_per_row;
  }
  elementwise_kernel<Loader, Store, kFp8, kAmax>
      <<<blocks, kThreads, 0, ctx.stream()>>>(loader, store, shape, vectorized, args);
  ctx.check_launch("activation elementwise_kernel launch");
}

/* The loader's results ([rows, kParts * cols]) to `output` (+ `output_t`, + dbias partial
 * column sums, whose row count is returned). */
template <bool kBackward, class Loader>
size_t launch_result(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                     NVTEBuffer& output, NVTEBuffer* output_t, const CastArgs& args,
                     float* column_sums) {
  using IType = typename Loader::InputType;
  if (!is_fp8(output.dtype)) {  // check_result: a high-precision output has the input's dtype
    launch_elementwise<Loader, HighPrecisionStore<IType>, false>(
        ctx, loader, HighPrecisionStore<IType>{static_cast<IType*>(output.data)}, rows, cols,
        args);
    return 0;
  }
  auto* out = static_cast<uint8_t*>(output.data);
  size_t partial_rows = 0;
  dispatch_fp8(ctx.op(), output.dtype, [&](auto is_e4m3) {
    constexpr bool kE4M3 = decltype(is_e4m3)::value;
    if (output_t == nullptr || rows * cols == 0) {
      launch_elementwise<Loader, Fp8Store<kE4M3>, true>(ctx, loader, Fp8Store<kE4M3>{out, 1.0f},
                                                        rows, cols, args);
      return;
    }
    auto* out_t = static_cast<uint8_t*>(output_t->data);
    if constexpr (kBackward) {  // dbias: backward only
      if (column_sums != nullptr) {
        partial_rows = cast_detail::launch_cast_transpose_from<Loader, kE4M3, true>(
            loader, out, out_t, rows, cols, args, column_sums, ctx);
        return;
      }
    }
    cast_detail::launch_cast_transpose_from<Loader, kE4M3, false>(loader, out, out_t, rows, cols,
                                                                  args, nullptr, ctx);
  });
  return partial_rows;
}

/* The amax of the loader's [rows, cols] values, overwriting `amax` (zeroed first). */
template <class Loader>
void launch_amax_only(CallContext& ctx, const Loader& loader, size_t rows, size_t cols,
                      float* amax) {
  check_cuda(ctx.op(), cudaMemsetAsync(amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  const CastArgs args{nullptr, amax, nullptr, nullptr};
  launch_elementwise<Loader, AmaxOnlyStore, false, true>(ctx, loader, AmaxOnlyStore{}, rows, cols,
                                                         args);
}

inline NVTEActivation check_activation(const char* op, const NVTEActivation& act) {
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
inline ActivationShape check_input(const char* op, const NVTEBuffer& in, bool gated) {
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

inline void check_extent(const char* op, const char* name, const NVTEBuffer& buffer, size_t rows,
                  size_t cols) {
  check_well_formed(op, name, buffer);
  if (buffer.ndim == 0 || last_dim(buffer) != cols || numel(buffer) != rows * cols) {
    throw_invalid(op, name, " must hold [", rows, ", ", cols, "] elements with last extent ",
                  cols);
  }
}

/* The FP8 arguments: present exactly when `output` is FP8; returns the kernels' pointers. */
inline CastArgs check_fp8_args(const char* op, const NVTEBuffer& output, const char* output_name,
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
inline CastArgs check_result(const char* op, const char* name, const NVTEBuffer& out,
                      const NVTEBuffer& in, size_t rows, size_t cols, const NVTEBuffer* scale,
                      NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  check_extent(op, name, out, rows, cols);
  if (!is_fp8(out.dtype) && out.dtype != in.dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(out.dtype), " but input has ",
                  dtype_name(in.dtype), "; a high-precision ", name, " keeps the input's dtype");
  }
  return check_fp8_args(op, out, name, scale, output_t, amax, scale_inv, rows, cols);
}

inline void check_fp8_on_device(CallContext& ctx, const NVTEBuffer* scale, NVTEBuffer* output_t,
                         NVTEBuffer* amax, NVTEBuffer* scale_inv) {
  if (scale != nullptr) ctx.check_on_device("scale", *scale);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);
}

/* `grad` [rows, cols] in the input's dtype; throws otherwise. */
inline const NVTEBuffer& check_grad(const char* op, const NVTEBuffer* grad, const NVTEBuffer& in,
                             const ActivationShape& shape) {
  const NVTEBuffer& g = require(op, "grad", grad);
  check_extent(op, "grad", g, shape.rows, shape.cols);
  if (g.dtype != in.dtype) {
    throw_invalid(op, "grad has dtype ", dtype_name(g.dtype), " but input has ",
                  dtype_name(in.dtype), "; pass both in the activation dtype");
  }
  return g;
}

/* Calls f(std::integral_constant<int, kind>) for the checked kind: the one switch on the kind,
 * at launch (sigmoid and clamped SwiGLU exist gated only, see check_activation). */
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

}  // namespace
}  // namespace transformer_engine

