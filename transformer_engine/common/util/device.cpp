#include "util/device.h"

#include <atomic>
#include <mutex>
#include <vector>

#include "util/errors.h"

namespace transformer_engine {

namespace {

int checked_device_count(const char* op) {
  // The count is fixed for the life of the process (CUDA reads CUDA_VISIBLE_DEVICES once, at
  // initialisation), so it is asked once per process instead of once per call. A failure is not
  // cached: every call reports it.
  static std::atomic<int> cached{0};
  int count = cached.load(std::memory_order_relaxed);
  if (count > 0) return count;
  check_cuda(op, cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  cached.store(count, std::memory_order_relaxed);
  return count;
}

}  // namespace

DeviceGuard::DeviceGuard(const char* op, int device) {
  if (device < 0) {
    throw_invalid(op, "device=", device, " is not a CUDA device index; pass tensor.device.index");
  }
  const int count = checked_device_count(op);
  if (device >= count) {
    throw_invalid(op, "device=", device, " does not exist; this process sees ", count,
                  " CUDA device(s) (check CUDA_VISIBLE_DEVICES)");
  }
  check_cuda(op, cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    check_cuda(op, cudaSetDevice(device), "cudaSetDevice");
    switched_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (switched_) {
    // A destructor must not throw; restoring a device that was current a moment ago cannot
    // reasonably fail, and if it does the next CUDA call reports the sticky error.
    (void)cudaSetDevice(previous_);
  }
}

CallContext::CallContext(const char* op, int device, NVTEStream stream)
    : op_(op),
      device_(device),
      guard_(op, device),
      stream_(reinterpret_cast<cudaStream_t>(stream)) {
  // The legacy and per-thread default streams are the call's device's own (nothing to check).
  if (stream_ == nullptr || stream_ == cudaStreamLegacy || stream_ == cudaStreamPerThread) return;
  // A stream being captured into a CUDA graph refuses cudaStreamGetDevice, and the refused call
  // invalidates the capture. cudaStreamIsCapturing is the query capture allows: while the stream
  // captures, the double-checks that need runtime queries (this one and check_on_device) are
  // left out. The Python wrappers' placement checks still run, and the eager warm-up a capture
  // needs has passed these checks with the same buffers.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(op, cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing");
  capturing_ = capture != cudaStreamCaptureStatusNone;
  if (capturing_) return;
  int stream_device = -1;
  check_cuda(op, cudaStreamGetDevice(stream_, &stream_device), "cudaStreamGetDevice");
  if (stream_device != device) {
    throw_runtime(op, "the stream belongs to device ", stream_device,
                  " but the call runs on device ", device,
                  "; pass torch.cuda.current_stream(tensor.device)");
  }
}

void CallContext::check_on_device(const char* name, const NVTEBuffer& buffer) const {
  if (buffer.data == nullptr) return;  // empty tensors carry no pointer
  if (capturing_) return;              // no runtime queries during graph capture (see above)
  cudaPointerAttributes attributes{};
  check_cuda(op_, cudaPointerGetAttributes(&attributes, buffer.data), "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    throw_runtime(op_, name, " is not device memory (a host pointer?); the call runs on device ",
                  device_);
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device_) {
    throw_runtime(op_, name, " is on device ", attributes.device, " but the call runs on device ",
                  device_, "; move it to cuda:", device_);
  }
}

void CallContext::check_launch(const char* kernel) const {
  check_cuda(op_, cudaGetLastError(), kernel);
}

namespace {

/* A device attribute through `cache` (one entry per device, 0 until asked): GPUs of one process
 * may differ (docs/architecture.md, the device contract). cudaDeviceGetAttribute is allowed
 * during capture. */
int cached_attribute(const char* op, int device, cudaDeviceAttr attribute, const char* what,
                     std::vector<int>& cache) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= cache.size()) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    check_cuda(op, cudaDeviceGetAttribute(&cache[device], attribute, device), what);
  }
  return cache[device];
}

}  // namespace

int CallContext::sm_count() const {
  static std::vector<int> counts;
  return cached_attribute(op_, device_, cudaDevAttrMultiProcessorCount,
                          "cudaDeviceGetAttribute(MultiProcessorCount)", counts);
}

int CallContext::max_shared_memory_per_block() const {
  static std::vector<int> bytes;
  return cached_attribute(op_, device_, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                          "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)", bytes);
}

}  // namespace transformer_engine
