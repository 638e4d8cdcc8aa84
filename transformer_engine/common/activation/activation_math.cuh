/* The activation functions and their derivatives in float32, and the loaders that compute an
 * activation (or its gradient) of a row of FC1's output on the fly for the cast kernels.
 *
 * The kind is a run-time value, uniform over a launch: one kernel per element type and
 * gating serves all seven functions (a warp never diverges on it), which keeps the number of
 * compiled kernels small. The loaders branch on it once per vector of elements
 * (dispatch_kind), so the per-element code is each function's own straight-line arithmetic. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_

#include <cstddef>
#include <type_traits>

#include "cast/cast_transpose.cuh"
#include "transformer_engine/activation.h"
#include "util/buffer.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace activation_detail {

using cast_detail::kVecElems;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kQGeluSlope = 1.702f;

/* The logistic function s = 1 / (1 + e), e = exp(-x), and 1 - s = e s computed without the
 * cancellation of 1 - s (x = -inf gives e s = inf * 0, and fminf(NaN, 1) = 1 is the limit).
 * kFast (bf16/fp16 activations, whose results round to 2^-9 / 2^-12): the special-function
 * unit's exponential (__expf, a few float32 ulps) and a correctly rounded reciprocal; float32
 * activations keep libm's expf and IEEE division. The kernels are bound by this arithmetic,
 * not by memory, with the libm forms. */
struct Logistic {
  float s, one_minus_s;
};

template <bool kFast>
__device__ __forceinline__ Logistic logistic(float x) {
  const float e = kFast ? __expf(-x) : expf(-x);
  const float s = kFast ? __frcp_rn(1.0f + e) : 1.0f / (1.0f + e);
  return {s, fminf(e * s, 1.0f)};
}

/* NaN stays NaN (as torch.relu), everything at or below 0 becomes 0. */
__device__ __forceinline__ float relu(float u) { return u > 0.0f || u != u ? u : 0.0f; }

/* act(u) and d act / d u of the non-clamped kinds, together (the gated backward needs both and
 * they share the exponential). GELU's tanh form: kFast uses 0.5 (1 + tanh z) = logistic(2 z),
 * the same function without tanhf; float32 keeps the tanhf formula of the reference. */
template <int kKind, bool kFast>
__device__ __forceinline__ void act_value_and_derivative(float u, float& y, float& dy) {
  switch (kKind) {
    case kNVTEActGelu: {
      const float z = kSqrt2OverPi * (u + kGeluCubic * u * u * u);
      const float dz = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * u * u);
      if constexpr (kFast) {
        const Logistic l = logistic<true>(2.0f * z);
        y = u * l.s;
        dy = l.s + 2.0f * u * l.s * l.one_minus_s * dz;
      } else {
        const float t = tanhf(z);
        y = 0.5f * u * (1.0f + t);
        dy = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * dz;
      }
      return;
    }
    case kNVTEActQGelu: {
      const Logistic l = logistic<kFast>(kQGeluSlope * u);
      y = u * l.s;
      dy = l.s + kQGeluSlope * u * l.s * l.one_minus_s;
      return;
    }
    case kNVTEActRelu:
      y = relu(u);
      dy = u > 0.0f ? 1.0f : 0.0f;
      return;
    case kNVTEActSRelu: {
      const float r = relu(u);
      y = r * r;
      dy = 2.0f * r;
      return;
    }
    case kNVTEActSilu: {
      const Logistic l = logistic<kFast>(u);
      y = u * l.s;
      dy = l.s * (1.0f + u * l.one_minus_s);
      return;
    }
    default: {  // kNVTEActSigmoid
      const Logistic l = logistic<kFast>(u);
      y = l.s;
      dy = l.s * l.one_minus_s;
      return;
    }
  }
}

/* act(u) alone (the forward); the derivative's extra arithmetic is dead code here. */
template <int kKind, bool kFast>
__device__ __forceinline__ float act_value(float u) {
  float y, dy;
  act_value_and_derivative<kKind, kFast>(u, y, dy);
  return y;
}

/* The forward value of one output element: `u` from the first half, `v` from the second
 * (gated only). */
template <int kKind, bool kFast>
__device__ __forceinline__ float forward_value(const NVTEActivation& act, bool gated, float u,
                                               float v) {
  if constexpr (kKind == kNVTEActClampedSilu) {
    const float a = u > act.limit ? act.limit : u;
    const float b = v > act.limit ? act.limit : (v < -act.limit ? -act.limit : v);
    return a * logistic<kFast>(act.alpha * a).s * (b + act.glu_linear_offset);
  } else {
    const float y = act_value<kKind, kFast>(u);
    return gated ? y * v : y;
  }
}

/* The gradients of one element pair: `du` for the first-half input, `dv` for the second
 * (gated only), given the output gradient `g`. */
