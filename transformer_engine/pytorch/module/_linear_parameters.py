"""The weight and bias of ``Linear`` and ``LayerNormLinear``, optionally split by
``parameters_split`` into several named parameters, and the check of not-built arguments the
linear-family modules share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._contiguous_parameters import as_one_tensor

__all__ = [
    "check_single_process_arguments",
    "check_features",
    "split_sizes",
    "register_linear_parameters",
    "linear_weight",
    "linear_bias",
]


def check_single_process_arguments(module: str, **arguments) -> None:
    """Arguments of features not built here (userbuffers comm/GEMM overlap, symmetric
    all-reduce, grouped tensors) are accepted at their defaults and refused otherwise."""
    for name, value in arguments.items():
        if value not in (None, False):
            raise NotImplementedError(f"{module}: {name}={value!r} is not implemented yet")


def check_features(**features) -> None:
    """Layer sizes must be positive ints (checked before anything is allocated)."""
    for label, value in features.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{label}={value!r} must be a positive int")


def split_sizes(parameters_split, out_features: int) -> dict[str, int]:
    """``parameters_split`` as ``{name: rows}`` (a tuple of names splits evenly); ``{"": out}``
    when there is no split."""
    if parameters_split is None:
        return {"": out_features}
    if isinstance(parameters_split, dict):
        sizes = {str(k): int(v) for k, v in parameters_split.items()}
    else:
        names = list(parameters_split)
        if not names or out_features % len(names):
            raise ValueError(
                f"parameters_split={parameters_split!r} must split out_features={out_features} "
                "into equal parts; pass a dict of sizes otherwise"
            )
        sizes = {str(n): out_features // len(names) for n in names}
    if sum(sizes.values()) != out_features:
        raise ValueError(
            f"parameters_split sizes {sizes} sum to {sum(sizes.values())}, not out_features="
            f"{out_features}"
        )
    return {name.rstrip("_"): size for name, size in sizes.items()}


def register_linear_parameters(
    module,
    *,
    in_features: int,
    out_features: int,
    parameters_split,
    bias: bool,
    params_dtype: torch.dtype,
    device: torch.device,
    init_method: Callable,
    fp8_meta_index: int,
) -> None:
    """Register ``weight``/``bias`` (or ``<name>_weight``/``<name>_bias`` per split) on
    ``module`` and record the split in ``module.sizes``. FP8 parameters cannot be split."""
    module.sizes = split_sizes(parameters_split, out_features)
    module.use_bias = bias
    if parameters_split is not None and module.primary_weights_in_fp8:
        raise ValueError(
            f"parameters_split={parameters_split!r} cannot be combined with FP8 parameters "
            "(quantized_model_init): the splits would be views into one FP8 weight, which a "
            "quantized tensor cannot share; build the module outside quantized_model_init, or "
            "keep the weight whole (MultiheadAttention / TransformerLayer: fuse_qkv_params=True)"
        )
    if parameters_split is not None and getattr(module, "fuse_wgrad_accumulation", False):
        raise ValueError(
            "parameters_split cannot be combined with fuse_wgrad_accumulation=True: the split "
            "weights are separate parameters, so there is no single main_grad to accumulate into"
        )
    # All the weights, then all the biases, as upstream registers them (the order of
    # ``parameters()``, which an optimizer's state follows); a split's weights (and biases) are
    # row ranges of one buffer, kept so by reset_parameters and moves (_contiguous_parameters).
    prefixes = [f"{split}_" if split else "" for split in module.sizes]
    rows = list(module.sizes.values())
    weights = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
    for prefix, w in zip(prefixes, weights.split(rows, dim=0)):
        module.register_parameter(
            f"{prefix}weight", torch.nn.Parameter(w), init_fn=init_method,
            fp8_meta_index=None if prefix else fp8_meta_index,
        )  # fmt: skip
    if bias:
        biases = torch.empty(out_features, dtype=params_dtype, device=device)
        for prefix, b in zip(prefixes, biases.split(rows, dim=0)):
            module.register_parameter(f"{prefix}bias", torch.nn.Parameter(b), init_fn=None)
    else:
        for prefix in prefixes:
            # No bias: an empty tensor, as upstream (no Parameter, not in the state dict).
            setattr(module, f"{prefix}bias", torch.empty(0, dtype=params_dtype, device=device))
    if len(prefixes) > 1:
        module._contiguous_parameter_groups = [[f"{p}weight" for p in prefixes]] + (
            [[f"{p}bias" for p in prefixes]] if bias else []
        )


def linear_weight(module) -> torch.Tensor:
    """The whole weight (split parameters concatenated along the output dimension)."""
    if "" in module.sizes:
        return module.weight
    return as_one_tensor([getattr(module, f"{n}_weight") for n in module.sizes])


def linear_bias(module) -> torch.Tensor | None:
    """The whole bias, or ``None`` without one. (Concatenated: a split bias is small, and
    ``torch.cat`` and its backward cost less host time than the weight's view.)"""
    if not module.use_bias:
        return None
    if "" in module.sizes:
        return module.bias
    return torch.cat([getattr(module, f"{n}_bias") for n in module.sizes])
