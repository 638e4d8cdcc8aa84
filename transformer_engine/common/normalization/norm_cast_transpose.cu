/* nvte_norm_forward_from_stats (normalization.h), and the second kernel of nvte_norm_forward's
 * FP8 output with the transposed copy (norm_cast_transpose.h): the tiled cast+transpose kernels
 * of the casts (cast/cast_transpose.cuh) over a loader that normalizes as it reads.
 *
 * Why two kernels: a row's statistics need the whole row, the transposed copy wants runs of
 * rows of each column. The single kernel that held whole rows in registers and staged the FP8
 * bytes of 8-32 rows in shared memory for the transposed stores ran at a quarter to a third of
 * the copy's bandwidth (2-4 rows a SM in flight, its stores after its loads); here the norm
 * kernels write only the statistics (2 bytes an element read), and the tiles are those of the
 * plain cast+transpose (2 bytes read, 1 + 1 written). */
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cast/cast_transpose.cuh"
#include "cast/dispatch.cuh"
#include "normalization/norm_cast_transpose.h"
#include "normalization/norm_common.cuh"
#include "transformer_engine/normalization.h"

namespace transformer_engine {
namespace norm_detail {
namespace {

using cast_detail::kVecElems;
static_assert(kVecElems == kVec, "one loader vector is one norm vector");

/* y = (x - mean) * rsigma * g + beta (RMSNorm: x * rsigma * g), written as the norm kernels'
 * emit() writes it (the same float32 operations in the same order, so the same contraction into
 * one fused multiply-add), rounded to x's dtype: the values the norm's high-precision output
 * holds, which the cast kernels then cast and max as they cast any input. WType: gamma's. */
template <typename IType, typename WType>
struct NormLoad {
  const IType* x;
  const WType* gamma;
  const WType* beta;  // null: no shift (adds +0.0, as emit() does)
  const float* mean;  // null: RMSNorm
  const float* rsigma;
  size_t cols;
  bool zero_centered;
  // Four blocks an SM (64 registers, a few bytes spilled): unbounded it takes 79 registers and
  // three blocks, and at 8192 x 4096 BF16 runs 52 us against 48.5 (five blocks spill: 75 us).
  static constexpr int kTallMinBlocks = 4;

  bool vectorizable() const {
    return aligned_to(x, 16) && aligned_to(gamma, 16) && (beta == nullptr || aligned_to(beta, 16));
  }

  __device__ __forceinline__ float param(const WType* p, size_t c) const { return to_float(p[c]); }

  __device__ __forceinline__ float normalize(float v, float mu, float rs, float g, float b) const {
    const float d = mean != nullptr ? v - mu : v;
    const float y = d * rs * g + b;
    return to_float(from_float<IType>(y));
  }

  __device__ __forceinline__ float load(size_t r, size_t c) const {
    float g = param(gamma, c);
    if (zero_centered) g = 1.0f + g;
    const float b = beta != nullptr ? param(beta, c) : 0.0f;
    const float mu = mean != nullptr ? mean[r] : 0.0f;
    return normalize(to_float(x[r * cols + c]), mu, rsigma[r], g, b);
  }

  struct TileRaw {
    Vec<IType, kVec> x;
    float mean;
    float rsigma;
  };
  __device__ __forceinline__ TileRaw tile_fetch(size_t r, size_t c) const {
    TileRaw raw;
    raw.x = load_readonly<IType, kVec>(x + r * cols + c);
    raw.mean = mean != nullptr ? __ldg(mean + r) : 0.0f;
    raw.rsigma = __ldg(rsigma + r);
    return raw;
  }
  __device__ __forceinline__ void tile_compute(const TileRaw& raw, size_t c,
                                               float (&v)[kVec]) const {
    // The same columns for all of a thread's row vectors: the compiler loads these once.
    const Vec<WType, kVec> g = load_readonly<WType, kVec>(gamma + c);
    Vec<WType, kVec> b;
    if (beta != nullptr) b = load_readonly<WType, kVec>(beta + c);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float gj = to_float(g.v[j]);
      if (zero_centered) gj = 1.0f + gj;
      const float bj = beta != nullptr ? to_float(b.v[j]) : 0.0f;
      v[j] = normalize(to_float(raw.x.v[j]), raw.mean, raw.rsigma, gj, bj);
    }
  }
  __device__ __forceinline__ void load_vec(size_t r, size_t c, float (&v)[kVec]) const {
    tile_compute(tile_fetch(r, c), c, v);
  }
};

/* rows == 0: nothing to cast, but scale_inv is published, as the casts do. */
__global__ void publish_scale_inv_kernel(const float* scale, float* scale_inv) {
  *scale_inv = 1.0f / *scale;
}

}  // namespace

void launch_norm_cast_transpose(CallContext& ctx, NVTEDType x_dtype, const NormCastParams& p) {
  const char* op = ctx.op();
  const cast_detail::CastArgs args{p.scale, p.amax, p.scale_inv, nullptr};
  dispatch_high_precision(op, x_dtype, [&](auto itype) {
    using IType = decltype(itype);
    auto launch = [&](auto wtype) {
      using WType = decltype(wtype);
      const NormLoad<IType, WType> loader{static_cast<const IType*>(p.x),
                                          static_cast<const WType*>(p.gamma),
                                          static_cast<const WType*>(p.beta),
                                          p.mean,
                                          p.rsigma,
                                          static_cast<size_t>(p.H),
                                          p.zero_centered};
      if (p.e5m2) {
        cast_detail::launch_cast_transpose_from<NormLoad<IType, WType>, false, false>(
            loader, p.y, p.y_t, p.rows, p.H, args, nullptr, ctx);
      } else {
        cast_detail::launch_cast_transpose_from<NormLoad<IType, WType>, true, false>(
            loader, p.y, p.y_t, p.rows, p.H, args, nullptr, ctx);
      }
    };
    if (p.w_fp32) {
      launch(float{});
    } else {
      launch(IType{});
    }
  });
}

}  // namespace norm_detail
}  // namespace transformer_engine

