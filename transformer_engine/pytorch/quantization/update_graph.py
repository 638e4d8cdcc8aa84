"""One device's delayed-scaling update, captured once as a CUDA graph and replayed.

Every autocast exit, and every region's backward end, updates the registered scales: one fused
kernel a device (:func:`~..cpp_extensions.scaling.delayed_scaling_update_prevalidated`). Launched
as a native call, that kernel costs the call's argument conversion, its placement checks and the
launch; replayed from a graph, the same kernel costs one graph launch. On the H200 hosts
measured (one CPU each) that is about 3 us against 9-15 us a call, and a CUDA-graphed FP8 step
(two replays of its own) spent more host time on its two scale updates than on its replays.

A graph holds the pointers, history lengths and recipe values it was captured with, so the
registry keeps one only while its device group is unchanged (any register, replace, unregister
or freed pair drops it) and replays it only for the same FP8 dtype, margin and amax algorithm.
The registry captures after a group's first eager update, so groups rebuilt every step never pay
for a capture. Never replayed while the device's current stream is being captured (a user's
own graph of a whole step records the kernel itself, as before). ``NVTE_GRAPH_SCALE_UPDATES=0``
(read at import) keeps every update a native call.
"""

from __future__ import annotations

import os

import torch

from ..cpp_extensions.scaling import delayed_scaling_update_prevalidated

__all__ = ["GRAPH_SCALE_UPDATES", "UpdateGraph", "stream_is_capturing"]

GRAPH_SCALE_UPDATES = os.environ.get("NVTE_GRAPH_SCALE_UPDATES", "1") != "0"


def _on_device(device: torch.device, fn):
    """``fn()`` with ``device`` current (no device switch when it already is)."""
    if device.index == torch.cuda.current_device():
        return fn()
    with torch.cuda.device(device):
        return fn()


def stream_is_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a CUDA graph."""
    return _on_device(device, torch.cuda.is_current_stream_capturing)


class UpdateGraph:
    """The fused update of the pairs ``(histories[i], scales[i])`` on ``device`` as a graph.

    Capturing runs nothing (the caller still has to :meth:`replay` for the update it is making).
    The capture is on a side stream in thread-local mode, so other threads' CUDA calls are not
    refused meanwhile; the update allocates no memory, so the graph's pool stays empty.
    """

    __slots__ = ("device", "config", "_graph")

    def __init__(self, device: torch.device, histories, scales, fp8_dtype, margin, algo) -> None:
        self.device = device
        self.config = (fp8_dtype, margin, algo)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        # Ordered after the current stream's work, and before its next: `capture_begin` fills
        # the device's default generator's graph-safe seed and offset tensors (every graph
        # registers that generator) on the capturing stream, and graphs replayed on the current
        # stream read those tensors when their random kernels run. Unordered, a capture made
        # while a replay was still running gave that replay's later dropout masks offset 0.
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                delayed_scaling_update_prevalidated(
                    histories, scales, fp8_dtype, margin, algo, None
                )
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self._graph = graph

    def replay(self) -> None:
        """Launch the update on ``device``'s current stream."""
        _on_device(self.device, self._graph.replay)
