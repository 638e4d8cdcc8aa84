/* nvte_norm_forward and nvte_norm_amax (normalization.h): LayerNorm/RMSNorm forward.
 *
 * Kernel shape (norm_common.cuh): a team (a warp, or the block for long rows) owns one row at a
 * time, holding it in registers; a block loops over groups of rows (grid-stride, a few resident
 * blocks per SM), so the amax needs one atomic per block. Per row: mean (LayerNorm), then the
 * sum of squared deviations from the registers, both reduced over the team; then each vector is
 * normalized, rounded to x's dtype and stored (high precision), or cast to FP8.
 *
 * The transposed FP8 copy: a block handles a group of R rows (32, fewer when H is long so that
 * R * H bytes fit kTileBudget), staging their FP8 bytes in dynamic shared memory, then writes
 * each column's R bytes as one contiguous run of out_t (16-byte stores when aligned). Rows too
 * long for the register teams go through a looped kernel that reads x once per pass (three
 * passes) and writes the transposed bytes directly. */
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "cast/dispatch.cuh"
#include "normalization/norm_common.cuh"
#include "transformer_engine/normalization.h"

namespace transformer_engine {
namespace norm_detail {
namespace {

constexpr int kTileBudget = 96 * 1024;  // staging bytes for the transposed copy: 2 blocks/SM
constexpr int kMaxGroupRows = 32;       // a 32-byte sector of out_t per column
constexpr int kLoopThreads = 512;

enum OutKind { kOutHigh = 0, kOutE4M3 = 1, kOutE5M2 = 2 };

struct FwdParams {
  const void* x;
  const void* gamma;
  const void* beta;  // null: no shift (and always for RMSNorm)
  void* y;           // null: amax only
  uint8_t* y_t;      // FP8 transposed copy, or null
  float* mean;
  float* rsigma;
  const float* scale;
  float* amax;
  float* scale_inv;
  size_t rows;
  int H;
  int group_rows;  // rows per block iteration
  float eps;
  bool rms;
  bool zero_centered;
  bool vec;  // 16-byte vector accesses (H % 8 == 0, pointers aligned)
  bool vec_t;  // 16-byte runs of out_t (rows % 16 == 0, out_t aligned)
};

/* Normalizes the vector at column c of `row` (n valid elements) and writes it: y in x's dtype,
 * or its FP8 bytes (+ amax of the rounded values, + the transposed copy: staged in `tile_row`
 * when given, else written directly). */
template <typename IType, typename WType, int kOut>
__device__ __forceinline__ void emit(const FwdParams& p, const float (&x)[kVec], int n,
                                     size_t row, int c, float mean, float rsigma, float scale,
                                     float& amax, uint8_t* tile_row) {
  float g[kVec], b[kVec], y[kVec];
  load_vec(static_cast<const WType*>(p.gamma) + c, p.vec, n, g);
  if (p.beta != nullptr) {
    load_vec(static_cast<const WType*>(p.beta) + c, p.vec, n, b);
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float beta = p.beta != nullptr ? b[j] : 0.0f;
    y[j] = (x[j] - mean) * rsigma * effective_gamma(g[j], p.zero_centered) + beta;
  }
  const size_t offset = row * static_cast<size_t>(p.H) + c;
  if constexpr (kOut == kOutHigh) {
    store_vec(static_cast<IType*>(p.y) + offset, p.vec, n, y);
  } else {
    constexpr bool kE4M3 = kOut == kOutE4M3;
    // Round to x's dtype first: the bytes equal those of casting the high-precision output.
    Vec<uint16_t, kVec / 2> q;
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      const float a = to_float(from_float<IType>(y[2 * j]));
      const float bb = to_float(from_float<IType>(y[2 * j + 1]));
      if (2 * j < n) amax = amax_step(amax, a);
      if (2 * j + 1 < n) amax = amax_step(amax, bb);
      q.v[j] = Fp8Format<kE4M3>::cast_pair(a * scale, bb * scale);
    }
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&q);
    if (p.y != nullptr) {
      uint8_t* out = static_cast<uint8_t*>(p.y) + offset;
      if (p.vec && n == kVec) {
        *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(&q);
      } else {
        for (int j = 0; j < n; ++j) out[j] = bytes[j];
      }
    }
    if (p.y_t != nullptr) {
      if (tile_row != nullptr) {
        if (p.vec && n == kVec) {
          *reinterpret_cast<uint2*>(tile_row + c) = *reinterpret_cast<const uint2*>(&q);
        } else {
          for (int j = 0; j < n; ++j) tile_row[c + j] = bytes[j];
        }
      } else {
        for (int j = 0; j < n; ++j) p.y_t[static_cast<size_t>(c + j) * p.rows + row] = bytes[j];
      }
    }
  }
}

/* FP8 kernels: the scale, read once; block 0 publishes 1 / scale (IEEE division). */
template <int kOut>
__device__ __forceinline__ float fwd_scale(const FwdParams& p) {
  if constexpr (kOut == kOutHigh) {
    return 1.0f;
  } else {
    const float scale = p.scale != nullptr ? *p.scale : 1.0f;
    if (p.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = 1.0f / scale;
    return scale;
  }
}

/* The staged FP8 bytes of rows [r0, r0 + count) to out_t: column c's bytes are one contiguous
 * run of out_t; a thread writes up to 16 of them, consecutive threads the next run (of the same
 * column when R = 32, so a column's 32 bytes fill one sector). */
template <int kThreads>
__device__ void write_transposed(const FwdParams& p, const uint8_t* tile, size_t r0, int count) {
  const int H = p.H;
  const int run = p.group_rows < 16 ? p.group_rows : 16;
  const int runs = p.group_rows / run;
  for (int i = threadIdx.x; i < H * runs; i += kThreads) {
    const int c = i / runs;
    const int lr0 = (i % runs) * run;
    if (lr0 >= count) continue;
    uint8_t* dst = p.y_t + static_cast<size_t>(c) * p.rows + r0 + lr0;
    if (run == 16 && p.vec_t && lr0 + 16 <= count) {
      Vec<uint8_t, 16> v;
#pragma unroll
      for (int k = 0; k < 16; ++k) v.v[k] = tile[(lr0 + k) * H + c];
      *reinterpret_cast<Vec<uint8_t, 16>*>(dst) = v;
    } else {
      const int m = count - lr0 < run ? count - lr0 : run;
      for (int k = 0; k < m; ++k) dst[k] = tile[(lr0 + k) * H + c];
    }
  }
}

template <class Cfg, typename IType, typename WType, int kOut>
__global__ void __launch_bounds__(Cfg::kThreads) norm_fwd_kernel(const FwdParams p) {
  constexpr int kTeam = Cfg::kTeam, kVecs = Cfg::kVecs, kThreads = Cfg::kThreads;
  extern __shared__ __align__(16) uint8_t tile[];  // [group_rows][H] FP8 bytes (out_t only)
  __shared__ float scratch[kThreads / 32];
  const int team = threadIdx.x / kTeam;
  const int t = threadIdx.x % kTeam;
  const float scale = fwd_scale<kOut>(p);
  const float h = static_cast<float>(p.H);
  const bool staged = kOut != kOutHigh && p.y_t != nullptr;
  float amax = 0.0f;
  const size_t groups = (p.rows + p.group_rows - 1) / p.group_rows;
  for (size_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const size_t r0 = g * p.group_rows;
    const int count = static_cast<int>(min(static_cast<size_t>(p.group_rows), p.rows - r0));
    // `lr` is uniform over a team, so a block team's __syncthreads see every thread.
    for (int lr = team; lr < count; lr += Cfg::kTeams) {
      const size_t row = r0 + lr;
      const IType* xr = static_cast<const IType*>(p.x) + row * static_cast<size_t>(p.H);
      float x[kVecs][kVec];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = (v * kTeam + t) * kVec;
        load_vec(xr + c, p.vec, vec_count(c, p.H), x[v]);
      }
      float mean = 0.0f;
      if (!p.rms) {
        float s = 0.0f;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) s += x[v][j];  // padding is zero
        }
        mean = team_sum<kTeam, kThreads>(s, scratch) / h;
      }
      float ss = 0.0f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int n = vec_count((v * kTeam + t) * kVec, p.H);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = x[v][j] - mean;
          ss += j < n ? d * d : 0.0f;
        }
      }
      const float rsigma = rsqrtf(team_sum<kTeam, kThreads>(ss, scratch) / h + p.eps);
      if (t == 0) {
        if (p.mean != nullptr) p.mean[row] = mean;
        if (p.rsigma != nullptr) p.rsigma[row] = rsigma;
      }
      uint8_t* tile_row = staged ? tile + lr * p.H : nullptr;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = (v * kTeam + t) * kVec;
        const int n = vec_count(c, p.H);
        if (n > 0) {
          emit<IType, WType, kOut>(p, x[v], n, row, c, mean, rsigma, scale, amax, tile_row);
        }
      }
    }
    if (staged) {
      __syncthreads();  // the group's bytes are staged
      write_transposed<kThreads>(p, tile, r0, count);
      __syncthreads();  // before the next group overwrites the tile
    }
  }
  if constexpr (kOut != kOutHigh) {
    if (p.amax != nullptr) block_amax_to_global<kThreads>(amax, p.amax);
  }
}

