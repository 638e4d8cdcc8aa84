/* The block-scaled casts of transformer_engine._native (block_cast.h): Float8BlockScaling's and
 * MXFP8's. Same conventions as native_module.cpp: tensors cross as (data_ptr, shape, dtype
 * code) tuples (buffer_args.h), the device as an int, the stream as the integer value of a
 * cudaStream_t; the GIL is released while native code runs. */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "buffer_args.h"
#include "transformer_engine/block_cast.h"
#include "transformer_engine/transformer_engine.h"

namespace py = pybind11;

namespace {

using namespace transformer_engine_binding;

void block_scaled_quantize(const TensorArg& input, const OptionalTensorArg& rowwise_data,
                           const OptionalTensorArg& rowwise_scale_inv,
                           const OptionalTensorArg& columnwise_data,
                           const OptionalTensorArg& columnwise_scale_inv, int block_scaling_dim,
                           float epsilon, bool force_pow_2_scales, const OptionalTensorArg& noop,
                           int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  OptionalBuffer rd(rowwise_data), rs(rowwise_scale_inv), cd(columnwise_data),
      cs(columnwise_scale_inv), nf(noop);
  py::gil_scoped_release no_gil;
  nvte_block_scaled_quantize(&in, rd.get(), rs.get(), cd.get(), cs.get(), block_scaling_dim,
                             epsilon, force_pow_2_scales ? 1 : 0, nf.get(), device,
                             to_stream(stream));
}

void mxfp8_quantize(const TensorArg& input, const OptionalTensorArg& rowwise_data,
                    const OptionalTensorArg& rowwise_scale_inv,
                    const OptionalTensorArg& columnwise_data,
                    const OptionalTensorArg& columnwise_scale_inv, bool two_d,
                    const OptionalTensorArg& noop, int device, std::uintptr_t stream) {
  const NVTEBuffer in = to_buffer(input);
  OptionalBuffer rd(rowwise_data), rs(rowwise_scale_inv), cd(columnwise_data),
      cs(columnwise_scale_inv), nf(noop);
  py::gil_scoped_release no_gil;
  nvte_mxfp8_quantize(&in, rd.get(), rs.get(), cd.get(), cs.get(), two_d ? 1 : 0, nf.get(),
                      device, to_stream(stream));
}

}  // namespace

void register_block_cast(py::module_& m) {
  m.def("block_scaled_quantize", &block_scaled_quantize, py::arg("input"),
        py::arg("rowwise_data"), py::arg("rowwise_scale_inv"), py::arg("columnwise_data"),
        py::arg("columnwise_scale_inv"), py::arg("block_scaling_dim"), py::arg("epsilon"),
        py::arg("force_pow_2_scales"), py::arg("noop"), py::arg("device"), py::arg("stream"),
        "Float8BlockScaling's cast (nvte_block_scaled_quantize).");
  m.def("mxfp8_quantize", &mxfp8_quantize, py::arg("input"), py::arg("rowwise_data"),
        py::arg("rowwise_scale_inv"), py::arg("columnwise_data"),
        py::arg("columnwise_scale_inv"), py::arg("two_d"), py::arg("noop"), py::arg("device"),
        py::arg("stream"), "MXFP8's cast (nvte_mxfp8_quantize).");
}