extern "C" void nvte_norm_forward_from_stats(const NVTEBuffer* input, const NVTEBuffer* gamma,
                                             const NVTEBuffer* beta, int zero_centered_gamma,
                                             int rms, const NVTEBuffer* mean,
                                             const NVTEBuffer* rsigma, NVTEBuffer* output,
                                             const NVTEBuffer* scale, NVTEBuffer* output_t,
                                             NVTEBuffer* amax, NVTEBuffer* scale_inv, int device,
                                             NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::norm_detail;
  const char* op = "nvte_norm_forward_from_stats";
  const NVTEBuffer& x = require(op, "input", input);
  const NormShape shape = check_norm_input(op, "input", x);
  const NVTEBuffer& g = require(op, "gamma", gamma);
  check_param(op, "gamma", g, shape.H, x.dtype, kNVTENumTypes);
  if (beta != nullptr) {
    if (rms) throw_invalid(op, "RMSNorm takes no beta; pass null");
    check_param(op, "beta", *beta, shape.H, x.dtype, g.dtype);
  }
  if (rms) {
    if (mean != nullptr) throw_invalid(op, "RMSNorm has no mean; pass null");
  } else {
    check_stat(op, "mean", require(op, "mean", mean), shape.rows);
  }
  check_stat(op, "rsigma", require(op, "rsigma", rsigma), shape.rows);
  const NVTEBuffer& out = require(op, "output", output);
  if (!is_fp8(out.dtype)) {
    throw_invalid(op, "output has dtype ", dtype_name(out.dtype),
                  "; this entry writes FP8 (E4M3 or E5M2) only");
  }
  check_matrix(op, "output", out, shape.rows, shape.H, out.dtype);
  const NVTEBuffer& out_t = require(op, "output_t", output_t);
  check_transposed_copy(op, out_t, out, shape);
  check_fp32_scalar(op, "scale", require(op, "scale", scale));
  if (amax != nullptr) check_fp32_scalar(op, "amax", *amax);
  if (scale_inv != nullptr) check_fp32_scalar(op, "scale_inv", *scale_inv);

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", x);
  ctx.check_on_device("gamma", g);
  if (beta != nullptr) ctx.check_on_device("beta", *beta);
  if (mean != nullptr) ctx.check_on_device("mean", *mean);
  ctx.check_on_device("rsigma", *rsigma);
  ctx.check_on_device("output", out);
  ctx.check_on_device("output_t", out_t);
  ctx.check_on_device("scale", *scale);
  if (amax != nullptr) ctx.check_on_device("amax", *amax);
  if (scale_inv != nullptr) ctx.check_on_device("scale_inv", *scale_inv);

  NormCastParams p{};
  p.x = x.data;
  p.gamma = g.data;
  p.beta = beta != nullptr ? beta->data : nullptr;
  p.mean = rms ? nullptr : static_cast<const float*>(mean->data);
  p.rsigma = static_cast<const float*>(rsigma->data);
  p.y = static_cast<uint8_t*>(out.data);
  p.y_t = static_cast<uint8_t*>(out_t.data);
  p.scale = static_cast<const float*>(scale->data);
  p.amax = amax != nullptr ? static_cast<float*>(amax->data) : nullptr;
  p.scale_inv = scale_inv != nullptr ? static_cast<float*>(scale_inv->data) : nullptr;
  p.rows = shape.rows;
  p.H = shape.H;
  p.zero_centered = zero_centered_gamma != 0;
  p.w_fp32 = g.dtype == kNVTEFloat32;
  dispatch_fp8(op, out.dtype, [&](auto is_e4m3) { p.e5m2 = !decltype(is_e4m3)::value; });
  if (shape.rows == 0) {
    if (p.scale_inv != nullptr) {
      publish_scale_inv_kernel<<<1, 1, 0, ctx.stream()>>>(p.scale, p.scale_inv);
      ctx.check_launch("publish_scale_inv_kernel launch");
    }
    return;
  }
  launch_norm_cast_transpose(ctx, x.dtype, p);
}
