"""The fields of ``NVFP4BlockScaling``: their environment defaults, checks and derived QParams.

``_NVFP4Fields`` is a dataclass mixin; ``transformer_engine.common.recipe`` defines
``NVFP4BlockScaling(_NVFP4Fields, Recipe)`` from it (the recipe module itself is at its size
limit). Environment variables, each read at construction:

``NVTE_NVFP4_DISABLE_RHT``, ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING``,
``NVTE_NVFP4_DISABLE_2D_QUANTIZATION``, ``NVTE_NVFP4_ROW_SCALED_ACTIVATION``
    ``"1"`` makes the matching bool field default to True.
``NVTE_NVFP4_4OVER6`` (default ``"none"``), ``NVTE_NVFP4_4OVER6_E4M3_USE_256`` (default
``"all"``), ``NVTE_NVFP4_4OVER6_ERR_MODE`` (default ``"MAE"``, upper-cased)
    Defaults of the 4over6 fields.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ._field_checks import (
    RecipeTypeError,
    backward_override_from_env,
    check_backward_override,
    check_bool,
    lax_str,
    type_name,
)
from ._formats import Format, QParams, as_format, as_params

__all__ = ["_NVFP4Fields", "unbuilt_nvfp4_options"]

FOUR_OVER_SIX_TARGETS = ("none", "weights", "activations", "all")
ERR_MODES = ("MAE", "MSE")


def _env_flag(name: str):
    return lambda: os.environ.get(name, "0") == "1"


def _env_str(name: str, default: str, upper: bool = False):
    def read() -> str:
        value = os.environ.get(name, default)
        return value.upper() if upper else value

    return read


def _check_choice(choices):
    def check(owner: str, name: str, value: Any) -> str:
        value = lax_str(value)
        if not isinstance(value, str):
            raise RecipeTypeError(
                f"{owner}: {name} must be a str, got {value!r} ({type_name(value)}); pass one of "
                f"{choices}"
            )
        if value not in choices:
            raise ValueError(f"{owner}: {name}={value!r} is not one of {choices}")
        return value

    return check


def _check_format(expected: Format):
    def check(owner: str, name: str, value: Any) -> Format:
        if as_format(value) is not expected:
            raise ValueError(
                f"{owner}: {name}={value!r} is not supported; NVFP4 uses {name}=Format."
                f"{expected.name}"
            )
        return expected

    return check


def _check_qparams(owner: str, name: str, value: Any) -> QParams:
    return as_params(QParams, owner, name, value, "QParams(random_hadamard_transform=True)")


@dataclasses.dataclass(repr=False)
class _NVFP4Fields:
    """Fields, checks, ``__post_init__`` and repr of ``NVFP4BlockScaling``."""

    disable_rht: bool = dataclasses.field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = dataclasses.field(
        default_factory=_env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    disable_2d_quantization: bool = dataclasses.field(
        default_factory=_env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION")
    )
    row_scaled_activation: bool = dataclasses.field(
        default_factory=_env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION")
    )
    nvfp4_4over6: str = dataclasses.field(default_factory=_env_str("NVTE_NVFP4_4OVER6", "none"))
    nvfp4_4over6_e4m3_use_256: str = dataclasses.field(
        default_factory=_env_str("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all")
    )
    nvfp4_4over6_err_mode: str = dataclasses.field(
        default_factory=_env_str("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE", upper=True)
    )
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=backward_override_from_env)
    # Derived in __post_init__ from the disable_* flags (not constructor arguments); tests and
    # users assign them afterwards to switch RHT, stochastic rounding or 2-D blocks per role.
    fp4_quant_fwd_inp: QParams = dataclasses.field(init=False, default=QParams())
    fp4_quant_fwd_weight: QParams = dataclasses.field(init=False, default=QParams())
    fp4_quant_bwd_grad: QParams = dataclasses.field(init=False, default=QParams())

    _field_checks = {
        "disable_rht": check_bool,
        "disable_stochastic_rounding": check_bool,
        "disable_2d_quantization": check_bool,
        "row_scaled_activation": check_bool,
        "nvfp4_4over6": _check_choice(FOUR_OVER_SIX_TARGETS),
        "nvfp4_4over6_e4m3_use_256": _check_choice(FOUR_OVER_SIX_TARGETS),
        "nvfp4_4over6_err_mode": _check_choice(ERR_MODES),
        "fp4_format": _check_format(Format.E2M1),
        "fp8_format": _check_format(Format.E4M3),
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_backward_override,
        "fp4_quant_fwd_inp": _check_qparams,
        "fp4_quant_fwd_weight": _check_qparams,
        "fp4_quant_bwd_grad": _check_qparams,
    }

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.nvfp4_4over6 != "none" and not (
            self.disable_rht and self.disable_stochastic_rounding
        ):
            raise ValueError(
                f"{owner}: nvfp4_4over6={self.nvfp4_4over6!r} cannot be combined with the random "
                "Hadamard transform or stochastic rounding; set disable_rht=True and "
                "disable_stochastic_rounding=True, or nvfp4_4over6='none'"
            )
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )

    def __repr__(self) -> str:
        def q(p: QParams) -> str:
            return (
                f"(rht={p.random_hadamard_transform}, sr={p.stochastic_rounding}, "
                f"2d={p.fp4_2d_quantization})"
            )

        return (
            f"recipe_type={type(self).__name__}, fp4_format={self.fp4_format.name}, "
            f"fp8_format={self.fp8_format.name}, fp4_quant_fwd_inp={q(self.fp4_quant_fwd_inp)}, "
            f"fp4_quant_fwd_weight={q(self.fp4_quant_fwd_weight)}, "
            f"fp4_quant_bwd_grad={q(self.fp4_quant_bwd_grad)}, "
            f"row_scaled_activation={self.row_scaled_activation}, "
            f"nvfp4_4over6={self.nvfp4_4over6}, fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, backward_override={self.backward_override}"
        )


def unbuilt_nvfp4_options(recipe) -> list[str]:
    """The options set on an NVFP4 recipe that this package does not build (empty: none)."""
    options = []
    if recipe.nvfp4_4over6 != "none":
        options.append(f"nvfp4_4over6={recipe.nvfp4_4over6!r} (the 4over6 block-scale search)")
    if recipe.row_scaled_activation:
        options.append("row_scaled_activation=True (per-row global scales of activations)")
    if recipe.fp8_dpa or recipe.fp8_mha:
        options.append("fp8_dpa/fp8_mha=True (FP8 attention with an NVFP4 recipe)")
    for name in ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad"):
        p = getattr(recipe, name)
        if p.power_2_scale or p.amax_epsilon:
            options.append(f"{name} with power_2_scale/amax_epsilon (FP8 block-scale options)")
    return options
