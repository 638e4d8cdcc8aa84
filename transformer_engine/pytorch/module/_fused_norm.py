"""The normalization fused in front of ``LayerNormLinear`` and ``LayerNormMLP``: its argument
check, its parameters (``layer_norm_weight`` / ``layer_norm_bias``) and its forward."""

from __future__ import annotations

import torch

from ..functional.normalization import layernorm, norm_kernels_write_fp8, norm_to_fp8, rmsnorm
from ..functional.produced_fp8 import can_produce

__all__ = [
    "NORMALIZATIONS",
    "check_normalization",
    "register_norm_parameters",
    "apply_norm",
    "apply_norm_fp8",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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


def apply_norm_fp8(module, inp: torch.Tensor, config, *, columnwise: bool):
    """The module's normalization of ``inp`` written in FP8 for the GEMM ``config`` describes
    (its input quantizer's cast, in the norm's own kernel where it can), as the ``[rows, H]``
    tensor that GEMM takes as it is, with the transposed copy when ``columnwise``; ``None``
    where the norm kernels do not write FP8 (``norm_kernels_write_fp8``) or that GEMM does not
    take a produced FP8 input (no FP8, a recipe whose quantizer computes its scale some other
    way, a high-precision backward, or ``save_original_input``, which quantizes the norm's
    output again in backward)."""
    quantizer = config.input_quantizer
    if (
        not norm_kernels_write_fp8()
        or not config.fp8
        or config.backward_override is not None
        or config.save_original_input
        or not can_produce(quantizer, inp.dtype, config.activation_dtype)
    ):
        return None
    # 2-D: the GEMM then takes the tensor as it is (no view of an FP8 tensor).
    out = norm_to_fp8(
        inp.reshape(-1, inp.shape[-1]), module.layer_norm_weight, module.layer_norm_bias,
        module.eps, module.zero_centered_gamma, rms=module.normalization == "RMSNorm",
        quantizer=quantizer, columnwise=columnwise,
    )  # fmt: skip
    config.input_produced = True  # the GEMM drops the row-wise bytes after use
    return out
