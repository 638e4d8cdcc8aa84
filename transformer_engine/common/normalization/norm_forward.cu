/* nvte_norm_forward and nvte_norm_amax (normalization.h): LayerNorm/RMSNorm forward.
 *
 * Kernel shape (norm_common.cuh): a team (a warp, or 2-32 warps for long rows; several teams a
 * block, each with its own named barrier) owns one row at a time, holding it in registers as raw
 * 16-byte vectors, and prefetches its next row meanwhile (16-bit inputs). Teams walk the rows
 * grid-stride (as many blocks as the SMs hold), so the amax needs one atomic per block. Per row:
 * mean (LayerNorm), then the sum of squared deviations from the registers, both reduced over the
 * team; then each vector is normalized, rounded to x's dtype and stored (high precision), or cast
 * to FP8 (the format a runtime switch, as gamma's dtype: fewer kernels to compile). The same kernel
 * and team serve the high-precision and FP8 outputs for a given input, so the FP8 bytes are those
 * of casting the high-precision output.
 *
 * With the transposed FP8 copy, the forward runs in two kernels: these write the statistics
 * alone (no output), then the tiled cast+transpose of norm_cast_transpose.cu normalizes 128 x 64
 * tiles from them, writing both FP8 copies (a row's statistics need the whole row, the
 * transposed copy whole column runs: one kernel holding both staged whole rows and ran at a
 * third of the copy's bandwidth). Rows too long for the register teams, and unaligned inputs or
 * H % 8 != 0, go through a looped kernel that reads x once per pass (three passes). */
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cast/dispatch.cuh"
#include "normalization/norm_cast_transpose.h"
#include "normalization/norm_common.cuh"
#include "normalization/norm_forward_math.cuh"
#include "transformer_engine/normalization.h"
#include "util/cp_async.cuh"
#include "util/device_set.h"

