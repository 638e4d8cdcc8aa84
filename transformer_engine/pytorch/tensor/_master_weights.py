"""Master-weight shards cast into FP8 parameters: upstream's ``quantize_master_weights`` (and its
old name ``cast_master_weights_to_fp8``) and ``post_all_gather_processing``.

A ZeRO-style distributed optimizer keeps each FP8 parameter's high-precision master weight split
over the data-parallel ranks: rank r holds the elements ``start_offset`` to ``start_offset +
numel - 1`` of the flattened parameter (or none). After its step, each rank casts its shard
into the matching bytes of its copy of the FP8 parameter; the caller then all-gathers the bytes
(Megatron-LM moves them through a bucket, ``replace_raw_data``), so every rank must cast with
the same scale:

- delayed scaling (``Float8Quantizer``): the scale the recipe state holds; each shard's amax is
  max-accumulated into the weight's amax slot and the slots are all-reduced (MAX) over
  ``group``, so the next scale update sees the whole weight's amax;
- current scaling (``Float8CurrentScalingQuantizer``): the shards' amaxes are all-reduced
  (MAX) first, and the scale is the one the quantizer computes from that amax (its epsilon and
  power-of-2 rule).

Every parameter's ``_scale_inv`` then becomes ``1 / scale`` and its transposed copy is dropped:
its bytes are complete only after the all-gather, and the next use that needs the copy makes it
(``post_all_gather_processing`` makes it at once). Shards are cast from the master rounded to the
parameter's dtype first, as the forward of a high-precision weight would cast it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..cpp_extensions import quantize
from ..reference import compute_scale_from_amax
from ._float8_quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from ._float8_tensor_class import Float8Tensor

__all__ = ["quantize_master_weights", "cast_master_weights_to_fp8", "post_all_gather_processing"]


def _check(name, model_weights, master_weights, start_offsets, shards):
    n = len(model_weights)
    if len(master_weights) != n or len(start_offsets) != n or len(shards) != n:
        raise ValueError(
            f"{name}: model_weights, master_weights, start_offsets (and fsdp_shard_model_weights) "
            f"must be equally long, got {n}, {len(master_weights)}, {len(start_offsets)}, "
            f"{len(shards)}"
        )
    for i, (weight, master, offset, shard) in enumerate(
        zip(model_weights, master_weights, start_offsets, shards)
    ):
        quantizer = getattr(weight, "_quantizer", None)
        if not isinstance(weight, Float8Tensor) or not isinstance(
            quantizer, (Float8Quantizer, Float8CurrentScalingQuantizer)
        ):
            raise TypeError(
                f"{name}: model_weights[{i}] is a {type(weight).__name__}"
                f"{'' if quantizer is None else ' of a ' + type(quantizer).__name__}; only "
                "per-tensor FP8 parameters (delayed or current scaling) are cast here (the "
                "block-scaled, MXFP8 and NVFP4 forms are not built)"
            )
        if weight._data is None:
            raise ValueError(f"{name}: model_weights[{i}] holds no row-wise bytes to write")
        if master is None:
            continue
        if offset is None or int(offset) < 0 or int(offset) + master.numel() > weight.numel():
            raise ValueError(
                f"{name}: master_weights[{i}] ({master.numel()} elements) at start offset "
                f"{offset} does not fit in its parameter of {weight.numel()} elements"
            )
        if master.device != weight.device:
            raise ValueError(
                f"{name}: master_weights[{i}] is on {master.device}, its parameter on "
                f"{weight.device}"
            )
        if shard is not None and shard.numel() != master.numel():
            raise ValueError(
                f"{name}: fsdp_shard_model_weights[{i}] has {shard.numel()} elements, its master "
                f"shard {master.numel()}"
            )


def _target_bytes(weight, master, offset, shard) -> torch.Tensor:
    """The uint8 bytes that ``master``'s shard is cast into."""
    if shard is not None:
        return shard.view(torch.uint8).view(-1)
    start = int(offset)
    return weight._data.view(torch.uint8).view(-1)[start : start + master.numel()]