/* Rows longer than the register teams: one block per row, three passes over x in global memory
 * (sum, squared deviations, output), the transposed bytes written directly. */
template <typename IType, typename WType, int kOut>
__global__ void __launch_bounds__(kLoopThreads) norm_fwd_looped_kernel(const FwdParams p) {
  __shared__ float scratch[kLoopThreads / 32];
  const float scale = fwd_scale<kOut>(p);
  const float h = static_cast<float>(p.H);
  float amax = 0.0f;
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const IType* xr = static_cast<const IType*>(p.x) + row * static_cast<size_t>(p.H);
    float x[kVec];
    float mean = 0.0f;
    if (!p.rms) {
      float s = 0.0f;
      for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
        load_vec(xr + c, p.vec, vec_count(c, p.H), x);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s += x[j];
      }
      mean = team_sum<kLoopThreads, kLoopThreads>(s, scratch) / h;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(xr + c, p.vec, n, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = x[j] - mean;
        ss += j < n ? d * d : 0.0f;
      }
    }
    const float rsigma =
        rsqrtf(team_sum<kLoopThreads, kLoopThreads>(ss, scratch) / h + p.eps);
    if (threadIdx.x == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      if (p.rsigma != nullptr) p.rsigma[row] = rsigma;
    }
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(xr + c, p.vec, n, x);
      emit<IType, WType, kOut>(p, x, n, row, c, mean, rsigma, scale, amax, nullptr);
    }
  }
  if constexpr (kOut != kOutHigh) {
    if (p.amax != nullptr) block_amax_to_global<kLoopThreads>(amax, p.amax);
  }
}

