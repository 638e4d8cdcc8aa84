/* The LayerNorm/RMSNorm forward kernels' parameters and their per-vector output: how one
 * normalized vector is written, high precision or FP8 with its amax (norm_forward.cu's register,
 * staged and looped kernels all write through emit()). */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_FORWARD_MATH_CUH_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_FORWARD_MATH_CUH_

#include "normalization/norm_common.cuh"

namespace transformer_engine {
namespace norm_detail {

struct FwdParams {
  const void* x;
  const void* gamma;
  const void* beta;  // null: no shift (and always for RMSNorm)
  void* y;           // null: the statistics alone (high precision), or the amax alone (FP8)
  float* mean;
  float* rsigma;
  const float* scale;
  float* amax;
  float* scale_inv;
  size_t rows;
  int H;
  float eps;
  float inv_h;  // exact_reciprocal(H)
  bool rms;
  bool zero_centered;
  bool w_fp32;   // gamma/beta are float32 (else x's dtype)
  bool e5m2;     // FP8 outputs: E5M2 (else E4M3)
  bool vec;      // 16-byte vector loads (H % 8 == 0, x, gamma, beta aligned)
  bool vec_out;  // vector stores of whole vectors (vec, and the output aligned)
};

/* A parameter vector (gamma or beta) at column c, float32 or x's dtype. */
template <typename IType, bool kVecIO>
__device__ __forceinline__ void load_param(const FwdParams& p, const void* base, int c, int n,
                                           float (&v)[kVec]) {
  if (p.w_fp32) {
    load_vec(static_cast<const float*>(base) + c, kVecIO || p.vec, kVecIO ? kVec : n, v);
  } else {
    load_vec(static_cast<const IType*>(base) + c, kVecIO || p.vec, kVecIO ? kVec : n, v);
  }
}

/* The first n of kVec FP8 bytes (packed two a word) to dst[0], dst[stride], ...: unrolled, so
 * each byte is taken from its word with a constant shift (a run-time index into the bytes would
 * put them in local memory). */
__device__ __forceinline__ void store_fp8_bytes(uint8_t* dst, size_t stride,
                                                const Vec<uint16_t, kVec / 2>& q, int n) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (j < n) dst[j * stride] = static_cast<uint8_t>(q.v[j / 2] >> (8 * (j % 2)));
  }
}

/* Normalizes the vector at column c of `row` (n valid elements) from its deviations d = x - mean
 * (x itself for RMSNorm), y = d * rsigma * gamma + beta, and writes it: y in x's dtype,
 * or its FP8 bytes (+ amax of the rounded values). kVecIO: p.vec holds and n == kVec (the register
 * kernel). */
template <typename IType, bool kFp8, bool kVecIO = false>
__device__ __forceinline__ void emit(const FwdParams& p, const float (&d)[kVec], int n_in,
                                     size_t row, int c, float rsigma, float scale, float& amax) {
  const int n = kVecIO ? kVec : n_in;
  float g[kVec], b[kVec], y[kVec];
  load_param<IType, kVecIO>(p, p.gamma, c, n, g);
  make_effective_gamma(g, p.zero_centered);
  // A uniform branch rather than a select per element; no beta adds +0.0 as a beta of zeros
  // would (a -0.0 product becomes +0.0 either way).
  if (p.beta != nullptr) {
    load_param<IType, kVecIO>(p, p.beta, c, n, b);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) y[j] = d[j] * rsigma * g[j] + b[j];
  const size_t offset = row * static_cast<size_t>(p.H) + c;
  if constexpr (!kFp8) {
    store_vec(static_cast<IType*>(p.y) + offset, p.vec_out, n, y);
  } else {
    // Round to x's dtype first: the bytes equal those of casting the high-precision output.
    float r[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      r[j] = to_float(from_float<IType>(y[j]));
      if (j < n) amax = amax_step(amax, r[j]);
    }
    if (p.y == nullptr) return;  // amax only
    Vec<uint16_t, kVec / 2> q;
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      q.v[j] = p.e5m2 ? Fp8Format<false>::cast_pair(r[2 * j] * scale, r[2 * j + 1] * scale)
                      : Fp8Format<true>::cast_pair(r[2 * j] * scale, r[2 * j + 1] * scale);
    }
    uint8_t* out = static_cast<uint8_t*>(p.y) + offset;
    if (p.vec_out && n == kVec) {
      *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(&q);
    } else {
      store_fp8_bytes(out, 1, q, n);
    }
  }
}

/* FP8 kernels: the scale, read once; block 0 publishes 1 / scale (IEEE division). */
template <bool kFp8>
__device__ __forceinline__ float fwd_scale(const FwdParams& p) {
  if constexpr (!kFp8) {
    return 1.0f;
  } else {
    const float scale = p.scale != nullptr ? *p.scale : 1.0f;
    if (p.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = 1.0f / scale;
    return scale;
  }
}

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_FORWARD_MATH_CUH_
