"""Quantizer factories for ``CustomRecipe`` that reproduce the built-in FP8 recipes.

Each factory maps one slot's :class:`~transformer_engine.pytorch.quantization.QuantizerRole`
(``None`` for a module's boundary slots) to what the slot is quantized with. A ``CustomRecipe``
with one of them casts exactly as the built-in recipe with default fields does;
``high_precision_factory`` quantizes nothing (every slot gets an :class:`IdentityQuantizer`).
"""

from __future__ import annotations

import torch

from ...common.recipe import Format
from ..quantization import DelayedScalingRequest, QuantizerRole
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer
from ..tensor.identity_tensor import IdentityQuantizer

__all__ = ["current_scaling_factory", "delayed_scaling_factory", "high_precision_factory"]


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
