/* The activation functions and their derivatives in float32, and the loaders that compute an
 * activation (or its gradient) of a row of FC1's output on the fly for the kernels of
 * activation_elementwise.cuh and cast/cast_transpose.cuh.
 *
 * Each loader is a template over the element type, the activation kind and the gating, so a
 * kernel holds one function's straight-line arithmetic and nothing branches on the kind per
 * element or per vector: the entry points switch on it once, at launch (activation_launch.cuh).
 * Only clamped SwiGLU's parameters stay run-time values. */
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

/* The logistic function s = 1 / (1 + e) of k x, e = exp(-k x), and 1 - s = e s computed
 * without the cancellation of 1 - s (k x = -inf gives e s = inf * 0, and fminf(NaN, 1) = 1 is
 * the limit).
 *
 * kFast (bf16/fp16 activations, whose results round to 2^-9 / 2^-12): e = 2^t with
 * t = x (-k log2 e), k log2 e folded into one constant, and the special-function unit's
 * exponential and reciprocal (ex2/rcp.approx.ftz: within two float32 ulps, subnormals flushed;
 * s then differs from the exact value by a few 1e-7 relative). Four instructions where expf
 * and a correctly rounded division take about twenty, which had bound the kernels by their
 * instruction count. float32 activations keep libm's expf and IEEE division. */
struct Logistic {
  float s, one_minus_s;
};

constexpr float kNegLog2e = -1.4426950408889634f;

__device__ __forceinline__ float exp2_approx(float t) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
}

__device__ __forceinline__ float rcp_approx(float d) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return y;
}

/* kFast's logistic from t = -x log2 e directly (callers that fold more into t). */
__device__ __forceinline__ Logistic logistic_exp2(float t) {
  const float e = exp2_approx(t);
  const float s = rcp_approx(1.0f + e);
  return {s, fminf(e * s, 1.0f)};
}

