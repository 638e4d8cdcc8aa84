"""``make_graphed_callables(_order=..., _reuse_graph_input_output_buffers=True)``: the static
tensors the graphs of a pipeline schedule share instead of holding one each.

Every graph reads its inputs from static tensors and its backward reads the output gradients
from static buffers; a replay copies the caller's tensors into them. With a schedule of many
layers and microbatches that is two activation-sized tensors per graph pair, and a copy into each
at every replay. With the flag:

- the first static input of a layer is the first output of the layer before it in the same chunk
  and microbatch (where shape, dtype and device match): a schedule that passes that output on,
  as pipeline schedules do, copies nothing, and the graphs no longer hold that layer's sample
  argument. Passing another tensor copies it into that buffer, which overwrites the output the
  earlier layer returned (warned once);
- that earlier layer's static output gradient is the later layer's input gradient, so the
  gradient passed back between them is not copied either;
- a chunk's first static input is, for a microbatch whose forward comes after the backward of an
  earlier microbatch of that chunk, that microbatch's buffer: nothing reads it between that
  backward and the next forward's copy into it;
- every other static output gradient is one of a set of buffers all backward graphs share (one
  per shape, dtype and layout, and per position among a graph's outputs of that kind): a backward
  graph reads its output gradients only while it replays, and replays run one after another. An
  input gradient that would be such a buffer itself (a layer passing its gradient through) is
  copied inside the graph, so the next backward does not overwrite what this one handed out.

Layers with deferred weight gradients (``delay_wgrad_compute``) keep their own output-gradient
buffers, and their chunks their own first inputs: ``backward_dw()`` reads them after the
backward, when another graph may have written a shared one.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["SharedBuffers", "warn_shared_input_overwritten"]

_warned = False


def warn_shared_input_overwritten(name: str) -> None:
    """Once a process: a replay gave a shared static input a tensor other than the one it is."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"{name}: with _reuse_graph_input_output_buffers=True this graph's input is the "
            "previous layer's output buffer; it was called with another tensor, which is copied "
            "into that buffer and so overwrites the output the previous layer returned. Pass the "
            "previous layer's output itself, or capture without the flag",
            RuntimeWarning,
            stacklevel=5,
        )


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _read_first_input_from(graphs, buffer: torch.Tensor) -> None:
    """The graphs' first static input becomes a leaf alias of ``buffer`` (its memory, the
    sample argument's ``requires_grad``)."""
    first = graphs.static_inputs[0]
    shared = buffer.detach().requires_grad_(first.requires_grad)
    graphs.static_inputs = (shared,) + graphs.static_inputs[1:]


class SharedBuffers:
    """Decides, capture by capture, what a graph reads from another graph's tensors;
    ``captured`` is the capture's ``{entry: CapturedGraphs}``."""

    def __init__(self, schedule, captured: dict) -> None:
        self.previous = schedule.previous_layer
        self.next = {before: after for after, before in self.previous.items()}
        self.chunk_of = schedule.chunk_of
        self.captured = captured
        deferring = {self.chunk_of[i] for i, v in captured.items() if v.owner.deferred_wgrads}
        self.chunk_may_share = [c not in deferring for c in range(max(self.chunk_of) + 1)]
        self.free_inputs: dict = {}  # chunk -> first static inputs no graph reads any more
        self.grad_buffers: dict = {}

    def share_input(self, index: int) -> None:
        """Before capturing the forward of entry ``index``."""
        graphs = self.captured[index]
        if not graphs.static_inputs:
            return
        static = graphs.static_inputs[0]
        before = self.previous.get(index)
        if before is None:
            buffer = self._free_first_input(self.chunk_of[index], static)
            if buffer is not None:
                _read_first_input_from(graphs, buffer)
            return
        earlier = self.captured[before]
        if not getattr(earlier, "outputs", None):  # captured before this one, in the plan
            return
        out = earlier.outputs[0]
        if _layout(out) != _layout(static):
            return
        if any(out.data_ptr() == t.data_ptr() for t in earlier.surface()):
            return  # the output is the earlier layer's input or a parameter: leave it alone
        _read_first_input_from(graphs, out)
        graphs.shared_input = True

    def _free_first_input(self, chunk: int, static: torch.Tensor) -> torch.Tensor | None:
        """A chunk's first layer: the buffer of an earlier microbatch whose backward is done,
        or None."""
        free = self.free_inputs.get(chunk, [])
        for k, buffer in enumerate(free):
            if _layout(buffer) == _layout(static):
                return free.pop(k)
        return None

    def backward_captured(self, index: int) -> None:
        """After capturing a backward: for a chunk's first layer, that microbatch's first static
        input is free for a later forward of the chunk, unless an output of the layer is that
        buffer (a pass-through, whose output the caller may hold)."""
        chunk, graphs = self.chunk_of[index], self.captured[index]
        if index in self.previous or not self.chunk_may_share[chunk] or not graphs.static_inputs:
            return
        buffer = graphs.static_inputs[0]
        if any(o.data_ptr() == buffer.data_ptr() for o in graphs.outputs):
            return
        self.free_inputs.setdefault(chunk, []).append(buffer)

    def grad_outputs(self, index: int) -> tuple | None:
        """Before capturing the backward of entry ``index``: its static output gradients
        (None: buffers of its own, for a layer with deferred weight gradients)."""
        graphs, after = self.captured[index], self.next.get(index)
        if graphs.owner.deferred_wgrads:
            return None
        later = None if after is None else self.captured[after]
        taken: dict = {}
        grads = []
        for k, (out, rg) in enumerate(zip(graphs.outputs, graphs.output_requires_grad)):
            if not rg:
                grads.append(None)
                continue
            if k == 0 and later is not None and later.shared_input:
                given = later.grad_inputs[0] if later.grad_inputs is not None else None
                if (
                    later.static_inputs[0].data_ptr() == out.data_ptr()
                    and given is not None
                    and _layout(given) == _layout(out)
                ):
                    grads.append(given)
                    continue
            key = _layout(out)
            n = taken[key] = taken.get(key, -1) + 1
            buffer = self.grad_buffers.get((key, n))
            if buffer is None:
                buffer = self.grad_buffers[key, n] = torch.empty_like(out)
            grads.append(buffer)
        return tuple(grads)
