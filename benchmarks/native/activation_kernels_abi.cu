/* Times the native activation kernels through their C ABI (nvte_activation, nvte_dactivation
 * and their amax passes), with no Python in the loop, as fractions of a device-to-device copy's
 * bandwidth measured in the same run: GELU (tanh approximation) and SwiGLU (gated SiLU), BF16
 * input, each result an MLP step asks for.
 *
 * Why a C++ program: a package build takes minutes on the GPU machines, while this program
 * builds from one source tree in a minute or two (build_activation_kernels_abi.sh), so an old and
 * a new build of the kernels run side by side in one GPU call (as norm_kernels_abi.cu does for
 * the norms).
 *
 * Per shape (rows x cols, cols the activation's output width; SwiGLU's input is twice as wide)
 * and activation, the median time of 7 batches of 20 calls of:
 *   fwd bf16     input -> output in BF16               bytes: 2 in + 2 out
 *   fwd fp8+T    input -> FP8 output and its transpose  bytes: 2 in + 1 + 1 out
 *   fwd amax     the amax-only pass                     bytes: 2 in
 *   bwd bf16     grad, input -> dinput in BF16          bytes: 2 grad + 2 in + 2 dinput
 *   bwd fp8+T+db grad, input -> FP8 dinput, transpose and dbias
 *                                                       bytes: 2 grad + 2 in + 1 + 1 dinput
 *   bwd amax     the backward's amax-only pass          bytes: 2 grad + 2 in
 * (in: per input element, out: per output element), and a checksum of the BF16 outputs, to
 * check that two builds agree.
 *
 * Usage: act_bench [label [ROWSxCOLS ...]] (default 8192x16384 and 8192x14336; ROWS * COLS at
 * most 2^28). */
#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

#include "abi_bench_common.h"
#include "transformer_engine/activation.h"
#include "transformer_engine/cast.h"

