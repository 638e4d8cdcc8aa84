/* The block-scaled GEMM of transformer_engine._native (gemm.h). Same conventions as
 * native_module.cpp: tensors cross as (data_ptr, shape, dtype code) tuples (buffer_args.h), the
 * device as an int, the stream as the integer value of a cudaStream_t; the GIL is released
 * while native code runs. */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "buffer_args.h"
#include "transformer_engine/gemm.h"

namespace py = pybind11;

namespace {

using namespace transformer_engine_binding;

bool block_scaled_gemm(const TensorArg& x, const TensorArg& x_scale_inv, bool x_block_2d,
                       const TensorArg& y, const TensorArg& y_scale_inv, bool y_block_2d,
                       const OptionalTensorArg& bias, const TensorArg& out,
                       const OptionalTensorArg& workspace, int device, std::uintptr_t stream) {
  const NVTEBuffer xb = to_buffer(x), xs = to_buffer(x_scale_inv), yb = to_buffer(y),
                   ys = to_buffer(y_scale_inv);
  NVTEBuffer ob = to_buffer(out);
  OptionalBuffer bb(bias), wb(workspace);
  py::gil_scoped_release no_gil;
  return nvte_block_scaled_gemm(&xb, &xs, x_block_2d ? 1 : 0, &yb, &ys, y_block_2d ? 1 : 0,
                                bb.get(), &ob, wb.get(), device, to_stream(stream)) != 0;
}

}  // namespace

void register_gemm(py::module_& m) {
  m.def("block_scaled_gemm", &block_scaled_gemm, py::arg("x"), py::arg("x_scale_inv"),
        py::arg("x_block_2d"), py::arg("y"), py::arg("y_scale_inv"), py::arg("y_block_2d"),
        py::arg("bias"), py::arg("out"), py::arg("workspace"), py::arg("device"), py::arg("stream"),
        "Float8BlockScaling's GEMM on cuBLASLt (nvte_block_scaled_gemm): out = x @ y^T (+ bias). "
        "False when cuBLASLt has no kernel for the problem (nothing launched).");
  m.def("cublaslt_version", &nvte_cublaslt_version,
        "The loaded cuBLASLt's version for the block-scaled GEMM, 0 when unusable.");
}
