"""A module's parameters under FSDP2: deferred initialization and FP8 weights.

The deferred-initialization flow of FSDP2 (and of Megatron-FSDP, torchtitan): build the model
on the ``meta`` device, ``fully_shard`` it, ``model.to_empty(device=...)``, then call each
module's ``reset_parameters()``, which writes each whole initial value's part into the shard in
place (``_sharded_parameters.py``). Under ``quantized_model_init`` the whole value is
quantized first, with the module's fresh quantizer, as unsharded.
"""

from __future__ import annotations

import torch

from .._sharded_parameters import (
    copy_whole_value_into_shard,
    empty_fp8_weight_on_meta,
    is_sharded_parameter,
    local_part,
    rebind_weight_quantizer,
)
from ..quantized_tensor import QuantizedTensor
from ..tensor.utils import attach_high_precision_init_val

__all__ = [
    "meta_fp8_parameters",
    "rebind_fp8_parameter_quantizers",
    "reset_sharded_parameters",
]


def meta_fp8_parameters(module) -> None:
    """Under ``quantized_model_init`` on ``meta``: each weight becomes an empty FP8 tensor of
    the recipe (see :func:`~.._sharded_parameters.empty_fp8_weight_on_meta`)."""
    if not module.primary_weights_in_fp8:
        return
    for name, (_, index) in module.param_init_meta.items():
        param = module._parameters.get(name)
        if index is None or param is None or not param.is_meta:
            continue
        if isinstance(param, QuantizedTensor):
            continue
        empty = empty_fp8_weight_on_meta(param, module._fp8_param_recipe)
        if empty is None:
            return
        module._replace_parameter(name, param, empty)


def rebind_fp8_parameter_quantizers(module) -> None:
    """After the module's recipe state was (re)built: each FP8 weight re-quantizes with a copy
    of its new quantizer. An FSDP2 shard's gets the shard's form at once (row-wise, amax
    reduced over the shard group, see ``tensor/_float8_fsdp.py``): an optimizer step before
    the next all-gather must already cast with the whole weight's amax."""
    for name, param in module.named_parameters(recurse=False):
        index = module.param_init_meta.get(name, (None, None))[1]
        if index is None:
            continue
        rebind_weight_quantizer(param, module.quantizers["scaling_fwd"][index].copy())


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
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        with module._rng_context():
            full.zero_() if init_fn is None else init_fn(full)
        high_precision = None
        if fp8_index is not None and module.primary_weights_in_fp8:
            high_precision = local_part(full, param).cpu().clone()
            full = module._quantize_parameter(full, fp8_index)
    copy_whole_value_into_shard(param, full)
    return high_precision
