/* The activation functions and their derivatives in float32, and the loaders that compute an
 * activation (or its gradient) of a row of FC1's output on the fly for the cast kernels.
 *
 * The kind is a run-time value, uniform over a launch: one kernel per element type and
 * gating serves all seven functions (a warp never diverges on it), which keeps the number of
 * compiled kernels small; the kernels are bound by memory, not by this branch. */
#ifndef TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
#define TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_

#include <cstddef>

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

__device__ __forceinline__ float sigmoid(float u) { return 1.0f / (1.0f + expf(-u)); }

/* NaN stays NaN (as torch.relu), everything at or below 0 becomes 0. */
__device__ __forceinline__ float relu(float u) { return u > 0.0f || u != u ? u : 0.0f; }

/* act(u) for the non-clamped kinds. */
__device__ __forceinline__ float act_value(int kind, float u) {
  switch (kind) {
    case kNVTEActGelu:
      return 0.5f * u * (1.0f + tanhf(kSqrt2OverPi * (u + kGeluCubic * u * u * u)));
    case kNVTEActQGelu:
      return u * sigmoid(kQGeluSlope * u);
    case kNVTEActRelu:
      return relu(u);
    case kNVTEActSRelu: {
      const float r = relu(u);
      return r * r;
    }
    case kNVTEActSilu:
      return u * sigmoid(u);
    default:  // kNVTEActSigmoid
      return sigmoid(u);
  }
}

/* d act / d u for the non-clamped kinds. */
__device__ __forceinline__ float act_derivative(int kind, float u) {
  switch (kind) {
    case kNVTEActGelu: {
      const float t = tanhf(kSqrt2OverPi * (u + kGeluCubic * u * u * u));
      return 0.5f * (1.0f + t) +
             0.5f * u * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * u * u);
    }
    case kNVTEActQGelu: {
      const float s = sigmoid(kQGeluSlope * u);
      return s + kQGeluSlope * u * s * (1.0f - s);
    }
    case kNVTEActRelu:
      return u > 0.0f ? 1.0f : 0.0f;
    case kNVTEActSRelu:
      return 2.0f * relu(u);
    case kNVTEActSilu: {
      const float s = sigmoid(u);
      return s * (1.0f + u * (1.0f - s));
    }
    default: {  // kNVTEActSigmoid
      const float s = sigmoid(u);
      return s * (1.0f - s);
    }
  }
}

/* The forward value of one output element: `u` from the first half, `v` from the second
 * (gated only). */
__device__ __forceinline__ float forward_value(const NVTEActivation& act, bool gated, float u,
                                               float v) {
  if (act.kind == kNVTEActClampedSilu) {
    const float a = u > act.limit ? act.limit : u;
    const float b = v > act.limit ? act.limit : (v < -act.limit ? -act.limit : v);
    return a * sigmoid(act.alpha * a) * (b + act.glu_linear_offset);
  }
  const float y = act_value(act.kind, u);
  return gated ? y * v : y;
}

/* The gradients of one element pair: `du` for the first-half input, `dv` for the second
 * (gated only), given the output gradient `g`. */
__device__ __forceinline__ void backward_values(const NVTEActivation& act, bool gated, float g,
                                                float u, float v, float& du, float& dv) {
  if (act.kind == kNVTEActClampedSilu) {
    const float a = u > act.limit ? act.limit : u;
    const bool v_inside = v >= -act.limit && v <= act.limit;
    const float b = v_inside ? v : (v > act.limit ? act.limit : -act.limit);
    const float s = sigmoid(act.alpha * a);
    const float swish = a * s;
    du = u <= act.limit ? g * (b + act.glu_linear_offset) * (s + act.alpha * a * s * (1.0f - s))
                        : 0.0f;
    dv = v_inside ? g * swish : 0.0f;
    return;
  }
  if (gated) {
    du = g * v * act_derivative(act.kind, u);
    dv = g * act_value(act.kind, u);
  } else {
    du = g * act_derivative(act.kind, u);
    dv = 0.0f;
  }
}

template <typename IType, int N>
__device__ __forceinline__ void load_floats(const IType* p, float (&v)[N]) {
  const auto x = *reinterpret_cast<const Vec<IType, N>*>(p);
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
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = forward_value(act, kGated, u[j], v[j]);
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + c]) : 0.0f;
    return forward_value(act, kGated, to_float(row[c]), v);
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
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      float du, dv;
      backward_values(act, kGated, g[j], u[j], v[j], du, dv);
      out[j] = second ? dv : du;
    }
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    const bool second = kGated && c >= cols;
    const size_t k = second ? c - cols : c;
    const IType* row = in + r * (kGated ? 2 * cols : cols);
    const float v = kGated ? to_float(row[cols + k]) : 0.0f;
    float du, dv;
    backward_values(act, kGated, to_float(grad[r * cols + k]), to_float(row[k]), v, du, dv);
    return second ? dv : du;
  }
};

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
