/* Error reporting: every failure becomes a C++ exception whose message starts with the name of
 * the nvte_* operation, so a Python user sees e.g.
 * "nvte_quantize: output is on device 0 but the call runs on device 1". */
#ifndef TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_
#define TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace transformer_engine {

/* Message formatting without iostreams: some toolchains link libstdc++ statically into shared
 * libraries, and there the stream/locale machinery can be left uninitialised (formatting a
 * number through std::ostringstream crashed on such a build). to_string/snprintf use libc. */
inline void append_to(std::string& out, const char* text) { out += text; }
inline void append_to(std::string& out, const std::string& text) { out += text; }
inline void append_to(std::string& out, double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.9g", value);
  out += buffer;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
void append_to(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append_to(out, args), ...);
  return out;
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
    throw_runtime(op, what, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status),
                  ")");
  }
}

}  // namespace transformer_engine

#endif  // TRANSFORMER_ENGINE_COMMON_UTIL_ERRORS_H_