namespace {

constexpr size_t kMaxOutElems = size_t{1} << 28;

struct Timing {
  const char* name;
  float ms;
  double bytes_per_elem;  // per output element (cols), input and output counted
};

void run_shape(const char* label, size_t rows, size_t cols, bool gated, double copy_bytes_per_s) {
  const size_t in_cols = gated ? 2 * cols : cols;
  const size_t n_in = rows * in_cols, n_out = rows * cols;
  void *input, *grad, *out, *out8, *out8_t, *din, *din8, *din8_t, *dbias, *scale, *amax, *sinv;
  float* workspace;
  CHECK_CUDA(cudaMalloc(&input, n_in * 2));
  CHECK_CUDA(cudaMalloc(&grad, n_out * 2));
  CHECK_CUDA(cudaMalloc(&out, n_out * 2));
  CHECK_CUDA(cudaMalloc(&out8, n_out));
  CHECK_CUDA(cudaMalloc(&out8_t, n_out));
  CHECK_CUDA(cudaMalloc(&din, n_in * 2));
  CHECK_CUDA(cudaMalloc(&din8, n_in));
  CHECK_CUDA(cudaMalloc(&din8_t, n_in));
  CHECK_CUDA(cudaMalloc(&dbias, in_cols * 2));
  CHECK_CUDA(cudaMalloc(&scale, 4));
  CHECK_CUDA(cudaMalloc(&amax, 4));
  CHECK_CUDA(cudaMalloc(&sinv, 4));
  const size_t ws_elems = nvte_quantize_dbias_workspace_elements(rows, in_cols);
  CHECK_CUDA(cudaMalloc(&workspace, ws_elems * 4));
  fill_uniform(input, n_in, 0.0f, 6.0f, 1);  // FC1 outputs: both signs, |u| up to 3
  fill_uniform(grad, n_out, 0.0f, 2.0f, 2);
  const float one = 1.0f;
  CHECK_CUDA(cudaMemcpy(scale, &one, 4, cudaMemcpyHostToDevice));

  NVTEActivation act{};
  act.kind = gated ? kNVTEActSilu : kNVTEActGelu;
  act.gated = gated ? 1 : 0;
  NVTEBuffer b_in = buffer(input, kNVTEBFloat16, rows, in_cols);
  NVTEBuffer b_grad = buffer(grad, kNVTEBFloat16, rows, cols);
  NVTEBuffer b_out = buffer(out, kNVTEBFloat16, rows, cols);
  NVTEBuffer b_out8 = buffer(out8, kNVTEFloat8E4M3, rows, cols);
  NVTEBuffer b_out8_t = buffer(out8_t, kNVTEFloat8E4M3, cols, rows);
  NVTEBuffer b_din = buffer(din, kNVTEBFloat16, rows, in_cols);
  NVTEBuffer b_din8 = buffer(din8, kNVTEFloat8E4M3, rows, in_cols);
  NVTEBuffer b_din8_t = buffer(din8_t, kNVTEFloat8E4M3, in_cols, rows);
  NVTEBuffer b_dbias = buffer(dbias, kNVTEBFloat16, in_cols);
  NVTEBuffer b_ws = buffer(workspace, kNVTEFloat32, ws_elems);
  NVTEBuffer b_scale = scalar(scale), b_amax = scalar(amax), b_sinv = scalar(sinv);
  const double in_per_out = static_cast<double>(in_cols) / cols;

  std::vector<Timing> timings;
  timings.push_back({"fwd bf16",
                     median_ms(
                         [&] {
                           nvte_activation(&b_in, act, &b_out, nullptr, nullptr, nullptr, nullptr,
                                           0, nullptr);
                         },
                         20),
                     2 * in_per_out + 2});
  timings.push_back({"fwd fp8+T",
                     median_ms(
                         [&] {
                           nvte_activation(&b_in, act, &b_out8, &b_scale, &b_out8_t, &b_amax,
                                           &b_sinv, 0, nullptr);
                         },
                         20),
                     2 * in_per_out + 2});
  timings.push_back({"fwd amax",
                     median_ms([&] { nvte_activation_amax(&b_in, act, &b_amax, 0, nullptr); }, 20),
                     2 * in_per_out});
  timings.push_back({"bwd bf16",
                     median_ms(
                         [&] {
                           nvte_dactivation(&b_grad, &b_in, act, &b_din, nullptr, nullptr, nullptr,
                                            nullptr, nullptr, nullptr, 0, nullptr);
                         },
                         20),
                     2 + 4 * in_per_out});
  timings.push_back({"bwd fp8+T+db",
                     median_ms(
                         [&] {
                           nvte_dactivation(&b_grad, &b_in, act, &b_din8, &b_scale, &b_din8_t,
                                            &b_amax, &b_sinv, &b_dbias, &b_ws, 0, nullptr);
                         },
                         20),
                     2 + 4 * in_per_out});
  timings.push_back(
      {"bwd amax",
       median_ms([&] { nvte_dactivation_amax(&b_grad, &b_in, act, &b_amax, 0, nullptr); }, 20),
       2 + 2 * in_per_out});
  CHECK_CUDA(cudaDeviceSynchronize());
  const char* name = gated ? "swiglu" : "gelu  ";
  for (const Timing& t : timings) {
    const double bytes = t.bytes_per_elem * static_cast<double>(n_out);
    std::printf("[%s] %s %zux%zu %-12s %.4f ms %.3f of copy\n", label, name, rows, cols, t.name,
                t.ms, bytes / (t.ms * 1e-3) / copy_bytes_per_s);
  }
  std::printf("[%s] %s %zux%zu sum %.6e %.6e %.6e\n", label, name, rows, cols, checksum(out, n_out),
              checksum(din, n_in), checksum(dbias, in_cols));
  for (void* p : {input, grad, out, out8, out8_t, din, din8, din8_t, dbias, scale, amax, sinv}) {
    CHECK_CUDA(cudaFree(p));
  }
  CHECK_CUDA(cudaFree(workspace));
}

}  // namespace

int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "act";
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<std::pair<size_t, size_t>> shapes;
  for (int i = 2; i < argc; ++i) {
    size_t rows = 0, cols = 0;
    if (std::sscanf(argv[i], "%zux%zu", &rows, &cols) != 2 || rows == 0 || cols == 0 ||
        rows * cols > kMaxOutElems) {
      std::printf("bad shape %s: ROWSxCOLS, ROWS * COLS <= 2^28\n", argv[i]);
      return 2;
    }
    shapes.emplace_back(rows, cols);
  }
  if (shapes.empty()) shapes = {{8192, 16384}, {8192, 14336}};

  const double copy_bytes_per_s = copy_bytes_per_second(label);
  try {
    for (const auto& [rows, cols] : shapes) {
      run_shape(label, rows, cols, false, copy_bytes_per_s);
      run_shape(label, rows, cols, true, copy_bytes_per_s);
    }
  } catch (const std::exception& e) {  // the entry points refuse bad arguments by throwing
    std::printf("[%s] error: %s\n", label, e.what());
    return 1;
  }
  return 0;
}
