/* transformer_engine._native: a pybind11 binding over the C ABI.
 *
 * It includes no torch (and no CUDA) headers, so one build serves every torch version: tensors
 * cross as (data_ptr, shape, dtype code) tuples, the device as an int and the stream as the
 * integer value of a cudaStream_t. The GIL is released while native code runs. C++ exceptions
 * from the library become Python exceptions: std::invalid_argument -> ValueError,
 * std::runtime_error -> RuntimeError. */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_args.h"
#include "transformer_engine/activation.h"
#include "transformer_engine/cast.h"
#include "transformer_engine/recipe.h"
#include "transformer_engine/transformer_engine.h"

namespace py = pybind11;

namespace {

using namespace transformer_engine_binding;

void quantize(const TensorArg& input, const TensorArg& scale, const TensorArg& output,
              const OptionalTensorArg& output_t, const OptionalTensorArg& amax,
              const OptionalTensorArg& scale_inv, const OptionalTensorArg& noop, int device,
              std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), sc = to_buffer(scale);
  NVTEBuffer out = to_buffer(output);
  OptionalBuffer out_t(output_t), am(amax), si(scale_inv), nf(noop);
  py::gil_scoped_release no_gil;
  nvte_quantize(&in, &sc, &out, out_t.get(), am.get(), si.get(), nf.get(), device,
                to_stream(stream));
}

void quantize_dbias(const TensorArg& input, const TensorArg& scale, const TensorArg& output,
                    const TensorArg& output_t, const OptionalTensorArg& amax,
                    const OptionalTensorArg& scale_inv, const TensorArg& dbias,
                    const TensorArg& workspace, int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), sc = to_buffer(scale);
  NVTEBuffer out = to_buffer(output), out_t = to_buffer(output_t), db = to_buffer(dbias),
             ws = to_buffer(workspace);
  OptionalBuffer am(amax), si(scale_inv);
  py::gil_scoped_release no_gil;
  nvte_quantize_dbias(&in, &sc, &out, &out_t, am.get(), si.get(), &db, &ws, device,
                      to_stream(stream));
}

void quantize_current_scaling(const TensorArg& input, const TensorArg& output,
                              const OptionalTensorArg& output_t, const TensorArg& amax,
                              const TensorArg& scale, const OptionalTensorArg& scale_inv,
                              float epsilon, bool force_pow_2_scales,
                              const OptionalTensorArg& dbias, const OptionalTensorArg& workspace,
                              int device, std::uintptr_t stream,
                              const OptionalTensorArg& amax_workspace) {
  const NVTEBuffer in = to_buffer(input);
  NVTEBuffer out = to_buffer(output), am = to_buffer(amax), sc = to_buffer(scale);
  OptionalBuffer out_t(output_t), si(scale_inv), db(dbias), ws(workspace), aw(amax_workspace);
  py::gil_scoped_release no_gil;
  nvte_quantize_current_scaling(&in, &out, out_t.get(), &am, &sc, si.get(), epsilon,
                                force_pow_2_scales ? 1 : 0, db.get(), ws.get(), aw.get(), device,
                                to_stream(stream));
}

void dequantize(const TensorArg& input, const TensorArg& scale_inv, const TensorArg& output,
                int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input), si = to_buffer(scale_inv);
  NVTEBuffer out = to_buffer(output);
  py::gil_scoped_release no_gil;
  nvte_dequantize(&in, &si, &out, device, to_stream(stream));
}

void compute_amax(const TensorArg& input, const TensorArg& amax, int device,
                  std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  NVTEBuffer am = to_buffer(amax);
  py::gil_scoped_release no_gil;
  nvte_compute_amax(&in, &am, device, to_stream(stream));
}

void compute_scale_from_amax(const TensorArg& amax, const TensorArg& scale, int fp8_dtype,
                             float epsilon, bool force_pow_2_scales, int device,
                             std::uintptr_t stream) {
  const NVTEBuffer am = to_buffer(amax);
  NVTEBuffer sc = to_buffer(scale);
  py::gil_scoped_release no_gil;
  nvte_compute_scale_from_amax(&am, &sc, static_cast<NVTEDType>(fp8_dtype), epsilon,
                               force_pow_2_scales ? 1 : 0, device, to_stream(stream));
}

void compute_current_scale(const TensorArg& input, const TensorArg& amax, const TensorArg& scale,
                           int fp8_dtype, float epsilon, bool force_pow_2_scales,
                           const TensorArg& amax_workspace, const OptionalTensorArg& noop,
                           int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  NVTEBuffer am = to_buffer(amax), sc = to_buffer(scale), aw = to_buffer(amax_workspace);
  OptionalBuffer nf(noop);
  py::gil_scoped_release no_gil;
  nvte_compute_current_scale(&in, &am, &sc, static_cast<NVTEDType>(fp8_dtype), epsilon,
                             force_pow_2_scales ? 1 : 0, &aw, nf.get(), device,
                             to_stream(stream));
}

