"""The arguments of ``te.make_graphed_callables``, checked: its options, the callables, their
devices and capture-time hooks, and how replayed arguments compare with the captured ones."""

from __future__ import annotations

import torch

from .quantization.graph_state import CaptureAutocast

__all__ = ["Options", "call_hooks", "check_module", "device_of", "sorted_kwargs", "same_constant"]

_WHO = "make_graphed_callables"
_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class Options:
    """The resolved arguments of one :func:`make_graphed_callables` call."""

    def __init__(self, n: int, args: dict) -> None:
        if args["_order"] is None and (
            args["_num_layers_per_chunk"] is not None or args["_reuse_graph_input_output_buffers"]
        ):
            raise ValueError(
                f"{_WHO}: _num_layers_per_chunk and _reuse_graph_input_output_buffers belong to "
                "the _order schedule; they need _order"
            )
        self.autocast = CaptureAutocast(n, {k: args[k] for k in CaptureAutocast.ARGUMENTS})
        self.cache_quantized_params = self.autocast.cache_quantized_params
        warmup = args["num_warmup_iters"]
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"{_WHO}: num_warmup_iters={warmup!r} must be an int >= 1 (the first forward "
                "creates FP8 state and workspaces, which must not happen inside a capture)"
            )
        self.num_warmup_iters = warmup
        self.allow_unused_input = bool(args["allow_unused_input"])
        self.clone_param_grads = bool(args["clone_param_grads_on_return"])
        self.retain_graph_in_backward = bool(args["retain_graph_in_backward"])
        self.pool = args["pool"]
        self.reuse_buffers = bool(args["_reuse_graph_input_output_buffers"])


def call_hooks(hooks: dict | None, kind: str, module) -> None:
    for hook_id, fn in ((hooks or {}).get(kind) or {}).items():
        if fn(module) is not None:
            raise RuntimeError(
                f"{_WHO}: capture_time_hooks {kind}[{hook_id!r}] returned a value; capture-time "
                "hooks run outside the graphs and must return None"
            )


def check_module(index: int, module, hooks) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{_WHO}: callable {index} is a {type(module).__name__}; only torch.nn.Module "
            "callables can be graphed (wrap a function in a Module; pass modules as a tuple)"
        )
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            raise RuntimeError(
                f"{_WHO}: callable {index} has module hooks registered on {type(m).__name__}; "
                "graphs replay none of them: remove them or pass them as capture_time_hooks"
            )
    for name, buffer in module.named_buffers():
        if buffer.requires_grad:
            raise ValueError(f"{_WHO}: buffer {name!r} of callable {index} requires grad")
    if "forward" in module.__dict__:
        raise ValueError(
            f"{_WHO}: callable {index} is already graphed (or has its own forward attribute); "
            "call its reset() first"
        )
    if hooks is not None and (not isinstance(hooks, dict) or set(hooks) - set(_HOOK_KINDS)):
        raise ValueError(
            f"{_WHO}: capture_time_hooks[{index}] must be a dict with keys among {_HOOK_KINDS}, "
            f"each {{id: fn(module)}}; got {hooks!r}"
        )


def device_of(index: int, module, tensors) -> torch.device:
    """The CUDA device of a callable: every sample tensor and parameter must be on it."""
    named = [(f"parameter {n!r}", p) for n, p in module.named_parameters()]
    named += [(f"sample input {i}", t) for i, t in enumerate(tensors)]
    for what, t in named:
        if t.device.type != "cuda" or t.device != named[0][1].device:
            raise ValueError(
                f"{_WHO}: callable {index} ({type(module).__name__}): {what} is on {t.device}; "
                "CUDA graphs need CUDA tensors, all of a callable's on one device: move the "
                "module and its sample arguments there"
            )
    if not named:
        raise ValueError(f"{_WHO}: callable {index} has no parameters or sample tensors")
    return named[0][1].device


def sorted_kwargs(kwargs: dict) -> dict:
    # pytree dict specs compare their keys in order: flatten kwargs in one order
    return {k: kwargs[k] for k in sorted(kwargs)}


def same_constant(got, want) -> bool:
    # a tensor never equals a captured constant (its == would compare elementwise)
    return got is want or (not isinstance(got, torch.Tensor) and bool(got == want))
