/* nvte_quantize_dbias: the cast+transpose of nvte_quantize that also sums the input over its
 * rows (a linear layer's bias gradient from its output gradient), so the gradient is read once
 * instead of twice. Two launches: the tiled cast+transpose writes one float32 column sum per
 * 64-row tile into the workspace, then a second kernel adds the tiles up in a fixed order and
 * rounds once to the output dtype. Deterministic: no atomics, a fixed summation order. */
#include <cuda_runtime.h>

#include "cast/cast_transpose.cuh"
#include "cast/dispatch.cuh"
#include "cast/launchers.h"
#include "transformer_engine/cast.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"
#include "util/fp8_math.cuh"

namespace transformer_engine {
namespace {

using namespace cast_detail;

/* The column sums' second stage: a block of kReduceSplit warps takes 32 adjacent columns (a
 * warp reads 128 contiguous bytes of a tile row); warp w adds tile rows w, w + kReduceSplit, ...
 * in order, issuing kReduceBatch loads before it adds the first; then the first warp adds the
 * warps' sums in warp order. A fixed order, so the result is deterministic. The sums come from
 * memory (the cast's outputs have evicted them from L2 by then), so what counts is the loads in
 * flight: one thread per column walking all tile rows took 14-18 us for 256 x 4096 sums on an
 * H200, 128 columns a block 8.5 us. */
constexpr int kReduceSplit = 32;
constexpr int kReduceThreads = 32 * kReduceSplit;
constexpr int kReduceCols = 32;
constexpr int kReduceBatch = 8;

template <typename OType>
__global__ void __launch_bounds__(kReduceThreads)
    column_sums_to_dbias_kernel(const float* __restrict__ column_sums, OType* __restrict__ dbias,
                                size_t tiles, size_t cols) {
  __shared__ float partial[kReduceSplit][kReduceCols];
  const int lane = threadIdx.x % kReduceCols;
  const int split = threadIdx.x / kReduceCols;
  const size_t c = static_cast<size_t>(blockIdx.x) * kReduceCols + lane;
  float total = 0.0f;
  if (c < cols) {
    for (size_t t0 = split; t0 < tiles; t0 += kReduceBatch * kReduceSplit) {
      float v[kReduceBatch];
#pragma unroll
      for (int k = 0; k < kReduceBatch; ++k) {
        const size_t t = t0 + static_cast<size_t>(k) * kReduceSplit;
        v[k] = t < tiles ? __ldg(column_sums + t * cols + c) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kReduceBatch; ++k) total += v[k];
    }
  }
  partial[split][lane] = total;
  __syncthreads();
  if (split != 0 || c >= cols) return;
  float sum = partial[0][lane];
#pragma unroll
  for (int k = 1; k < kReduceSplit; ++k) sum += partial[k][lane];
  dbias[c] = from_float<OType>(sum);
}

/* rows == 0: no cast kernel runs, but scale_inv is still published, as nvte_quantize does. */
__global__ void publish_scale_inv_kernel(CastArgs args) { load_scale(args); }

}  // namespace
}  // namespace transformer_engine

namespace transformer_engine {
namespace cast_detail {

void check_dbias_args(const char* op, const QuantizeShape& shape, const NVTEBuffer& input,
                      const NVTEBuffer* dbias, const NVTEBuffer* workspace) {
  const NVTEBuffer& db = require(op, "dbias", dbias);
  if (db.dtype != input.dtype) {
    throw_invalid(op, "dbias has dtype ", dtype_name(db.dtype), " but input has ",
                  dtype_name(input.dtype), "; the bias gradient uses the input's dtype");
  }
  if (db.ndim != 1 || db.shape[0] != shape.cols) {
    throw_invalid(op, "dbias must have shape [", shape.cols, "] (the input's last extent)");
  }
  const NVTEBuffer& ws = require(op, "workspace", workspace);
  check_dtype(op, "workspace", ws, {kNVTEFloat32});
  const size_t needed = nvte_quantize_dbias_workspace_elements(shape.rows, shape.cols);
  if (numel(ws) < needed) {
    throw_invalid(op, "workspace has ", numel(ws), " elements; [", shape.rows, ", ", shape.cols,
                  "] needs nvte_quantize_dbias_workspace_elements = ", needed);
  }
}

void launch_dbias_from_column_sums(CallContext& ctx, const float* column_sums, NVTEBuffer& dbias,
                                   size_t rows, size_t cols) {
  dispatch_high_precision(ctx.op(), dbias.dtype, [&](auto otype) {
    using OType = decltype(otype);
    const size_t blocks = (cols + kReduceCols - 1) / kReduceCols;
    column_sums_to_dbias_kernel<OType><<<blocks, kReduceThreads, 0, ctx.stream()>>>(
        column_sums, static_cast<OType*>(dbias.data), tile_rows(rows), cols);
    ctx.check_launch("column_sums_to_dbias_kernel launch");
  });
}

void launch_quantize_dbias(CallContext& ctx, const NVTEBuffer& input, NVTEBuffer& output,
                           NVTEBuffer& output_t, const QuantizeShape& shape, const CastArgs& args,
                           NVTEBuffer& dbias, NVTEBuffer& workspace) {
  const char* op = ctx.op();
  const size_t rows = shape.rows, cols = shape.cols;
  if (rows == 0 && args.scale_inv != nullptr) {
    publish_scale_inv_kernel<<<1, 1, 0, ctx.stream()>>>(args);
    ctx.check_launch("publish_scale_inv_kernel launch");
  }
  if (cols == 0) return;
  auto* column_sums = static_cast<float*>(workspace.data);
  dispatch_high_precision(op, input.dtype, [&](auto itype) {
    using IType = decltype(itype);
    if (rows > 0) {
      dispatch_fp8(op, output.dtype, [&](auto is_e4m3) {
        constexpr bool kE4M3 = decltype(is_e4m3)::value;
        launch_cast_transpose<IType, kE4M3, true>(
            static_cast<const IType*>(input.data), static_cast<uint8_t*>(output.data),
            static_cast<uint8_t*>(output_t.data), rows, cols, args, column_sums, ctx);
      });
    }
    launch_dbias_from_column_sums(ctx, column_sums, dbias, rows, cols);
  });
}

}  // namespace cast_detail
}  // namespace transformer_engine

extern "C" size_t nvte_quantize_dbias_workspace_elements(size_t rows, size_t cols) {
  return transformer_engine::cast_detail::tile_rows(rows) * cols;
}

extern "C" void nvte_quantize_dbias(const NVTEBuffer* input, const NVTEBuffer* scale,
                                    NVTEBuffer* output, NVTEBuffer* output_t, NVTEBuffer* amax,
                                    NVTEBuffer* scale_inv, NVTEBuffer* dbias, NVTEBuffer* workspace,
                                    int device, NVTEStream stream) {
  using namespace transformer_engine;
  using namespace transformer_engine::cast_detail;
  const char* op = "nvte_quantize_dbias";
  if (output_t == nullptr) {
    throw_invalid(op, "output_t is required: the bias gradient comes with the transposed copy");
  }
  const QuantizeShape shape =
      check_quantize_args(op, input, scale, output, output_t, amax, scale_inv, nullptr);
  check_dbias_args(op, shape, *input, dbias, workspace);

  CallContext ctx(op, device, stream);
  const CastArgs args =
      checked_cast_args(ctx, input, scale, output, output_t, amax, scale_inv, nullptr);
  ctx.check_on_device("dbias", *dbias);
  ctx.check_on_device("workspace", *workspace);
  launch_quantize_dbias(ctx, *input, *output, *output_t, shape, args, *dbias, *workspace);
}
