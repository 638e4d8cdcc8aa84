/* Device helpers shared by the cast kernels: saturating FP8 conversion, element loads and the
 * block-wide amax reduction. The float32 arithmetic here is mirrored exactly by
 * transformer_engine/pytorch/reference.py. */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_FP8_MATH_CUH_
#define TRANSFORMER_ENGINE_COMMON_UTIL_FP8_MATH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace transformer_engine {

constexpr uint8_t kFp8CanonicalNaN = 0x7F;

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half value) {
  return __half2float(value);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

/* The FP8 format of a cast, fixed at compile time. */
template <bool kE4M3>
struct Fp8Format {
  static constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  static constexpr __nv_fp8_interpretation_t kInterp = kE4M3 ? __NV_E4M3 : __NV_E5M2;

  /* Two saturating casts at once (the hardware converts pairs; .satfinite takes values past
   * the format's range, +-Inf included, to +-kMax). NaN is patched to the canonical byte
   * afterwards, on a branch a pair only takes when it holds a NaN (the casts are in the inner
   * loop of every FP8 kernel: fewer instructions there pay everywhere). */
  static __device__ __forceinline__ uint16_t cast_pair(float a, float b) {
    uint16_t bits = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kInterp);
    if (isnan(a) || isnan(b)) {
      if (isnan(a)) bits = (bits & 0xFF00u) | kFp8CanonicalNaN;
      if (isnan(b)) bits = (bits & 0x00FFu) | (static_cast<uint16_t>(kFp8CanonicalNaN) << 8);
    }
    return bits;
  }

  /* cast_pair for values the caller knows are not NaN: the conversion alone, without the
   * NaN test and patch (two instructions a pair, as many as the conversion itself). */
  static __device__ __forceinline__ uint16_t cast_pair_not_nan(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kInterp);
  }

  /* cast_pair, or cast_pair_not_nan where kMayBeNaN is false. */
  template <bool kMayBeNaN>
  static __device__ __forceinline__ uint16_t cast_pair_as(float a, float b) {
    if constexpr (kMayBeNaN) {
      return cast_pair(a, b);
    } else {
      return cast_pair_not_nan(a, b);
    }
  }

  static __device__ __forceinline__ uint8_t cast(float a) {
    return static_cast<uint8_t>(cast_pair(a, 0.0f) & 0xFFu);
  }

  static __device__ __forceinline__ float to_float(uint8_t bits) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(bits, kInterp);
    return __half2float(__half(h));
  }
};

/* fmaxf ignores NaN, which is the amax rule. */
__device__ __forceinline__ float amax_step(float running, float value) {
  return fmaxf(running, fabsf(value));
}

/* The maximum of `value` over the block (NaN ignored), valid in thread 0. Every thread of the
 * block must call it. */
template <int kThreads>
__device__ __forceinline__ float block_max(float value) {
  static_assert(kThreads % 32 == 0, "whole warps only");
  __shared__ float warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) {
      value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
  }
  return value;
}

/* Reduce `value` over the block and max-accumulate it into `*amax` (one atomic per block).
 * Valid because amaxes are non-negative: their float order equals their int bit-pattern order. */
template <int kThreads>
__device__ __forceinline__ void block_amax_to_global(float value, float* amax) {
  value = block_max<kThreads>(value);
  if (threadIdx.x == 0 && value > 0.0f) {
    atomicMax(reinterpret_cast<int*>(amax), __float_as_int(value));
  }
}

/* A device-side no-op flag: 1.0 means "write nothing". */
__device__ __forceinline__ bool skip_requested(const float* noop) {
  return noop != nullptr && *noop == 1.0f;
}

/* `N` contiguous elements moved as one aligned vector. */
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

/* A Vec read through the read-only (non-coherent) path: the kernels never write what they
 * read, and marking the loads so lets the compiler issue a thread's loads ahead of its
 * stores instead of after them (plain loads may alias the outputs). */
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_readonly(const T* p) {
  static_assert(sizeof(Vec<T, N>) % sizeof(uint4) == 0, "whole 16-byte chunks");
  Vec<T, N> x;
  const uint4* src = reinterpret_cast<const uint4*>(p);
  uint4* dst = reinterpret_cast<uint4*>(&x);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec<T, N>) / sizeof(uint4)); ++i) {
    dst[i] = __ldg(src + i);
  }
  return x;
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_FP8_MATH_CUH_
