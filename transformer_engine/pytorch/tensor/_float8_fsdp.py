"""FSDP2 all-gather of ``Float8Tensor`` parameters in FP8.

``torch.distributed.fsdp.fully_shard`` splits a parameter along dim 0 into one shard per rank
(the dispatch's ``split``/``narrow``/``new_zeros``/``copy_`` keep each shard a ``Float8Tensor``
sharing the parameter's scale) and, before a forward or backward, all-gathers the shards. A
tensor subclass that defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` chooses what
travels: here the shards' row-wise FP8 bytes (one byte per value instead of two or four), and
the whole parameter is rebuilt around the gathered bytes with the shard's ``_scale_inv``.

Why one ``_scale_inv`` serves the gathered bytes: every rank's shard is quantized with the same
scale. Under delayed scaling the scale is the module's recipe state, which the amax reduction
keeps equal on every rank (the weight's amax slot too: each rank's optimizer step records its
shard's amax and the reduction takes the maximum). Under current scaling each re-quantization
computes the scale from the amax, so the shard's quantizer all-reduces the amax over the FSDP
group (set up at the first all-gather, before any optimizer step) and every rank computes the
scale of the whole parameter.

What FSDP2 frees and re-allocates: the all-gather output (the gathered tensor's row-wise bytes
are a view of it) and the tensors ``fsdp_post_all_gather`` names, here the gathered tensor's
transposed copy where the device needs one (Hopper, Ada, the CPU path). Later all-gathers pass
the same tensor as ``out``: its bytes are already in place, its transpose is rebuilt from them
and its ``_scale_inv`` copied from the shard, so tensors the autograd graph saved see the new
values and nothing stale survives a reshard.
"""

from __future__ import annotations

import torch

from ..device import is_non_tn_fp8_gemm_supported
from .storage.float8_tensor_storage import float8_transposed_shape

__all__ = [
    "fsdp_pre_all_gather",
    "fsdp_post_all_gather",
    "is_shard_quantizer",
    "make_shard_quantizer",
    "refresh_shard_quantizer",
]

# What a shard's quantizer keeps of its own when it takes a new recipe state's settings.
_SHARD_SETTINGS = ("rowwise_usage", "columnwise_usage", "with_amax_reduction",
                   "amax_reduction_group", "_fsdp_shard_quantizer")  # fmt: skip


def make_shard_quantizer(shard, group) -> None:
    """Give the shard a quantizer of its own that writes only the row-wise bytes (the gathered
    tensor makes its transpose; a shard's would be re-made by every optimizer step for nothing)
    and all-reduces the amax of each re-quantization over ``group`` (FSDP2's shard group):
    current scaling
    casts with the whole parameter's scale, delayed scaling records its amax."""
    q = shard._quantizer
    if q is None or is_shard_quantizer(q):
        return
    q = q.copy()  # shallow: a delayed-scaling copy shares the module's scale and amax history
    q.set_usage(rowwise=True, columnwise=False)
    q._reduce_amax_across(group)
    q._fsdp_shard_quantizer = True
    shard._quantizer = q


def is_shard_quantizer(quantizer) -> bool:
    """Whether ``quantizer`` is an FSDP2 shard's (:func:`make_shard_quantizer`); the whole
    weight FSDP2 rebuilds around the gathered bytes holds the same object."""
    return getattr(quantizer, "_fsdp_shard_quantizer", False)


def refresh_shard_quantizer(shard_quantizer, quantizer) -> None:
    """The module's recipe state was rebuilt (e.g. an autocast recipe of other settings than
    ``quantized_model_init``'s) while FSDP2 had the whole weight registered: the shard's
    quantizer, which that weight shares, takes ``quantizer``'s state (scale, amax history
    row, settings) in place, keeping its shard form, so the shard's next re-quantization casts
    with the live state."""
    keep = {k: v for k, v in vars(shard_quantizer).items() if k in _SHARD_SETTINGS}
    shard_quantizer.__dict__.update(quantizer.__getstate__())
    shard_quantizer.__dict__.update(keep)


