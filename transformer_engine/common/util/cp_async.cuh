/* cp.async (sm_80+): 16-byte copies from global to shared memory that do not pass through
 * registers, so a kernel can keep its next loads in flight while it works on what it holds. */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_CP_ASYNC_CUH_
#define TRANSFORMER_ENGINE_COMMON_UTIL_CP_ASYNC_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace transformer_engine {

/* Copies 16 bytes global -> shared without passing through registers; `src_bytes` 0 writes 16
 * zero bytes and reads nothing (`src` must still be a valid address, so callers pass the input's
 * base pointer for chunks outside the matrix). .cg: the input is read once, keep it out of L1. */
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most `kPending` of this thread's committed groups are still in flight. */
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_CP_ASYNC_CUH_