/* Rows per block iteration with the transposed copy: R = 32, halved until R * H fits. */
int transpose_group_rows(int H) {
  int r = kMaxGroupRows;
  while (r > 1 && static_cast<size_t>(r) * H > static_cast<size_t>(kTileBudget)) r /= 2;
  return r;
}

template <typename IType, typename WType, int kOut>
void launch_forward(CallContext& ctx, FwdParams p) {
  if (p.rows == 0) return;
  dispatch_team<4>(p.H, [&](auto cfg) {
    using Cfg = decltype(cfg);
    if constexpr (std::is_same_v<Cfg, std::nullptr_t>) {
      const size_t blocks = std::min<size_t>(p.rows, static_cast<size_t>(ctx.sm_count()) * 4);
      p.group_rows = 1;
      norm_fwd_looped_kernel<IType, WType, kOut>
          <<<static_cast<unsigned>(blocks), kLoopThreads, 0, ctx.stream()>>>(p);
      ctx.check_launch("norm_fwd_looped_kernel launch");
    } else {
      const bool staged = kOut != kOutHigh && p.y_t != nullptr;
      p.group_rows = staged ? transpose_group_rows(p.H) : Cfg::kTeams;
      if (staged && p.group_rows < Cfg::kTeams) p.group_rows = Cfg::kTeams;  // warp teams: H small
      const int smem = staged ? p.group_rows * p.H : 0;
      auto kernel = norm_fwd_kernel<Cfg, IType, WType, kOut>;
      if (smem > 48 * 1024) {
        static std::atomic<uint64_t> done{0};
        allow_dynamic_smem(ctx, kernel, kTileBudget, done);
      }
      const size_t groups = (p.rows + p.group_rows - 1) / p.group_rows;
      // Resident blocks per SM: threads, and with the staging tile about 200 KiB of shared
      // memory (the grid-stride loop takes the rest of the groups).
      const int by_smem = smem > 0 ? std::max(1, 200 * 1024 / smem) : 2048;
      const size_t per_sm = std::max(1, std::min(2048 / Cfg::kThreads, by_smem));
      const size_t blocks = std::min<size_t>(groups, per_sm * ctx.sm_count());
      kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, smem, ctx.stream()>>>(p);
      ctx.check_launch("norm_fwd_kernel launch");
    }
  });
}