def _check_one_scale(shard, mesh) -> None:
    """Once per shard, at its first all-gather (the only collective the hooks add): do all
    ranks' shards hold the same scale?

    From then on every re-quantization of a shard reduces its amax over the group, so the
    scales stay equal; before, a shard re-quantized under current scaling (e.g. a checkpoint
    loaded into the sharded model before its first forward) took the scale of its own rows,
    and the gathered bytes would be read with one rank's scale. One two-float all-reduce and
    one host sync per FP8 parameter, in the first step only."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # a mesh without a process group (the hooks driven by hand)
    scale_inv = shard._scale_inv.detach().reshape(1).float()
    extremes = torch.cat([scale_inv, -scale_inv])
    torch.distributed.all_reduce(
        extremes, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group()
    )
    largest, smallest = extremes[0].item(), -extremes[1].item()
    if largest != smallest:
        raise RuntimeError(
            f"{type(shard).__name__}: the FSDP2 shards of an FP8 parameter hold different "
            f"scales on different ranks (scale_inv from {smallest:.6g} to {largest:.6g}), so "
            "its gathered bytes have no one scale. Under current scaling a shard re-quantized "
            "before the model's first forward (e.g. a checkpoint of high-precision values "
            "loaded after fully_shard) takes the scale of its own rows: load such values "
            "before fully_shard, or after the first forward, or load FP8 values (bytes and "
            "scale) instead"
        )


def fsdp_pre_all_gather(shard, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
    """``((row-wise FP8 bytes of the shard, padded to FSDP's shard size),), metadata)``."""
    del contiguous_orig_stride, module, mp_policy  # FP8 parameters are contiguous; no casts
    owner = type(shard).__name__
    orig_size = torch.Size(orig_size)
    if shard.dim() == 0 or tuple(shard.shape[1:]) != tuple(orig_size[1:]):
        raise NotImplementedError(
            f"{owner}: FSDP2 shards an FP8 parameter of shape {tuple(orig_size)} into "
            f"{tuple(shard.shape)}; FP8 all-gather takes shards along dim 0 only (drop the "
            "shard_placement_fn that picks another dim for this parameter)"
        )
    if shard._data is None:
        raise RuntimeError(
            f"{owner}: this FSDP2 shard holds only its transposed FP8 copy; the all-gather "
            "sends row-wise bytes. Re-quantize the parameter with row-wise usage"
        )
    # FSDP2 keeps the shard in a buffer of its own (padded for uneven sizes): the shard is the
    # whole tensor its scale belongs to, not a part of another one.
    shard._shares_scale_with_base = False
    make_shard_quantizer(shard, mesh.get_group())
    if not shard.__dict__.get("_fsdp_scale_checked", False):
        _check_one_scale(shard, mesh)
        shard._fsdp_scale_checked = True
    if shard._transpose is not None:
        shard.update_usage(rowwise_usage=True, columnwise_usage=False)
    data = shard._data
    world = mesh.size()
    padded_rows = -(-orig_size[0] // world)
    if data.shape[0] != padded_rows:
        padded = torch.zeros((padded_rows, *data.shape[1:]), dtype=data.dtype, device=data.device)
        padded[: data.shape[0]].copy_(data)
        data = padded
    return (data,), (orig_size,)


def _fill_transpose(transpose: torch.Tensor, data: torch.Tensor) -> None:
    cols = data.shape[-1]
    transpose.view(cols, -1).copy_(data.reshape(-1, cols).t())


def fsdp_post_all_gather(shard, all_gather_outputs, metadata, param_dtype, *, out=None):
    """The whole parameter around the gathered bytes: ``(tensor, tensors FSDP2 frees)`` the
    first time, ``None`` when refreshing ``out`` in place."""
    (gathered,) = all_gather_outputs
    (orig_size,) = metadata
    data = gathered[: orig_size[0]].view(orig_size)  # drops the padding rows; still a view
    needs_transpose = orig_size.numel() > 0 and not is_non_tn_fp8_gemm_supported(data.device)
    if out is not None:
        if out._data is None or out._data.data_ptr() != data.data_ptr():
            raise RuntimeError(
                f"{type(shard).__name__}: the FP8 parameter FSDP2 refreshes no longer views "
                "its all-gather buffer (its row-wise bytes were replaced); do not re-quantize "
                "or edit unsharded FSDP2 parameters in place"
            )
        out._scale_inv.copy_(shard._scale_inv.reshape(out._scale_inv.shape))
        out._fp8_dtype = shard._fp8_dtype
        if out._transpose is not None:
            _fill_transpose(out._transpose, data)
        return None
    transpose = None
    if needs_transpose:
        transpose = torch.empty(
            float8_transposed_shape(orig_size), dtype=torch.uint8, device=data.device
        )
        _fill_transpose(transpose, data)
    tensor = type(shard)(
        orig_size,
        param_dtype,
        data=data,
        fp8_scale_inv=shard._scale_inv.detach().clone().reshape(1),
        fp8_dtype=shard._fp8_dtype,
        data_transpose=transpose,
        quantizer=shard._quantizer,
    )
    return tensor, ([transpose] if transpose is not None else [])
