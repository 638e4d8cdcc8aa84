"""``te.make_graphed_callables``: a module's forward and backward as CUDA graphs.

Each callable is warmed up eagerly, then its forward and its backward are captured into one CUDA
graph each (all graphs share one memory pool), under ``te.autocast(..., _graph=True)`` with the
callable's ``enabled`` flag. The same modules come back with ``forward`` replaced by a replay:
inputs are copied into the captured (static) input tensors, the forward graph is replayed, and
autograd's backward replays the backward graph; FP8 state stays eager around the graphs
(``quantization/graph_state.py``). With ``cache_quantized_params=True`` the one graph serves
both values of ``is_first_microbatch``: its weight casts read a device flag that each replay
sets (``graph_state.cast_cached_weights_in_graph``). With ``_order`` every callable
gets a pair of graphs per microbatch, captured in the schedule's order and returned as functions
(``_graph_schedule.py``). See docs/cuda_graphs.md.
"""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

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
from ._graph_buffers import SharedBuffers
from ._graph_captured import TENSOR, CapturedGraphs, GraphReplay
from ._graph_schedule import Schedule
from ._graph_streams import ReplayStream
from .module.base import TransformerEngineBaseModule
from .quantization.graph_state import (
    DelayedScalingSnapshot,
    GraphedFP8State,
    graph_capture_backward,
)

__all__ = ["make_graphed_callables", "is_graph_capturing"]

_IS_GRAPH_CAPTURING = False
_WHO = "make_graphed_callables"


def is_graph_capturing() -> bool:
    """Whether :func:`make_graphed_callables` is warming up or capturing right now."""
    return _IS_GRAPH_CAPTURING


