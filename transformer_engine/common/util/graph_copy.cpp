/* graph_copy.h: copies recorded in a CUDA graph as memcpy nodes, retargeted before each replay.
 *
 * The handles are the driver's (cudaGraph_t is CUgraph): a graph captured through torch's CUDA
 * runtime and this library's statically linked one are the same object, as streams are. */
#include "transformer_engine/graph_copy.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "util/device.h"
#include "util/errors.h"

namespace {

using transformer_engine::CallContext;
using transformer_engine::check_cuda;
using transformer_engine::DeviceGuard;
using transformer_engine::throw_invalid;
using transformer_engine::throw_runtime;

/* The 1-D copy a memcpy node describes (a captured cudaMemcpyAsync is one row of bytes). */
bool is_copy(const cudaMemcpy3DParms& p, const void* dst, const void* src, size_t bytes) {
  return p.dstPtr.ptr == dst && p.srcPtr.ptr == src && p.extent.width == bytes &&
         p.extent.height == 1 && p.extent.depth == 1 && p.srcArray == nullptr &&
         p.dstArray == nullptr;
}

}  // namespace

extern "C" void nvte_graph_copy(void* dst, const void* src, size_t bytes, int device,
                                NVTEStream stream) {
  constexpr const char* op = "nvte_graph_copy";
  if (dst == nullptr || src == nullptr || bytes == 0) {
    throw_invalid(op, "dst and src must be non-null and bytes > 0 (got bytes=", bytes, ")");
  }
  const CallContext ctx(op, device, stream);
  if (dst == src && !ctx.capturing()) {
    throw_invalid(op, "dst == src is a capture-time placeholder; the stream is not capturing");
  }
  check_cuda(op, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx.stream()),
             "cudaMemcpyAsync");
}

extern "C" void* nvte_graph_find_copy(void* graph, const void* dst, const void* src, size_t bytes,
                                      int device) {
  constexpr const char* op = "nvte_graph_find_copy";
  if (graph == nullptr) throw_invalid(op, "graph is null (capture with keep_graph=True)");
  const DeviceGuard guard(op, device);
  auto* g = static_cast<cudaGraph_t>(graph);
  size_t count = 0;
  check_cuda(op, cudaGraphGetNodes(g, nullptr, &count), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) check_cuda(op, cudaGraphGetNodes(g, nodes.data(), &count), "cudaGraphGetNodes");
  cudaGraphNode_t found = nullptr;
  int matches = 0;
  for (size_t i = 0; i < count; ++i) {
    cudaGraphNodeType type;
    check_cuda(op, cudaGraphNodeGetType(nodes[i], &type), "cudaGraphNodeGetType");
    if (type != cudaGraphNodeTypeMemcpy) continue;
    cudaMemcpy3DParms params{};
    check_cuda(op, cudaGraphMemcpyNodeGetParams(nodes[i], &params), "cudaGraphMemcpyNodeGetParams");
    if (is_copy(params, dst, src, bytes)) {
      found = nodes[i];
      ++matches;
    }
  }
  if (matches != 1) {
    throw_runtime(op, "the graph holds ", matches, " memcpy nodes of ", bytes,
                  " bytes with these pointers; expected exactly one (record it with "
                  "nvte_graph_copy while capturing)");
  }
  return found;
}

extern "C" void nvte_graph_exec_retarget_copy(void* exec, void* node, void* dst, const void* src,
                                              size_t bytes, int device) {
  constexpr const char* op = "nvte_graph_exec_retarget_copy";
  if (exec == nullptr || node == nullptr) throw_invalid(op, "exec and node must be non-null");
  if (dst == nullptr || src == nullptr || dst == src || bytes == 0) {
    throw_invalid(op, "the copy needs distinct non-null dst and src and bytes > 0");
  }
  const DeviceGuard guard(op, device);
  check_cuda(op,
             cudaGraphExecMemcpyNodeSetParams1D(static_cast<cudaGraphExec_t>(exec),
                                                static_cast<cudaGraphNode_t>(node), dst, src, bytes,
                                                cudaMemcpyDeviceToDevice),
             "cudaGraphExecMemcpyNodeSetParams1D");
}

extern "C" void nvte_graph_exec_enable_copy(void* exec, void* node, int enabled, int device) {
  constexpr const char* op = "nvte_graph_exec_enable_copy";
  if (exec == nullptr || node == nullptr) throw_invalid(op, "exec and node must be non-null");
  const DeviceGuard guard(op, device);
  check_cuda(op,
             cudaGraphNodeSetEnabled(static_cast<cudaGraphExec_t>(exec),
                                     static_cast<cudaGraphNode_t>(node), enabled != 0 ? 1 : 0),
             "cudaGraphNodeSetEnabled");
}