namespace transformer_engine {
namespace norm_detail {
namespace {

constexpr int kLoopThreads = 512;

/* Teams of three vectors a thread (dispatch_forward_team says which rows; 16-bit elements) have
 * no registers left for the next row; kStage: they stage it in shared memory instead, with cp.async
 * (two buffers of the block's vectors, alternating rows), so its loads are in flight while the
 * current row's sums and output are worked out (launch_forward says when). */
template <class Cfg, typename IType>
constexpr bool kMayStage = sizeof(IType) == 2 && Cfg::kVecs == 3;

template <class Cfg>
constexpr int staged_row_bytes() {
  return 2 * Cfg::kVecs * Cfg::kThreads * 16;
}

/* The register-team kernel's rows (p.vec: whole 16-byte vectors). Team k of block b takes rows
 * b * kTeams + k, then every gridDim.x * kTeams-th row after it: one 64-bit add a row, where
 * groups of rows a block had cost a fifth more instructions in the loop. With 16-bit inputs each
 * team loads its next row while it normalizes the current one: two rows of loads in flight per
 * team. The next row waits in registers as x's raw bits; the current one is converted to float32
 * once, and its deviations from the mean formed once, for the squared sum and the output. The
 * kernels are bound by the instructions they issue (ncu: a scheduler issues in about 80% of
 * cycles), so converting once, the exact reciprocal of H and the uniform branches in emit() count.
 */
template <class Cfg, typename IType, bool kFp8, bool kStage>
__device__ __forceinline__ void norm_fwd_rows(const FwdParams& p, float* scratch, uint4* stage) {
  constexpr bool kVecIO = true;
  constexpr int kTeam = Cfg::kTeam, kVecs = Cfg::kVecs, kThreads = Cfg::kThreads;
  constexpr int kTeams = Cfg::kTeams;
  int phase = 0;
  const int team = threadIdx.x / kTeam;
  const int t = threadIdx.x % kTeam;
  const float scale = fwd_scale<kFp8>(p);
  const float h = static_cast<float>(p.H);
  const bool emits = kFp8 || p.y != nullptr;  // else the statistics alone
  const IType* x_base = static_cast<const IType*>(p.x);
  float amax = 0.0f;
  RawVec<IType> raw[kVecs];
  auto fetch_row = [&](size_t row) {
    const IType* xr = x_base + row * static_cast<size_t>(p.H);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      fetch_raw<IType, kVecIO>(xr + c, vec_count(c, p.H), raw[v]);
    }
  };
  // 16-bit rows of up to 2 vectors a thread prefetch the next one (more take too many registers:
  // three are staged in shared memory).
  constexpr bool kPrefetch = sizeof(IType) == 2 && kVecs <= 2;
  constexpr bool kStaged = kStage && kMayStage<Cfg, IType>;
  auto stage_row = [&](size_t row, int buf) {
    const IType* xr = x_base + row * static_cast<size_t>(p.H);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = (v * kTeam + t) * kVec;
      const bool inside = c < p.H;  // whole vectors (p.vec); outside: 16 zero bytes
      cp_async_16(stage + (buf * kVecs + v) * kThreads + threadIdx.x, inside ? xr + c : x_base,
                  inside ? 16 : 0);
    }
    cp_async_commit();
  };
  int buf = 0;
  // The team's rows: row, row + stride, ... (`row` is uniform over a team, so the team
  // barriers see all of its threads).
  const size_t stride = static_cast<size_t>(gridDim.x) * kTeams;
  size_t row = static_cast<size_t>(blockIdx.x) * kTeams + team;
  if (kPrefetch && row < p.rows) fetch_row(row);
  if (kStaged && row < p.rows) stage_row(row, 0);
  for (; row < p.rows; row += stride) {
    if constexpr (kStaged) {
      // Each thread reads back only the vectors it staged itself: no barrier needed. The other
      // buffer was read a row ago, before that row's team barriers.
      cp_async_wait<0>();
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        put_chunk(raw[v], 0, stage[(buf * kVecs + v) * kThreads + threadIdx.x]);
      }
      if (row + stride < p.rows) stage_row(row + stride, buf ^ 1);
      buf ^= 1;
    } else if (!kPrefetch) {
      fetch_row(row);
    }
    // The row as float32, converted once (padding vectors are +0.0: they add nothing to the
    // sum and are skipped below).
    float xf[kVecs][kVec];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) xf[v][j] = raw_elem(raw[v], j);
    }
    if (kPrefetch && row + stride < p.rows) fetch_row(row + stride);
    float mean = 0.0f;
    if (!p.rms) {
      float s = 0.0f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) s += xf[v][j];
      }
      mean = divide_by_features(team_sum<kTeam, kThreads>(s, scratch, phase), h, p.inv_h);
      // The deviations, formed once (xf holds them from here on; on an H200 3-5% faster
      // than forming them again for the output).
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) xf[v][j] -= mean;
      }
    }
    // Whole vectors only (p.vec: H % 8 == 0), so a vector is in the row or not at all.
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if ((v * kTeam + t) * kVec < p.H) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          ss = fmaf(xf[v][j], xf[v][j], ss);  // one instruction an element, not two
        }
      }
    }
    const float rsigma = rsqrtf(
        divide_by_features(team_sum<kTeam, kThreads>(ss, scratch, phase), h, p.inv_h) + p.eps);
    if (t == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      if (p.rsigma != nullptr) p.rsigma[row] = rsigma;
    }
    if (emits) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = (v * kTeam + t) * kVec;
        const int n = vec_count(c, p.H);
        if (n > 0) emit<IType, kFp8, kVecIO>(p, xf[v], n, row, c, rsigma, scale, amax);
      }
    }
  }
  if constexpr (kFp8) {
    if (p.amax != nullptr) block_amax_to_global<kThreads>(amax, p.amax);
  }
}

