/* The block-scaled casts of transformer_engine._native (block_cast.h): Float8BlockScaling's and
 * MXFP8's. Same conventions as native_module.cpp: tensors cross as (data_ptr, shape, dtype
 * code) tuples, the device as an int, the stream as the integer value of a cudaStream_t; the
 * GIL is released while native code runs. */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "transformer_engine/block_cast.h"
#include "transformer_engine/transformer_engine.h"

namespace py = pybind11;

namespace {

using TensorArg = std::tuple<std::uintptr_t, std::vector<size_t>, int>;
using OptionalTensorArg = std::optional<TensorArg>;

NVTEBuffer to_buffer(const TensorArg& arg) {
  const auto& [pointer, shape, dtype] = arg;
  if (shape.size() > NVTE_MAX_DIMS) {
    throw std::invalid_argument("tensor has " + std::to_string(shape.size()) +
                                " dimensions; the native library takes at most " +
                                std::to_string(NVTE_MAX_DIMS));
  }
  if (dtype < 0 || dtype >= kNVTENumTypes) {
    throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
  }
  NVTEBuffer buffer{};
  buffer.data = reinterpret_cast<void*>(pointer);
  buffer.dtype = static_cast<NVTEDType>(dtype);
  buffer.ndim = shape.size();
  for (size_t d = 0; d < shape.size(); ++d) buffer.shape[d] = shape[d];
  return buffer;
}

/* An optional buffer, handed out as a pointer (or null). */
struct OptionalBuffer {
  explicit OptionalBuffer(const OptionalTensorArg& arg) {
    if (arg) {
      buffer = to_buffer(*arg);
      present = true;
    }
  }
  NVTEBuffer* get() { return present ? &buffer : nullptr; }
  NVTEBuffer buffer{};
  bool present = false;
};

NVTEStream to_stream(std::uintptr_t stream) { return reinterpret_cast<NVTEStream>(stream); }

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