class _Graphed:
    """What :func:`make_graphed_callables` keeps for one callable, and its replacing forward."""

    def __init__(self, index: int, module, args, kwargs, hooks, options: Options,
                 callable_index: int, shared: SimpleNamespace) -> None:  # fmt: skip
        # index: the sample's (and, with _order, the returned function's); callable_index: the
        # module's, which its enabled flag follows; shared: per module, whether a replay has
        # cast its weights (is_first_microbatch=True) since capture or an eager call
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
            kwargs.pop("is_first_microbatch", None)  # warm-up and capture pass their own
            try:
                inspect.signature(module.forward).bind_partial(is_first_microbatch=True)
            except TypeError:
                raise ValueError(
                    f"{_WHO}: cache_quantized_params=True passes is_first_microbatch to each "
                    f"callable, but {type(module).__name__}.forward (callable {callable_index}) takes "
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
        self.leaves = [TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.device = device_of(index, module, tensors)
        # detached aliases of the sample tensors: the graphs read them, replays write them
        self.static_inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        self.index, self.module, self.hooks, self.options = index, module, hooks, options
        self.callable_index, self.shared, self.installed = callable_index, shared, False
        self.params = tuple(module.parameters())
        self.enabled = options.autocast.enabled[callable_index]
        self.training = module.training
        self.te_modules = [
            m for m in module.modules() if isinstance(m, TransformerEngineBaseModule)
        ]
        # delay_wgrad_compute: backward_dw() reads the backward's operands later
        self.deferred_wgrads = any(getattr(m, "wgrad_store", None) is not None
                                   for m in module.modules())  # fmt: skip
        self.captured: CapturedGraphs | None = None  # the captured graphs; None again after reset()
        self.last, self.fp8_state = None, None
        self.name = f"graphed {type(module).__name__}"
        self.original_forward = module.forward

    def surface(self) -> tuple:
        return self.static_inputs + self.params

    def run_forward(self, is_first_microbatch: bool | None, static_inputs: tuple | None = None):
        """The module's own forward on the static inputs (the captured graphs' own, where
        ``_graph_buffers`` gave them others), as captured."""
        tensors = iter(self.static_inputs if static_inputs is None else static_inputs)
        leaves = [next(tensors) if leaf is TENSOR else leaf for leaf in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        if is_first_microbatch is not None:
            kwargs["is_first_microbatch"] = is_first_microbatch
        with self.options.autocast(self.callable_index):
            return self.module(*args, **kwargs)

    def run_backward(self, outputs, grad_outputs, surface: tuple, wanted: list) -> tuple:
        """Gradients of the outputs w.r.t. the entries ``wanted`` of ``surface`` (the static
        inputs, then the parameters; None elsewhere)."""
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
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
        surface = self.surface()
        wanted = [i for i, t in enumerate(surface) if t.requires_grad]
        # weight caching: warm up as a first microbatch, which casts the cached weights
        for is_first in (True,) if self.cache else (None,):
            for _ in range(self.options.num_warmup_iters):
                call_hooks(self.hooks, "forward_pre_hooks", self.module)
                out = tree_flatten(self.run_forward(is_first))[0]
                call_hooks(self.hooks, "forward_hooks", self.module)
                out = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
                if out and wanted:
                    call_hooks(self.hooks, "backward_pre_hooks", self.module)
                    with graph_capture_backward():
                        self.run_backward(out, [torch.zeros_like(t) for t in out], surface, wanted)
                    call_hooks(self.hooks, "backward_hooks", self.module)
                del out
        for m in self.te_modules:
            if m.need_backward_dw():
                m.wgrad_store.clear()  # warm-up's deferred GEMMs are not the user's

    # -- replay ----------------------------------------------------------------------------------
    def install(self) -> None:
        """Replay through the module itself: its ``forward`` becomes the replay."""
        self._start_replays()
        self.module.forward = lambda *args, **kwargs: self.forward(args, kwargs)
        self.module.backward_dw = self.backward_dw
        self.module.reset = self.reset
        self.installed = True

    def as_function(self):
        """Replay through a function of its own (``_order``: several per module)."""
        self._start_replays()

        def graphed(*args, **kwargs):
            return self.forward(args, kwargs)

        graphed.backward_dw, graphed.reset = self.backward_dw, self.reset
        return graphed

    def _start_replays(self) -> None:
        if self.enabled:
            self.fp8_state = GraphedFP8State(self.module, self.options.autocast.recipe, self.name)

    def forward(self, args: tuple, kwargs: dict):
        first = None
        where = ReplayStream.take(kwargs, self.device, self.name) if kwargs else None
        if self.cache:
            first = kwargs.pop("is_first_microbatch", None)
            if not isinstance(first, bool):
                raise ValueError(
                    f"{self.name}: captured with cache_quantized_params=True, so every call "
                    f"needs is_first_microbatch=True or False (got {first!r})"
                )
        if self.captured is None or self.module.training != self.training:
            # reset(), or another training mode than captured: the module runs eagerly
            self.last, self.shared.first_replayed = None, False
            if first is not None:
                kwargs["is_first_microbatch"] = first
            return self.original_forward(*args, **kwargs)
        if first is False and not self.shared.first_replayed:
            raise ValueError(
                f"{self.name}: is_first_microbatch=False reuses the weights cast by an "
                "is_first_microbatch=True replay, and none ran since capture (or since an eager "
                "call); call it with is_first_microbatch=True first"
            )
        graphs = self.captured
        inputs = self._match_inputs(args, kwargs)
        grad = torch.is_grad_enabled()
        fp8, update = self.fp8_state.begin_replay(grad) if self.enabled else (False, None)
        backward = grad and graphs.bwd_graph is not None
        if self.cache:
            graphs.set_first_microbatch(first, backward)
        if backward:
            outputs = GraphReplay.apply(graphs, update, where, *inputs, *self.params)
        else:
            outputs = graphs.replay_forward(inputs, where)
        if fp8:
            self.fp8_state.end_replay()
        self.shared.first_replayed = self.shared.first_replayed or bool(first)
        self.last = graphs
        return graphs.unflatten(outputs)

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
            if want is not TENSOR:
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
        if self.captured is not None:
            self.captured.reset()
        self.captured, self.last = None, None
        if self.installed:
            for name in ("forward", "backward_dw", "reset"):
                self.module.__dict__.pop(name, None)
            self.installed = False


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
    _order : list of int, optional
        A pipeline schedule (Megatron-LM's): ``modules`` are the layers of model chunks, ``+c``
        / ``-c`` the forward / backward of chunk ``c``'s next microbatch; one pair of graphs per
        layer and microbatch, captured in this order, which replays must follow; a negative
        fraction (``-1.5``: chunk 1) marks where the schedule calls ``backward_dw()`` for the
        deferred weight gradients of that chunk's oldest backward.
        ``sample_args`` (and ``sample_kwargs``) then hold one entry per graph: chunk by chunk,
        microbatch by microbatch, layer by layer.
    _num_layers_per_chunk : list of int, optional
        With ``_order``: the layers of each chunk (default: an equal share).
    _reuse_graph_input_output_buffers : bool, default False
        With ``_order``: a layer's static input is the previous layer's output (same chunk and
        microbatch) and the backward graphs share their static output gradients, saving that
        memory and the copies; pass each layer's output on unchanged (another tensor is copied
        into that buffer, overwriting the output; warned once).

    Returns
    -------
    The same module(s) with ``forward`` replaced by a replay (eager while ``module.training``
    differs from the capture's), plus ``backward_dw()`` and ``reset()``; with ``_order`` a
    tuple of functions laid out as ``sample_args``, each with ``backward_dw()`` and
    ``reset()``. Replay inside ``te.autocast`` with the capture's recipe. A replay also takes
    ``cuda_graph_stream=`` (replay on that side stream, ordered with the calling stream) and
    ``cuda_graph_event=`` (an event the graph records: the calling stream waits for it instead of
    the whole side stream).
    """
    options = Options(len(modules) if isinstance(modules, tuple) else 1, dict(locals()))
    single = not isinstance(modules, tuple)
    if single:
        modules = (modules,)
        if _order is None:  # with _order, sample_args holds one entry per microbatch already
            sample_args, sample_kwargs = (sample_args,), (sample_kwargs,)
        if isinstance(capture_time_hooks, dict):
            capture_time_hooks = (capture_time_hooks,)
    n = len(modules)
    schedule = Schedule(n, _order, _num_layers_per_chunk)
    graphs = schedule.num_samples
    sample_kwargs = (None,) * graphs if sample_kwargs is None else tuple(sample_kwargs)
    hooks = (None,) * n if capture_time_hooks is None else tuple(capture_time_hooks)
    per_graph = "callables"
    if schedule.ordered:
        per_graph = f"graphs ({n} callables x {schedule.num_microbatches} microbatches)"
    for name, value, want, what in (("sample_args", sample_args, graphs, per_graph),
                                    ("sample_kwargs", sample_kwargs, graphs, per_graph),
                                    ("capture_time_hooks", hooks, n, "callables")):  # fmt: skip
        if len(value) != want:
            raise ValueError(f"{_WHO}: {len(value)} {name} for {want} {what}; give one each")
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
    shared = [SimpleNamespace(first_replayed=False) for _ in modules]
    entries = [
        _Graphed(s, modules[c], sample_args[s], sample_kwargs[s], hooks[c], options, c, shared[c])
        for s, c in schedule.entries
    ]
    _capture_all(entries, options, pre_warmup_hook, post_warmup_hook, schedule)
    if schedule.ordered:
        return tuple(e.as_function() for e in entries)
    for e in entries:
        e.install()
    return modules[0] if single else modules


def _capture_all(entries, options: Options, pre_warmup_hook, post_warmup_hook, schedule) -> None:
    """Warm up, then capture the graphs in the order of ``schedule.plan`` (forwards in order and
    backwards in reverse, or the ``_order`` schedule's): the order replays follow, which is what
    lets all graphs share one memory pool (and, with ``_reuse_graph_input_output_buffers``, some
    static tensors: ``_graph_buffers.py``). FP8 state, ``main_grad`` buffers and RNG states are
    written back afterwards."""
    plan = schedule.plan
    global _IS_GRAPH_CAPTURING
    devices = list(dict.fromkeys(e.device for e in entries))
    streams = {d: torch.cuda.Stream(device=d) for d in devices}
    pool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    modules = list(dict.fromkeys(e.module for e in entries))  # with _order, one per microbatch
    fp8_snapshot = DelayedScalingSnapshot(modules)
    main_grads = [getattr(p, "main_grad", None) for m in modules for p in m.parameters()]
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
        first = False if options.cache_quantized_params else None  # graph_state's one graph
        captured = {i: CapturedGraphs(e, first) for i, e in enumerate(entries)}
        buffers = SharedBuffers(schedule, captured) if options.reuse_buffers else None
        for forward, i in plan:
            e, v = entries[i], captured[i]
            with torch.cuda.device(e.device):
                if forward:
                    if buffers is not None:
                        buffers.share_input(i)
                    v.capture_forward(pool, streams[e.device])
                else:
                    grads = None if buffers is None else buffers.grad_outputs(i)
                    v.capture_backward(pool, streams[e.device], grads)
                    e.captured = v
                    if buffers is not None:
                        buffers.backward_captured(i)
        if buffers is not None:  # the replays' checks need the inputs' shapes only: let the
            for e in entries:  # sample arguments the graphs no longer read go
                e.static_inputs = e.captured.static_inputs
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
