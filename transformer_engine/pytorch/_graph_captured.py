"""The captured graphs of a graphed callable (``te.make_graphed_callables``): its forward,
backward and deferred-wgrad CUDA graphs, the static tensors they read and write, and their
replay as one autograd node (:class:`GraphReplay`).

The copies into and out of the static tensors are nodes of the graphs themselves
(``_graph_copies.py``); the callable's own warm-up, argument checks and FP8 bookkeeping are in
``graph.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._graph_arguments import call_hooks
from ._graph_buffers import warn_shared_input_overwritten
from ._graph_copies import GraphCopies, copy_nodes_enabled, new_graph
from ._graph_streams import ReplayStream
from .quantization import FP8GlobalStateManager
from .quantization.graph_state import cast_cached_weights_in_graph, graph_capture_backward

__all__ = ["GraphReplay", "CapturedGraphs", "TENSOR"]

TENSOR = object()  # marks where a flattened argument or output holds a tensor


class CapturedGraphs:
    """One captured forward graph, its backward graph and its deferred-wgrad graph.

    ``is_first_microbatch``: what the capture passes the callable; ``False`` under weight
    caching, where the graph serves both values (``graph_state.cast_cached_weights_in_graph``):
    :meth:`set_first_microbatch` before each replay."""

    def __init__(self, owner, is_first_microbatch) -> None:
        self.owner, self.is_first_microbatch = owner, is_first_microbatch
        # the copies into and out of the static tensors, as nodes of the graphs (_graph_copies)
        keep = copy_nodes_enabled()
        self.fwd_copies = GraphCopies(owner.device, keep)
        self.bwd_copies = GraphCopies(owner.device, keep)
        self.fwd_graph, self.bwd_graph, self.dw_graph = new_graph(keep), None, None
        # the tensors the graphs read as the callable's inputs: the owner's (aliases of the
        # sample arguments) unless _graph_buffers gives the first one another layer's output
        self.static_inputs: tuple = owner.static_inputs
        self.shared_input = False
        # weight caching: the graph's own flag its weight casts read, and the weights whose
        # main_grad a first microbatch overwrites (zeroed before its replay; the graph adds)
        self.skip_flag: torch.Tensor | None = None
        self.next_skip: float | None = None  # the flag's value for the next forward replay
        self.overwritten: list = []
        self.grad_outputs = self.grad_inputs = None
        self.dw_grads: list = []
        # What the graphs read that nothing else may keep alive: the deferred-wgrad GEMMs'
        # operands and the FP8 weight workspaces cast in the graph (an eager call may replace a
        # module's entry; the pool must not hand that memory to a later capture).
        self.keep_alive: list = []

    def capture_forward(self, pool, stream) -> None:
        owner = self.owner
        caching = self.is_first_microbatch is False
        if caching:  # made here, outside the capture; one per graph (see set_first_microbatch)
            self.skip_flag = torch.zeros(1, dtype=torch.float32, device=owner.device)
        call_hooks(owner.hooks, "forward_pre_hooks", owner.module)
        in_graph = (
            cast_cached_weights_in_graph(self.skip_flag) if caching else contextlib.nullcontext()
        )
        with torch.cuda.graph(self.fwd_graph, pool=pool, stream=stream), in_graph:
            self.input_slots = [self.fwd_copies.record(t) for t in self.static_inputs]
            out = owner.run_forward(self.is_first_microbatch, self.static_inputs)
        if caching:
            self.overwritten = in_graph.overwritten
        self.fwd_copies.finish(self.fwd_graph)
        call_hooks(owner.hooks, "forward_hooks", owner.module)
        self.keep_alive += [dict(m._fp8_workspaces) for m in owner.te_modules]
        leaves, self.out_spec = tree_flatten(out)
        self.out_leaves = [TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        self.outputs = tuple(t for t in leaves if isinstance(t, torch.Tensor))
        self.output_requires_grad = tuple(t.requires_grad for t in self.outputs)

    def surface(self) -> tuple:
        return self.static_inputs + self.owner.params

    def capture_backward(self, pool, stream, grad_outputs: tuple | None = None) -> None:
        """``grad_outputs``: the static output gradients to read (buffers shared with other
        graphs, ``_graph_buffers``); buffers of this graph's own by default."""
        owner = self.owner
        surface = self.surface()
        wanted = [i for i, t in enumerate(surface) if t.requires_grad]
        if wanted and any(self.output_requires_grad):
            if grad_outputs is None:
                grad_outputs = tuple(
                    torch.empty_like(t) if rg else None
                    for t, rg in zip(self.outputs, self.output_requires_grad)
                )
            self.grad_outputs = grad_outputs
            copies, grads_in = self.bwd_copies, self.grad_outputs
            clone = owner.options.clone_param_grads
            self.bwd_graph = new_graph(copies.active)
            call_hooks(owner.hooks, "backward_pre_hooks", owner.module)
            with graph_capture_backward(), torch.cuda.graph(self.bwd_graph, pool, stream=stream):
                self.grad_slots = [None if g is None else copies.record(g) for g in grads_in]
                grad_inputs = owner.run_backward(self.outputs, grads_in, surface, wanted)
                if grad_outputs is not None:  # shared: other graphs overwrite them
                    grad_inputs = _unaliased(grad_inputs, grads_in)
                self.grad_inputs = grad_inputs
                # the parameter gradients handed out as copies, made by the graph itself
                self.out_slots = {}
                for i in range(len(owner.static_inputs), len(self.grad_inputs)):
                    g = self.grad_inputs[i]
                    slot = None if g is None or not clone else copies.record(g)
                    if slot is not None:
                        self.out_slots[i] = slot
            copies.finish(self.bwd_graph)
            call_hooks(owner.hooks, "backward_hooks", owner.module)
        else:  # an inference graph: the replay's outputs do not require grad
            self.output_requires_grad = (False,) * len(self.outputs)
        if not owner.options.retain_graph_in_backward:  # else its saved tensors stay alive
            self.outputs = tuple(t.detach() for t in self.outputs)
        deferred = [m for m in owner.te_modules if m.need_backward_dw() and m.wgrad_store]
        if deferred:
            self._capture_deferred_wgrads(deferred, pool, stream)

    def _capture_deferred_wgrads(self, modules, pool, stream) -> None:
        """``delay_wgrad_compute``: the weight-gradient GEMMs the backward capture queued become
        a third graph, replayed by ``backward_dw()``. A GEMM that assigns ``.grad`` does so with
        a tensor of the graph's pool; the replay adds that into ``.grad`` eagerly."""
        self.keep_alive += [list(m.wgrad_store) for m in modules]
        params = [p for m in modules for p in m.parameters(recurse=False)]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.dw_graph = torch.cuda.CUDAGraph()
        with graph_capture_backward(), torch.cuda.graph(self.dw_graph, pool, stream=stream):
            for m in modules:
                type(m).backward_dw(m)
        self.dw_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, saved):
            p.grad = grad

    def set_first_microbatch(self, first: bool, backward: bool) -> None:
        """Weight caching: the next replay casts the weights (``True``) or reuses them; with
        ``backward`` (its backward will run) a first microbatch's replay zeroes the
        ``main_grad`` its weight gradients would overwrite.

        The flag is this graph's own, written by the replay's ``prepare`` step on the stream the
        graph replays on: an earlier replay on a side stream may still be casting (a caller that
        waits for a ``cuda_graph_event`` goes on before the graph ends), and no other graph
        reads it."""
        self.next_skip = 0.0 if first else 1.0
        # upstream's process-wide flag, which its replays set: kept current for its readers
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first, self.owner.device)
        if first and backward:
            for weight in self.overwritten:
                main_grad = getattr(weight, "main_grad", None)
                if main_grad is not None:
                    main_grad.zero_()

    def replay_forward(self, inputs, where: ReplayStream | None) -> tuple:
        # inputs: the user's tensors, then the parameters (their own static tensors)
        if self.shared_input and inputs[0].data_ptr() != self.static_inputs[0].data_ptr():
            warn_shared_input_overwritten(self.owner.name)

        def copy_inputs() -> None:
            if self.next_skip is not None:
                self.skip_flag.fill_(self.next_skip)
                self.next_skip = None
            for static, x, slot in zip(self.static_inputs, inputs, self.input_slots):
                if slot is not None:
                    self.fwd_copies.copy_in(slot, x)
                elif static is not x and static.data_ptr() != x.data_ptr():
                    static.copy_(x)

        self._replay(self.fwd_graph, where, copy_inputs)
        return tuple(t.detach() for t in self.outputs)

    def _replay(self, graph: torch.cuda.CUDAGraph, where: ReplayStream | None, prepare) -> None:
        """``prepare()`` (the eager copies, the copy nodes' host-side updates, weight caching's
        flag), then the replay, both on the stream the graph replays on: on a side stream these
        writes come after the side stream's earlier replays, which may still read the static
        tensors after the event the calling stream waited for."""
        if where is None:
            prepare()
            graph.replay()
        else:
            where.replay(graph, self.owner.device, prepare)

    def replay_backward(self, grads, where: ReplayStream | None) -> tuple:
        copies = self.bwd_copies

        def copy_grads() -> None:
            for static, grad, slot in zip(self.grad_outputs, grads, self.grad_slots):
                if static is None:
                    continue
                if grad is None:
                    if slot is not None:
                        copies.skip(slot)
                    static.zero_()
                elif slot is not None:
                    copies.copy_in(slot, grad)
                elif static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)

        # Allocated on the calling stream, which uses and frees them (the graph fills them at
        # its end); None where the copies fell back: cloned below.
        copied = {i: copies.copy_out(slot) for i, slot in self.out_slots.items()}
        copied = {i: out for i, out in copied.items() if out is not None}
        self._replay(self.bwd_graph, where, copy_grads)
        n_user, clone = len(self.owner.static_inputs), self.owner.options.clone_param_grads
        return tuple(
            copied[i] if i in copied
            else None if g is None
            else g.clone() if clone and i >= n_user
            else g.detach()
            for i, g in enumerate(self.grad_inputs)
        )  # fmt: skip

    def replay_deferred_wgrads(self) -> None:
        if self.dw_graph is not None:
            self.dw_graph.replay()
            for p, static in self.dw_grads:
                p.grad = static.clone() if p.grad is None else p.grad + static

    def unflatten(self, outputs) -> Any:
        it = iter(outputs)
        leaves = [next(it) if leaf is TENSOR else leaf for leaf in self.out_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def reset(self) -> None:
        for graph in (self.fwd_graph, self.bwd_graph, self.dw_graph):
            if graph is not None:
                graph.reset()
        self.__dict__.clear()  # drops the static tensors; the owner drops these graphs


def _unaliased(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """The input gradients, each that is one of the (shared) output-gradient buffers itself
    (a layer passing its gradient through) replaced by a copy made in the graph: the next
    graph reading that buffer would overwrite the gradient this one handed out."""
    buffers = {g.data_ptr() for g in grad_outputs if g is not None}
    return tuple(g.clone() if g is not None and g.data_ptr() in buffers else g for g in grad_inputs)


class GraphReplay(torch.autograd.Function):
    """One replay as one autograd node: forward graph in forward, backward graph in backward."""

    @staticmethod
    def forward(ctx, graphs: CapturedGraphs, update, where: ReplayStream | None, *inputs):  # noqa: D102
        ctx.captured, ctx.update = graphs, update
        ctx.where = None if where is None else where.for_backward()
        ctx.set_materialize_grads(False)
        outputs = graphs.replay_forward(inputs, where)
        frozen = [t for t, rg in zip(outputs, graphs.output_requires_grad) if not rg]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        grad_inputs = ctx.captured.replay_backward(grads, ctx.where)
        if ctx.update is not None:
            ctx.update.complete()  # the region's first FP8 callable: its backward ran last
        return (None, None, None, *grad_inputs)
