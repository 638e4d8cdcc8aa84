"""Number formats and per-GEMM / per-role parameters of the recipes.

``Format``, ``MMParams`` and ``QParams`` (and the checks of fields holding them) live here, below
the recipe classes, so that every recipe module can import them without importing the package
``__init__`` (which imports the recipe modules). ``transformer_engine.common.recipe`` re-exports
them under their upstream names and sets their ``__module__`` to itself, so pickles and reprs
name the public path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from enum import Enum
from typing import Any, NamedTuple

from ._field_checks import (
    RecipeTypeError,
    check_bool,
    lax_float,
    lax_int,
    power_2_scales_from_env,
    type_name,
)
from ._lenient_init import LenientInit

# ------------------------------------------------------------------ formats and parameters


class _FormatMaxima(NamedTuple):
    """Largest finite magnitudes of a :class:`Format`: forward tensors and gradients."""

    max_fwd: int
    max_bwd: int


class Format(Enum):
    """Low-precision number formats a recipe can cast to.

    Each member's ``value`` is a named tuple ``(max_fwd, max_bwd)``: the largest finite
    magnitude of the format used for forward tensors (activations, weights) and for backward
    tensors (gradients). Read them as ``fmt.value.max_fwd`` and ``fmt.value.max_bwd``.

    Attributes
    ----------
    E2M1
        FP4 (largest value 6) everywhere. Only for FP4 recipes; FP8 recipes reject it.
    E4M3
        FP8 E4M3 (largest value 448) everywhere.
    E5M2
        FP8 E5M2 (largest value 57344) everywhere. FP8 recipes reject it: pure E5M2 training is
        not supported.
    HYBRID
        E4M3 for forward tensors, E5M2 for gradients (448 / 57344).
    """

    E2M1 = _FormatMaxima(max_fwd=6, max_bwd=6)
    E4M3 = _FormatMaxima(max_fwd=448, max_bwd=448)
    E5M2 = _FormatMaxima(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatMaxima(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass(frozen=True)
class MMParams(metaclass=LenientInit):
    """Options of one FP8 matrix multiplication (GEMM).

    Parameters
    ----------
    use_split_accumulator : bool, default True
        Accumulate in higher precision by periodically promoting the partial sums (cuBLASLt's
        split accumulation) instead of the faster FP8 fast-accumulation mode.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        value = check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)
        object.__setattr__(self, "use_split_accumulator", value)