template <bool kFast>
__device__ __forceinline__ Logistic logistic(float x, float k = 1.0f) {
  if constexpr (kFast) {
    return logistic_exp2(x * (k * kNegLog2e));
  } else {
    const float e = expf(-(k * x));
    const float s = 1.0f / (1.0f + e);
    return {s, fminf(e * s, 1.0f)};
  }
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
      if constexpr (kFast) {
        // logistic(2 z), z = sqrt(2/pi) (u + c u^3): its exponent 2^t, t = u (a + a c u^2),
        // a = -2 sqrt(2/pi) log2 e; dz = sqrt(2/pi) + 3 c sqrt(2/pi) u^2.
        constexpr float a = 2.0f * kSqrt2OverPi * kNegLog2e;
        const float u2 = u * u;
        const Logistic l = logistic_exp2(u * fmaf(a * kGeluCubic, u2, a));
        const float dz = fmaf(3.0f * kGeluCubic * kSqrt2OverPi, u2, kSqrt2OverPi);
        y = u * l.s;
        dy = fmaf(2.0f * u * l.s * l.one_minus_s, dz, l.s);
      } else {
        const float z = kSqrt2OverPi * (u + kGeluCubic * u * u * u);
        const float dz = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * u * u);
        const float t = tanhf(z);
        y = 0.5f * u * (1.0f + t);
        dy = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * dz;
      }
      return;
    }
    case kNVTEActQGelu: {
      const Logistic l = logistic<kFast>(u, kQGeluSlope);
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
    return a * logistic<kFast>(a, act.alpha).s * (b + act.glu_linear_offset);
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
    const Logistic l = logistic<kFast>(a, act.alpha);
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

/* The fast arithmetic for 16-bit activations (see logistic()). */
template <typename IType>
constexpr bool kFastMath = !std::is_same<IType, float>::value;

template <typename IType, int N>
__device__ __forceinline__ void to_floats(const Vec<IType, N>& x, float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_float(x.v[j]);
}

/* A loader serves two kernels through two contracts.
 *
 * The tiled cast+transpose (cast_transpose.cuh, whose PlainLoad states the contract) reads the
 * result as a [rows, result_cols] matrix: `load_vec(r, c, v)` gives kVecElems consecutive result
 * columns from c, `load(r, c)` one, and `tile_fetch`/`tile_compute` are load_vec in two halves.
 *
 * The element-wise kernel (activation_elementwise.cuh) walks positions (r, c) of a [rows, cols]
 * matrix, cols the activation's output width; a position gives kParts results, part p being
 * result column p * cols + c. `fetch(r, c)` issues one vector position's 16-byte loads and
 * returns them unconverted (Raw), `compute(raw, out)` turns them into kParts x kVecElems
 * float32 results, and `load_parts(r, c, out)` computes one position's results element-wise.
 * Fetch and compute are apart so that a thread can have several positions' loads in flight
 * before it waits for the first. Both need cols % kVecElems == 0 and aligned operands
 * (`vectorizable()`). */

/* The forward: element (r, c) of act(input) as a [rows, cols] matrix; the input row has
 * in_cols = (gated ? 2 : 1) * cols elements. A position gives one result. */
template <typename IType, int kKind, bool kGated>
struct ActivationLoad {
  using InputType = IType;
  static constexpr int kParts = 1;
  static constexpr int kOperands = kGated ? 2 : 1;  // u (and v)
  /* |act(u)| <= |u| for every u, as computed: act(u) = u s with s in [0, 1] (GELU's logistic
   * form or 0.5 (1 + tanhf), QGELU's and SiLU's logistic; a float product by s <= 1 rounds to
   * at most |u|; rcp.approx may put s a few ulps above 1, which the amax pass's relative margin
   * of 2^-20, 16 ulps, covers). The amax-only pass (activation_elementwise.cuh) then skips the
   * arithmetic of inputs no larger than an amax already found: their values cannot raise it.
   * Only the activations whose arithmetic is worth skipping (two special-function operations
   * an element) claim it. */
  static constexpr bool kBoundedByInput =
      !kGated && (kKind == kNVTEActGelu || kKind == kNVTEActQGelu || kKind == kNVTEActSilu);
  struct Raw {
    Vec<IType, kVecElems> x[kOperands];
  };
  const IType* in;
  size_t cols;
  NVTEActivation act;

  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ const IType* row(size_t r) const {
    return in + r * (kGated ? 2 * cols : cols);
  }

  // The tiled kernel's contract.
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&out)[kVecElems]) const {
    float x[1][kVecElems];
    compute(fetch(r, c), x);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = x[0][j];
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    float x[1];
    load_parts(r, c, x);
    return x[0];
  }
  using TileRaw = Raw;
  __device__ __forceinline__ Raw tile_fetch(size_t r, size_t c) const { return fetch(r, c); }
  __device__ __forceinline__ void tile_compute(const Raw& raw, size_t,
                                               float (&out)[kVecElems]) const {
    float x[1][kVecElems];
    compute(raw, x);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = x[0][j];
  }

  // The element-wise kernel's contract.
  __device__ __forceinline__ Raw fetch(size_t r, size_t c) const {
    Raw raw;
    raw.x[0] = load_readonly<IType, kVecElems>(row(r) + c);
    if constexpr (kGated) raw.x[1] = load_readonly<IType, kVecElems>(row(r) + cols + c);
    return raw;
  }
  __device__ __forceinline__ void compute(const Raw& raw, float (&out)[1][kVecElems]) const {
    float u[kVecElems], v[kVecElems] = {};
    to_floats(raw.x[0], u);
    if constexpr (kGated) to_floats(raw.x[1], v);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      out[0][j] = forward_value<kKind, kFastMath<IType>>(act, kGated, u[j], v[j]);
    }
  }
  __device__ __forceinline__ void load_parts(size_t r, size_t c, float (&out)[1]) const {
    const float v = kGated ? to_float(row(r)[cols + c]) : 0.0f;
    out[0] = forward_value<kKind, kFastMath<IType>>(act, kGated, to_float(row(r)[c]), v);
  }
  /* Whether every input of the position is at most `bound` in magnitude (NaN is not). */
  __device__ __forceinline__ bool inputs_within(const Raw& raw, float bound) const {
    bool within = true;
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) within &= fabsf(to_float(raw.x[0].v[j])) <= bound;
    return within;
  }
};

