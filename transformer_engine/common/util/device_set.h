/* DeviceSet: the devices for which a one-time, per-device step has been done, such as raising a
 * kernel's shared-memory limit (cudaFuncSetAttribute) or asking what its loaded code supports
 * (cudaFuncGetAttributes). Those settings and answers belong to a kernel on one device, so each
 * kernel keeps its own set, a function-local static, and the launch path asks it without a lock.
 * Devices 0-63 fit; a device past 63 is never in the set, so its callers simply repeat the step
 * every call (correct, only slower). */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_SET_H_
#define TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_SET_H_

#include <atomic>
#include <cstdint>

namespace transformer_engine {

class DeviceSet {
 public:
  bool contains(int device) const {
    const uint64_t bit = bit_of(device);
    return bit != 0 && (bits_.load(std::memory_order_acquire) & bit) != 0;
  }
  /* After the step is done: a racing thread may do it a second time, which every such step
   * allows (it sets or reads the same value). */
  void insert(int device) { bits_.fetch_or(bit_of(device), std::memory_order_acq_rel); }

 private:
  static uint64_t bit_of(int device) {
    return device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  }
  std::atomic<uint64_t> bits_{0};
};

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_DEVICE_SET_H_
