/* Error reporting: every failure becomes a C++ exception whose message starts with the name of
 * the nvte_* operation, so a Python user sees e.g.
 * "nvte_quantize: output is on device 0 but the call runs on device 1". */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_
#define TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_

#include <cuda_runtime_api.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace transformer_engine {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

/* Bad arguments: thrown before any CUDA call, so nothing has changed. */
template <typename... Args>
[[noreturn]] void throw_invalid(const char* op, const Args&... args) {
  throw std::invalid_argument(concat(op, ": ", args...));
}

/* CUDA failures and placement errors. */
template <typename... Args>
[[noreturn]] void throw_runtime(const char* op, const Args&... args) {
  throw std::runtime_error(concat(op, ": ", args...));
}

inline void check_cuda(const char* op, cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw_runtime(op, what, " failed: ", cudaGetErrorName(status), " (",
                  cudaGetErrorString(status), ")");
  }
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_
