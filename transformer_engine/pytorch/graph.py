"""``te.make_graphed_callables``: a module's forward and backward as CUDA graphs.

Each callable is warmed up eagerly, then its forward and its backward are captured into one CUDA
graph each (all graphs share one memory pool), under ``te.autocast(..., _graph=True)`` with the
callable's ``enabled`` flag. The same modules come back with ``forward`` replaced by a replay:
inputs are copied into the captured (static) input tensors, the forward graph is replayed, and
autograd's backward replays the backward graph; FP8 state stays eager around the graphs
(``quantization/graph_state.py``). ``cache_quantized_params=True`` captures the variants
``is_first_microbatch=True`` and ``False``; each replay picks one. See docs/cuda_graphs.md.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._graph_arguments import (
    Options,
    call_hooks,
    check_module,
    device_of,
    same_constant,
    sorted_kwargs,
)
from ._graph_copies import GraphCopies, copy_nodes_enabled, new_graph
from .module.base import TransformerEngineBaseModule
from .quantization import FP8GlobalStateManager
from .quantization.graph_state import (
    DelayedScalingSnapshot,
    GraphedFP8State,
    graph_capture_backward,
)

__all__ = ["make_graphed_callables", "is_graph_capturing"]

_IS_GRAPH_CAPTURING = False
_TENSOR = object()  # marks where a flattened argument or output holds a tensor
_WHO = "make_graphed_callables"


def is_graph_capturing() -> bool:
    """Whether :func:`make_graphed_callables` is warming up or capturing right now."""
    return _IS_GRAPH_CAPTURING


class _Variant:
    """One captured forward graph, its backward graph and its deferred-wgrad graph."""

    def __init__(self, owner: _Graphed, is_first_microbatch) -> None:
        self.owner, self.is_first_microbatch = owner, is_first_microbatch
        # the copies into and out of the static tensors, as nodes of the graphs (_graph_copies)
        keep = copy_nodes_enabled()
        self.fwd_copies = GraphCopies(owner.device, keep)
        self.bwd_copies = GraphCopies(owner.device, keep)
        self.fwd_graph, self.bwd_graph, self.dw_graph = new_graph(keep), None, None
        self.grad_outputs = self.grad_inputs = None
        self.dw_grads: list = []
        # What the graphs read that nothing else may keep alive: the deferred-wgrad GEMMs'
        # operands and the FP8 weight workspaces cast in the graph (an eager call may replace a
        # module's entry; the pool must not hand that memory to a later capture).
        self.keep_alive: list = []

    def capture_forward(self, pool, stream) -> None:
        owner = self.owner
        call_hooks(owner.hooks, "forward_pre_hooks", owner.module)
        with torch.cuda.graph(self.fwd_graph, pool=pool, stream=stream):
            self.input_slots = [self.fwd_copies.record(t) for t in owner.static_inputs]
            out = owner.run_forward(self.is_first_microbatch)
        self.fwd_copies.finish(self.fwd_graph)
        call_hooks(owner.hooks, "forward_hooks", owner.module)
        self.keep_alive += [dict(m._fp8_workspaces) for m in owner.te_modules]
        leaves, self.out_spec = tree_flatten(out)
        self.out_leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        self.outputs = tuple(t for t in leaves if isinstance(t, torch.Tensor))
        self.output_requires_grad = tuple(t.requires_grad for t in self.outputs)

    def capture_backward(self, pool, stream) -> None:
        owner = self.owner
        wanted = [i for i, t in enumerate(owner.surface()) if t.requires_grad]
        if wanted and any(self.output_requires_grad):
            self.grad_outputs = tuple(
                torch.empty_like(t) if rg else None
                for t, rg in zip(self.outputs, self.output_requires_grad)
            )
            copies, grads_in = self.bwd_copies, self.grad_outputs
            clone = owner.options.clone_param_grads
            self.bwd_graph = new_graph(copies.active)
            call_hooks(owner.hooks, "backward_pre_hooks", owner.module)
            with graph_capture_backward(), torch.cuda.graph(self.bwd_graph, pool, stream=stream):
                self.grad_slots = [None if g is None else copies.record(g) for g in grads_in]
                self.grad_inputs = owner.run_backward(self.outputs, grads_in, wanted)
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

    def replay_forward(self, inputs) -> tuple:
        # inputs: the user's tensors, then the parameters (their own static tensors)
        for static, x, slot in zip(self.owner.static_inputs, inputs, self.input_slots):
            if slot is not None:
                self.fwd_copies.copy_in(slot, x)
            elif static is not x and static.data_ptr() != x.data_ptr():
                static.copy_(x)
        self.fwd_graph.replay()
        return tuple(t.detach() for t in self.outputs)

    def replay_backward(self, grads) -> tuple:
        copies = self.bwd_copies
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
        copied = {i: copies.copy_out(slot) for i, slot in self.out_slots.items()}
        copied = {i: out for i, out in copied.items() if out is not None}  # None: cloned below
        self.bwd_graph.replay()
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
        leaves = [next(it) if leaf is _TENSOR else leaf for leaf in self.out_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def reset(self) -> None:
        for graph in (self.fwd_graph, self.bwd_graph, self.dw_graph):
            if graph is not None:
                graph.reset()
        self.__dict__.clear()  # drops the static tensors; the owner drops this variant


class _GraphReplay(torch.autograd.Function):
    """One replay as one autograd node: forward graph in forward, backward graph in backward."""

    @staticmethod
    def forward(ctx, variant: _Variant, update, *inputs):  # noqa: D102
        ctx.variant, ctx.update = variant, update
        ctx.set_materialize_grads(False)
        outputs = variant.replay_forward(inputs)
        frozen = [t for t, rg in zip(outputs, variant.output_requires_grad) if not rg]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        grad_inputs = ctx.variant.replay_backward(grads)
        if ctx.update is not None:
            ctx.update.complete()  # the region's first FP8 callable: its backward ran last
        return (None, None, *grad_inputs)


class _Graphed:
    """What :func:`make_graphed_callables` keeps for one callable, and its replacing forward."""

    def __init__(self, index: int, module, args, kwargs, hooks, options: Options) -> None:
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"{_WHO}: sample_args[{index}] must be a tuple of tensors, got "
                f"{type(args).__name__} (for one tensor x pass (x,))"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"{_WHO}: sample_kwargs[{index}] must be a dict")
        for i, t in enumerate(tree_flatten(tuple(args))[0]):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{_WHO}: sample_args[{index}] holds a {type(t).__name__} at position {i}; "
                    "sample_args may contain tensors only (pass other values as sample_kwargs)"
                )
        kwargs = dict(kwargs or {})
        self.cache = options.cache_quantized_params
        if self.cache:
            kwargs.pop("is_first_microbatch", None)  # each variant passes its own
            try:
                inspect.signature(module.forward).bind_partial(is_first_microbatch=True)
            except TypeError:
                raise ValueError(
                    f"{_WHO}: cache_quantized_params=True passes is_first_microbatch to each "
                    f"callable, but {type(module).__name__}.forward (callable {index}) takes "
                    "none; graph the TE modules themselves, or give the container that argument"
                ) from None
        # one flattening of (args, kwargs): tensors are static inputs, the rest is captured
        leaves, self.spec = tree_flatten((tuple(args), sorted_kwargs(kwargs)))
        # the common call, module(x, y, ...) with tensors only, skips the flattening per replay
        self.flat_positional = (
            not kwargs
            and len(leaves) == len(args)
            and all(isinstance(t, torch.Tensor) for t in args)
        )
        self.leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.device = device_of(index, module, tensors)
        # detached aliases of the sample tensors: the graphs read them, replays write them
        self.static_inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        self.index, self.module, self.hooks, self.options = index, module, hooks, options
        self.params = tuple(module.parameters())
        self.enabled, self.training = options.autocast.enabled[index], module.training
        self.te_modules = [
            m for m in module.modules() if isinstance(m, TransformerEngineBaseModule)
        ]
        self.variants: dict | None = {}
        self.first_replayed, self.last, self.fp8_state = False, None, None
        self.name = f"graphed {type(module).__name__}"
        self.original_forward = module.forward

    def surface(self) -> tuple:
        return self.static_inputs + self.params

    def run_forward(self, is_first_microbatch: bool | None):
        """The module's own forward on the static inputs, as captured."""
        tensors = iter(self.static_inputs)
        leaves = [next(tensors) if leaf is _TENSOR else leaf for leaf in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        if is_first_microbatch is not None:
            kwargs["is_first_microbatch"] = is_first_microbatch
        with self.options.autocast(self.index):
            return self.module(*args, **kwargs)

    def run_backward(self, outputs, grad_outputs, wanted: list) -> tuple:
        """Gradients of the outputs w.r.t. the surface entries ``wanted`` (None elsewhere)."""
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
        surface = self.surface()
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            [surface[i] for i in wanted],
            [g for _, g in pairs],
            retain_graph=self.options.retain_graph_in_backward,
            allow_unused=self.options.allow_unused_input,
        )
        result: list = [None] * len(surface)
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)

    def warm_up(self) -> None:
        wanted = [i for i, t in enumerate(self.surface()) if t.requires_grad]
        for is_first in self.options.variants:
            for _ in range(self.options.num_warmup_iters):
                call_hooks(self.hooks, "forward_pre_hooks", self.module)
                out = tree_flatten(self.run_forward(is_first))[0]
                call_hooks(self.hooks, "forward_hooks", self.module)
                out = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
                if out and wanted:
                    call_hooks(self.hooks, "backward_pre_hooks", self.module)
                    with graph_capture_backward():
                        self.run_backward(out, [torch.zeros_like(t) for t in out], wanted)
                    call_hooks(self.hooks, "backward_hooks", self.module)
                del out
        for m in self.te_modules:
            if m.need_backward_dw():
                m.wgrad_store.clear()  # warm-up's deferred GEMMs are not the user's

    # -- replay ----------------------------------------------------------------------------------
    def install(self) -> None:
        if self.enabled:
            self.fp8_state = GraphedFP8State(self.module, self.options.autocast.recipe, self.name)
        self.module.forward = lambda *args, **kwargs: self.forward(args, kwargs)
        self.module.backward_dw = self.backward_dw
        self.module.reset = self.reset

    def forward(self, args: tuple, kwargs: dict):
        first = None
        if self.cache:
            first = kwargs.pop("is_first_microbatch", None)
            if not isinstance(first, bool):
                raise ValueError(
                    f"{self.name}: captured with cache_quantized_params=True, so every call "
                    f"needs is_first_microbatch=True or False (got {first!r})"
                )
        if self.variants is None or self.module.training != self.training:
            # reset(), or another training mode than captured: the module runs eagerly
            self.last, self.first_replayed = None, False
            if first is not None:
                kwargs["is_first_microbatch"] = first
            return self.original_forward(*args, **kwargs)
        if first is False and not self.first_replayed:
            raise ValueError(
                f"{self.name}: is_first_microbatch=False reuses the weights cast by an "
                "is_first_microbatch=True replay, and none ran since capture (or since an eager "
                "call); call it with is_first_microbatch=True first"
            )
        variant = self.variants[first]
        inputs = self._match_inputs(args, kwargs)
        grad = torch.is_grad_enabled()
        fp8, update = self.fp8_state.begin_replay(grad) if self.enabled else (False, None)
        if self.cache:
            FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first, self.device)
        if grad and variant.bwd_graph is not None:
            outputs = _GraphReplay.apply(variant, update, *inputs, *self.params)
        else:
            outputs = variant.replay_forward(inputs)
        if fp8:
            self.fp8_state.end_replay()
        self.first_replayed = self.first_replayed or bool(first)
        self.last = variant
        return variant.unflatten(outputs)

    def _match_inputs(self, args: tuple, kwargs: dict) -> list:
        """The replay's tensors in the order of the static inputs, checked against them."""
        if self.flat_positional and not kwargs and len(args) == len(self.leaves):
            leaves = args  # a non-tensor among them fails the checks below as in the general case
        else:
            leaves, spec = tree_flatten((tuple(args), sorted_kwargs(kwargs)))
            if spec != self.spec:
                self._wrong_structure(spec)
        return self._checked(leaves)

    def _wrong_structure(self, spec) -> None:
        raise TypeError(
            f"{self.name}: called with arguments {spec}, captured with {self.spec}; the "
            "positional and keyword arguments (names, nesting) must be the captured ones"
        )

    def _checked(self, leaves) -> list:
        tensors, grad = [], torch.is_grad_enabled()
        for x, want in zip(leaves, self.leaves):
            if want is not _TENSOR:
                if not same_constant(x, want):
                    raise ValueError(
                        f"{self.name}: an argument is {x!r}, captured as {want!r}; non-tensor "
                        "arguments are part of the graph (capture again to change them)"
                    )
                continue
            static = self.static_inputs[len(tensors)]
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{self.name}: got a {type(x).__name__} where a tensor was captured"
                )
            if x.shape != static.shape or x.dtype != static.dtype or x.device != static.device:
                raise ValueError(
                    f"{self.name}: input {len(tensors)} is {x.dtype} {tuple(x.shape)} on "
                    f"{x.device}; captured with {static.dtype} {tuple(static.shape)} on "
                    f"{static.device}"
                )
            if grad and x.requires_grad and not static.requires_grad:
                raise ValueError(
                    f"{self.name}: input {len(tensors)} requires grad but its sample argument did "
                    "not, so the graph computes no gradient for it; capture with requires_grad"
                )
            tensors.append(x)
        return tensors

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs the last backward deferred (``delay_wgrad_compute``)."""
        if self.last is None:
            for m in self.te_modules:
                type(m).backward_dw(m)  # the class's: the module's own attribute is this method
        else:
            self.last.replay_deferred_wgrads()

    def reset(self) -> None:
        """Free the graphs and their static tensors; the module runs eagerly from now on."""
        for variant in (self.variants or {}).values():
            variant.reset()
        self.variants, self.last = None, None
        for name in ("forward", "backward_dw", "reset"):
            self.module.__dict__.pop(name, None)


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled=None,
    fp8_calibrating=None,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching=None,
    enabled=None,
    calibrating=None,
    recipe=None,
    amax_reduction_group=None,
    cache_quantized_params=None,
    _order=None,
    _num_layers_per_chunk=None,
    pool=None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook=None,
    post_warmup_hook=None,
    capture_time_hooks=None,
):
    """Capture the forward and backward of ``modules`` as CUDA graphs (docs/cuda_graphs.md).

    Parameters
    ----------
    modules : torch.nn.Module or tuple of torch.nn.Module
        On CUDA, all in one training mode, with no module hooks.
    sample_args : tuple of tensors (a tuple of such tuples for a tuple of modules)
        The static inputs (replays copy into them); their ``requires_grad`` says which input
        gradients the backward graph computes.
    num_warmup_iters : int, default 3
        Eager forward + backward passes before capture (at least 1).
    allow_unused_input : bool, default False
        Allow inputs and parameters the outputs do not depend on.
    sample_kwargs : dict (a tuple of dicts), optional
        Tensors among them are static inputs; other values are captured, and every replay must
        pass them unchanged.
    enabled, calibrating, recipe, amax_reduction_group : optional
        The capture's ``te.autocast`` arguments; ``enabled`` (default False) may be a tuple with
        one flag per callable; ``recipe`` defaults to ``get_default_recipe()``. Old names:
        ``fp8_enabled``, ``fp8_calibrating``, ``fp8_recipe``, ``fp8_group``.
    cache_quantized_params : bool, default False
        Cache FP8 weights across microbatches; every replay then takes ``is_first_microbatch``
        (old name ``fp8_weight_caching``).
    pool : optional
        A ``torch.cuda.graph_pool_handle()`` to capture into (a new one by default).
    retain_graph_in_backward : bool, default False
        Keep the captured autograd graph after the backward capture.
    clone_param_grads_on_return : bool, default True
        Return copies of the parameter gradients (``False``: the graph's static buffers).
    pre_warmup_hook, post_warmup_hook : callable, optional
        Called without arguments before and after warm-up.
    capture_time_hooks : tuple of dict, optional
        Per callable ``None`` or ``{kind: {id: fn(module)}}`` with kinds ``forward_pre_hooks``,
        ``forward_hooks``, ``backward_pre_hooks``, ``backward_hooks``: run around warm-up and
        capture passes, outside the graphs; they must return ``None``.
    _order, _num_layers_per_chunk, _reuse_graph_input_output_buffers
        Megatron's interleaved pipeline schedule: not supported (``NotImplementedError``).

    Returns
    -------
    The same module(s) with ``forward`` replaced by a replay (eager while ``module.training``
    differs from the capture's), plus ``backward_dw()`` and ``reset()``. Replay inside
    ``te.autocast`` with the capture's recipe.
    """
    options = Options(len(modules) if isinstance(modules, tuple) else 1, dict(locals()))
    single = not isinstance(modules, tuple)
    if single:
        modules, sample_args, sample_kwargs = (modules,), (sample_args,), (sample_kwargs,)
        if isinstance(capture_time_hooks, dict):
            capture_time_hooks = (capture_time_hooks,)
    n = len(modules)
    sample_kwargs = (None,) * n if sample_kwargs is None else tuple(sample_kwargs)
    hooks = (None,) * n if capture_time_hooks is None else tuple(capture_time_hooks)
    for name, value in (("sample_args", sample_args), ("sample_kwargs", sample_kwargs),
                        ("capture_time_hooks", hooks)):  # fmt: skip
        if len(value) != n:
            raise ValueError(f"{_WHO}: {len(value)} {name} for {n} callables; give one each")
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            f"{_WHO}: torch.autocast's weight cache must be off during capture; use "
            "torch.autocast(..., cache_enabled=False)"
        )
    for i, (module, h) in enumerate(zip(modules, hooks)):
        check_module(i, module, h)
    if len({m.training for m in modules}) > 1:
        raise RuntimeError(
            f"{_WHO}: the callables are in different training modes; call .train() or .eval() "
            "on all of them before capture"
        )
    entries = [
        _Graphed(i, m, a, k, h, options)
        for i, (m, a, k, h) in enumerate(zip(modules, sample_args, sample_kwargs, hooks))
    ]
    _capture_all(entries, options, pre_warmup_hook, post_warmup_hook)
    for e in entries:
        e.install()
    return modules[0] if single else modules


def _capture_all(entries, options: Options, pre_warmup_hook, post_warmup_hook) -> None:
    """Warm up, then capture forward graphs in order and backward graphs in reverse: the order
    of a replayed step, which is what lets all graphs share one memory pool. FP8 state,
    ``main_grad`` buffers and RNG states are written back afterwards."""
    global _IS_GRAPH_CAPTURING
    devices = list(dict.fromkeys(e.device for e in entries))
    streams = {d: torch.cuda.Stream(device=d) for d in devices}
    pool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    fp8_snapshot = DelayedScalingSnapshot([e.module for e in entries])
    main_grads = [getattr(p, "main_grad", None) for e in entries for p in e.params]
    main_grads = [(g, g.clone()) for g in main_grads if isinstance(g, torch.Tensor)]
    rng = torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]
    # No Python garbage collection while capturing: a collection started by an allocation
    # inside a capture can free an unreachable CUDA graph (a graphed module that was dropped
    # is a reference cycle) and destroying a graph is illegal during capture: it invalidates
    # the capture. (torch.cuda.graph no longer collects on entry.) Collect once, up front.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    _IS_GRAPH_CAPTURING = True
    try:
        for d in devices:
            torch.cuda.synchronize(d)
        if pre_warmup_hook is not None:
            pre_warmup_hook()
        for e in entries:
            with torch.cuda.device(e.device):
                current = torch.cuda.current_stream(e.device)
                streams[e.device].wait_stream(current)
                with torch.cuda.stream(streams[e.device]):
                    e.warm_up()
                current.wait_stream(streams[e.device])
        if post_warmup_hook is not None:
            post_warmup_hook()
        for is_first in options.variants:
            variants = [_Variant(e, is_first) for e in entries]
            for e, v in zip(entries, variants):
                with torch.cuda.device(e.device):
                    v.capture_forward(pool, streams[e.device])
            for e, v in reversed(list(zip(entries, variants))):
                with torch.cuda.device(e.device):
                    v.capture_backward(pool, streams[e.device])
                e.variants[is_first] = v
        for d in devices:
            torch.cuda.synchronize(d)
    finally:
        _IS_GRAPH_CAPTURING = False
        if gc_was_enabled:
            gc.enable()
        fp8_snapshot.restore()
        with torch.no_grad():
            for g, saved in main_grads:
                g.copy_(saved)
        torch.set_rng_state(rng[0])
        for d, state in rng[1]:
            torch.cuda.set_rng_state(state, d)
