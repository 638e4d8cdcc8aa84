/* What the LayerNorm/RMSNorm kernels share (norm_forward.cu, norm_backward.cu): how a row is
 * split over a team of threads, the team-wide sums, 8-element loads and stores with a scalar
 * fallback, the choice of team by the row length, and the host-side argument checks.
 *
 * A row of H elements is owned by a team of kTeam threads (half a warp for short rows, a warp,
 * several warps, or a whole block for long rows). Thread t of the team holds kVecs vectors of kVec
 * consecutive elements, vector v at columns (v * kTeam + t) * kVec: consecutive threads read
 * consecutive 16-byte chunks (one coalesced access per vector), and the row lives in registers, so
 * x is read from global memory once. Rows longer than the largest team's registers go through a
 * looped kernel instead. */
#ifndef TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_COMMON_CUH_
#define TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "transformer_engine/transformer_engine.h"
#include "util/buffer.h"
#include "util/byte_transpose.cuh"
#include "util/device.h"
#include "util/device_set.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace norm_detail {

constexpr int kVec = 8;  // elements per vector: 16 bytes of bf16/fp16, 32 of fp32

/* kThreads threads per block, split into kTeams teams of kTeam threads (half a warp, a warp,
 * several warps, or the whole block). Teams of several warps smaller than the block synchronize
 * through their own named barrier (1 + team index), so they never wait for each other; teams of
 * a warp or less need no barrier (their sums are shuffles among their own lanes). */
template <int kTeam_, int kVecs_, int kThreads_>
struct TeamConfig {
  static constexpr int kTeam = kTeam_;
  static constexpr int kVecs = kVecs_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kTeams = kThreads / kTeam;  // rows a block works on at once
  static constexpr int kMaxH = kTeam * kVecs * kVec;
  static_assert((kTeam == 16 || kTeam % 32 == 0) && kThreads % kTeam == 0,
                "teams of half a warp or of whole warps");
  static_assert(kTeam <= 32 || kTeam == kThreads || kTeams <= 15, "a named barrier per team");
};

/* Floats of scratch team_sum and team_sum2 need: two buffers of a float pair per warp (alternate
 * calls use alternate buffers, so one barrier per call suffices; both functions lay the buffers
 * out alike, so calls of either may follow each other). Declare it __align__(8). */
template <int kThreads>
constexpr int kScratchFloats = 4 * kThreads / 32;

/* Waits for the calling thread's team (kTeam threads; the block when kTeam == kThreads). */
template <int kTeam, int kThreads>
__device__ __forceinline__ void team_barrier() {
  if constexpr (kTeam == kThreads) {
    __syncthreads();
  } else if constexpr (kTeam > 32) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + static_cast<int>(threadIdx.x) / kTeam), "n"(kTeam)
                 : "memory");
  } else {
    __syncwarp();
  }
}

/* The lanes of the calling thread's warp that its team's shuffles involve: the whole warp, or
 * for a team of half a warp its own half (the two halves may walk different numbers of rows, so
 * neither may wait on the other's lanes). */
template <int kTeam>
__device__ __forceinline__ unsigned warp_team_lanes() {
  if constexpr (kTeam >= 32) {
    return 0xffffffffu;
  } else {
    return ((1u << kTeam) - 1u) << (threadIdx.x % 32 / kTeam * kTeam);
  }
}

/* v += v of the lane `offset` away (xor), for one sum or two at once. */
__device__ __forceinline__ void add_from_lane(float& v, int offset) {
  v += __shfl_xor_sync(0xffffffffu, v, offset);
}
__device__ __forceinline__ void add_from_lane(float2& v, int offset) {
  v.x += __shfl_xor_sync(0xffffffffu, v.x, offset);
  v.y += __shfl_xor_sync(0xffffffffu, v.y, offset);
}

/* The sum of a team's kWarps warp sums (sums[0..kWarps), float or float2), as each of its warps
 * forms it after the team barrier: lane l takes warp l % kWarps's sum, then a butterfly over
 * kWarps lanes. One shared-memory load and log2(kWarps) shuffles and adds a thread, where adding
 * the kWarps sums in turn took kWarps of each (the norm kernels are bound by the instructions
 * they issue, and every thread of the team does this). */