/* The backward. Tiled contract: element (r, c) of d loss / d input as a [rows, in_cols] matrix,
 * from the output gradient grad [rows, cols] and the forward's input; for a gated activation,
 * columns below `cols` are the first half's gradient, the others the second half's (a vector
 * never straddles the two, as cols % kVecElems == 0). Element-wise contract: position (r, c) of
 * grad gives the gradient at input column c (part 0) and, gated, at input column cols + c
 * (part 1), so a thread reads grad, u and v once and writes both halves. */
template <typename IType, int kKind, bool kGated>
struct DActivationLoad {
  using InputType = IType;
  static constexpr int kParts = kGated ? 2 : 1;
  static constexpr int kOperands = kGated ? 3 : 2;  // grad, u (and v)
  static constexpr bool kBoundedByInput = false;  // see ActivationLoad
  struct Raw {
    Vec<IType, kVecElems> x[kOperands];
  };
  const IType* grad;
  const IType* in;
  size_t cols;
  NVTEActivation act;

  bool vectorizable() const {
    return cols % kVecElems == 0 && aligned_to(grad, sizeof(IType) * kVecElems) &&
           aligned_to(in, sizeof(IType) * kVecElems);
  }
  __device__ __forceinline__ const IType* row(size_t r) const {
    return in + r * (kGated ? 2 * cols : cols);
  }

  // The tiled kernel's contract: one half's gradients of a position's vector.
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&out)[kVecElems]) const {
    const bool second = kGated && c >= cols;
    float x[kParts][kVecElems];
    compute(fetch(r, second ? c - cols : c), x);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = second ? x[kParts - 1][j] : x[0][j];
  }
  __device__ __forceinline__ float load(size_t r, size_t c) const {
    const bool second = kGated && c >= cols;
    float x[kParts];
    load_parts(r, second ? c - cols : c, x);
    return second ? x[kParts - 1] : x[0];
  }
  using TileRaw = Raw;
  __device__ __forceinline__ Raw tile_fetch(size_t r, size_t c) const {
    return fetch(r, kGated && c >= cols ? c - cols : c);
  }
  __device__ __forceinline__ void tile_compute(const Raw& raw, size_t c,
                                               float (&out)[kVecElems]) const {
    const bool second = kGated && c >= cols;
    float x[kParts][kVecElems];
    compute(raw, x);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = second ? x[kParts - 1][j] : x[0][j];
  }

  // The element-wise kernel's contract.
  __device__ __forceinline__ Raw fetch(size_t r, size_t c) const {
    Raw raw;
    raw.x[0] = load_readonly<IType, kVecElems>(grad + r * cols + c);
    raw.x[1] = load_readonly<IType, kVecElems>(row(r) + c);
    if constexpr (kGated) raw.x[2] = load_readonly<IType, kVecElems>(row(r) + cols + c);
    return raw;
  }
  __device__ __forceinline__ void compute(const Raw& raw, float (&out)[kParts][kVecElems]) const {
    float g[kVecElems], u[kVecElems], v[kVecElems] = {};
    to_floats(raw.x[0], g);
    to_floats(raw.x[1], u);
    if constexpr (kGated) to_floats(raw.x[2], v);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      float du, dv;
      backward_values<kKind, kFastMath<IType>>(act, kGated, g[j], u[j], v[j], du, dv);
      out[0][j] = du;
      if constexpr (kGated) out[kParts - 1][j] = dv;
    }
  }
  __device__ __forceinline__ void load_parts(size_t r, size_t c, float (&out)[kParts]) const {
    const float v = kGated ? to_float(row(r)[cols + c]) : 0.0f;
    float du, dv;
    backward_values<kKind, kFastMath<IType>>(act, kGated, to_float(grad[r * cols + c]),
                                             to_float(row(r)[c]), v, du, dv);
    out[0] = du;
    if constexpr (kGated) out[kParts - 1] = dv;
  }
};

}  // namespace activation_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_ACTIVATION_ACTIVATION_MATH_CUH_