def _all_reduce_max(values: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``values`` (one-element tensors) reduced MAX over ``group`` in one collective."""
    if not values:
        return values
    packed = torch.stack([v.reshape(()).float() for v in values])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return list(packed.unbind(0))


@torch.no_grad()
def quantize_master_weights(model_weights, master_weights, start_offsets, group,
                            fsdp_shard_model_weights=None,
                            manual_post_all_gather_processing=False) -> None:  # fmt: skip
    """Cast each rank's master-weight shards into its FP8 parameters (module docstring).

    Parameters
    ----------
    model_weights : list of Float8Tensor
        The FP8 parameters, the same list in the same order on every rank of ``group``.
    master_weights : list of torch.Tensor or None
        This rank's shard of each parameter's master weight (any shape; its elements are the
        flattened parameter's), ``None`` where this rank holds none.
    start_offsets : list of int or None
        Where each shard starts in the flattened parameter.
    group : torch.distributed.ProcessGroup or None
        The ranks the shards are spread over (every one must call this).
    fsdp_shard_model_weights : list of torch.Tensor or None, optional
        Where each shard's FP8 bytes go instead of the parameter's own (a sharded FSDP buffer).
    manual_post_all_gather_processing : bool, default False
        Accepted for upstream's signature: the transposed copies are dropped either way (a
        stale copy is never kept), and made again when next needed or by
        :func:`post_all_gather_processing`.
    """
    del manual_post_all_gather_processing
    shards = list(fsdp_shard_model_weights or [None] * len(model_weights))
    model_weights, master_weights = list(model_weights), list(master_weights)
    _check("quantize_master_weights", model_weights, master_weights, list(start_offsets), shards)
    for weight in model_weights:
        clear = getattr(weight, "clear_high_precision_init_val", None)
        if clear is not None:
            clear()
    items = list(zip(model_weights, master_weights, start_offsets, shards))
    delayed = [it for it in items if isinstance(it[0]._quantizer, Float8Quantizer)]
    current = [it for it in items if isinstance(it[0]._quantizer, Float8CurrentScalingQuantizer)]

    for weight, master, offset, shard in delayed:
        quantizer = weight._quantizer
        if master is not None:
            values = master.detach().reshape(-1).to(weight.dtype)
            quantize(values, quantizer.scale, quantizer.dtype, amax=quantizer.amax,
                     out=_target_bytes(weight, master, offset, shard))  # fmt: skip
    reduced = _all_reduce_max([w._quantizer.amax for w, *_ in delayed], group)
    for (weight, *_), amax in zip(delayed, reduced):
        weight._quantizer.amax.copy_(amax.reshape(weight._quantizer.amax.shape))
        weight._scale_inv.copy_(torch.reciprocal(weight._quantizer.scale.float()).reshape(1))

    local, shard_values = [], []
    for weight, master, _, _ in current:
        values = None if master is None else master.detach().reshape(-1).to(weight.dtype)
        shard_values.append(values)
        amax = values.abs().amax().float() if values is not None and values.numel() else None
        local.append(torch.zeros((), device=weight.device) if amax is None else amax)
    reduced = _all_reduce_max(local, group)
    for (weight, master, offset, shard), values, amax in zip(current, shard_values, reduced):
        quantizer = weight._quantizer
        scale = compute_scale_from_amax(
            amax, quantizer.dtype, quantizer.amax_epsilon, quantizer.force_pow_2_scales
        )
        if values is not None:
            quantize(
                values, scale, quantizer.dtype, out=_target_bytes(weight, master, offset, shard)
            )
        weight._scale_inv.copy_(torch.reciprocal(scale).reshape(1))

    for weight, *_ in items:
        weight.remove_caches()


def cast_master_weights_to_fp8(*args, **kwargs) -> None:
    """Deprecated name of :func:`quantize_master_weights`."""
    warnings.warn(
        "cast_master_weights_to_fp8 is deprecated; use quantize_master_weights",
        DeprecationWarning,
        stacklevel=2,
    )
    quantize_master_weights(*args, **kwargs)


@torch.no_grad()
def post_all_gather_processing(model_weights) -> None:
    """Make the transposed copies of FP8 parameters whose bytes were just all-gathered, where
    this device's FP8 GEMMs need one (Hopper and the CPU); other tensors are left alone."""
    if isinstance(model_weights, torch.Tensor):
        model_weights = [model_weights]
    for weight in model_weights:
        if isinstance(weight, Float8Tensor) and weight._data is not None:
            weight.remove_caches()
            weight.update_usage(rowwise_usage=True, columnwise_usage=True)
