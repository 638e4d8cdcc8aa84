/* The device seam of the native library: the only place that asks or changes which device is
 * current. Entry points construct a CallContext, which validates the device index, makes it
 * current for the call, checks that the stream belongs to it, and restores the caller's device
 * when it goes out of scope (exceptions included). Every query it makes is one that CUDA-graph
 * capture allows (cudaGetDevice/cudaSetDevice, cudaStreamIsCapturing, cudaGetLastError,
 * cudaDeviceGetAttribute); the others are skipped while the stream captures. (Kernels that need
 * more than 48 KiB of dynamic shared memory also call cudaFuncSetAttribute, and programmatic
 * dependent launches cudaFuncGetAttributes, once per kernel and device, which capture allows:
 * neither is a stream operation.) */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_H_
#define TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_H_

#include <cuda_runtime_api.h>

#include "transformer_engine/transformer_engine.h"

namespace transformer_engine {

/* RAII: make `device` current, restore the previous device on destruction. */
class DeviceGuard {
 public:
  DeviceGuard(const char* op, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

/* What a kernel launch needs: the guard plus the checked stream of that device. */
class CallContext {
 public:
  CallContext(const char* op, int device, NVTEStream stream);

  const char* op() const { return op_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  /* Whether `stream` is being captured into a CUDA graph: then the stream-device and
   * buffer-placement double-checks are skipped, since capture refuses the queries they need. */
  bool capturing() const { return capturing_; }
  /* Throws unless `buffer` (when non-empty) points to memory on this call's device (not checked
   * while the stream is capturing). */
  void check_on_device(const char* name, const NVTEBuffer& buffer) const;
  /* Throws with the launch error, if the preceding launch failed. */
  void check_launch(const char* kernel) const;
  /* Number of multiprocessors of this call's device (cached per device). */
  int sm_count() const;
  /* Shared memory one block may take on this call's device, after cudaFuncSetAttribute
   * (cached per device): 227 KiB on Hopper, 99 KiB on Ada. */
  int max_shared_memory_per_block() const;

 private:
  const char* op_;
  int device_;
  DeviceGuard guard_;
  cudaStream_t stream_;
  bool capturing_ = false;
};

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_H_
