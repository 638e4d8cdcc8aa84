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
  OptionalBuffer b(beta), sc(scale), out_t(output_t), am(amax), si(scale_inv), mu(mean),
      rs(rsigma);
  py::gil_scoped_release no_gil;
  nvte_norm_forward(&in, &g, b.get(), epsilon, zero_centered_gamma ? 1 : 0, rms ? 1 : 0, &out,
                    sc.get(), out_t.get(), am.get(), si.get(), mu.get(), rs.get(), device,
                    to_stream(stream));
}

void norm_amax(const TensorArg& input, const TensorArg& gamma, const OptionalTensorArg& beta,
               float epsilon, bool zero_centered_gamma, bool rms, const TensorArg& amax,
               int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), g = to_buffer(gamma);
  NVTEBuffer am = to_buffer(amax);
  OptionalBuffer b(beta);
  py::gil_scoped_release no_gil;
  nvte_norm_amax(&in, &g, b.get(), epsilon, zero_centered_gamma ? 1 : 0, rms ? 1 : 0, &am, device,
                 to_stream(stream));
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
        py::arg("device"), py::arg("stream"),
        "The amax of the forward's rounded output alone (nvte_norm_amax).");
}