void delayed_scaling_update(const OptionalTensorArg& amax_reduction_buffer,
                            const std::vector<TensorArg>& amax_histories,
                            const std::vector<TensorArg>& scales, bool algo_max, int fp8_dtype,
                            double margin, int device, std::uintptr_t stream) {
  if (amax_histories.size() != scales.size()) {
    throw std::invalid_argument("got " + std::to_string(amax_histories.size()) +
                                " amax histories but " + std::to_string(scales.size()) + " scales");
  }
  OptionalBuffer reduced(amax_reduction_buffer);
  std::vector<NVTEBuffer> histories, scale_buffers;
  for (const auto& h : amax_histories) histories.push_back(to_buffer(h));
  for (const auto& s : scales) scale_buffers.push_back(to_buffer(s));
  std::vector<NVTEBuffer*> history_ptrs, scale_ptrs;
  for (auto& h : histories) history_ptrs.push_back(&h);
  for (auto& s : scale_buffers) scale_ptrs.push_back(&s);
  py::gil_scoped_release no_gil;
  nvte_delayed_scaling_update(reduced.get(), history_ptrs.data(), scale_ptrs.data(),
                              history_ptrs.size(), algo_max ? kNVTEAmaxMax : kNVTEAmaxMostRecent,
                              static_cast<NVTEDType>(fp8_dtype), margin, device, to_stream(stream));
}

NVTEActivation to_activation(int kind, bool gated, float limit, float alpha,
                             float glu_linear_offset) {
  return NVTEActivation{kind, gated ? 1 : 0, limit, alpha, glu_linear_offset};
}

void activation(const TensorArg& input, int kind, bool gated, float limit, float alpha,
                float glu_linear_offset, const TensorArg& output, const OptionalTensorArg& scale,
                const OptionalTensorArg& output_t, const OptionalTensorArg& amax,
                const OptionalTensorArg& scale_inv, int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  NVTEBuffer out = to_buffer(output);
  OptionalBuffer sc(scale), out_t(output_t), am(amax), si(scale_inv);
  const NVTEActivation act = to_activation(kind, gated, limit, alpha, glu_linear_offset);
  py::gil_scoped_release no_gil;
  nvte_activation(&in, act, &out, sc.get(), out_t.get(), am.get(), si.get(), device,
                  to_stream(stream));
}

void dactivation(const TensorArg& grad, const TensorArg& input, int kind, bool gated, float limit,
                 float alpha, float glu_linear_offset, const TensorArg& dinput,
                 const OptionalTensorArg& scale, const OptionalTensorArg& output_t,
                 const OptionalTensorArg& amax, const OptionalTensorArg& scale_inv,
                 const OptionalTensorArg& dbias, const OptionalTensorArg& workspace, int device,
                 std::uintptr_t stream) {
  const NVTEBuffer g = to_buffer(grad), in = to_buffer(input);
  NVTEBuffer dx = to_buffer(dinput);
  OptionalBuffer sc(scale), out_t(output_t), am(amax), si(scale_inv), db(dbias), ws(workspace);
  const NVTEActivation act = to_activation(kind, gated, limit, alpha, glu_linear_offset);
  py::gil_scoped_release no_gil;
  nvte_dactivation(&g, &in, act, &dx, sc.get(), out_t.get(), am.get(), si.get(), db.get(), ws.get(),
                   device, to_stream(stream));
}

void activation_amax(const TensorArg& input, int kind, bool gated, float limit, float alpha,
                     float glu_linear_offset, const TensorArg& amax, int device,
                     std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  NVTEBuffer am = to_buffer(amax);
  const NVTEActivation act = to_activation(kind, gated, limit, alpha, glu_linear_offset);
  py::gil_scoped_release no_gil;
  nvte_activation_amax(&in, act, &am, device, to_stream(stream));
}

void dactivation_amax(const TensorArg& grad, const TensorArg& input, int kind, bool gated,
                      float limit, float alpha, float glu_linear_offset, const TensorArg& amax,
                      int device, std::uintptr_t stream) {
  const NVTEBuffer g = to_buffer(grad), in = to_buffer(input);
  NVTEBuffer am = to_buffer(amax);
  const NVTEActivation act = to_activation(kind, gated, limit, alpha, glu_linear_offset);
  py::gil_scoped_release no_gil;
  nvte_dactivation_amax(&g, &in, act, &am, device, to_stream(stream));
}

}  // namespace