template <int kWarps, typename T>
__device__ __forceinline__ T sum_of_warp_sums(const T* sums) {
  static_assert(kWarps >= 2 && kWarps <= 32 && (kWarps & (kWarps - 1)) == 0,
                "a power-of-two number of warps");
  T total = sums[threadIdx.x % kWarps];
#pragma unroll
  for (int offset = kWarps / 2; offset > 0; offset /= 2) add_from_lane(total, offset);
  return total;
}

/* Sum of v over the team; every thread of the team gets the same bits (a butterfly adds the
 * same two values on both lanes of each pair: within each warp, then over the warps' sums, which
 * every warp adds up alike), so all threads agree on the statistics. Teams of several warps use
 * `scratch` (kScratchFloats<kThreads>) and one team barrier: every thread of the team must call it,
 * and `phase` (0 at first, per thread) picks the buffer. Call k + 2 reuses call k's buffer only
 * after every thread passed call k + 1's barrier, i.e. finished reading call k's. */
template <int kTeam, int kThreads>
__device__ __forceinline__ float team_sum(float v, float* scratch, int& phase) {
  constexpr int kLanes = kTeam < 32 ? kTeam : 32;
  const unsigned lanes = warp_team_lanes<kTeam>();
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(lanes, v, offset);
  if constexpr (kTeam <= 32) {
    return v;
  } else {
    constexpr int kWarps = kTeam / 32;
    float* s = scratch + phase * (2 * kThreads / 32) + (threadIdx.x / kTeam) * kWarps;
    phase ^= 1;
    if (threadIdx.x % 32 == 0) s[(threadIdx.x % kTeam) / 32] = v;
    team_barrier<kTeam, kThreads>();
    return sum_of_warp_sums<kWarps>(s);
  }
}

/* Two team sums with one barrier: each component's bits equal those of team_sum on it (same
 * additions in the same order). The backward's per-row latency is largely its barriers, so
 * LayerNorm's two row sums go through one. Same contract as team_sum. */
template <int kTeam, int kThreads>
__device__ __forceinline__ float2 team_sum2(float2 v, float* scratch, int& phase) {
  constexpr int kLanes = kTeam < 32 ? kTeam : 32;
  const unsigned lanes = warp_team_lanes<kTeam>();
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v.x += __shfl_xor_sync(lanes, v.x, offset);
    v.y += __shfl_xor_sync(lanes, v.y, offset);
  }
  if constexpr (kTeam <= 32) {
    return v;
  } else {
    constexpr int kWarps = kTeam / 32;
    float2* s = reinterpret_cast<float2*>(scratch + phase * (2 * kThreads / 32)) +
                (threadIdx.x / kTeam) * kWarps;
    phase ^= 1;
    if (threadIdx.x % 32 == 0) s[(threadIdx.x % kTeam) / 32] = v;
    team_barrier<kTeam, kThreads>();
    return sum_of_warp_sums<kWarps>(s);
  }
}

/* 1 / H when H is a power of two, else 0 (host side). Then s * (1 / H) is bitwise s / H (both
 * are the correctly rounded value of one real number), and a multiply costs one instruction where
 * an IEEE division costs about ten: the forward is bound by the instructions it issues. (The
 * backward keeps its divisions: no faster with this there, and its looped kernel, bound by
 * latency, ran 3-6% slower on an H200.) */
inline float exact_reciprocal(int H) {
  return (H & (H - 1)) == 0 ? 1.0f / static_cast<float>(H) : 0.0f;
}

/* s / h, through the exact reciprocal when there is one (a uniform branch). */
__device__ __forceinline__ float divide_by_features(float s, float h, float inv_h) {
  return inv_h != 0.0f ? s * inv_h : s / h;
}

/* Elements of the vector at column c that lie in the row (0..kVec). */
__device__ __forceinline__ int vec_count(int c, int H) {
  return c >= H ? 0 : (H - c < kVec ? H - c : kVec);
}

