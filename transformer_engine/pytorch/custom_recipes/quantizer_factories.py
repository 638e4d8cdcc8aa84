"""Quantizer factories for ``CustomRecipe`` that reproduce the built-in FP8 recipes.

Each factory maps one slot's :class:`~transformer_engine.pytorch.quantization.QuantizerRole`
(``None`` for a module's boundary slots) to what the slot is quantized with. A ``CustomRecipe``
with one of them casts exactly as the built-in recipe with default fields does (for
``nvfp4_factory``, see its docstring); ``high_precision_factory`` quantizes nothing (every slot
gets an :class:`IdentityQuantizer`).
"""

from __future__ import annotations

import torch

from ...common.recipe import Format
from ..quantization import DelayedScalingRequest, QuantizerRole
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer
from ..tensor.identity_tensor import IdentityQuantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer

__all__ = [
    "current_scaling_factory",
    "delayed_scaling_factory",
    "float8_block_scaling_factory",
    "high_precision_factory",
    "mxfp8_factory",
    "nvfp4_factory",
]

_LINEAR_OWNERS = ("linear", "grouped_linear")


def _linear_weight(role: QuantizerRole | None) -> bool:
    return role is not None and role.tensor_type == "weight" and role.module_type in _LINEAR_OWNERS


def current_scaling_factory(role: QuantizerRole | None) -> Float8CurrentScalingQuantizer:
    """``Float8CurrentScaling()`` slot by slot: a current-scaling quantizer, E5M2 for gradients
    (``tensor_type == "grad_output"``) and E4M3 for everything else (boundary slots included),
    no power-of-2 scales, no amax epsilon."""
    grad = role is not None and role.tensor_type == "grad_output"
    dtype = torch.float8_e5m2 if grad else torch.float8_e4m3fn
    return Float8CurrentScalingQuantizer(dtype, force_pow_2_scales=False, amax_epsilon=0.0)


def delayed_scaling_factory(role: QuantizerRole | None) -> DelayedScalingRequest:
    """``DelayedScaling()`` slot by slot: every slot asks for library-managed delayed scaling
    with the default fields (HYBRID: E4M3 forward, E5M2 backward)."""
    del role  # every slot gets the same request: they share one history per direction
    return DelayedScalingRequest(fp8_format=Format.HYBRID)


def high_precision_factory(role: QuantizerRole | None) -> IdentityQuantizer:
    """No quantization: every slot keeps its tensor in high precision, so the GEMMs of a
    ``CustomRecipe`` with this factory compute as outside ``te.autocast``."""
    del role  # every slot is treated alike
    return IdentityQuantizer()


def float8_block_scaling_factory(role: QuantizerRole | None) -> Float8BlockQuantizer:
    """``Float8BlockScaling()`` slot by slot: E4M3 everywhere, power-of-2 scales, no amax
    epsilon, both usages; 128x128 blocks for the weights of linear and grouped-linear owners,
    1x128 tiles for every other slot (inputs, gradients, boundary slots)."""
    return Float8BlockQuantizer(
        torch.float8_e4m3fn, rowwise=True, columnwise=True,
        block_scaling_dim=2 if _linear_weight(role) else 1,
        force_pow_2_scales=True, amax_epsilon=0.0,
    )  # fmt: skip


def mxfp8_factory(role: QuantizerRole | None) -> MXFP8Quantizer:
    """``MXFP8BlockScaling()`` slot by slot: E4M3 with both usages for every slot."""
    del role  # every slot is treated alike
    return MXFP8Quantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True)


def nvfp4_factory(role: QuantizerRole | None) -> NVFP4Quantizer:
    """NVFP4 slot by slot, as upstream's factory: weights of linear owners in 16x16 blocks
    without the random Hadamard transform or stochastic rounding; output gradients with the
    transform, the amax measured after it, and stochastic rounding; every other slot with the
    transform (amax measured before it). That last point is where it differs from
    ``NVFP4BlockScaling()``, whose input slots measure the amax after the transform."""
    if _linear_weight(role):
        return NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=True)
    grad = role is not None and role.tensor_type == "grad_output"
    return NVFP4Quantizer(
        rowwise=True, columnwise=True, with_rht=True, with_post_rht_amax=grad,
        stochastic_rounding=grad,
    )  # fmt: skip
