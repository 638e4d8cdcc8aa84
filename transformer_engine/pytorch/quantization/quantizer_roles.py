"""Quantizer roles and requests: what a :class:`CustomRecipe` factory is asked and may answer.

A module or operation names each of its quantizer slots with a :class:`QuantizerRole`; the
factory of a ``CustomRecipe`` maps the role to a ``Quantizer`` or to a :class:`QuantizerRequest`,
a request for a quantizer whose state the library keeps (:class:`DelayedScalingRequest`).
All three are frozen (hashable) dataclasses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...common.recipe import DelayedScaling, Format

__all__ = ["QuantizerRole", "QuantizerRequest", "DelayedScalingRequest"]


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """What one quantizer slot quantizes.

    Parameters
    ----------
    module_type : str
        The kind of owner, e.g. ``"linear"`` (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``
        and ``te.ops`` linears) or ``"grouped_linear"``.
    tensor_type : str
        The tensor of the slot: ``"input"``, ``"weight"`` (forward) or ``"grad_output"``
        (backward).
    name : str
        The owner's ``name=`` (``LayerNormMLP`` adds ``.fc1`` / ``.fc2``); empty when unnamed.
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("module_type", "tensor_type", "name"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise TypeError(
                    f"QuantizerRole: {field} must be a str, got {value!r} "
                    f"({type(value).__name__}); pass a string (empty for 'unspecified')"
                )

    def __str__(self) -> str:
        parts = [
            f"{field}={getattr(self, field)}"
            for field in ("module_type", "tensor_type", "name")
            if getattr(self, field)
        ]
        return "|".join(parts) if parts else "QuantizerRole()"


@dataclasses.dataclass(frozen=True)
class QuantizerRequest:
    """Base of the answers a factory gives when the library should build and own the
    quantizer's state (rather than the factory returning a ready ``Quantizer``)."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingRequest(QuantizerRequest):
    """Quantize this slot with delayed scaling; the library keeps the amax history and scale.

    The fields mean what the :class:`~transformer_engine.common.recipe.DelayedScaling` fields of
    the same names mean, and are checked the same way. Every request answered within one
    module's (or operation's) direction must be equal: they share one amax history and scale
    tensor, updated together.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[[Any], Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        self.as_delayed_scaling()  # runs DelayedScaling's per-field checks

    def as_delayed_scaling(self) -> DelayedScaling:
        """The :class:`DelayedScaling` recipe whose update rules this request asks for."""
        return DelayedScaling(
            fp8_format=self.fp8_format,
            margin=self.margin,
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            scaling_factor_compute_algo=self.scaling_factor_compute_algo,
            reduce_amax=self.reduce_amax,
        )
