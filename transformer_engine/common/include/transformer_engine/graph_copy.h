/*! \file graph_copy.h
 *  \brief Copies inside a CUDA graph whose pointers change from one replay to the next.
 *
 *  A graph reads and writes fixed ("static") buffers. A caller that replays it on other tensors
 *  copies them into the static inputs before each replay, and the results out of the static
 *  outputs after it: each such copy, issued on its own, is a driver call (a launch) of its own.
 *  These entry points put those copies inside the graph instead: while the graph is captured,
 *  `nvte_graph_copy` records one memcpy node per static buffer (a copy of the buffer onto
 *  itself, a placeholder to be disabled or retargeted before any replay); after capture
 *  `nvte_graph_find_copy` finds that node, and before a replay
 *  `nvte_graph_exec_retarget_copy` points the instantiated node at that replay's tensor (a
 *  host-side update of the executable graph, no launch), or `nvte_graph_exec_enable_copy`
 *  disables it. (The graph must be kept after instantiation: node handles belong to it.)
 *  Updates affect later launches only: launches already enqueued keep their pointers.
 *
 *  Graph, executable graph and node handles cross as `void*` (`cudaGraph_t`,
 *  `cudaGraphExec_t`, `cudaGraphNode_t`), as torch's `CUDAGraph.raw_cuda_graph()` and
 *  `raw_cuda_graph_exec()` return them.
 */
#ifndef TRANSFORMER_ENGINE_GRAPH_COPY_H_
#define TRANSFORMER_ENGINE_GRAPH_COPY_H_

#include "transformer_engine/transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief A stream-ordered device-to-device copy of `bytes` (> 0) from `src` to `dst` on
 *  `stream` of `device`: while the stream captures, a memcpy node of the graph. `src == dst` is
 *  allowed only while capturing (the placeholder above); outside capture it is refused.
 */
NVTE_API void nvte_graph_copy(void* dst, const void* src, size_t bytes, int device,
                              NVTEStream stream);

/*! \brief The one memcpy node of `graph` that copies `bytes` from `src` to `dst` (as recorded at
 *  capture). Throws if the graph holds no such node, or more than one.
 */
NVTE_API void* nvte_graph_find_copy(void* graph, const void* dst, const void* src, size_t bytes,
                                    int device);

/*! \brief Points `node` (found by nvte_graph_find_copy in the graph `exec` was instantiated
 *  from) at a copy of `bytes` (the captured size) from `src` to `dst` in later launches of
 *  `exec`. `src == dst` is refused.
 */
NVTE_API void nvte_graph_exec_retarget_copy(void* exec, void* node, void* dst, const void* src,
                                            size_t bytes, int device);

/*! \brief Enables (`enabled != 0`) or disables `node` in later launches of `exec`: a disabled
 *  copy does nothing (for a replay whose tensor is the static buffer itself, or that fills the
 *  buffer some other way).
 */
NVTE_API void nvte_graph_exec_enable_copy(void* exec, void* node, int enabled, int device);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_GRAPH_COPY_H_