void register_block_cast(py::module_& m);  // block_cast_binding.cpp
void register_norm(py::module_& m);        // norm_binding.cpp
void register_graph_copy(py::module_& m);  // graph_binding.cpp
void register_gemm(py::module_& m);        // gemm_binding.cpp

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native FP8 kernels of transformer_engine (C ABI binding; no torch headers).";
  m.def("version", &nvte_version, "Version of the native library.");
  m.def("cuda_runtime_version", &nvte_cuda_runtime_version,
        "CUDA runtime version the library was built against.");
  m.def("device_count", &nvte_device_count, "CUDA devices visible to the native library.");
  register_block_cast(m);
  register_norm(m);
  register_graph_copy(m);
  register_gemm(m);
  m.def("quantize", &quantize, py::arg("input"), py::arg("scale"), py::arg("output"),
        py::arg("output_t"), py::arg("amax"), py::arg("scale_inv"), py::arg("noop"),
        py::arg("device"), py::arg("stream"));
  m.def("quantize_dbias", &quantize_dbias, py::arg("input"), py::arg("scale"), py::arg("output"),
        py::arg("output_t"), py::arg("amax"), py::arg("scale_inv"), py::arg("dbias"),
        py::arg("workspace"), py::arg("device"), py::arg("stream"));
  m.def("quantize_dbias_workspace_elements", &nvte_quantize_dbias_workspace_elements,
        py::arg("rows"), py::arg("cols"));
  m.def("quantize_current_scaling", &quantize_current_scaling, py::arg("input"), py::arg("output"),
        py::arg("output_t"), py::arg("amax"), py::arg("scale"), py::arg("scale_inv"),
        py::arg("epsilon"), py::arg("force_pow_2_scales"), py::arg("dbias"), py::arg("workspace"),
        py::arg("device"), py::arg("stream"), py::arg("amax_workspace") = py::none());
  m.def("amax_workspace_elements", &nvte_amax_workspace_elements);
  m.def("dequantize", &dequantize, py::arg("input"), py::arg("scale_inv"), py::arg("output"),
        py::arg("device"), py::arg("stream"));
  m.def("compute_amax", &compute_amax, py::arg("input"), py::arg("amax"), py::arg("device"),
        py::arg("stream"));
  m.def("compute_scale_from_amax", &compute_scale_from_amax, py::arg("amax"), py::arg("scale"),
        py::arg("fp8_dtype"), py::arg("epsilon"), py::arg("force_pow_2_scales"), py::arg("device"),
        py::arg("stream"));
  m.def("compute_current_scale", &compute_current_scale, py::arg("input"), py::arg("amax"),
        py::arg("scale"), py::arg("fp8_dtype"), py::arg("epsilon"),
        py::arg("force_pow_2_scales"), py::arg("amax_workspace"), py::arg("noop"),
        py::arg("device"), py::arg("stream"));
  m.def("delayed_scaling_update", &delayed_scaling_update, py::arg("amax_reduction_buffer"),
        py::arg("amax_histories"), py::arg("scales"), py::arg("algo_max"), py::arg("fp8_dtype"),
        py::arg("margin"), py::arg("device"), py::arg("stream"));
  m.def("activation", &activation, py::arg("input"), py::arg("kind"), py::arg("gated"),
        py::arg("limit"), py::arg("alpha"), py::arg("glu_linear_offset"), py::arg("output"),
        py::arg("scale"), py::arg("output_t"), py::arg("amax"), py::arg("scale_inv"),
        py::arg("device"), py::arg("stream"));
  m.def("dactivation", &dactivation, py::arg("grad"), py::arg("input"), py::arg("kind"),
        py::arg("gated"), py::arg("limit"), py::arg("alpha"), py::arg("glu_linear_offset"),
        py::arg("dinput"), py::arg("scale"), py::arg("output_t"), py::arg("amax"),
        py::arg("scale_inv"), py::arg("dbias"), py::arg("workspace"), py::arg("device"),
        py::arg("stream"));
  m.def("activation_amax", &activation_amax, py::arg("input"), py::arg("kind"), py::arg("gated"),
        py::arg("limit"), py::arg("alpha"), py::arg("glu_linear_offset"), py::arg("amax"),
        py::arg("device"), py::arg("stream"));
  m.def("dactivation_amax", &dactivation_amax, py::arg("grad"), py::arg("input"), py::arg("kind"),
        py::arg("gated"), py::arg("limit"), py::arg("alpha"), py::arg("glu_linear_offset"),
        py::arg("amax"), py::arg("device"), py::arg("stream"));
}