@dataclasses.dataclass(frozen=True)
class QParams(metaclass=LenientInit):
    """Options of one quantization role (input, weight or gradient).

    Parameters
    ----------
    power_2_scale : bool, default False
        Round each scale down to a power of 2, so scaling is exact in binary.
    amax_epsilon : float, default 0.0
        Lower bound applied to the amax before the scale is computed; keeps near-zero tensors
        from producing huge scales. Must be finite and >= 0.
    random_hadamard_transform : bool, default False
        Apply a random Hadamard transform before quantizing (FP4 recipes only).
    stochastic_rounding : bool, default False
        Round stochastically instead of to nearest (FP4 recipes only).
    fp4_2d_quantization : bool, default False
        Use 2D blocks for FP4 quantization (FP4 recipes only).
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        for name in (
            "power_2_scale",
            "random_hadamard_transform",
            "stochastic_rounding",
            "fp4_2d_quantization",
        ):
            object.__setattr__(self, name, check_bool("QParams", name, getattr(self, name)))
        eps = lax_float(self.amax_epsilon)
        if eps is None:
            raise RecipeTypeError(
                f"QParams: amax_epsilon must be a float, got {self.amax_epsilon!r} "
                f"({type_name(self.amax_epsilon)}); pass a finite number >= 0.0"
            )
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(
                f"QParams: amax_epsilon must be finite and >= 0.0, got {self.amax_epsilon!r}; "
                f"pass e.g. 0.0"
            )
        # Stored as a float, so equal epsilons compare and print alike.
        object.__setattr__(self, "amax_epsilon", eps)


def as_format(value: Any) -> Format | None:
    """``value`` as a :class:`Format`: a member, or a member's value (pydantic's lax rule for
    enums, e.g. ``(448, 57344)``); None if it is neither."""
    if isinstance(value, Format):
        return value
    try:
        return Format(value)
    except (ValueError, TypeError):
        return None


def as_params(cls: type, owner: str, name: str, value: Any, example: str) -> Any:
    """``value`` as an ``MMParams``/``QParams`` (``cls``): an instance, or a dict of its fields
    (pydantic's lax rule for nested dataclasses)."""
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise RecipeTypeError(
            f"{owner}: {name} must be a {cls.__name__}, got {value!r} ({type_name(value)}); "
            f"pass e.g. {example}"
        )
    return value


def _check_fp8_format(owner: str, name: str, value: Any) -> Format:
    if as_format(value) is None:
        raise RecipeTypeError(
            f"{owner}: {name} must be a Format, got {value!r} ({type_name(value)}); "
            f"pass Format.HYBRID or Format.E4M3"
        )
    value = as_format(value)
    if value is Format.E5M2:
        raise ValueError(
            f"{owner}: {name}=Format.E5M2: pure E5M2 training is not supported; use "
            f"Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3"
        )
    if value is Format.E2M1:
        raise ValueError(
            f"{owner}: {name}=Format.E2M1 is an FP4 format, not an FP8 one; use "
            f"Format.HYBRID or Format.E4M3"
        )
    return value


def _check_mm_params(owner: str, name: str, value: Any) -> MMParams:
    return as_params(MMParams, owner, name, value, "MMParams(use_split_accumulator=True)")


def _import_time_role_qparams() -> QParams:
    """Per-role ``QParams`` of ``Float8CurrentScaling``, made once when this module is imported."""
    return QParams(power_2_scale=power_2_scales_from_env(), amax_epsilon=0.0)


FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


def fp32_scales_from_env() -> bool:
    """Default of ``Float8BlockScaling.use_f32_scales``: True exactly when the variable is
    ``"1"``."""
    return os.environ.get(FP32_SCALES_ENV, "0") == "1"


def _import_time_block_qparams() -> QParams:
    """Per-role ``QParams`` of ``Float8BlockScaling``, made once when this module is imported:
    power-of-2 scales unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` is ``"1"``."""
    return QParams(power_2_scale=not fp32_scales_from_env(), amax_epsilon=0.0)


def _check_block_scaling_dim(owner: str, name: str, value: Any) -> int:
    dim = lax_int(value)
    if dim is None:
        raise RecipeTypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); pass 1 "
            f"(1x128 tiles) or 2 (128x128 blocks)"
        )
    if dim not in (1, 2):
        raise ValueError(
            f"{owner}: {name}={value!r} is not supported; pass 1 (1x128 tiles) or 2 (128x128 "
            f"blocks)"
        )
    return dim


def _check_split_accumulator(owner: str, name: str, value: Any) -> MMParams:
    value = _check_mm_params(owner, name, value)
    if not value.use_split_accumulator:
        raise ValueError(
            f"{owner}: {name}=MMParams(use_split_accumulator=False) is not supported: block-scaled "
            f"FP8 GEMMs always accumulate in full float32; pass MMParams(use_split_accumulator=True)"
        )
    return value


def _check_false(owner: str, name: str, value: Any) -> bool:
    if check_bool(owner, name, value):
        raise ValueError(
            f"{owner}: {name}=True is not supported: FP8 attention is not available with "
            f"Float8BlockScaling (upstream asserts it False too); leave {name}=False"
        )
    return False


_BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")


def _check_block_dims_together(recipe: Any, name: str, old: Any) -> None:
    """After ``recipe.<name>`` was set (from ``old``, ``dataclasses.MISSING`` during
    construction): refuse two block dims of 2, restoring the recipe as it was.

    The block dims of ``Float8BlockScaling`` are checked together: every GEMM pairs two of the
    three roles, and no GEMM takes two 128x128-scaled operands."""
    fields = recipe.__dict__
    if name not in _BLOCK_DIM_FIELDS or not all(f in fields for f in _BLOCK_DIM_FIELDS):
        return
    two_d = [f for f in _BLOCK_DIM_FIELDS if fields[f] == 2]
    if len(two_d) > 1:
        if old is dataclasses.MISSING:
            object.__delattr__(recipe, name)
        else:
            object.__setattr__(recipe, name, old)
        raise ValueError(
            f"{type(recipe).__name__}: {' and '.join(f'{f}=2' for f in two_d)}: 2D by 2D "
            f"block gemm not supported (a GEMM of two 128x128-scaled operands); set at "
            f"most one block dim to 2 (default: w_block_scaling_dim=2, the others 1)"
        )
