/* The activation functions and their derivatives in float32, and the loaders that compute an
 * activation (or its gradient) of a row of FC1's output on the fly for the kernels of
 * activation_launch.cuh and cast/cast_transpose.cuh.
 *
 * Everything is fixed at compile time: each loader is a template over the element type, the
 * activation kind and the gating, so a kernel holds one function's straight-line arithmetic
 * and nothing branches on the kind per element or per vector (activation_launch.cuh switches on it
 * once, at launch). Only clamped SwiGLU's parameters stay run-time values. */
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
constexpr float kLog2E = 1.4426950408889634f;

/* 2^x on the special-function unit (a few float32 ulps; subnormal results kept). */
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* 1 / x on the special-function unit (1 ulp). Only called with x >= 1, Inf or NaN, so
 * flushing subnormals changes nothing. */
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* The logistic function s = 1 / (1 + e), e = exp(-x), and 1 - s = e s computed without the
 * cancellation of 1 - s (x = -inf gives e s = inf * 0, and fminf(NaN, 1) = 1 is the limit).
 * kFast (bf16/fp16 activations, whose results round to 2^-9 / 2^-12): the special-function
 * unit's exponential and reciprocal (a few float32 ulps together); float32 activations keep
 * libm's expf and IEEE division. */
struct Logistic {
  float s, one_minus_s;
};

template <bool kFast>
__device__ __forceinline__ Logistic logistic(float x) {
  const float e = kFast ? exp2_approx(-kLog2E * x) : expf(-x);
  const float s = kFast ? rcp_approx(1.0f + e) : 1.0f / (1.0f + e);
  return {s, fminf(e * s, 1.0f)};
}

/* NaN stays NaN (as torch.relu), everything at or below 0 becomes 0. */
__device__ __forceinline__ float relu(float u) { return u > 0.0f || u != u ? u : 0.0f; }

/* act(u) and, when kDerivative, d act / d u of the non-clamped kinds (the gated backward
 * needs both and they share the exponential). GELU's tanh form: kFast uses
 * 0.5 (1 + tanh z) = logistic(2 z), the same function without tanhf; float32 keeps the tanhf
 * formula of the reference. */
template <int kKind, bool kFast, bool kDerivative>
__device__ __forceinline__ void act_value_and_derivative(float u, float& y, float& dy) {
  if constexpr (kKind == kNVTEActGelu) {
    const float u2 = u * u;
    const float dz = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * u2);
    if constexpr (kFast) {
      // logistic(2 z) with 2 z = u (2 sqrt(2/pi) + 2 sqrt(2/pi) 0.044715 u^2).
      const float two_z = u * (2.0f * kSqrt2OverPi + 2.0f * kSqrt2OverPi * kGeluCubic * u2);
      const Logistic l = logistic<true>(two_z);
      y = u * l.s;
      if constexpr (kDerivative) dy = l.s + 2.0f * u * l.s * l.one_minus_s * dz;
    } else {
      const float z = kSqrt2OverPi * (u + kGeluCubic * u2 * u);
      const float t = tanhf(z);
      y = 0.5f * u * (1.0f + t);
      if constexpr (kDerivative) dy = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * dz;
    }
  } else if constexpr (kKind == kNVTEActQGelu) {
    const Logistic l = logistic<kFast>(kQGeluSlope * u);
    y = u * l.s;
    if constexpr (kDerivative) dy = l.s + kQGeluSlope * u * l.s * l.one_minus_s;
  } else if constexpr (kKind == kNVTEActRelu) {
    y = relu(u);
    if constexpr (kDerivative) dy = u > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (kKind == kNVTEActSRelu) {
    const float r = relu(u);
    y = r * r;
    if constexpr (kDerivative) dy = 2.0f * r;
  } else if constexpr (kKind == kNVTEActSilu) {
    const Logistic l = logistic<kFast>(u);
    y = u * l.s;
    if constexpr (kDerivative) dy = l.s * (1.0f + u * l.one_minus_s);
  } else {
    static_assert(kKind == kNVTEActSigmoid, "clamped SwiGLU has its own formulas");
    const Logistic l = logistic<kFast>(u);
    y = l.s;
    if constexpr (kDerivative) dy = l.s * l.one_minus_s;
  }
}

/* The forward value of one output element: `u` from the first half, `v` from the second
 * (gated only). */
template <int kKind, bool kGated, bool kFast>
__device__ __forceinline__ float forward_value(const NVTEActivation& act, float u, float v) {
  if constexpr (kKind == kNVTEActClampedSilu) {
    const float a = u > act.limit ? act.limit : u;
    const float b = v > act.limit ? act.limit : (v < -act.limit ? -act.limit : v);
    return a * logistic<kFast>(act.alpha * a).s * (b + act.glu_linear_offset);
  } else {
    float y, dy;
    act_value_and_derivative<kKind, kFast, false>(u, y, dy);
    return kGated ? y * v : y;
  }
}

