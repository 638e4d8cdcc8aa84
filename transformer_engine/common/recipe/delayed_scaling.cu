/* nvte_delayed_scaling_update: the fused amax-history roll and scale update over many
 * (history, scale) pairs of one device. The pairs travel in the kernel's parameter block, one
 * CUDA block per pair, so the update is one launch per kEntriesPerLaunch pairs. */
#include <cuda_runtime.h>

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

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const UpdateBatch batch, const float* __restrict__ reduced,
                                  bool algo_max, float scaled_max) {
  const int k = blockIdx.x;
  const size_t n = batch.slots[k];
  const uint32_t length = batch.length[k];
  for (size_t i = threadIdx.x; i < n; i += kThreads) {
    float* h = batch.history[k] + i;  // column i; row j is h[j * n]
    float a = h[0];
    if (reduced != nullptr) {
      const float r = reduced[batch.reduced_offset[k] + i];
      if (r != 0.0f) a = r;
    }
    if (a == 0.0f) continue;  // slot not exercised this step: no roll, scale kept
    float candidate = a;
    if (algo_max) {
      for (uint32_t j = 1; j < length; ++j) candidate = max_propagating_nan(candidate, h[j * n]);
    }
    for (uint32_t j = 0; j + 1 < length; ++j) h[j * n] = h[(j + 1) * n];
    h[(length - 1) * n] = a;
    h[0] = 0.0f;
    if (isfinite(candidate) && candidate > 0.0f) {
      float s = scaled_max / candidate;
      if (isinf(s)) s = FLT_MAX;
      batch.scale[k][i] = s;
    }
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
    for (size_t k = begin; k < num_pairs && count < kEntriesPerLaunch; ++k, ++count) {
      const NVTEBuffer& h = *amax_histories[k];
      batch.history[count] = static_cast<float*>(h.data);
      batch.scale[count] = static_cast<float*>(scales[k]->data);
      batch.slots[count] = static_cast<uint32_t>(h.shape[1]);
      batch.length[count] = static_cast<uint32_t>(h.shape[0]);
      batch.reduced_offset[count] = static_cast<uint32_t>(offset);
      offset += h.shape[1];
    }
    delayed_scaling_update_kernel<<<count, kThreads, 0, ctx.stream()>>>(
        batch, reduced, algo == kNVTEAmaxMax, scaled_max);
    ctx.check_launch("delayed_scaling_update_kernel launch");
  }
}
