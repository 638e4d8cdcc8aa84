/* Times the native LayerNorm/RMSNorm kernels through their C ABI (nvte_norm_forward,
 * nvte_norm_backward), with no Python in the loop, as fractions of a device-to-device copy's
 * bandwidth measured in the same run. BF16 input and parameters (gamma, beta random near 1).
 *
 * Why a C++ program: at 8192 x 4096 one kernel takes about as long as a Python call's host work,
 * and a package build takes minutes on the GPU machines, while this program builds from one
 * source tree in under a minute (build_norm_kernels_abi.sh). Build it from two trees (say the
 * last commit's and the working tree's) and run both binaries in one GPU call to compare kernel
 * changes side by side.
 *
 * Built twice from this file: with NORM_ABI_FORWARD the forward binary (high-precision output,
 * and FP8 E4M3 with the transposed copy and the amax), else the backward binary. Each prints, per
 * shape and per norm, the median time of 7 batches of 20 calls and the fraction of the copy:
 * bytes moved / time, over the copy's bytes read and written / time. Bytes moved: forward x read
 * and y written (2 + 2 bytes an element; FP8: 2 + 1 + 1), backward x and dz read and dx written
 * (2 + 2 + 2). Also a checksum of the outputs, to check that two builds agree.
 *
 * Usage: norm_fwd [label [ROWSxH ...]] / norm_bwd [label [ROWSxH ...]]; the label prefixes every
 * line; shapes (ROWS * H <= 2^27, H <= 32768, ROWS <= 131072) replace the default
 * list. */
#ifdef NORM_ABI_FORWARD
#include "normalization/norm_forward.cu"
#else
#include "normalization/norm_backward.cu"
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

