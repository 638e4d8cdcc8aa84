"""``checkpoint(..., distribute_saved_activations=True)``: activation recompute that keeps only
this rank's share of the region's first tensor argument between forward and backward.

Under tensor parallelism without sequence parallelism every rank of the group holds the same
input (the hidden states entering a layer), and a checkpointed region keeps that input alive
until its backward recomputes the region. Distributing it keeps ``1 / tp_size`` of it per
rank: after the forward, the first tensor argument's data is replaced by this rank's equal
1-D chunk of its elements (so its full buffer is freed once nothing else holds it), and the
backward all-gathers the chunks over ``tp_group`` and gives the argument its full data back
before the recompute. The caller must not read that tensor between the region's forward and
its backward (as in upstream and Megatron-LM, whose layers pass the hidden states on through
the region's output, not the input).

The recompute is this module's own reentrant autograd function (torch's would keep the whole
input): the forward runs without grad; the backward restores the CPU RNG state and those of the
CUDA devices of the tensor arguments, re-enters torch autocast as it was, recomputes with grad
enabled and backpropagates through the recomputed outputs. The FP8 and RNG-tracker handling of
``checkpoint`` happens inside ``run``, as without distribution.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._tensor_parallel import _all_gather_dim0

__all__ = ["distributed_checkpoint"]

_OP = "checkpoint"


def _first_tensor(args, world: int) -> int:
    """The index of the argument to distribute: the first tensor, whose size ``world`` must
    divide."""
    index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if index is None:
        raise TypeError(
            f"{_OP}: distribute_saved_activations=True distributes the first tensor argument, "
            f"but the arguments hold none ({[type(a).__name__ for a in args]})"
        )
    first = args[index]
    if first.numel() % world:
        raise ValueError(
            f"{_OP}: distribute_saved_activations=True splits the first argument's "
            f"{first.numel()} elements (shape {tuple(first.shape)}) into {world} equal chunks "
            f"(tp_group has {world} ranks); pass an input whose size the group divides, or "
            "distribute_saved_activations=False"
        )
    return index


def _chunk(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of ``tensor``'s elements, as a new 1-D buffer."""
    flat = tensor.detach().reshape(-1)
    part = flat.numel() // world
    return flat[rank * part : (rank + 1) * part].clone()


def _autocast_states(devices) -> list:
    """``(device_type, enabled, dtype)`` of torch autocast for the CPU and the CUDA devices."""
    kinds = ["cpu"] + (["cuda"] if any(d.type == "cuda" for d in devices) else [])
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


class _DistributedCheckpoint(torch.autograd.Function):
    """Reentrant recompute of ``run(*args)`` keeping only a chunk of ``args[index]``."""

    @staticmethod
    def forward(ctx, run, group, index, *args):  # noqa: D102
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        first = args[index]
        devices = list(dict.fromkeys(a.device for a in args if isinstance(a, torch.Tensor)))
        ctx.run, ctx.group, ctx.world = run, group, world
        ctx.cuda_devices = [d for d in devices if d.type == "cuda"]
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.autocast = _autocast_states(devices)
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        with torch.no_grad():
            outputs = run(*args)
        ctx.first_shape, ctx.first_requires_grad = first.shape, first.requires_grad
        chunk = _chunk(first, rank, world)
        # Free the full input: the argument itself now holds only this rank's chunk (a view
        # shares its base's buffer, which stays alive through the base anyway).
        ctx.first = first if first._base is None else None
        if ctx.first is not None:
            first.data = chunk
        ctx.index = index
        ctx.tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(chunk, *(args[i] for i in ctx.tensor_slots if i != index))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):  # noqa: D102
        chunk, *others = ctx.saved_tensors
        full = torch.empty(chunk.numel() * ctx.world, dtype=chunk.dtype, device=chunk.device)
        _all_gather_dim0(full, chunk, group=ctx.group)
        full = full.view(ctx.first_shape)
        if ctx.first is not None:  # the caller's tensor whole again, as before the region
            ctx.first.data = full
        args = list(ctx.constants)
        others = iter(others)
        for slot in ctx.tensor_slots:
            tensor = full if slot == ctx.index else next(others)
            wants = ctx.first_requires_grad if slot == ctx.index else tensor.requires_grad
            args[slot] = tensor.detach().requires_grad_(wants)
        with torch.random.fork_rng(devices=ctx.cuda_devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), _reenter_autocast(ctx):
                outputs = ctx.run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        ctx.first = None
        grads = [a.grad if isinstance(a, torch.Tensor) else None for a in args]
        return (None, None, None, *grads)


class _reenter_autocast:
    """The torch autocast states of the original forward, entered for the recompute."""

    def __init__(self, ctx) -> None:
        self.contexts = [
            torch.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=ctx.autocast_cache)
            for kind, enabled, dtype in ctx.autocast
        ]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


def distributed_checkpoint(run, args, tp_group):
    """``run(*args)`` recomputed in backward with its first tensor argument distributed over
    ``tp_group`` (see the module docstring); for groups of more than one rank."""
    index = _first_tensor(args, dist.get_world_size(tp_group))
    return _DistributedCheckpoint.apply(run, tp_group, index, *args)