/* At most 64 registers a thread: half the SM's threads resident, fwd_blocks_per_sm blocks. */
constexpr int fwd_blocks_per_sm(int threads) { return 1024 / threads; }
template <class Cfg, typename IType, bool kFp8, bool kStage>
__global__ void __launch_bounds__(Cfg::kThreads, fwd_blocks_per_sm(Cfg::kThreads))
    norm_fwd_kernel(const FwdParams p) {
  __shared__ __align__(8) float scratch[kScratchFloats<Cfg::kThreads>];
  extern __shared__ uint4 stage[];  // kStage: staged_row_bytes<Cfg>()
  norm_fwd_rows<Cfg, IType, kFp8, kStage>(p, scratch, stage);
}

/* Rows longer than the register teams: one block per row, three passes over x in global memory
 * (sum, squared deviations, output; no third with the statistics alone). */
template <typename IType, bool kFp8>
__global__ void __launch_bounds__(kLoopThreads) norm_fwd_looped_kernel(const FwdParams p) {
  __shared__ __align__(8) float scratch[kScratchFloats<kLoopThreads>];
  int phase = 0;
  const float scale = fwd_scale<kFp8>(p);
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
      mean =
          divide_by_features(team_sum<kLoopThreads, kLoopThreads>(s, scratch, phase), h, p.inv_h);
    }
    float ss = 0.0f;
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(xr + c, p.vec, n, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = j < n ? x[j] - mean : 0.0f;
        ss = fmaf(d, d, ss);
      }
    }
    const float rsigma = rsqrtf(
        divide_by_features(team_sum<kLoopThreads, kLoopThreads>(ss, scratch, phase), h, p.inv_h) +
        p.eps);
    if (threadIdx.x == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      if (p.rsigma != nullptr) p.rsigma[row] = rsigma;
    }
    if (!kFp8 && p.y == nullptr) continue;  // the statistics alone
    for (int c = threadIdx.x * kVec; c < p.H; c += kLoopThreads * kVec) {
      const int n = vec_count(c, p.H);
      load_vec(xr + c, p.vec, n, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] -= mean;
      emit<IType, kFp8>(p, x, n, row, c, rsigma, scale, amax);
    }
  }
  if constexpr (kFp8) {
    if (p.amax != nullptr) block_amax_to_global<kLoopThreads>(amax, p.amax);
  }
}

/* The forward's teams: several rows per block (half-warp teams up to H = 384: half the per-row
 * sums and loop work an element of a warp team's, no idle lanes at H <= 128; warp teams up to
 * 768, 2-32 warps above), 2 or 3 vectors of 8 a thread (64 registers without spills). 3-vector
 * teams stage their next row in shared memory (kStage) and take the widths where 2-vector teams
 * would leave a quarter or more of their vectors as padding (257-384, 513-768, 1025-1536,
 * 2049-3072, 4097-6144), and 8193-12288; not RMSNorm rows of exactly 384, 768 or 1536, which fill
 * the 3-vector team and run unstaged on it, slower than on the 2-vector team
 * (docs/performance_norms.md has the figures). Calls f(nullptr) past the largest team (the looped kernel). */
template <typename F>
void dispatch_forward_team(int H, bool rms, F&& f) {
  if (H <= 128) {
    f(TeamConfig<16, 1, 256>{});
  } else if (H <= 256) {
    f(TeamConfig<16, 2, 256>{});
  } else if (H < 384 || (H == 384 && !rms)) {
    f(TeamConfig<16, 3, 256>{});
  } else if (H <= 512) {
    f(TeamConfig<32, 2, 256>{});
  } else if (H < 768 || (H == 768 && !rms)) {
    f(TeamConfig<32, 3, 256>{});
  } else if (H <= 1024) {
    f(TeamConfig<64, 2, 512>{});
  } else if (H < 1536 || (H == 1536 && !rms)) {
    f(TeamConfig<64, 3, 512>{});
  } else if (H <= 2048) {
    f(TeamConfig<128, 2, 512>{});
  } else if (H <= 3072) {
    f(TeamConfig<128, 3, 512>{});
  } else if (H <= 4096) {
    f(TeamConfig<256, 2, 512>{});
  } else if (H <= 6144) {
    f(TeamConfig<256, 3, 512>{});
  } else if (H <= 8192) {
    f(TeamConfig<512, 2, 512>{});
  } else if (H <= 12288) {
    f(TeamConfig<512, 3, 512>{});
  } else if (H <= 16384) {
    f(TeamConfig<1024, 2, 1024>{});
  } else {
    f(nullptr);
  }
}

