/* Programmatic dependent launch (Hopper and newer): a kernel launched as a dependent of the
 * kernel before it in the stream may start its blocks once every block of that kernel has
 * called allow_dependent_launch() (or exited), and waits in wait_for_prerequisite_grid() until
 * that kernel has finished and its writes are visible. The dependent's launch latency then
 * overlaps the prerequisite's last blocks instead of following them.
 *
 * The wait is what keeps this correct, so a dependent launch is only made where the dependent
 * kernel's loaded code has it: `griddepcontrol` exists from PTX for sm_90, and a kernel compiled
 * for an older architecture (or JIT-compiled from older PTX) would start without waiting.
 * launch_as_dependent checks that once per kernel and device with cudaFuncGetAttributes (no
 * stream operation, so graph capture allows it) and otherwise launches the ordinary way. CUDA
 * graphs keep the dependency as a programmatic edge when a stream is captured. */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_DEPENDENT_LAUNCH_CUH_
#define TRANSFORMER_ENGINE_COMMON_UTIL_DEPENDENT_LAUNCH_CUH_

#include <cuda_runtime.h>

#include "util/device.h"
#include "util/device_set.h"
#include "util/errors.h"

namespace transformer_engine {

/* Lets the stream's next kernel, if launched as a dependent, start its blocks: once every block
 * of this grid has called it (or exited). No effect before sm_90 or without a dependent. */
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Waits until the grid this one was launched as a dependent of has completed and its memory
 * operations are visible; returns at once when launched the ordinary way. */
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Launches kernel<<<grid, block, 0, ctx.stream()>>>(args...) as a programmatic dependent of the
 * stream's previous kernel where the kernel's loaded code was compiled for sm_90 or newer (so it
 * has its wait_for_prerequisite_grid), the ordinary way elsewhere. `known` (the devices it was
 * asked for) and `capable` (those where it can) are the kernel's own. */
template <typename... Params, typename... Args>
void launch_as_dependent(const CallContext& ctx, void (*kernel)(Params...), dim3 grid, dim3 block,
                         DeviceSet& known, DeviceSet& capable, Args&&... args) {
  const int device = ctx.device();
  bool dependent;
  if (known.contains(device)) {
    dependent = capable.contains(device);
  } else {
    cudaFuncAttributes attributes{};
    check_cuda(ctx.op(), cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
    dependent = attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
    if (dependent) capable.insert(device);
    known.insert(device);
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = ctx.stream();
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  const cudaError_t status = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  if (status != cudaSuccess) {
    cudaGetLastError();  // reported here, not left for a later launch check
    check_cuda(ctx.op(), status, "cudaLaunchKernelEx");
  }
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_DEPENDENT_LAUNCH_CUH_