/* The gradients of one element pair: `du` for the first-half input, `dv` for the second
 * (gated only), given the output gradient `g`. */
template <int kKind, bool kGated, bool kFast>
__device__ __forceinline__ void backward_values(const NVTEActivation& act, float g, float u,
                                                float v, float& du, float& dv) {
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
    act_value_and_derivative<kKind, kFast, true>(u, y, dy);
    if constexpr (kGated) {
      du = g * v * dy;
      dv = g * y;
    } else {
      du = g * dy;
      dv = 0.0f;
    }
  }
}

/* The fast arithmetic for 16-bit activations (see logistic()). */
template <typename IType>
constexpr bool kFastMath = !std::is_same<IType, float>::value;

template <typename IType>
__device__ __forceinline__ void to_floats(const Vec<IType, kVecElems>& x, float (&v)[kVecElems]) {
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) v[j] = to_float(x.v[j]);
}

/* The loaders follow cast_transpose.cuh's Loader contract (PlainLoad states it): `fetch` issues
 * the 16-byte loads of one vector position, `compute` turns them into kParts x kVecElems
 * float32 results, `load` computes one position's kParts results element-wise. */

/* The forward: element (r, c) of act(input) as a [rows, cols] matrix; the input row has
 * (gated ? 2 : 1) * cols elements. */
template <typename IType, int kKind, bool kGated>
struct ActivationLoad {
  using InputType = IType;
  static constexpr int kParts = 1;
  struct Raw {
    Vec<IType, kVecElems> u, v;  // v: gated only
  };
  const IType* in;
  size_t cols;
  NVTEActivation act;

  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ Raw fetch(size_t r, size_t c) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    Raw raw;
    raw.u = load_readonly<IType, kVecElems>(row + c);
    if constexpr (kGated) raw.v = load_readonly<IType, kVecElems>(row + cols + c);
    return raw;
  }
  __device__ __forceinline__ void compute(const Raw& raw, float (&out)[1][kVecElems]) const {
    float u[kVecElems], v[kVecElems] = {};
    to_floats(raw.u, u);
    if constexpr (kGated) to_floats(raw.v, v);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      out[0][j] = forward_value<kKind, kGated, kFastMath<IType>>(act, u[j], v[j]);
    }
  }
  __device__ __forceinline__ void load(size_t r, size_t c, float (&out)[1]) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + c]) : 0.0f;
    out[0] = forward_value<kKind, kGated, kFastMath<IType>>(act, to_float(row[c]), v);
  }
};

/* The backward: position (r, c) of the output gradient grad [rows, cols] gives d loss / d input
 * at input column c (part 0) and, gated, at input column cols + c (part 1): one thread computes
 * both halves' gradients from one read of grad, u and v. */
template <typename IType, int kKind, bool kGated>
struct DActivationLoad {
  using InputType = IType;
  static constexpr int kParts = kGated ? 2 : 1;
  struct Raw {
    Vec<IType, kVecElems> g, u, v;  // v: gated only
  };
  const IType* grad;
  const IType* in;
  size_t cols;
  NVTEActivation act;

  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(grad, sizeof(IType) * kVecElems) &&
           aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ Raw fetch(size_t r, size_t c) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    Raw raw;
    raw.g = load_readonly<IType, kVecElems>(grad + r * cols + c);
    raw.u = load_readonly<IType, kVecElems>(row + c);
    if constexpr (kGated) raw.v = load_readonly<IType, kVecElems>(row + cols + c);
    return raw;
  }
  __device__ __forceinline__ void compute(const Raw& raw, float (&out)[kParts][kVecElems]) const {
    float g[kVecElems], u[kVecElems], v[kVecElems] = {};
    to_floats(raw.g, g);
    to_floats(raw.u, u);
    if constexpr (kGated) to_floats(raw.v, v);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      float du, dv;
      backward_values<kKind, kGated, kFastMath<IType>>(act, g[j], u[j], v[j], du, dv);
      out[0][j] = du;
      if constexpr (kGated) out[kParts - 1][j] = dv;
    }
  }
  __device__ __forceinline__ void load(size_t r, size_t c, float (&out)[kParts]) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + c]) : 0.0f;
    float du, dv;
    backward_values<kKind, kGated, kFastMath<IType>>(act, to_float(grad[r * cols + c]),
                                                      to_float(row[c]), v, du, dv);
    out[0] = du;
    if constexpr (kGated) out[kParts - 1] = dv;
  }
};

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
