/* How tensors, optional tensors and streams cross the transformer_engine._native binding
 * (native_module.cpp, block_cast_binding.cpp): a tensor is a (data_ptr, shape, dtype code) tuple,
 * a stream the integer value of a cudaStream_t. No torch and no CUDA headers. */
#ifndef TRANSFORMER_ENGINE_COMMON_PYBIND_BUFFER_ARGS_H_
#define TRANSFORMER_ENGINE_COMMON_PYBIND_BUFFER_ARGS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "transformer_engine/transformer_engine.h"

namespace transformer_engine_binding {

using TensorArg = std::tuple<std::uintptr_t, std::vector<size_t>, int>;
using OptionalTensorArg = std::optional<TensorArg>;

/* The NVTEBuffer a tensor tuple describes; throws std::invalid_argument (ValueError) for too
 * many dimensions or an unknown dtype code. */
inline NVTEBuffer to_buffer(const TensorArg& arg) {
  const auto& [pointer, shape, dtype] = arg;
  if (shape.size() > NVTE_MAX_DIMS) {
    throw std::invalid_argument("tensor has " + std::to_string(shape.size()) +
                                " dimensions; the native library takes at most " +
                                std::to_string(NVTE_MAX_DIMS));
  }
  if (dtype < 0 || dtype >= kNVTENumTypes) {
    throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
  }
  NVTEBuffer buffer{};
  buffer.data = reinterpret_cast<void*>(pointer);
  buffer.dtype = static_cast<NVTEDType>(dtype);
  buffer.ndim = shape.size();
  for (size_t d = 0; d < shape.size(); ++d) buffer.shape[d] = shape[d];
  return buffer;
}

/* Holds an optional buffer and hands out a pointer to it (or null). */
struct OptionalBuffer {
  explicit OptionalBuffer(const OptionalTensorArg& arg) {
    if (arg) {
      buffer = to_buffer(*arg);
      present = true;
    }
  }
  NVTEBuffer* get() { return present ? &buffer : nullptr; }
  NVTEBuffer buffer{};
  bool present = false;
};

inline NVTEStream to_stream(std::uintptr_t stream) { return reinterpret_cast<NVTEStream>(stream); }

}  // namespace transformer_engine_binding

#endif  // TRANSFORMER_ENGINE_COMMON_PYBIND_BUFFER_ARGS_H_
