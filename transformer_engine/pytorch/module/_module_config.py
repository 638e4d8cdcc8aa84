"""Pieces the linear-family modules share: the per-GEMM ``LinearConfig``, the weight as a GEMM
sees it, and the parameters and forward of the fused normalization.

``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and ``GroupedLinear`` all run their GEMMs
through ``linear_forward``; what differs between them is only which quantizer slots and which
weight workspace each GEMM uses, and whether it may claim the autocast region's
first-module flag (which decides who updates the backward scales). Those differences are the
keyword arguments of :func:`make_linear_config`.
"""

from __future__ import annotations

import warnings

import torch

from ..quantization import FP8GlobalStateManager
from ..quantized_tensor import QuantizedTensor
from ..functional.linear import LinearConfig, check_fp8_gemm_shapes
from ._normalization import layernorm, rmsnorm

__all__ = [
    "make_linear_config",
    "gemm_weight",
    "quantize_output",
    "fp8_input_gradient",
    "NORMALIZATIONS",
    "check_normalization",
    "register_norm_parameters",
    "apply_norm",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def make_linear_config(
    module,
    inp: torch.Tensor,
    weight: torch.Tensor,
    is_first_microbatch: bool | None,
    *,
    input_slot: int,
    weight_slot: int,
    grad_output_slot: int,
    workspace_key: str,
    in_features: int,
    out_features: int,
    read_first_module_flag: bool = True,
    main_grad_param: torch.Tensor | None = None,
) -> LinearConfig:
    """The ``LinearConfig`` of one GEMM of ``module`` in the current forward.

    Parameters
    ----------
    module : TransformerEngineBaseModule
        Inside ``prepare_forward_ctx``: its ``fp8``, ``activation_dtype``, quantizers and
        recipe are read, and its weight workspace is used for ``is_first_microbatch``.
    inp : torch.Tensor
        The GEMM's input; only its token count (product of the leading dimensions) is used.
    weight : torch.Tensor
        The weight the GEMM will use (a ``QuantizedTensor`` for FP8 parameters).
    is_first_microbatch : bool or None
        ``None``: quantize the weight every call. ``True``: quantize and cache it under
        ``workspace_key``. ``False``: reuse the cached copy. Also selects whether the weight
        gradient accumulates into ``main_grad`` (it does unless ``True``, or unless the weight
        carries ``overwrite_main_grad=True``).
    input_slot, weight_slot : int
        Forward quantizer slots of the GEMM's input and weight.
    grad_output_slot : int
        Backward quantizer slot of the GEMM's output gradient.
    workspace_key : str
        Key of the cached quantized weight (one per weight of the module).
    in_features, out_features : int
        The GEMM's reduction and output sizes (checked to be multiples of 16 in FP8).
    read_first_module_flag : bool, default True
        Whether this GEMM may claim the region's first-module flag and then update the
        backward scales at the end of its backward. Reading clears the flag, so a module with
        several GEMMs lets only the one whose backward runs last read it.

    Raises
    ------
    ValueError
        In FP8, sizes that are not multiples of 16 (see ``check_fp8_gemm_shapes``).
    """
    fp8 = module.fp8
    config = LinearConfig(
        fp8=fp8,
        activation_dtype=module.activation_dtype,
        fuse_wgrad_accumulation=module.fuse_wgrad_accumulation,
        # Megatron's overwrite_main_grad: the wgrad GEMM writes main_grad instead of adding.
        accumulate_into_main_grad=not is_first_microbatch
        and not getattr(
            main_grad_param if main_grad_param is not None else weight, "overwrite_main_grad", False
        ),
        main_grad_param=main_grad_param,
    )
    if not fp8:
        return config
    grad = torch.is_grad_enabled()
    tokens = inp.numel() // max(inp.shape[-1], 1)
    check_fp8_gemm_shapes(tokens, in_features, out_features, grad and weight.requires_grad)
    fwd, bwd = module.quantizers["scaling_fwd"], module.quantizers["scaling_bwd"]
    config.input_quantizer = fwd[input_slot]
    config.weight_quantizer = fwd[weight_slot]
    config.grad_output_quantizer = bwd[grad_output_slot]
    if not isinstance(weight, QuantizedTensor):
        config.cached_weight, config.cache_weight = module._cached_weight(
            workspace_key, is_first_microbatch
        )
    recipe = module.fp8_meta["recipe"]
    if hasattr(recipe, "fp8_gemm_fprop"):
        config.fprop_split_accumulator = recipe.fp8_gemm_fprop.use_split_accumulator
        config.dgrad_split_accumulator = recipe.fp8_gemm_dgrad.use_split_accumulator
        config.wgrad_split_accumulator = recipe.fp8_gemm_wgrad.use_split_accumulator
    config.backward_override = getattr(recipe, "backward_override", None)
    # With a backward override nothing is quantized in backward, so there is no backward
    # state to update (and the first-module flag stays for a module that has some).
    config.reduce_and_update_bwd = (
        read_first_module_flag
        and grad
        and config.backward_override is None
        and FP8GlobalStateManager.is_first_fp8_module()
    )
    return config


def quantize_output(quantizer, out: torch.Tensor):
    """``fp8_output=True``: the GEMM's output as a ``Float8Tensor`` (the forward state's output
    slot). It stays in the autograd graph: the gradient passes through unchanged, in high
    precision (straight-through), so a model can train through an FP8 output."""
    return quantizer.quantize(out)


class _QuantizeGradient(torch.autograd.Function):
    """Identity in forward; in backward the gradient is handed on as a quantized tensor."""

    @staticmethod
    def forward(ctx, tensor, quantizer):  # noqa: D102
        ctx.quantizer = quantizer
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        quantizer = ctx.quantizer
        quantizer.set_usage(rowwise=True, columnwise=False)
        return quantizer.quantize_impl(grad), None


def fp8_input_gradient(inp: torch.Tensor, quantizer) -> torch.Tensor:
    """``fp8_grad=True``: ``inp`` unchanged, but the module hands the gradient of its input back
    as a ``Float8Tensor`` (nominal dtype the input's) cast by ``quantizer``, the backward state's
    grad-input slot. The cast runs after the module's own backward (for ``LayerNormLinear``
    after the normalization's), so under delayed scaling its amax joins the history at the next
    backward update."""
    if not inp.requires_grad or not torch.is_grad_enabled():
        return inp
    return _QuantizeGradient.apply(inp, quantizer)


def gemm_weight(owner: str, weight: torch.Tensor, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    """The weight as a GEMM uses it.

    FP8 parameters are used as they are inside ``te.autocast`` and dequantized (with a warning)
    outside it; high-precision weights are cast to the activation dtype when they differ (under
    ``torch.autocast``).
    """
    if isinstance(weight, QuantizedTensor):
        if fp8:
            return weight
        warnings.warn(
            f"{owner}: FP8 weights used outside te.autocast are dequantized", stacklevel=3
        )
        return weight.dequantize(dtype=dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


# --- The fused normalization of LayerNormLinear and LayerNormMLP ------------------------------


def check_normalization(owner: str, normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{owner}: normalization={normalization!r} is not supported; use one of "
            f"{', '.join(repr(n) for n in NORMALIZATIONS)}"
        )


def _ones(t: torch.Tensor) -> None:
    t.fill_(1.0)


def register_norm_parameters(
    module,
    normalization: str,
    size: int,
    zero_centered_gamma: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm) on ``module``.

    The weight starts at 1, or at 0 with ``zero_centered_gamma`` (the norm then scales by
    ``1 + weight``); the bias starts at 0. RMSNorm has no bias: ``layer_norm_bias`` is ``None``.
    """
    weight = torch.empty(size, dtype=dtype, device=device)
    module.register_parameter(
        "layer_norm_weight",
        torch.nn.Parameter(weight),
        init_fn=None if zero_centered_gamma else _ones,  # None initializes to zero
    )
    if normalization == "LayerNorm":
        bias = torch.empty(size, dtype=dtype, device=device)
        module.register_parameter("layer_norm_bias", torch.nn.Parameter(bias), init_fn=None)
    else:
        module.layer_norm_bias = None


def apply_norm(module, inp: torch.Tensor) -> torch.Tensor:
    """The module's normalization of ``inp`` (float32 inside, output in ``inp``'s dtype)."""
    # The norm computes in float32 whatever the parameters' dtype, and returns inp's dtype.
    weight = module.layer_norm_weight
    if module.normalization == "RMSNorm":
        return rmsnorm(inp, weight, module.eps, module.zero_centered_gamma)
    return layernorm(inp, weight, module.layer_norm_bias, module.eps, module.zero_centered_gamma)
