/* nvte_delayed_scaling_update: the fused amax-history roll and scale update over many
 * (history, scale) pairs of one device. The pairs travel in the kernel's parameter block, one
 * CUDA block per pair, so the update is one launch per kEntriesPerLaunch pairs. Pairs of up to
 * kMaxGroupSlots slots (every module's): the whole block shares a pair's slots, each slot a
 * group of threads, so a history of 1024 rows moves in one pass of loads and one of stores.
 * Launches with wider pairs: one warp per slot, several passes of a warp's loads. */
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include "transformer_engine/recipe.h"
#include "util/buffer.h"
#include "util/device.h"
#include "util/errors.h"

namespace transformer_engine {
namespace {

constexpr int kThreads = 128;
constexpr int kEntriesPerLaunch = 128;

/* The pairs of one launch, as arrays (28 bytes a pair: 128 pairs fit the 4 KiB parameter
 * block with room to spare). */
struct UpdateBatch {
  float* history[kEntriesPerLaunch];  // [length, slots], row-major
  float* scale[kEntriesPerLaunch];    // [slots]
  uint32_t slots[kEntriesPerLaunch];
  uint32_t length[kEntriesPerLaunch];
  uint32_t reduced_offset[kEntriesPerLaunch];  // where the pair starts in the reduction buffer
};
static_assert(sizeof(UpdateBatch) <= 3584, "kernel parameters must stay below 4 KiB");

__device__ __forceinline__ float max_propagating_nan(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

constexpr int kWarpSize = 32;
constexpr int kRowsPerLane = 8;  // history rows a lane keeps in flight per pass
constexpr int kRowsPerPass = kWarpSize * kRowsPerLane;

__device__ __forceinline__ float warp_max_propagating_nan(float v) {
  for (int delta = kWarpSize / 2; delta > 0; delta /= 2) {
    v = max_propagating_nan(v, __shfl_xor_sync(0xffffffffu, v, delta));
  }
  return v;
}

/* The end of one slot's update, after the roll: `a` lands in the last row, row 0 starts over
 * at 0, and the scale becomes scaled_max / candidate when the candidate is finite and positive
 * (+Inf becomes FLT_MAX), else stays. `column` is the slot's row-0 element (row j at j * n). */
__device__ __forceinline__ void finish_slot(float* column, size_t n, uint32_t length, float a,
                                            float candidate, float scaled_max, float* scale) {
  column[static_cast<size_t>(length - 1) * n] = a;
  column[0] = 0.0f;
  if (isfinite(candidate) && candidate > 0.0f) {
    float s = scaled_max / candidate;
    if (isinf(s)) s = FLT_MAX;
    *scale = s;
  }
}

/* One CUDA block per (history, scale) pair; one warp per slot (column of the history). The warp
 * reads each history row once: the value of row j + 1 feeds the max and is written to row j (the
 * roll). Rows are read a pass of kRowsPerPass at a time, all reads of a pass before any of its
 * writes; a pass writes rows [c, c + kRowsPerPass) and the next one reads only rows above
 * c + kRowsPerPass, so the in-place shift never reads a row it already overwrote. The result is
 * bitwise the same as the sequential definition (max is exact and order-free, NaN wins). */
__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const UpdateBatch batch, const float* __restrict__ reduced,
                                  bool algo_max, float scaled_max) {
  const int k = blockIdx.x;
  const size_t n = batch.slots[k];
  const uint32_t length = batch.length[k];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  constexpr int kWarps = kThreads / kWarpSize;
  for (size_t i = warp; i < n; i += kWarps) {
    float* h = batch.history[k] + i;  // column i; row j is h[j * n]
    float a = h[0];
    if (reduced != nullptr) {
      const float r = reduced[batch.reduced_offset[k] + i];
      if (r != 0.0f) a = r;
    }
    __syncwarp();             // every lane has read row 0 before lane 0 overwrites it
    if (a == 0.0f) continue;  // slot not exercised this step: no roll, scale kept (warp-uniform)
    float candidate = a;
    for (uint32_t c = 0; c + 1 < length; c += kRowsPerPass) {
      float v[kRowsPerLane];
#pragma unroll
      for (int u = 0; u < kRowsPerLane; ++u) {
        const uint32_t src = c + u * kWarpSize + lane + 1;
        v[u] = src < length ? h[static_cast<size_t>(src) * n] : 0.0f;
        if (algo_max && src < length) candidate = max_propagating_nan(candidate, v[u]);
      }
      __syncwarp();
#pragma unroll
      for (int u = 0; u < kRowsPerLane; ++u) {
        const uint32_t src = c + u * kWarpSize + lane + 1;
        if (src < length) h[static_cast<size_t>(src - 1) * n] = v[u];
      }
      __syncwarp();
    }
    candidate = warp_max_propagating_nan(candidate);
    if (lane == 0) finish_slot(h, n, length, a, candidate, scaled_max, &batch.scale[k][i]);
    __syncwarp();
  }
}

constexpr int kGroupThreads = 1024;
constexpr int kGroupRowsPerThread = 8;
constexpr uint32_t kMaxGroupSlots = 64;

/* One CUDA block per (history, scale) pair of at most kMaxGroupSlots slots: slot i is owned by
 * the tpc = kGroupThreads / slots threads [i * tpc, (i + 1) * tpc), thread j of the group taking
 * rows 1 + j, 1 + j + tpc, ... of its column. A pass reads kGroupRowsPerThread * tpc rows of
 * every slot (all reads of a pass before the block barrier, then the writes one row lower);
 * later passes read only rows above those a pass wrote, as in the warp kernel. Row 0 (or the
 * reduced amax) is read before any write. The group's maxima meet in shared memory (a tree over
 * the group; max is exact and order-free, NaN wins), so the result is bitwise the warp kernel's.
 * Every thread runs the same number of passes and tree steps: the barriers see the whole block. */
__global__ void __launch_bounds__(kGroupThreads)
    delayed_scaling_update_group_kernel(const UpdateBatch batch, const float* __restrict__ reduced,
                                        bool algo_max, float scaled_max) {
  __shared__ float current[kMaxGroupSlots];
  __shared__ float partial[kGroupThreads];
  const int k = blockIdx.x;
  const uint32_t n = batch.slots[k];
  const uint32_t length = batch.length[k];
  float* const h = batch.history[k];
  if (n == 0) return;  // block-uniform: no barrier is left waiting
  const uint32_t tpc = kGroupThreads / n;
  const uint32_t col = threadIdx.x / tpc;
  const uint32_t j = threadIdx.x % tpc;
  const bool mine = col < n;  // threads past n * tpc only join the barriers
  if (threadIdx.x < n) {
    float a = h[threadIdx.x];
    if (reduced != nullptr) {
      const float r = reduced[batch.reduced_offset[k] + threadIdx.x];
      if (r != 0.0f) a = r;
    }
    current[threadIdx.x] = a;
  }
  __syncthreads();  // row 0 is read before the first pass overwrites it
  const float a = mine ? current[col] : 0.0f;
  const bool active = mine && a != 0.0f;  // a slot not exercised this step: no roll, scale kept
  float candidate = a;
  const uint32_t per_pass = kGroupRowsPerThread * tpc;
  for (uint32_t base = 1; base < length; base += per_pass) {
    float v[kGroupRowsPerThread];
#pragma unroll
    for (int u = 0; u < kGroupRowsPerThread; ++u) {
      const uint32_t src = base + u * tpc + j;
      v[u] = 0.0f;
      if (active && src < length) {
        v[u] = h[static_cast<size_t>(src) * n + col];
        if (algo_max) candidate = max_propagating_nan(candidate, v[u]);
      }
    }
    __syncthreads();  // the pass's rows are read before any of them is overwritten
#pragma unroll
    for (int u = 0; u < kGroupRowsPerThread; ++u) {
      const uint32_t src = base + u * tpc + j;
      if (active && src < length) h[static_cast<size_t>(src - 1) * n + col] = v[u];
    }
  }
  partial[threadIdx.x] = candidate;
  __syncthreads();  // also orders the passes' writes to row 0 before the final ones
  uint32_t span = 1;
  while (span < tpc) span *= 2;
  for (uint32_t s = span / 2; s > 0; s /= 2) {
    if (mine && j < s && j + s < tpc) {
      partial[threadIdx.x] = max_propagating_nan(partial[threadIdx.x], partial[threadIdx.x + s]);
    }
    __syncthreads();
  }
  if (active && j == 0) {
    finish_slot(h + col, n, length, a, partial[threadIdx.x], scaled_max, &batch.scale[k][col]);
  }
}

}  // namespace
}  // namespace transformer_engine

