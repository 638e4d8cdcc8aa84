"""Parameters as FSDP2 shards them, for deferred initialization.

The deferred-initialization flow of FSDP2 (and of Megatron-FSDP, torchtitan): build the model
on the ``meta`` device, ``fully_shard`` it, ``model.to_empty(device=...)``, then call each
module's ``reset_parameters()``.

Under ``quantized_model_init`` the weights are FP8 tensors from the start, on ``meta`` too
(:func:`meta_fp8_parameters`): ``fully_shard`` decides then, from the tensor type, whether a
parameter's all-gather sends FP8 bytes (``Float8Tensor.fsdp_pre_all_gather``), and a weight
that became FP8 only at the reset would be all-gathered as high-precision values.

A ``reset_parameters()`` of a module whose parameters are ``DTensor`` shards: FSDP2 holds the sharded ``Parameter`` objects it made, so the
reset must write into them, not replace them (a replaced parameter is a plain full tensor FSDP
no longer manages). Each rank computes the whole initial value, as an unsharded module does
(the same random draws, so sharded and unsharded models start equal), keeps the part its shard
covers and copies it into the shard in place. Under ``quantized_model_init`` the whole value is
quantized first, with the module's (fresh) quantizer as unsharded, and the shard takes the
FP8 bytes, the scale and that quantizer.
"""

from __future__ import annotations

import torch

from ...common.recipe import DelayedScaling, Float8CurrentScaling
from ..quantization import get_fp8_te_dtype
from ..quantized_tensor import QuantizedTensor
from ..tensor._float8_fsdp import make_shard_quantizer
from ..tensor.float8_tensor import Float8Tensor
from ..tensor.utils import attach_high_precision_init_val

__all__ = [
    "is_sharded_parameter",
    "meta_fp8_parameters",
    "rebind_fp8_parameter_quantizers",
    "reset_sharded_parameters",
]


def meta_fp8_parameters(module) -> None:
    """Under ``quantized_model_init`` of a per-tensor recipe (``DelayedScaling``,
    ``Float8CurrentScaling``) on ``meta``: each weight becomes a ``Float8Tensor`` on ``meta``
    in the recipe's forward format (no quantizer: its recipe state needs a real device);
    ``reset_parameters()`` gives it values, scale and quantizer. Block-scaled weights, which
    FSDP2 has no FP8 all-gather for here, stay high-precision until the reset."""
    recipe = module._fp8_param_recipe
    if not module.primary_weights_in_fp8 or not isinstance(
        recipe, (DelayedScaling, Float8CurrentScaling)
    ):
        return
    fp8_dtype = get_fp8_te_dtype(recipe, fprop_tensor=True)
    for name, (_, index) in module.param_init_meta.items():
        param = module._parameters.get(name)
        if index is None or param is None or not param.is_meta:
            continue
        if isinstance(param, QuantizedTensor):
            continue
        empty = Float8Tensor(
            param.shape,
            param.dtype,
            data=torch.empty(param.shape, dtype=torch.uint8, device="meta"),
            fp8_scale_inv=torch.ones(1, dtype=torch.float32, device="meta"),
            fp8_dtype=fp8_dtype,
        )
        module._replace_parameter(name, param, empty)


def is_sharded_parameter(param) -> bool:
    """Whether ``param`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, or a DTensor-based
    tensor-parallel plan)."""
    return hasattr(param, "device_mesh") and hasattr(param, "to_local")


def _shard_of(param):
    """A DTensor's local tensor itself: ``to_local()`` of a Parameter hands out a view (torch
    >= 2.12), and what is set on a view (a quantizer) would not reach the shard."""
    local = getattr(param, "_local_tensor", None)
    return param.to_local() if local is None else local


def rebind_fp8_parameter_quantizers(module) -> None:
    """After the module's recipe state was (re)built: each FP8 weight re-quantizes with a copy
    of its new quantizer. An FSDP2 shard's gets the shard's form at once (row-wise, amax
    reduced over the shard group, see ``tensor/_float8_fsdp.py``): an optimizer step before
    the next all-gather must already cast with the whole weight's amax."""
    for name, param in module.named_parameters(recurse=False):
        index = module.param_init_meta.get(name, (None, None))[1]
        if index is None:
            continue
        quantizer = module.quantizers["scaling_fwd"][index].copy()
        if is_sharded_parameter(param):
            local = _shard_of(param)
            if isinstance(local, QuantizedTensor):
                local._quantizer = quantizer
                if hasattr(local, "fsdp_pre_all_gather"):
                    make_shard_quantizer(local, param.device_mesh)
        elif isinstance(param, QuantizedTensor):
            param._quantizer = quantizer


def _local_part(full: torch.Tensor, param) -> torch.Tensor:
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


def reset_sharded_parameters(module) -> list[str]:
    """Initialize each of ``module``'s DTensor parameters in place, in registration order (the
    random draws of an unsharded module); returns their names."""
    names = [n for n, p in module.named_parameters(recurse=False) if is_sharded_parameter(p)]
    for name in names:
        init_fn, index = module.param_init_meta.get(name, (None, None))
        high_precision = _reset_sharded_parameter(module, name, init_fn, index)
        if high_precision is not None and module.preserve_high_precision_init_val:
            attach_high_precision_init_val(getattr(module, name), high_precision)
    return names


def _reset_sharded_parameter(module, name: str, init_fn, fp8_index) -> torch.Tensor | None:
    """Initialize the DTensor parameter ``module.<name>`` in place (see the module doc);
    returns the high-precision values of this rank's part when the parameter is FP8 (for
    ``preserve_high_precision_init_val``), else ``None``."""
    param = getattr(module, name)
    with torch.no_grad():
        local = _shard_of(param)
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        with module._rng_context():
            full.zero_() if init_fn is None else init_fn(full)
        high_precision = None
        if fp8_index is not None and module.primary_weights_in_fp8:
            high_precision = _local_part(full, param).cpu().clone()
            full = module._quantize_parameter(full, fp8_index)
        part = _local_part(full, param)
        if isinstance(local, QuantizedTensor):
            # FSDP2 keeps the shard in a buffer of its own: it takes the part's bytes and scale
            # as a whole tensor (not re-quantized with a scale shared with that buffer), and the
            # quantizer of the module's new recipe state (the shard's came from the meta one).
            if hasattr(local, "_shares_scale_with_base"):
                local._shares_scale_with_base = False
            if isinstance(part, QuantizedTensor):
                local._quantizer = part._quantizer
        local.copy_(part)
    return high_precision
