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
 * FP8 E4M3 with the transposed copy and the amax, and for comparison the high-precision output
 * followed by nvte_quantize's cast+transpose), else the backward binary. Each prints, per
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
#include "transformer_engine/cast.h"
#else
#include "normalization/norm_backward.cu"
#endif

#include <cstdio>
#include <utility>
#include <vector>

#include "abi_bench_common.h"

namespace {

constexpr size_t kShapes[][2] = {{8192, 4096},  {16384, 4096}, {8192, 8192},  {16384, 2048},
                                 {32768, 1024}, {65536, 512},  {131072, 256}, {65536, 768},
                                 {16384, 3072}, {8192, 5120},  {4096, 12288}, {4096, 16384},
                                 {2048, 32768}};
constexpr size_t kMaxElems = 8192ull * 8192 * 2;
constexpr size_t kMaxH = 32768;
constexpr size_t kMaxRows = 131072;

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
  void *x, *dz, *y, *gamma, *beta, *dgamma, *dbeta;
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
  fill_uniform(x, kMaxElems, 1.0f, 6.0f, 1);
  fill_uniform(dz, kMaxElems, 0.0f, 2.0f, 2);
  fill_uniform(gamma, kMaxH, 1.0f, 1.0f, 3);
  fill_uniform(beta, kMaxH, 0.0f, 1.0f, 4);

  const double copy_bytes_per_s = copy_bytes_per_second(label);

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
      // The baseline the FP8 output replaces: the high-precision norm, then the cast.
      const float ms_unfused = median_ms(
          [&] {
            nvte_norm_forward(&bx, &bg, beta_arg, 1e-5f, 0, rms, &by, nullptr, nullptr, nullptr,
                              nullptr, mean_arg, &brsigma, 0, nullptr);
            nvte_quantize(&by, &bscale, &by8, &by8t, &bamax, &bscale_inv, nullptr, 0, nullptr);
          },
          20);
      float ms_second = 0.0f;  // the FP8+T path's second kernel alone (trees that have one)
#if __has_include("normalization/norm_cast_transpose.h")
      ms_second = median_ms(
          [&] {
            nvte_norm_forward_from_stats(&bx, &bg, beta_arg, 0, rms, mean_arg, &brsigma, &by8,
                                         &bscale, &by8t, &bamax, &bscale_inv, 0, nullptr);
          },
          20);
#endif
      const double elems = static_cast<double>(rows) * H;
      std::printf(
          "[%s] %s fwd %zux%zu %.4f ms %.3f of copy | fp8+T %.4f ms %.3f (2nd kernel %.4f ms) | "
          "norm then cast+T %.4f ms | sum %.6e\n",
          label, name, rows, H, ms, 4.0 * elems / (ms * 1e-3) / copy_bytes_per_s, ms_fp8,
          4.0 * elems / (ms_fp8 * 1e-3) / copy_bytes_per_s, ms_second, ms_unfused,
          checksum(y, rows * H));
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