extern "C" void nvte_delayed_scaling_update(const NVTEBuffer* amax_reduction_buffer,
                                            NVTEBuffer* const* amax_histories,
                                            NVTEBuffer* const* scales, size_t num_pairs,
                                            NVTEAmaxComputeAlgo algo, NVTEDType fp8_dtype,
                                            double margin, int device, NVTEStream stream) {
  using namespace transformer_engine;
  const char* op = "nvte_delayed_scaling_update";
  if (algo != kNVTEAmaxMax && algo != kNVTEAmaxMostRecent) {
    throw_invalid(op, "amax_compute_algo code ", static_cast<int>(algo),
                  " is unknown; use kNVTEAmaxMax or kNVTEAmaxMostRecent");
  }
  if (!std::isfinite(margin)) throw_invalid(op, "margin=", margin, " must be finite");
  const double scaled_max_d = static_cast<double>(fp8_max(op, fp8_dtype)) * std::pow(2.0, -margin);
  const float scaled_max = static_cast<float>(scaled_max_d);
  if (num_pairs > 0 && (amax_histories == nullptr || scales == nullptr)) {
    throw_invalid(op, "amax_histories and scales must point to ", num_pairs, " buffers each");
  }

  // Validate everything before the first launch, so a refused call changes nothing.
  uint64_t total_slots = 0;
  for (size_t k = 0; k < num_pairs; ++k) {
    const std::string hname = concat("amax_histories[", k, "]");
    const std::string sname = concat("scales[", k, "]");
    const NVTEBuffer& h = require(op, hname.c_str(), amax_histories[k]);
    const NVTEBuffer& s = require(op, sname.c_str(), scales[k]);
    check_dtype(op, hname.c_str(), h, {kNVTEFloat32});
    check_dtype(op, sname.c_str(), s, {kNVTEFloat32});
    if (h.ndim != 2 || h.shape[0] < 1) {
      throw_invalid(op, hname, " must have shape [amax_history_len >= 1, num_slots]");
    }
    if (s.ndim != 1 || s.shape[0] != h.shape[1]) {
      throw_invalid(op, sname, " must have shape [", h.shape[1], "] to match ", hname);
    }
    if (h.shape[0] > std::numeric_limits<uint32_t>::max() ||
        h.shape[1] > std::numeric_limits<uint32_t>::max()) {
      throw_invalid(op, hname, " is too large");
    }
    total_slots += h.shape[1];
  }
  if (total_slots > std::numeric_limits<uint32_t>::max()) {
    throw_invalid(op, "the histories have ", total_slots, " slots in all; at most 2^32 - 1");
  }
  const float* reduced = nullptr;
  if (amax_reduction_buffer != nullptr) {
    const NVTEBuffer& r = require(op, "amax_reduction_buffer", amax_reduction_buffer);
    check_dtype(op, "amax_reduction_buffer", r, {kNVTEFloat32});
    if (numel(r) != total_slots) {
      throw_invalid(op, "amax_reduction_buffer has ", numel(r), " elements but the histories have ",
                    total_slots, " slots in all");
    }
    reduced = static_cast<const float*>(r.data);
  }

  CallContext ctx(op, device, stream);
  if (amax_reduction_buffer != nullptr) {
    ctx.check_on_device("amax_reduction_buffer", *amax_reduction_buffer);
  }
  for (size_t k = 0; k < num_pairs; ++k) {
    ctx.check_on_device(concat("amax_histories[", k, "]").c_str(), *amax_histories[k]);
    ctx.check_on_device(concat("scales[", k, "]").c_str(), *scales[k]);
  }

  uint64_t offset = 0;
  for (size_t begin = 0; begin < num_pairs; begin += kEntriesPerLaunch) {
    UpdateBatch batch{};
    int count = 0;
    uint32_t widest = 0;
    for (size_t k = begin; k < num_pairs && count < kEntriesPerLaunch; ++k, ++count) {
      const NVTEBuffer& h = *amax_histories[k];
      batch.history[count] = static_cast<float*>(h.data);
      batch.scale[count] = static_cast<float*>(scales[k]->data);
      batch.slots[count] = static_cast<uint32_t>(h.shape[1]);
      batch.length[count] = static_cast<uint32_t>(h.shape[0]);
      batch.reduced_offset[count] = static_cast<uint32_t>(offset);
      offset += h.shape[1];
      widest = std::max(widest, batch.slots[count]);
    }
    if (widest == 0) continue;  // pairs without slots: nothing to update
    if (widest <= kMaxGroupSlots) {
      delayed_scaling_update_group_kernel<<<count, kGroupThreads, 0, ctx.stream()>>>(
          batch, reduced, algo == kNVTEAmaxMax, scaled_max);
      ctx.check_launch("delayed_scaling_update_group_kernel launch");
    } else {
      delayed_scaling_update_kernel<<<count, kThreads, 0, ctx.stream()>>>(
          batch, reduced, algo == kNVTEAmaxMax, scaled_max);
      ctx.check_launch("delayed_scaling_update_kernel launch");
    }
  }
}
