/* nvte_compute_amax: amax = max |x| (float32, NaN ignored), overwriting the buffer; and the
 * per-block maxima of the same pass that nvte_quantize_current_scaling reduces with its scale
 * (no zeroed buffer needed, so no memset launch before the pass). */
#include <cuda_runtime.h>

#include <algorithm>

#include "cast/dispatch.cuh"
#include "cast/launchers.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

constexpr int kAmaxThreads = 256;
constexpr int kAmaxVecElems = 8;
/* A read-only pass is bound by the loads in flight: each thread issues kAmaxUnroll 16-byte
 * loads before it reduces the first, and an SM holds kAmaxBlocksPerSm blocks (64 registers a
 * thread at most), 64 KiB of loads in flight an SM, as the activations' amax passes
 * (activation_elementwise.cuh). One load a thread at a time had read at about 0.76 of the copy
 * bandwidth on an H200. */
constexpr int kAmaxUnroll = 4;
constexpr int kAmaxBlocksPerSm = 4;
/* The grid's cap (the pass is grid-strided), so that the per-block maxima of
 * nvte_quantize_current_scaling fit a workspace of fixed size: 1024 blocks cover every SM four
 * times over on GPUs of up to 256 SMs. */
constexpr size_t kAmaxMaxBlocks = 1024;

/* The pass walks the input from its end to its start: the casts that follow it (current
 * scaling) read their tiles from the first row on, so the part of the input this pass read last
 * is what L2 still holds when they start. On an H200 that took 1.5-2 us off each amax + cast
 * pair (4096 x 4096 BF16 with the transposed copy: 36.6 -> 34.5 us); the amax is the same. */

template <typename IType, bool kVectorized>
__global__ void __launch_bounds__(kAmaxThreads, kAmaxBlocksPerSm)
    amax_kernel(const IType* __restrict__ in, size_t n, float* __restrict__ amax,
                float* __restrict__ block_maxima, const float* __restrict__ noop) {
  if (skip_requested(noop)) return;
  using V = Vec<IType, kAmaxVecElems>;
  float local_amax = 0.0f;
  const size_t first = static_cast<size_t>(blockIdx.x) * kAmaxThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * kAmaxThreads;
  size_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const size_t num_vecs = n / kAmaxVecElems;
    const auto* vin = reinterpret_cast<const V*>(in);
    size_t i = first;
    for (; i + (kAmaxUnroll - 1) * stride < num_vecs; i += kAmaxUnroll * stride) {
      V x[kAmaxUnroll];
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) {
        const size_t at = i + u * stride;
        x[u] = vin[num_vecs - 1 - at];
      }
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kAmaxVecElems; ++j) {
          local_amax = amax_step(local_amax, to_float(x[u].v[j]));
        }
      }
    }
    for (; i < num_vecs; i += stride) {  // fewer than kAmaxUnroll vectors left for this thread
      const V x = vin[num_vecs - 1 - i];
#pragma unroll
      for (int j = 0; j < kAmaxVecElems; ++j) local_amax = amax_step(local_amax, to_float(x.v[j]));
    }
    scalar_begin = num_vecs * kAmaxVecElems;
  }
  for (size_t i = scalar_begin + first; i < n; i += stride) {
    local_amax = amax_step(local_amax, to_float(in[i]));
  }
  if (block_maxima != nullptr) {
    const float block_amax = block_max<kAmaxThreads>(local_amax);
    if (threadIdx.x == 0) block_maxima[blockIdx.x] = block_amax;
  } else {
    block_amax_to_global<kAmaxThreads>(local_amax, amax);
  }
}

/* The amax pass over `in` (n > 0): atomics into `amax` (zeroed by the caller), or, with
 * `block_maxima`, one maximum per block there; no pass when `noop` holds 1.0. Returns the
 * number of blocks. */
size_t launch_amax_kernel(CallContext& ctx, const NVTEBuffer& in, float* amax,
                          float* block_maxima, const float* noop) {
  const size_t n = numel(in);
  size_t blocks = 0;
  dispatch_high_precision(ctx.op(), in.dtype, [&](auto itype) {
    using IType = decltype(itype);
    const auto* in_data = static_cast<const IType*>(in.data);
    const bool vectorized = aligned_to(in_data, sizeof(IType) * kAmaxVecElems);
    const size_t work = vectorized ? n / kAmaxVecElems + n % kAmaxVecElems : n;
    const size_t wanted = std::max<size_t>(1, (work + kAmaxThreads - 1) / kAmaxThreads);
    blocks = std::min<size_t>({wanted, static_cast<size_t>(ctx.sm_count()) * kAmaxBlocksPerSm,
                               kAmaxMaxBlocks});
    if (vectorized) {
      amax_kernel<IType, true>
          <<<blocks, kAmaxThreads, 0, ctx.stream()>>>(in_data, n, amax, block_maxima, noop);
    } else {
      amax_kernel<IType, false>
          <<<blocks, kAmaxThreads, 0, ctx.stream()>>>(in_data, n, amax, block_maxima, noop);
    }
    ctx.check_launch("amax_kernel launch");
  });
  return blocks;
}

}  // namespace
}  // namespace transformer_engine

namespace transformer_engine {
namespace cast_detail {

void launch_amax(CallContext& ctx, const NVTEBuffer& in, float* amax) {
  check_cuda(ctx.op(), cudaMemsetAsync(amax, 0, sizeof(float), ctx.stream()), "cudaMemsetAsync");
  if (numel(in) > 0) launch_amax_kernel(ctx, in, amax, nullptr, nullptr);
}

size_t launch_block_amaxes(CallContext& ctx, const NVTEBuffer& in, float* block_maxima,
                           const float* noop) {
  return numel(in) > 0 ? launch_amax_kernel(ctx, in, nullptr, block_maxima, noop) : 0;
}

void check_amax_workspace(const char* op, const NVTEBuffer& workspace) {
  check_well_formed(op, "amax_workspace", workspace);
  check_dtype(op, "amax_workspace", workspace, {kNVTEFloat32});
  if (numel(workspace) < kAmaxMaxBlocks) {
    throw_invalid(op, "amax_workspace has ", numel(workspace),
                  " elements; it needs nvte_amax_workspace_elements() = ", kAmaxMaxBlocks);
  }
}

}  // namespace cast_detail
}  // namespace transformer_engine

extern "C" void nvte_compute_amax(const NVTEBuffer* input, NVTEBuffer* amax, int device,
                                  NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_compute_amax";
  const NVTEBuffer& in = require(op, "input", input);
  check_dtype(op, "input", in, {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16});
  check_fp32_scalar(op, "amax", require(op, "amax", amax));

  CallContext ctx(op, device, stream);
  ctx.check_on_device("input", in);
  ctx.check_on_device("amax", *amax);
  cast_detail::launch_amax(ctx, in, static_cast<float*>(amax->data));
}

extern "C" size_t nvte_amax_workspace_elements(void) { return transformer_engine::kAmaxMaxBlocks; }