template <int kKind, bool kFast>
__device__ __forceinline__ void backward_values(const NVTEActivation& act, bool gated, float g,
                                                float u, float v, float& du, float& dv) {
  if constexpr (kKind == kNVTEActClampedSilu) {
    const float a = u > act.limit ? act.limit : u;
    const bool v_inside = v >= -act.limit && v <= act.limit;
    const float b = v_inside ? v : (v > act.limit ? act.limit : -act.limit);
    const Logistic l = logistic<kFast>(act.alpha * a);
    const float swish = a * l.s;
    du = u <= act.limit
             ? g * (b + act.glu_linear_offset) * (l.s + act.alpha * a * l.s * l.one_minus_s)
             : 0.0f;
    dv = v_inside ? g * swish : 0.0f;
  } else {
    float y, dy;
    act_value_and_derivative<kKind, kFast>(u, y, dy);
    if (gated) {
      du = g * v * dy;
      dv = g * y;
    } else {
      du = g * dy;
      dv = 0.0f;
    }
  }
}

/* Calls f(std::integral_constant<int, kind>): the loaders branch on the kind once per vector
 * of elements, and each branch is straight-line code for its function. */
template <typename F>
__device__ __forceinline__ void dispatch_kind(int kind, F&& f) {
  switch (kind) {
    case kNVTEActGelu:
      f(std::integral_constant<int, kNVTEActGelu>{});
      break;
    case kNVTEActQGelu:
      f(std::integral_constant<int, kNVTEActQGelu>{});
      break;
    case kNVTEActRelu:
      f(std::integral_constant<int, kNVTEActRelu>{});
      break;
    case kNVTEActSRelu:
      f(std::integral_constant<int, kNVTEActSRelu>{});
      break;
    case kNVTEActSilu:
      f(std::integral_constant<int, kNVTEActSilu>{});
      break;
    case kNVTEActClampedSilu:
      f(std::integral_constant<int, kNVTEActClampedSilu>{});
      break;
    default:
      f(std::integral_constant<int, kNVTEActSigmoid>{});
      break;
  }
}

/* The fast arithmetic for 16-bit activations (see logistic()). */
template <typename IType>
constexpr bool kFastMath = !std::is_same<IType, float>::value;

template <typename IType, int N>
__device__ __forceinline__ void load_floats(const IType* p, float (&v)[N]) {
  const Vec<IType, N> x = load_readonly<IType, N>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_float(x.v[j]);
}

/* The forward's values: element (r, c) of act(input) as a [rows, cols] matrix; the input row
 * has in_cols = (gated ? 2 : 1) * cols elements. */
template <typename IType, bool kGated>
struct ActivationLoad {
  const IType* in;
  size_t cols;
  NVTEActivation act;

  size_t in_cols() const { return kGated ? 2 * cols : cols; }
  bool vectorizable() const { return aligned_to(in, sizeof(IType) * kVecElems); }
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&out)[kVecElems]) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    float u[kVecElems], v[kVecElems] = {};
    load_floats(row + c, u);
    if constexpr (kGated) load_floats(row + cols + c, v);
    dispatch_kind(act.kind, [&](auto kind) {
      constexpr int kKind = decltype(kind)::value;
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        out[j] = forward_value<kKind, kFastMath<IType>>(act, kGated, u[j], v[j]);
      }
    });
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + c]) : 0.0f;
    float y = 0.0f;
    dispatch_kind(act.kind, [&](auto kind) {
      y = forward_value<decltype(kind)::value, kFastMath<IType>>(act, kGated, to_float(row[c]), v);
    });
    return y;
  }
};

/* The backward's values: element (r, c) of d loss / d input as a [rows, in_cols] matrix, from
 * the output gradient grad [rows, cols] and the forward's input. For a gated activation,
 * columns below `cols` are the first half's gradient, the others the second half's; a vector
 * of kVecElems never straddles the two when cols % kVecElems == 0 (vectorizable()). */
template <typename IType, bool kGated>
struct DActivationLoad {
  const IType* grad;
  const IType* in;
  size_t cols;
  NVTEActivation act;

  size_t in_cols() const { return kGated ? 2 * cols : cols; }
  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(grad, sizeof(IType) * kVecElems) &&
           aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&out)[kVecElems]) const {
    const bool second = kGated && c >= cols;
    const size_t k = second ? c - cols : c;
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    float g[kVecElems], u[kVecElems], v[kVecElems] = {};
    load_floats(grad + r * cols + k, g);
    load_floats(row + k, u);
    if constexpr (kGated) load_floats(row + cols + k, v);
    dispatch_kind(act.kind, [&](auto kind) {
      constexpr int kKind = decltype(kind)::value;
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        float du, dv;
        backward_values<kKind, kFastMath<IType>>(act, kGated, g[j], u[j], v[j], du, dv);
        out[j] = second ? dv : du;
      }
    });
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    const bool second = kGated && c >= cols;
    const size_t k = second ? c - cols : c;
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + k]) : 0.0f;
    const float g = to_float(grad[r * cols + k]);
    const float u = to_float(row[k]);
    float du = 0.0f, dv = 0.0f;
    dispatch_kind(act.kind, [&](auto kind) {
      backward_values<decltype(kind)::value, kFastMath<IType>>(act, kGated, g, u, v, du, dv);
    });
    return second ? dv : du;
  }
};

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