/* The checks both entry points share; fills the parameters' input side. */
FwdParams check_forward(const char* op, const NVTEBuffer* input, const NVTEBuffer* gamma,
                        const NVTEBuffer* beta, float epsilon, int zero_centered_gamma, int rms,
                        NVTEBuffer* mean, NVTEBuffer* rsigma, NormShape& shape) {
  const NVTEBuffer& x = require(op, "input", input);
  shape = check_norm_input(op, "input", x);
  const NVTEBuffer& g = require(op, "gamma", gamma);
  check_param(op, "gamma", g, shape.H, x.dtype, kNVTENumTypes);
  if (beta != nullptr) {
    if (rms) throw_invalid(op, "RMSNorm takes no beta; pass null");
    check_param(op, "beta", *beta, shape.H, x.dtype, g.dtype);
  }
  if (!(std::isfinite(epsilon) && epsilon >= 0.0f)) {
    throw_invalid(op, "epsilon must be finite and >= 0, got ", static_cast<double>(epsilon));
  }
  if (mean != nullptr) {
    if (rms) throw_invalid(op, "RMSNorm has no mean; pass null");
    check_stat(op, "mean", *mean, shape.rows);
  }
  if (rsigma != nullptr) check_stat(op, "rsigma", *rsigma, shape.rows);
  FwdParams p{};
  p.x = x.data;
  p.gamma = g.data;
  p.beta = beta != nullptr ? beta->data : nullptr;
  p.mean = mean != nullptr ? static_cast<float*>(mean->data) : nullptr;
  p.rsigma = rsigma != nullptr ? static_cast<float*>(rsigma->data) : nullptr;
  p.rows = shape.rows;
  p.H = shape.H;
  p.eps = epsilon;
  p.rms = rms != 0;
  p.zero_centered = zero_centered_gamma != 0;
  p.vec = shape.H % kVec == 0 && aligned_to(x.data, 16) && aligned_to(g.data, 16) &&
          (beta == nullptr || aligned_to(beta->data, 16));
  return p;
}

void check_inputs_on_device(CallContext& ctx, const NVTEBuffer* input, const NVTEBuffer* gamma,
                            const NVTEBuffer* beta, NVTEBuffer* mean, NVTEBuffer* rsigma) {
  ctx.check_on_device("input", *input);
  ctx.check_on_device("gamma", *gamma);
  if (beta != nullptr) ctx.check_on_device("beta", *beta);
  if (mean != nullptr) ctx.check_on_device("mean", *mean);
  if (rsigma != nullptr) ctx.check_on_device("rsigma", *rsigma);
}

/* Calls f(IType{}, WType{}) for the input's and the parameters' dtypes. */
template <typename F>
void dispatch_types(const char* op, NVTEDType x_dtype, NVTEDType w_dtype, F&& f) {
  dispatch_high_precision(op, x_dtype, [&](auto itype) {
    using IType = decltype(itype);
    dispatch_param<IType>(w_dtype, [&](auto wtype) { f(itype, wtype); });
  });
}

}  // namespace
}  // namespace norm_detail
}  // namespace transformer_engine

