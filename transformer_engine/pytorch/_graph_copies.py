"""Copies into and out of a CUDA graph's static tensors, made by the graph itself.

A graphed callable replays on fixed ("static") tensors: each replay copies its inputs into the
static inputs (forward), its output gradients into the static gradient buffers (backward), and
hands out copies of the static parameter gradients, so that the next replay does not overwrite
gradients autograd has given to the parameters. Issued one by one, every such copy is a CUDA
driver call of its own (a ``cudaMemcpyAsync``: 15-35 us of host time each on the H200 hosts of
docs/cuda_graphs.md), four a step for one ``te.Linear``, against two graph launches.

Here each copy is a memcpy node of the graph instead: while the graph is captured, one
placeholder copy per static tensor is recorded (the tensor onto itself, through
``nvte_graph_copy``); after capture the nodes are found and disabled, and before each replay each
one is pointed at that replay's tensor (``nvte_graph_exec_retarget_copy``, a host-side update of
the executable graph, no launch). A replay whose tensor is the static one itself, or whose
tensor is not contiguous (copied eagerly as before), disables the node.

Used when the native library is loaded and torch's ``CUDAGraph`` can keep its graph after
instantiation (``keep_graph=True``, which the node handles need); ``NVTE_GRAPH_COPY_NODES=0``
turns it off (the copies are then issued eagerly), read at each capture.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..common.native import native_module
from .device import native_launch_args

__all__ = ["GraphCopies", "new_graph", "copy_nodes_enabled"]

_warned = False  # the fallback's warning, once a process


def copy_nodes_enabled() -> bool:
    """Whether captures made now put their copies into the graphs (see the module doc)."""
    if os.environ.get("NVTE_GRAPH_COPY_NODES", "1") == "0" or native_module() is None:
        return False
    graph_type = torch.cuda.CUDAGraph
    return hasattr(graph_type, "raw_cuda_graph") and hasattr(graph_type, "raw_cuda_graph_exec")


def new_graph(keep: bool) -> torch.cuda.CUDAGraph:
    """A graph to capture into; ``keep``: it keeps its cudaGraph_t after instantiation."""
    return torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()


class _Slot:
    __slots__ = ("static", "ptr", "nbytes", "node", "enabled")

    def __init__(self, static: torch.Tensor) -> None:
        self.static, self.ptr = static, static.data_ptr()
        self.nbytes = static.numel() * static.element_size()
        self.node, self.enabled = 0, False


class GraphCopies:
    """The copy nodes of one graph: ``record`` them while capturing, ``finish`` after capture
    (instead of instantiating), then before each replay ``copy_in`` / ``copy_out`` / ``skip``."""

    def __init__(self, device: torch.device, active: bool) -> None:
        self.device, self.active = device, active
        self.slots: list[_Slot] = []
        self.exec = 0
        self.usable = active  # False once the driver refused an update (see _fall_back)

    def record(self, static: torch.Tensor) -> int | None:
        """Inside the capture: a placeholder copy of ``static`` onto itself; its slot, or None
        where the copy stays eager (no copy nodes, a non-contiguous or empty tensor, or one
        already recorded)."""
        if (
            not self.active
            or not static.is_contiguous()
            or static.numel() == 0
            or any(s.ptr == static.data_ptr() for s in self.slots)
        ):
            return None
        slot = _Slot(static)
        device, stream = native_launch_args(self.device)
        native_module().graph_copy(slot.ptr, slot.ptr, slot.nbytes, device, stream)
        self.slots.append(slot)
        return len(self.slots) - 1

    def finish(self, graph: torch.cuda.CUDAGraph) -> None:
        """After the capture: find the recorded nodes, instantiate, disable every node. If the
        driver refuses any of it, the copies are issued eagerly instead (the placeholders, a
        buffer copied onto itself, stay in the graph: harmless)."""
        if not self.active:
            return
        native, index = native_module(), self.device.index
        try:
            raw = graph.raw_cuda_graph()
            for slot in self.slots:
                slot.node = native.graph_find_copy(raw, slot.ptr, slot.ptr, slot.nbytes, index)
            graph.instantiate()
            self.exec = graph.raw_cuda_graph_exec()
            for slot in self.slots:
                native.graph_exec_enable_copy(self.exec, slot.node, False, index)
        except RuntimeError as err:
            self._fall_back(err)
            graph.instantiate()

    def _fall_back(self, err: Exception) -> None:
        """From now on every copy of this graph is issued eagerly; the nodes are disabled (an
        enabled node would copy the last replay's tensor again)."""
        global _warned
        self.usable = False
        if not _warned:
            _warned = True
            warnings.warn(
                f"make_graphed_callables: the copies into and out of the graphs' static tensors "
                f"run eagerly ({err}); set NVTE_GRAPH_COPY_NODES=0 to skip this attempt",
                RuntimeWarning,
                stacklevel=4,
            )
        for slot_index in range(len(self.slots)):
            self.skip(slot_index)  # a failure here leaves the graph unusable: let it raise

    def _point(self, slot: _Slot, dst: int, src: int) -> bool:
        """Point the slot's node at dst <- src; False where the copies have fallen back."""
        if not self.usable:
            return False
        native, index = native_module(), self.device.index
        try:
            native.graph_exec_retarget_copy(self.exec, slot.node, dst, src, slot.nbytes, index)
            if not slot.enabled:
                native.graph_exec_enable_copy(self.exec, slot.node, True, index)
                slot.enabled = True
        except RuntimeError as err:
            self._fall_back(err)
            return False
        return True

    def skip(self, slot_index: int) -> None:
        """The next replays leave the slot's static tensor as it is."""
        slot = self.slots[slot_index]
        if slot.enabled:
            native_module().graph_exec_enable_copy(self.exec, slot.node, False, self.device.index)
            slot.enabled = False

    def copy_in(self, slot_index: int, src: torch.Tensor) -> None:
        """The next replay copies ``src`` (the static tensor's shape and dtype) into the slot's
        static tensor first (or this copies it now, where the graph cannot)."""
        slot = self.slots[slot_index]
        ptr = src.data_ptr()
        if ptr == slot.ptr:
            self.skip(slot_index)
        elif not (src.is_contiguous() and self._point(slot, slot.ptr, ptr)):
            self.skip(slot_index)
            slot.static.copy_(src)

    def copy_out(self, slot_index: int) -> torch.Tensor | None:
        """A new tensor that the next replay fills with the slot's static tensor at its end;
        None where the copies have fallen back (the caller clones after the replay)."""
        slot = self.slots[slot_index]
        out = torch.empty_like(slot.static)
        return out if self._point(slot, out.data_ptr(), slot.ptr) else None