template <typename IType, bool kFp8>
void launch_forward(CallContext& ctx, FwdParams p) {
  if (p.rows == 0) return;
  auto looped = [&]() {
    const size_t blocks = std::min<size_t>(p.rows, static_cast<size_t>(ctx.sm_count()) * 4);
    norm_fwd_looped_kernel<IType, kFp8>
        <<<static_cast<unsigned>(blocks), kLoopThreads, 0, ctx.stream()>>>(p);
    ctx.check_launch("norm_fwd_looped_kernel launch");
  };
  dispatch_forward_team(p.H, p.rms, [&](auto cfg) {
    using Cfg = decltype(cfg);
    if constexpr (std::is_same_v<Cfg, std::nullptr_t>) {
      looped();
    } else if (!p.vec) {
      looped();  // H % 8 != 0 or unaligned inputs (the choice ignores the outputs' alignment)
    } else {
      // As many blocks as the SMs hold (or one a kTeams rows), their teams walking the rows
      // (prefetching teams keep loads in flight across rows; a block a group of rows had paid
      // each group's first loads).
      const size_t resident =
          static_cast<size_t>(ctx.sm_count()) * fwd_blocks_per_sm(Cfg::kThreads);
      const size_t wanted = (p.rows + Cfg::kTeams - 1) / Cfg::kTeams;
      const unsigned blocks = static_cast<unsigned>(std::min(wanted, resident));
      if constexpr (kMayStage<Cfg, IType>) {
        // Staged, but for RMSNorm rows that fill all three vectors of every thread, which ran
        // 3-5% faster without (on an H200: 4096 and 8192 x 12288; LayerNorm 9-20% faster
        // staged at 9216-12288, RMSNorm 5-11% at 9216-10240; docs/performance_norms.md), and 5-8%
        // faster without on the smaller 3-vector teams (16384 x 3072, 8192 x 6144).
        if (!(p.rms && p.H == Cfg::kMaxH)) {
          auto kernel = norm_fwd_kernel<Cfg, IType, kFp8, true>;
          static DeviceSet done;  // per instantiation: once per device
          allow_dynamic_smem(ctx, kernel, staged_row_bytes<Cfg>(), done);
          kernel<<<blocks, Cfg::kThreads, staged_row_bytes<Cfg>(), ctx.stream()>>>(p);
          ctx.check_launch("norm_fwd_kernel launch");
          return;
        }
      }
      norm_fwd_kernel<Cfg, IType, kFp8, false><<<blocks, Cfg::kThreads, 0, ctx.stream()>>>(p);
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
  p.inv_h = exact_reciprocal(shape.H);
  p.rms = rms != 0;
  p.zero_centered = zero_centered_gamma != 0;
  p.w_fp32 = g.dtype == kNVTEFloat32;
  p.vec = shape.H % kVec == 0 && aligned_to(x.data, 16) && aligned_to(g.data, 16) &&
          (beta == nullptr || aligned_to(beta->data, 16));
  return p;
}

/* The tiled kernel's parameters for the FP8 output p describes, with its transposed copy. */
NormCastParams cast_params(const FwdParams& p, NVTEBuffer* output_t) {
  NormCastParams c{};
  c.x = p.x;
  c.gamma = p.gamma;
  c.beta = p.beta;
  c.mean = p.rms ? nullptr : p.mean;
  c.rsigma = p.rsigma;
  c.y = static_cast<uint8_t*>(p.y);
  c.y_t = static_cast<uint8_t*>(output_t->data);
  c.scale = p.scale;
  c.amax = p.amax;
  c.scale_inv = p.scale_inv;
  c.rows = p.rows;
  c.H = p.H;
  c.zero_centered = p.zero_centered;
  c.w_fp32 = p.w_fp32;
  c.e5m2 = p.e5m2;
  return c;
}

void check_inputs_on_device(CallContext& ctx, const NVTEBuffer* input, const NVTEBuffer* gamma,
                            const NVTEBuffer* beta, NVTEBuffer* mean, NVTEBuffer* rsigma) {
  ctx.check_on_device("input", *input);
  ctx.check_on_device("gamma", *gamma);
  if (beta != nullptr) ctx.check_on_device("beta", *beta);
  if (mean != nullptr) ctx.check_on_device("mean", *mean);
  if (rsigma != nullptr) ctx.check_on_device("rsigma", *rsigma);
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
  FwdParams p =
      check_forward(op, input, gamma, beta, epsilon, zero_centered_gamma, rms, mean, rsigma, shape);
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
      check_transposed_copy(op, *output_t, out, shape);
      if (rsigma == nullptr || (!rms && mean == nullptr)) {
        throw_invalid(op, "output_t needs the statistics: pass rsigma", rms ? "" : " and mean",
                      " (the transposed copy is normalized from them in a second kernel)");
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
  p.vec_out = p.vec && aligned_to(out.data, fp8 ? 8 : 16);
  if (fp8) {
    p.scale = static_cast<const float*>(scale->data);
    p.amax = amax != nullptr ? static_cast<float*>(amax->data) : nullptr;
    p.scale_inv = scale_inv != nullptr ? static_cast<float*>(scale_inv->data) : nullptr;
  }
  if (shape.rows == 0) {
    // No rows: nothing to normalize, but scale_inv is still published, as the casts do.
    if (p.scale_inv != nullptr) {
      p.y = nullptr;
      p.amax = nullptr;
    } else {
      return;
    }
  }
  if (fp8) {
    dispatch_fp8(op, out.dtype, [&](auto is_e4m3) { p.e5m2 = !decltype(is_e4m3)::value; });
  }
  dispatch_high_precision(op, input->dtype, [&](auto itype) {
    using IType = decltype(itype);
    if (!fp8) {
      launch_forward<IType, false>(ctx, p);
      return;
    }
    if (shape.rows == 0) {
      // One block of one row's worth of nothing: only block 0's scale_inv write happens.
      FwdParams q = p;
      q.rows = 0;
      norm_fwd_looped_kernel<IType, true><<<1, kLoopThreads, 0, ctx.stream()>>>(q);
      ctx.check_launch("norm_fwd_looped_kernel launch");
      return;
    }
    if (output_t != nullptr) {
      FwdParams stats = p;  // the statistics alone, then both FP8 copies from them
      stats.y = nullptr;
      launch_forward<IType, false>(ctx, stats);
      launch_norm_cast_transpose(ctx, input->dtype, cast_params(p, output_t));
      return;
    }
    launch_forward<IType, true>(ctx, p);
  });
}

extern "C" void nvte_norm_amax(const NVTEBuffer* input, const NVTEBuffer* gamma,
                               const NVTEBuffer* beta, float epsilon, int zero_centered_gamma,
                               int rms, NVTEBuffer* amax, NVTEBuffer* mean, NVTEBuffer* rsigma,
                               int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::norm_detail;
  const char* op = "nvte_norm_amax";
  NormShape shape{};
  FwdParams p =
      check_forward(op, input, gamma, beta, epsilon, zero_centered_gamma, rms, mean, rsigma, shape);
  check_fp32_scalar(op, "amax", require(op, "amax", amax));
  CallContext ctx(op, device, stream);
  check_inputs_on_device(ctx, input, gamma, beta, mean, rsigma);
  ctx.check_on_device("amax", *amax);
  p.amax = static_cast<float*>(amax->data);
  check_cuda(op, cudaMemsetAsync(p.amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  // The E4M3 kernel with no output: the rounded values' amax (the format is irrelevant), and the
  // statistics where asked.
  dispatch_high_precision(op, input->dtype,
                          [&](auto itype) { launch_forward<decltype(itype), true>(ctx, p); });
}
