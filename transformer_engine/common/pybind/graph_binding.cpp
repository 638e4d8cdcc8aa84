/* The graph-copy entry points of transformer_engine._native (graph_copy.h). Pointers and graph
 * handles cross as integers (torch's data_ptr(), raw_cuda_graph(), raw_cuda_graph_exec()), the
 * stream as the integer value of a cudaStream_t; the GIL is released while native code runs. */
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "transformer_engine/graph_copy.h"

namespace py = pybind11;

namespace {

void* ptr(std::uintptr_t value) { return reinterpret_cast<void*>(value); }

void graph_copy(std::uintptr_t dst, std::uintptr_t src, size_t bytes, int device,
                std::uintptr_t stream) {
  py::gil_scoped_release no_gil;
  nvte_graph_copy(ptr(dst), ptr(src), bytes, device, reinterpret_cast<NVTEStream>(stream));
}

std::uintptr_t graph_find_copy(std::uintptr_t graph, std::uintptr_t dst, std::uintptr_t src,
                               size_t bytes, int device) {
  py::gil_scoped_release no_gil;
  return reinterpret_cast<std::uintptr_t>(
      nvte_graph_find_copy(ptr(graph), ptr(dst), ptr(src), bytes, device));
}

void graph_exec_retarget_copy(std::uintptr_t exec, std::uintptr_t node, std::uintptr_t dst,
                              std::uintptr_t src, size_t bytes, int device) {
  nvte_graph_exec_retarget_copy(ptr(exec), ptr(node), ptr(dst), ptr(src), bytes, device);
}

void graph_exec_enable_copy(std::uintptr_t exec, std::uintptr_t node, bool enabled, int device) {
  nvte_graph_exec_enable_copy(ptr(exec), ptr(node), enabled ? 1 : 0, device);
}

}  // namespace

void register_graph_copy(py::module_& m) {
  m.def("graph_copy", &graph_copy, py::arg("dst"), py::arg("src"), py::arg("bytes"),
        py::arg("device"), py::arg("stream"));
  m.def("graph_find_copy", &graph_find_copy, py::arg("graph"), py::arg("dst"), py::arg("src"),
        py::arg("bytes"), py::arg("device"));
  // Per replay, host-only and short: called with the GIL held (releasing it costs more).
  m.def("graph_exec_retarget_copy", &graph_exec_retarget_copy, py::arg("exec"), py::arg("node"),
        py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("device"));
  m.def("graph_exec_enable_copy", &graph_exec_enable_copy, py::arg("exec"), py::arg("node"),
        py::arg("enabled"), py::arg("device"));
}