#define CHECK_CUDA(expr)                                                                \
  do {                                                                                  \
    const cudaError_t status_ = (expr);                                                 \
    if (status_ != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(status_), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr size_t kShapes[][2] = {{8192, 4096},  {16384, 4096}, {8192, 8192},  {16384, 2048},
                                 {32768, 1024}, {65536, 512},  {131072, 256}, {4096, 12288},
                                 {4096, 16384}, {2048, 32768}};
constexpr size_t kMaxElems = 8192ull * 8192 * 2;
constexpr size_t kMaxH = 32768;
constexpr size_t kMaxRows = 131072;

NVTEBuffer buffer(void* data, NVTEDType dtype, size_t d0, size_t d1 = 0) {
  NVTEBuffer b{};
  b.data = data;
  b.dtype = dtype;
  b.ndim = d1 != 0 ? 2 : 1;
  b.shape[0] = d0;
  b.shape[1] = d1;
  return b;
}

#ifdef NORM_ABI_FORWARD
NVTEBuffer scalar(void* data) {
  NVTEBuffer b = buffer(data, kNVTEFloat32, 1);
  b.ndim = 0;
  return b;
}
#endif

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/* Uniform values in [center - width / 2, center + width / 2), as BF16, from a fixed LCG. */
void fill_uniform(void* dst, size_t n, float center, float width, uint32_t seed) {
  std::vector<uint16_t> host(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    host[i] = to_bf16(center + ((seed >> 8) * (1.0f / 16777216.0f) - 0.5f) * width);
  }
  CHECK_CUDA(cudaMemcpy(dst, host.data(), n * 2, cudaMemcpyHostToDevice));
}

/* Sum of |v| over every 7th BF16 element of a device buffer. */
double checksum(const void* src, size_t n) {
  std::vector<uint16_t> host(n);
  CHECK_CUDA(cudaMemcpy(host.data(), src, n * 2, cudaMemcpyDeviceToHost));
  double sum = 0.0;
  for (size_t i = 0; i < n; i += 7) sum += std::fabs(from_bf16(host[i]));
  return sum;
}

/* Median milliseconds per call over 7 batches of `calls` calls, after 3 warm-up calls. */
template <typename F>
float median_ms(F&& f, int calls) {
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

}  // namespace

int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "norm";
  std::vector<std::pair<size_t, size_t>> shapes;
  for (int i = 2; i < argc; ++i) {
    size_t rows = 0, H = 0;
    if (std::sscanf(argv[i], "%zux%zu", &rows, &H) != 2 || rows == 0 || H == 0 || H > kMaxH ||
        rows > kMaxRows || rows * H > kMaxElems) {
      std::printf("bad shape %s: ROWSxH, H <= %zu, ROWS <= %zu, ROWS * H <= %zu\n", argv[i], kMaxH,
                  kMaxRows, kMaxElems);
      return 2;
    }
    shapes.emplace_back(rows, H);
  }
  if (shapes.empty()) {
    for (const auto& shape : kShapes) shapes.emplace_back(shape[0], shape[1]);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  void *x, *dz, *y, *gamma, *beta, *dgamma, *dbeta, *copy_src, *copy_dst;
  float *mean, *rsigma;
  CHECK_CUDA(cudaMalloc(&x, kMaxElems * 2));
  CHECK_CUDA(cudaMalloc(&dz, kMaxElems * 2));
  CHECK_CUDA(cudaMalloc(&y, kMaxElems * 2));
  CHECK_CUDA(cudaMalloc(&gamma, kMaxH * 2));
  CHECK_CUDA(cudaMalloc(&beta, kMaxH * 2));
  CHECK_CUDA(cudaMalloc(&dgamma, kMaxH * 2));
  CHECK_CUDA(cudaMalloc(&dbeta, kMaxH * 2));
  CHECK_CUDA(cudaMalloc(&mean, kMaxRows * 4));
  CHECK_CUDA(cudaMalloc(&rsigma, kMaxRows * 4));
  const size_t copy_bytes = 8192ull * 32768 * 2;
  CHECK_CUDA(cudaMalloc(&copy_src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&copy_dst, copy_bytes));
  fill_uniform(x, kMaxElems, 1.0f, 6.0f, 1);
  fill_uniform(dz, kMaxElems, 0.0f, 2.0f, 2);
  fill_uniform(gamma, kMaxH, 1.0f, 1.0f, 3);
  fill_uniform(beta, kMaxH, 0.0f, 1.0f, 4);

  const float copy_ms = median_ms(
      [&] {
        CHECK_CUDA(cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice));
      },
      5);
  const double copy_bytes_per_s = 2.0 * copy_bytes / (copy_ms * 1e-3);
  std::printf("[%s] copy %.3f ms, %.0f GB/s\n", label, copy_ms, copy_bytes_per_s / 1e9);

  for (const auto& [rows, H] : shapes) {
    for (int rms = 0; rms < 2; ++rms) {
      NVTEBuffer bx = buffer(x, kNVTEBFloat16, rows, H), by = buffer(y, kNVTEBFloat16, rows, H);
      NVTEBuffer bg = buffer(gamma, kNVTEBFloat16, H), bb = buffer(beta, kNVTEBFloat16, H);
      NVTEBuffer bmean = buffer(mean, kNVTEFloat32, rows);
      NVTEBuffer brsigma = buffer(rsigma, kNVTEFloat32, rows);
      const NVTEBuffer* beta_arg = rms ? nullptr : &bb;
      NVTEBuffer* mean_arg = rms ? nullptr : &bmean;
      // The statistics the backward reads (and a first forward call).
      nvte_norm_forward(&bx, &bg, beta_arg, 1e-5f, 0, rms, &by, nullptr, nullptr, nullptr, nullptr,
                        mean_arg, &brsigma, 0, nullptr);
      CHECK_CUDA(cudaDeviceSynchronize());
      const char* name = rms ? "rms" : "ln ";
#ifdef NORM_ABI_FORWARD
      void *y8, *y8t, *scale, *amax, *scale_inv;
      CHECK_CUDA(cudaMalloc(&y8, rows * H));
      CHECK_CUDA(cudaMalloc(&y8t, rows * H));
      CHECK_CUDA(cudaMalloc(&scale, 4));
      CHECK_CUDA(cudaMalloc(&amax, 4));
      CHECK_CUDA(cudaMalloc(&scale_inv, 4));
      const float one = 1.0f;
      CHECK_CUDA(cudaMemcpy(scale, &one, 4, cudaMemcpyHostToDevice));
      NVTEBuffer by8 = buffer(y8, kNVTEFloat8E4M3, rows, H);
      NVTEBuffer by8t = buffer(y8t, kNVTEFloat8E4M3, H, rows);
      NVTEBuffer bscale = scalar(scale), bamax = scalar(amax), bscale_inv = scalar(scale_inv);
      const float ms = median_ms(
          [&] {
            nvte_norm_forward(&bx, &bg, beta_arg, 1e-5f, 0, rms, &by, nullptr, nullptr, nullptr,
                              nullptr, mean_arg, &brsigma, 0, nullptr);
          },
          20);
      const float ms_fp8 = median_ms(
          [&] {
            nvte_norm_forward(&bx, &bg, beta_arg, 1e-5f, 0, rms, &by8, &bscale, &by8t, &bamax,
                              &bscale_inv, mean_arg, &brsigma, 0, nullptr);
          },
          20);
      const double elems = static_cast<double>(rows) * H;
      std::printf("[%s] %s fwd %zux%zu %.4f ms %.3f of copy | fp8+T %.4f ms %.3f | sum %.6e\n",
                  label, name, rows, H, ms, 4.0 * elems / (ms * 1e-3) / copy_bytes_per_s, ms_fp8,
                  4.0 * elems / (ms_fp8 * 1e-3) / copy_bytes_per_s, checksum(y, rows * H));
      CHECK_CUDA(cudaFree(y8));
      CHECK_CUDA(cudaFree(y8t));
      CHECK_CUDA(cudaFree(scale));
      CHECK_CUDA(cudaFree(amax));
      CHECK_CUDA(cudaFree(scale_inv));
#else
      const size_t ws_elems = nvte_norm_backward_workspace_elements(rows, H, 0);
      float* workspace;
      CHECK_CUDA(cudaMalloc(&workspace, ws_elems * 4));
      NVTEBuffer bdz = buffer(dz, kNVTEBFloat16, rows, H);
      NVTEBuffer bws = buffer(workspace, kNVTEFloat32, ws_elems);
      NVTEBuffer bdg = buffer(dgamma, kNVTEBFloat16, H), bdb = buffer(dbeta, kNVTEBFloat16, H);
      const float ms = median_ms(
          [&] {
            nvte_norm_backward(&bdz, &bx, mean_arg, &brsigma, &bg, 0, rms, &by, &bdg,
                               rms ? nullptr : &bdb, &bws, 0, nullptr);
          },
          20);
      const double elems = static_cast<double>(rows) * H;
      std::printf("[%s] %s bwd %zux%zu %.4f ms %.3f of copy | sum %.6e %.6e\n", label, name, rows,
                  H, ms, 6.0 * elems / (ms * 1e-3) / copy_bytes_per_s, checksum(y, rows * H),
                  checksum(dgamma, H));
      CHECK_CUDA(cudaFree(workspace));
#endif
    }
  }
  return 0;
}
