/* The LayerNorm/RMSNorm kernels of transformer_engine._native (normalization.h). Same
 * conventions as native_module.cpp: tensors cross as (data_ptr, shape, dtype code) tuples
 * (buffer_args.h), the device as an int, the stream as the integer value of a cudaStream_t; the
 * GIL is released while native code runs. */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>

#include "buffer_args.h"
#include "transformer_engine/normalization.h"
#include "transformer_engine/transformer_engine.h"

namespace py = pybind11;

namespace {

using namespace transformer_engine_binding;

void norm_forward(const TensorArg& input, const TensorArg& gamma, const OptionalTensorArg& beta,
                  float epsilon, bool zero_centered_gamma, bool rms, const TensorArg& output,
                  const OptionalTensorArg& scale, const OptionalTensorArg& output_t,
                  const OptionalTensorArg& amax, const OptionalTensorArg& scale_inv,
                  const OptionalTensorArg& mean, const OptionalTensorArg& rsigma, int device,
                  std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), g = to_buffer(gamma);
  NVTEBuffer out = to_buffer(output);
  OptionalBuffer b(beta), sc(scale), out_t(output_t), am(amax), si(scale_inv), mu(mean), rs(rsigma);
  py::gil_scoped_release no_gil;
  nvte_norm_forward(&in, &g, b.get(), epsilon, zero_centered_gamma ? 1 : 0, rms ? 1 : 0, &out,
                    sc.get(), out_t.get(), am.get(), si.get(), mu.get(), rs.get(), device,
                    to_stream(stream));
}

void norm_amax(const TensorArg& input, const TensorArg& gamma, const OptionalTensorArg& beta,
               float epsilon, bool zero_centered_gamma, bool rms, const TensorArg& amax,
               const OptionalTensorArg& mean, const OptionalTensorArg& rsigma, int device,
               std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), g = to_buffer(gamma);
  NVTEBuffer am = to_buffer(amax);
  OptionalBuffer b(beta), mu(mean), rs(rsigma);
  py::gil_scoped_release no_gil;
  nvte_norm_amax(&in, &g, b.get(), epsilon, zero_centered_gamma ? 1 : 0, rms ? 1 : 0, &am, mu.get(),
                 rs.get(), device, to_stream(stream));
}

void norm_forward_from_stats(const TensorArg& input, const TensorArg& gamma,
                             const OptionalTensorArg& beta, bool zero_centered_gamma, bool rms,
                             const OptionalTensorArg& mean, const TensorArg& rsigma,
                             const TensorArg& output, const TensorArg& scale,
                             const TensorArg& output_t, const OptionalTensorArg& amax,
                             const OptionalTensorArg& scale_inv, int device,
                             std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), g = to_buffer(gamma), rs = to_buffer(rsigma),
                   sc = to_buffer(scale);
  NVTEBuffer out = to_buffer(output), out_t = to_buffer(output_t);
  OptionalBuffer b(beta), mu(mean), am(amax), si(scale_inv);
  py::gil_scoped_release no_gil;
  nvte_norm_forward_from_stats(&in, &g, b.get(), zero_centered_gamma ? 1 : 0, rms ? 1 : 0, mu.get(),
                               &rs, &out, &sc, &out_t, am.get(), si.get(), device,
                               to_stream(stream));
}

void norm_backward(const TensorArg& dz, const TensorArg& input, const OptionalTensorArg& mean,
                   const TensorArg& rsigma, const TensorArg& gamma, bool zero_centered_gamma,
                   bool rms, const TensorArg& dx, const TensorArg& dgamma,
                   const OptionalTensorArg& dbeta, const TensorArg& workspace, int device,
                   std::uintptr_t stream) {
  const NVTEBuffer g_out = to_buffer(dz), in = to_buffer(input), rs = to_buffer(rsigma),
                   g = to_buffer(gamma);
  NVTEBuffer d_in = to_buffer(dx), dg = to_buffer(dgamma), ws = to_buffer(workspace);
  OptionalBuffer mu(mean), db(dbeta);
  py::gil_scoped_release no_gil;
  nvte_norm_backward(&g_out, &in, mu.get(), &rs, &g, zero_centered_gamma ? 1 : 0, rms ? 1 : 0,
                     &d_in, &dg, db.get(), &ws, device, to_stream(stream));
}

size_t norm_backward_workspace_elements(size_t rows, size_t hidden, int device) {
  py::gil_scoped_release no_gil;
  return nvte_norm_backward_workspace_elements(rows, hidden, device);
}

}  // namespace

void register_norm(py::module_& m) {
  m.def("norm_forward", &norm_forward, py::arg("input"), py::arg("gamma"), py::arg("beta"),
        py::arg("epsilon"), py::arg("zero_centered_gamma"), py::arg("rms"), py::arg("output"),
        py::arg("scale"), py::arg("output_t"), py::arg("amax"), py::arg("scale_inv"),
        py::arg("mean"), py::arg("rsigma"), py::arg("device"), py::arg("stream"),
        "LayerNorm/RMSNorm forward (nvte_norm_forward).");
  m.def("norm_amax", &norm_amax, py::arg("input"), py::arg("gamma"), py::arg("beta"),
        py::arg("epsilon"), py::arg("zero_centered_gamma"), py::arg("rms"), py::arg("amax"),
        py::arg("mean"), py::arg("rsigma"), py::arg("device"), py::arg("stream"),
        "The amax of the forward's rounded output, and optionally its statistics "
        "(nvte_norm_amax).");
  m.def("norm_forward_from_stats", &norm_forward_from_stats, py::arg("input"), py::arg("gamma"),
        py::arg("beta"), py::arg("zero_centered_gamma"), py::arg("rms"), py::arg("mean"),
        py::arg("rsigma"), py::arg("output"), py::arg("scale"), py::arg("output_t"),
        py::arg("amax"), py::arg("scale_inv"), py::arg("device"), py::arg("stream"),
        "The FP8 forward output and its transposed copy from the statistics "
        "(nvte_norm_forward_from_stats).");
  m.def("norm_backward", &norm_backward, py::arg("dz"), py::arg("input"), py::arg("mean"),
        py::arg("rsigma"), py::arg("gamma"), py::arg("zero_centered_gamma"), py::arg("rms"),
        py::arg("dx"), py::arg("dgamma"), py::arg("dbeta"), py::arg("workspace"), py::arg("device"),
        py::arg("stream"), "LayerNorm/RMSNorm backward (nvte_norm_backward).");
  m.def("norm_backward_workspace_elements", &norm_backward_workspace_elements, py::arg("rows"),
        py::arg("hidden"), py::arg("device"),
        "Float32 elements of norm_backward's workspace (nvte_norm_backward_workspace_elements).");
}