/* kVec elements at p as float32: one or two 16-byte loads when `vec` (p 16-byte aligned and
 * n == kVec), else n scalar loads; the rest are zero. */
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, bool vec, int n, float (&v)[kVec]) {
  if (vec && n == kVec) {
    const Vec<T, kVec> x = load_readonly<T, kVec>(p);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = to_float(x.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = j < n ? to_float(p[j]) : 0.0f;
  }
}

/* Stores the first n of kVec values rounded to T (16-byte stores when `vec` and n == kVec). */
template <typename T>
__device__ __forceinline__ void store_vec(T* p, bool vec, int n, const float (&v)[kVec]) {
  if (vec && n == kVec) {
    Vec<T, kVec> y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) y.v[j] = from_float<T>(v[j]);
    const uint4* src = reinterpret_cast<const uint4*>(&y);
    uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(y) / sizeof(uint4)); ++i) dst[i] = src[i];
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j < n) p[j] = from_float<T>(v[j]);
    }
  }
}

/* A row vector of kVec elements kept as raw bits in 32-bit registers (kWords words: two 16-bit
 * elements a word, or one float32), so that no element type's copies go through memory. */
template <typename T>
struct RawVec {
  static constexpr int kWords = static_cast<int>(sizeof(T)) * kVec / 4;
  uint32_t w[kWords];
};

/* Words 4i..4i+3 of a raw vector from one 16-byte chunk (a global load, or a row staged in shared
 * memory). */
template <typename T>
__device__ __forceinline__ void put_chunk(RawVec<T>& r, int i, const uint4& u) {
  r.w[4 * i] = u.x;
  r.w[4 * i + 1] = u.y;
  r.w[4 * i + 2] = u.z;
  r.w[4 * i + 3] = u.w;
}

/* Loads kVec elements at p: 16-byte loads when kVecIO (whole vectors; n is 0 or kVec), else n
 * scalar loads; the rest are zero bits (+0.0). */
template <typename T, bool kVecIO>
__device__ __forceinline__ void fetch_raw(const T* p, int n, RawVec<T>& r) {
  constexpr int kWords = RawVec<T>::kWords;
  if constexpr (kVecIO) {
    if (n > 0) {
      const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) put_chunk(r, i, __ldg(src + i));
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) r.w[i] = 0u;
    }
  } else if constexpr (sizeof(T) == 4) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int j = 0; j < kVec; ++j) r.w[j] = j < n ? src[j] : 0u;
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      const uint32_t lo = 2 * i < n ? src[2 * i] : 0u;
      const uint32_t hi = 2 * i + 1 < n ? src[2 * i + 1] : 0u;
      r.w[i] = lo | (hi << 16);
    }
  }
}

/* fetch_raw with the vector path chosen at run time (vec && n == kVec). */
template <typename T>
__device__ __forceinline__ void fetch_raw_rt(const T* p, bool vec, int n, RawVec<T>& r) {
  if (vec && n == kVec) {
    fetch_raw<T, true>(p, n, r);
  } else {
    fetch_raw<T, false>(p, n, r);
  }
}

/* Element j of a raw vector as float32 (exact). */
template <typename T>
__device__ __forceinline__ float raw_elem(const RawVec<T>& r, int j) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(r.w[j]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = r.w[j / 2];
    return __uint_as_float((j & 1) != 0 ? (w & 0xFFFF0000u) : (w << 16));
  } else {
    const uint32_t w = r.w[j / 2];
    const uint32_t bits = (j & 1) != 0 ? (w >> 16) : (w & 0xFFFFu);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

/* Gamma's vector as the effective scale: gamma, or 1 + gamma for zero-centered gamma (formed
 * in float32 so that it never rounds to the parameter's dtype). One uniform branch for the
 * vector rather than a select per element: the norm kernels are bound by the instructions they
 * issue. */
__device__ __forceinline__ void make_effective_gamma(float (&g)[kVec], bool zero_centered) {
  if (zero_centered) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) g[j] = 1.0f + g[j];
  }
}

/* ---- host-side checks ---------------------------------------------------------------------- */

struct NormShape {
  size_t rows;
  int H;
};

