r"""Parameters that FSDP2 shards (``DTensor`` shards, also from DTensor tensor-parallel plans),
for the modules' and operations' deferred initialization and FP8 weights.

FP8 weights built on ``meta`` under a per-tensor recipe are ``Float8Tensor``\ s there already
(:func:`empty_fp8_weight_on_meta`): ``fully_shard`` on the meta model decides from the tensor
type whether a parameter's all-gather sends FP8 bytes (``Float8Tensor.fsdp_pre_all_gather``),
and a weight that became FP8 only at the reset would be all-gathered as high-precision values.

FSDP2 holds the sharded ``Parameter`` objects it made, so a reset must write into them, not
replace them (a replaced parameter is a plain full tensor FSDP2 no longer manages). The caller
computes the whole value as an unsharded module does (the same random draws, so sharded and
unsharded models start equal); each rank keeps the part its shard covers.
"""

from __future__ import annotations

import torch

from ..common.recipe import DelayedScaling, Float8CurrentScaling
from .quantization import Float8CurrentScalingRecipeState, get_fp8_te_dtype
from .quantized_tensor import QuantizedTensor
from .tensor._float8_fsdp import (
    is_shard_quantizer,
    make_shard_quantizer,
    refresh_shard_quantizer,
)
from .tensor.float8_tensor import Float8Tensor

__all__ = [
    "copy_whole_value_into_shard",
    "empty_fp8_weight_on_meta",
    "is_sharded_parameter",
    "local_part",
    "rebind_weight_quantizer",
    "shard_of",
]


def empty_fp8_weight_on_meta(param: torch.Tensor, recipe) -> torch.Tensor | None:
    """For a meta weight that ``quantized_model_init`` with ``recipe`` makes FP8: an empty
    ``Float8Tensor`` on meta in the recipe's forward format; the reset gives it values, scale
    and the module's quantizer. ``None`` for block-scaled recipes, which have no FP8 all-gather
    here (their weights stay high-precision until the reset).

    Values copied in before any reset (``to_empty`` then ``load_state_dict`` of high-precision
    values) are quantized as the recipe would: under current scaling by a quantizer of the
    recipe's settings (stateless, so it needs no device), under delayed scaling with the
    tensor's scale 1 (the recipe state's first scale, which lives on a real device only)."""
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return None
    quantizer = None
    if isinstance(recipe, Float8CurrentScaling):
        state = Float8CurrentScalingRecipeState(recipe, mode="forward", device="cpu")
        quantizer = state.make_quantizers()[0]
    return Float8Tensor(
        param.shape,
        param.dtype,
        data=torch.empty(param.shape, dtype=torch.uint8, device="meta"),
        fp8_scale_inv=torch.ones(1, dtype=torch.float32, device="meta"),
        fp8_dtype=get_fp8_te_dtype(recipe, fprop_tensor=True),
        quantizer=quantizer,
    )


def _dim0_shard_group(param):
    """The process group over which the DTensor ``param`` is split along dim 0 (FSDP2's shard
    group; under HSDP the mesh's shard dimension), or ``None`` when no one mesh dimension
    splits it so (then the next all-gather sets the shard up)."""
    dims = [i for i, p in enumerate(param.placements) if p.is_shard() and p.dim == 0]
    return param.device_mesh.get_group(dims[0]) if len(dims) == 1 else None


def rebind_weight_quantizer(param, quantizer) -> None:
    """After the owner's recipe state was (re)built: the FP8 weight ``param`` re-quantizes with
    ``quantizer`` (a copy of the new one).

    * A DTensor (FSDP2's shard, outside forward): the shard takes it in FSDP2's shard form at
      once (row-wise, amax reduced over the shard group; ``tensor/_float8_fsdp.py``): an
      optimizer step before the next all-gather must already cast with the whole weight's amax.
    * The whole weight FSDP2 rebuilt (inside forward): it shares its shard's quantizer, which
      takes the new state in place (the shard is out of reach here), and keeps it.
    * Any other FP8 weight: takes ``quantizer``.
    """
    if is_sharded_parameter(param):
        local = shard_of(param)
        if isinstance(local, QuantizedTensor):
            local._quantizer = quantizer
            group = _dim0_shard_group(param)
            if group is not None and hasattr(local, "fsdp_pre_all_gather"):
                make_shard_quantizer(local, group)
    elif isinstance(param, QuantizedTensor):
        if is_shard_quantizer(param._quantizer):
            refresh_shard_quantizer(param._quantizer, quantizer)
        else:
            param._quantizer = quantizer


def is_sharded_parameter(param) -> bool:
    """Whether ``param`` is a ``torch.distributed.tensor.DTensor``."""
    return hasattr(param, "device_mesh") and hasattr(param, "to_local")


def shard_of(param) -> torch.Tensor:
    """A DTensor's local tensor itself: ``to_local()`` of a Parameter hands out a view (torch
    >= 2.12), and what is set on a view (a quantizer) would not reach the shard."""
    local = getattr(param, "_local_tensor", None)
    return param.to_local() if local is None else local


def local_part(full: torch.Tensor, param) -> torch.Tensor:
    """The part of the whole value ``full`` that this rank's shard of ``param`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    part = full
    for dim, (start, length) in enumerate(zip(offset, shape)):
        if length != full.shape[dim]:
            part = part.narrow(dim, start, length)
    return part


def copy_whole_value_into_shard(param, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` (plain, or a quantized whole value) into the shard of
    the DTensor ``param``, in place.

    A quantized shard takes the part's bytes and scale as a whole tensor (FSDP2 keeps it in a
    buffer of its own: not re-quantized with a scale shared with that buffer) and the part's
    quantizer (the one of the owner's current recipe state)."""
    local = shard_of(param)
    part = local_part(full, param)
    with torch.no_grad():
        if isinstance(local, QuantizedTensor):
            if hasattr(local, "_shares_scale_with_base"):
                local._shares_scale_with_base = False
            if isinstance(part, QuantizedTensor):
                local._quantizer = part._quantizer
        local.copy_(part)