extern "C" void nvte_norm_forward(const NVTEBuffer* input, const NVTEBuffer* gamma,
                                  const NVTEBuffer* beta, float epsilon, int zero_centered_gamma,
                                  int rms, NVTEBuffer* output, const NVTEBuffer* scale,
                                  NVTEBuffer* output_t, NVTEBuffer* amax, NVTEBuffer* scale_inv,
                                  NVTEBuffer* mean, NVTEBuffer* rsigma, int device,
                                  NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::norm_detail;
  const char* op = "nvte_norm_forward";
  NormShape shape{};
  FwdParams p = check_forward(op, input, gamma, beta, epsilon, zero_centered_gamma, rms, mean,
                              rsigma, shape);
  const NVTEBuffer& out = require(op, "output", output);
  const bool fp8 = is_fp8(out.dtype);
  check_matrix(op, "output", out, shape.rows, shape.H, fp8 ? out.dtype : input->dtype);
  if (!fp8) {
    if (scale != nullptr || output_t != nullptr || amax != nullptr || scale_inv != nullptr) {
      throw_invalid(op, "output is high precision (", dtype_name(out.dtype),
                    "); scale, output_t, amax and scale_inv apply to FP8 outputs only");
    }
  } else {
    check_fp32_scalar(op, "scale", require(op, "scale", scale));
    if (output_t != nullptr) {
      check_well_formed(op, "output_t", *output_t);
      if (output_t->dtype != out.dtype) {
        throw_invalid(op, "output_t has dtype ", dtype_name(output_t->dtype), " but output has ",
                      dtype_name(out.dtype), "; both copies use one FP8 format");
      }
      if (output_t->ndim == 0 || output_t->shape[0] != static_cast<size_t>(shape.H) ||
          numel(*output_t) != shape.rows * shape.H) {
        throw_invalid(op, "output_t must have shape [", shape.H, ", ", shape.rows, "]");
      }
    }
    if (amax != nullptr) check_fp32_scalar(op, "amax", *amax);
    if (scale_inv != nullptr) check_fp32_scalar(op, "scale_inv", *scale_inv);
  }
  CallContext ctx(op, device, stream);
  check_inputs_on_device(ctx, input, gamma, beta, mean, rsigma);
  ctx.check_on_device("output", out);
  if (scale != nullptr) ctx.check_on_device("scale", *scale);
  if (output_t != nullptr) ctx.check_on_device("output_t", *output_t);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);

  p.y = out.data;
  p.vec = p.vec && aligned_to(out.data, fp8 ? 8 : 16);
  if (fp8) {
    p.scale = static_cast<const float*>(scale->data);
    p.amax = amax != nullptr ? static_cast<float*>(amax->data) : nullptr;
    p.scale_inv = scale_inv != nullptr ? static_cast<float*>(scale_inv->data) : nullptr;
    p.y_t = output_t != nullptr ? static_cast<uint8_t*>(output_t->data) : nullptr;
    p.vec_t = p.y_t != nullptr && shape.rows % 16 == 0 && aligned_to(p.y_t, 16);
  }
  if (shape.rows == 0) {
    // No rows: nothing to normalize, but scale_inv is still published, as the casts do.
    if (p.scale_inv != nullptr) {
      p.y = nullptr;
      p.y_t = nullptr;
      p.amax = nullptr;
    } else {
      return;
    }
  }
  dispatch_types(op, input->dtype, gamma->dtype, [&](auto itype, auto wtype) {
    using IType = decltype(itype);
    using WType = decltype(wtype);
    if (!fp8) {
      launch_forward<IType, WType, kOutHigh>(ctx, p);
      return;
    }
    dispatch_fp8(op, out.dtype, [&](auto is_e4m3) {
      constexpr int kOut = decltype(is_e4m3)::value ? kOutE4M3 : kOutE5M2;
      if (shape.rows == 0) {
        // One block of one row's worth of nothing: only block 0's scale_inv write happens.
        FwdParams q = p;
        q.rows = 0;
        norm_fwd_looped_kernel<IType, WType, kOut><<<1, kLoopThreads, 0, ctx.stream()>>>(q);
        ctx.check_launch("norm_fwd_looped_kernel launch");
        return;
      }
      launch_forward<IType, WType, kOut>(ctx, p);
    });
  });
}

extern "C" void nvte_norm_amax(const NVTEBuffer* input, const NVTEBuffer* gamma,
                               const NVTEBuffer* beta, float epsilon, int zero_centered_gamma,
                               int rms, NVTEBuffer* amax, int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::norm_detail;
  const char* op = "nvte_norm_amax";
  NormShape shape{};
  FwdParams p = check_forward(op, input, gamma, beta, epsilon, zero_centered_gamma, rms, nullptr,
                              nullptr, shape);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  check_inputs_on_device(ctx, input, gamma, beta, nullptr, nullptr);
  ctx.check_on_device("amax", *amax);
  p.amax = static_cast<float*>(amax->data);
  check_cuda(op, cudaMemsetAsync(p.amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  // The E4M3 kernel with no outputs: only the rounded values' amax (the format is irrelevant).
  dispatch_types(op, input->dtype, gamma->dtype, [&](auto itype, auto wtype) {
    launch_forward<decltype(itype), decltype(wtype), kOutE4M3>(ctx, p);
  });
}