/* x viewed as [rows, H]; H >= 1 and small enough for int column arithmetic. */
inline NormShape check_norm_input(const char* op, const char* name, const NVTEBuffer& x) {
  check_well_formed(op, name, x);
  check_dtype(op, name, x, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  if (x.ndim == 0) throw_invalid(op, name, " must have at least one dimension (the features)");
  const size_t H = last_dim(x);
  if (H == 0) throw_invalid(op, name, " has no features (last extent 0)");
  if (H > (size_t{1} << 30)) throw_invalid(op, name, " has ", H, " features; at most 2^30");
  return {numel(x) / H, static_cast<int>(H)};
}

/* A per-feature parameter: H elements, float32 or x's dtype (`dtype` when not kNVTENumTypes). */
inline void check_param(const char* op, const char* name, const NVTEBuffer& p, int H,
                        NVTEDType x_dtype, NVTEDType dtype) {
  check_well_formed(op, name, p);
  if (p.dtype != kNVTEFloat32 && p.dtype != x_dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(p.dtype), "; expected float32 or the ",
                  "input's dtype ", dtype_name(x_dtype));
  }
  if (dtype != kNVTENumTypes && p.dtype != dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(p.dtype), " but gamma has ",
                  dtype_name(dtype), "; pass both parameters in one dtype");
  }
  if (numel(p) != static_cast<size_t>(H)) {
    throw_invalid(op, name, " has ", numel(p), " elements; expected ", H,
                  ", one per feature of the input's last dimension");
  }
}

/* A float32 per-row statistic (mean, rsigma): `rows` elements. */
inline void check_stat(const char* op, const char* name, const NVTEBuffer& s, size_t rows) {
  check_well_formed(op, name, s);
  check_dtype(op, name, s, {kNVTEFloat32});
  if (numel(s) != rows) {
    throw_invalid(op, name, " has ", numel(s), " elements; expected ", rows, ", one per row");
  }
}

/* A [rows, H] tensor of dtype `dtype` (dz, dx, a high-precision output). */
inline void check_matrix(const char* op, const char* name, const NVTEBuffer& b, size_t rows, int H,
                         NVTEDType dtype) {
  check_well_formed(op, name, b);
  if (b.dtype != dtype) {
    throw_invalid(op, name, " has dtype ", dtype_name(b.dtype), "; expected the input's ",
                  dtype_name(dtype));
  }
  if (b.ndim == 0 || last_dim(b) != static_cast<size_t>(H) || numel(b) != rows * H) {
    throw_invalid(op, name, " must hold [", rows, ", ", H, "] elements with last extent ", H);
  }
}

/* The FP8 output's transposed copy: `[H, rows]`, the output's FP8 format. */
inline void check_transposed_copy(const char* op, const NVTEBuffer& out_t, const NVTEBuffer& out,
                                  const NormShape& shape) {
  check_well_formed(op, "output_t", out_t);
  if (out_t.dtype != out.dtype) {
    throw_invalid(op, "output_t has dtype ", dtype_name(out_t.dtype), " but output has ",
                  dtype_name(out.dtype), "; both copies use one FP8 format");
  }
  if (out_t.ndim == 0 || out_t.shape[0] != static_cast<size_t>(shape.H) ||
      numel(out_t) != shape.rows * shape.H) {
    throw_invalid(op, "output_t must have shape [", shape.H, ", ", shape.rows, "]");
  }
}

/* Calls f(W{}) with the C++ type of a parameter dtype: float, or the input's type IType. */
template <typename IType, typename F>
void dispatch_param(NVTEDType dtype, F&& f) {
  if (dtype == kNVTEFloat32) {
    f(float{});
  } else {
    f(IType{});
  }
}

/* Lets `kernel` take up to `bytes` of dynamic shared memory, once per kernel and device (`done`:
 * the kernel's own set). cudaFuncSetAttribute is no stream operation, so graph capture allows
 * it. */
template <typename Kernel>
void allow_dynamic_smem(const CallContext& ctx, Kernel kernel, int bytes, DeviceSet& done) {
  if (done.contains(ctx.device())) return;
  check_cuda(ctx.op(),
             cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  done.insert(ctx.device());
}

}  // namespace norm_detail
}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_NORMALIZATION_NORM_COMMON_CUH_
