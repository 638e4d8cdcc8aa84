/* What the C-ABI kernel benchmarks (norm_kernels_abi.cu, activation_kernels_abi.cu) share: a
 * CUDA error check, NVTEBuffer descriptors, BF16 test data from a fixed LCG, a checksum and the
 * median timing of batches of calls. Included after the kernels' source file (the benchmarks
 * build one translation unit with the kernels they time). */
#ifndef BENCHMARKS_NATIVE_ABI_BENCH_COMMON_H_
#define BENCHMARKS_NATIVE_ABI_BENCH_COMMON_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "transformer_engine/transformer_engine.h"

#define CHECK_CUDA(expr)                                                                \
  do {                                                                                  \
    const cudaError_t status_ = (expr);                                                 \
    if (status_ != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(status_), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

inline NVTEBuffer buffer(void* data, NVTEDType dtype, size_t d0, size_t d1 = 0) {
  NVTEBuffer b{};
  b.data = data;
  b.dtype = dtype;
  b.ndim = d1 != 0 ? 2 : 1;
  b.shape[0] = d0;
  b.shape[1] = d1;
  return b;
}

/* A 0-d Float32 buffer (a scale, an amax). */
inline NVTEBuffer scalar(void* data) {
  NVTEBuffer b = buffer(data, kNVTEFloat32, 1);
  b.ndim = 0;
  return b;
}

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/* Uniform values in [center - width / 2, center + width / 2), as BF16, from a fixed LCG. */
inline void fill_uniform(void* dst, size_t n, float center, float width, uint32_t seed) {
  std::vector<uint16_t> host(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    host[i] = to_bf16(center + ((seed >> 8) * (1.0f / 16777216.0f) - 0.5f) * width);
  }
  CHECK_CUDA(cudaMemcpy(dst, host.data(), n * 2, cudaMemcpyHostToDevice));
}

/* Sum of |v| over every 7th BF16 element of a device buffer. */
inline double checksum(const void* src, size_t n) {
  std::vector<uint16_t> host(n);
  CHECK_CUDA(cudaMemcpy(host.data(), src, n * 2, cudaMemcpyDeviceToHost));
  double sum = 0.0;
  for (size_t i = 0; i < n; i += 7) sum += std::fabs(from_bf16(host[i]));
  return sum;
}

/* Median milliseconds per call over 7 batches of `calls` calls, after 3 warm-up calls. */
template <typename F>
inline float median_ms(F&& f, int calls) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> times;
  for (int batch = 0; batch < 7; ++batch) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < calls; ++i) f();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / calls);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(times.begin(), times.end());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return times[times.size() / 2];
}

/* The benchmarks' yardstick: bytes per second (read plus written) of a 512 MiB device-to-device
 * copy, printed under `label`. */
inline double copy_bytes_per_second(const char* label) {
  void *src, *dst;
  const size_t bytes = size_t{512} << 20;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  const float ms =
      median_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 5);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  const double per_s = 2.0 * bytes / (ms * 1e-3);
  std::printf("[%s] copy %.3f ms, %.0f GB/s\n", label, ms, per_s / 1e9);
  return per_s;
}

#endif  // BENCHMARKS_NATIVE_ABI_BENCH_COMMON_H_
