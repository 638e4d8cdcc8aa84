"""Checks of single recipe field values, shared by construction and assignment.

Every check takes the owner's class name, the field name and the value, raises
:class:`RecipeTypeError` (wrong type) or ``ValueError`` (wrong value) with a message naming the
field, the value and the fix, and returns the value to store. Values are first converted the
way upstream's pydantic dataclasses convert them in their default (lax) mode, so that every
argument upstream accepts is accepted here with the same result: an int field takes integral
floats (``16.0``) and integer strings (``"16"``, ``" 16 "``, ``"16.0"``); a bool field takes
``0``/``1`` (ints, floats), ``"true"``/``"false"``, ``"yes"``/``"no"``, ``"on"``/``"off"``,
``"t"``/``"f"``, ``"y"``/``"n"``, ``"1"``/``"0"`` (any case); a float field takes numbers and
numeric strings; a str field takes bytes; NumPy scalars count as the Python value they hold.
Anything else (``16.5`` or ``"abc"`` for an int, ``2`` for a bool, ``None`` for either) is
refused. Checks that need the recipe types themselves (``Format``, ``MMParams``) live beside
those types.
"""

from __future__ import annotations

import decimal
import math
import numbers
import os
import re
from collections.abc import Callable
from typing import Any


class RecipeTypeError(TypeError, ValueError):
    """A recipe argument of the wrong type (e.g. ``margin="abc"``).

    Upstream's recipes are pydantic dataclasses, which raise ``pydantic.ValidationError``, a
    ``ValueError``, for a value of the wrong type; this package used to raise ``TypeError``.
    The error is both, so that code written against either (``except ValueError`` as upstream
    callers do, ``except TypeError`` as this package's earlier callers and tests do) still
    catches it.
    """


BACKWARD_OVERRIDE_ENV = "NVTE_BACKWARD_OVERRIDE"
POWER_2_SCALES_ENV = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
BACKWARD_OVERRIDES = ("high_precision", "dequantized")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def power_2_scales_from_env() -> bool:
    """Default of ``use_power_2_scales``: True exactly when the variable is ``"1"``."""
    return os.environ.get(POWER_2_SCALES_ENV, "0") == "1"


def backward_override_from_env() -> str | None:
    """Default of ``Float8CurrentScaling.backward_override`` from ``NVTE_BACKWARD_OVERRIDE``."""
    value = os.environ.get(BACKWARD_OVERRIDE_ENV, "")
    if value == "":
        return None
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"environment variable {BACKWARD_OVERRIDE_ENV}={value!r} is not a valid "
            f"backward_override; set it to one of {BACKWARD_OVERRIDES} or unset it"
        )
    return value


def type_name(value: Any) -> str:
    return type(value).__name__


_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_TRUE_TEXT = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_TEXT = frozenset({"0", "off", "f", "false", "n", "no"})


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python value it holds, bytes as str; anything else unchanged."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return value
    return value


def _integral(value: Any) -> int | None:
    """``value`` (a real number or Decimal) as an int if it is finite and whole, else None."""
    try:
        if math.isfinite(value) and value == int(value):
            return int(value)
    except (TypeError, ValueError, OverflowError, decimal.InvalidOperation):
        pass
    return None


def lax_int(value: Any) -> int | None:
    """``value`` as an int under pydantic's lax rules, or None where it is not one."""
    value = _plain(value)
    if isinstance(value, numbers.Integral):  # bool too: pydantic takes True as 1
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        return int(text.split(".")[0]) if _INT_TEXT.fullmatch(text) else None
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        return _integral(value)
    return None


def lax_bool(value: Any) -> bool | None:
    """``value`` as a bool under pydantic's lax rules, or None where it is not one."""
    value = _plain(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE_TEXT:
            return True
        return False if lowered in _FALSE_TEXT else None
    if isinstance(value, (numbers.Real, decimal.Decimal)) and _integral(value) in (0, 1):
        return bool(value)
    return None


def lax_float(value: Any) -> float | None:
    """``value`` as a float under pydantic's lax rules, or None where it is not one."""
    value = _plain(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        return float(value)
    return None


def lax_str(value: Any) -> Any:
    """Bytes as str (pydantic's lax rule); anything else unchanged, for the caller to check."""
    return _plain(value)


def check_bool(owner: str, name: str, value: Any) -> bool:
    result = lax_bool(value)
    if result is None:
        raise RecipeTypeError(
            f"{owner}: {name} must be a bool, got {value!r} ({type_name(value)}); "
            f"pass True or False"
        )
    return result


def check_int_at_least(owner: str, name: str, value: Any, minimum: int) -> int:
    result = lax_int(value)
    if result is None:
        raise RecipeTypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); "
            f"pass an integer >= {minimum}"
        )
    if result < minimum:
        raise ValueError(
            f"{owner}: {name} must be >= {minimum}, got {value!r}; pass {minimum} or more"
        )
    return result


def check_backward_override(owner: str, name: str, value: Any) -> str | None:
    value = lax_str(value)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecipeTypeError(
            f"{owner}: {name} must be None or a str, got {value!r} "
            f"({type_name(value)}); pass None, 'high_precision' or 'dequantized'"
        )
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"{owner}: {name}={value!r} is not supported; pass None, "
            f"'high_precision' or 'dequantized'"
        )
    return value


def check_delayed_backward_override(owner: str, name: str, value: Any) -> None:
    value = check_backward_override(owner, name, value)
    if value is not None:
        raise ValueError(
            f"{owner}: {name}={value!r} is not supported with delayed scaling; leave "
            f"{name}=None, or use Float8CurrentScaling"
        )
    return None


def check_amax_compute_algo(owner: str, name: str, value: Any) -> Any:
    value = lax_str(value)
    if isinstance(value, str):
        if value not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"{owner}: {name}={value!r} is not supported; pass 'max', 'most_recent' or a "
                f"callable mapping the amax history [L, N] to amaxes [N]"
            )
    elif not callable(value):
        raise RecipeTypeError(
            f"{owner}: {name} must be 'max', 'most_recent' or a callable, got {value!r} "
            f"({type_name(value)})"
        )
    return value


def check_optional_callable(owner: str, name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise RecipeTypeError(
            f"{owner}: {name} must be None or a callable (amax, scale, fp8_max, recipe) -> "
            f"scale, got {value!r} ({type_name(value)})"
        )
    return value


def check_qfactory(owner: str, name: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        raise RecipeTypeError(
            f"{owner}: {name} must be a callable taking a QuantizerRole (or None) and returning "
            f"a Quantizer or a QuantizerRequest, got {value!r} ({type_name(value)}); pass e.g. "
            f"transformer_engine.pytorch.custom_recipes.quantizer_factories.current_scaling_factory"
        )
    return value


def check_alignment(owner: str, name: str, value: Any) -> int:
    result = lax_int(value)
    if result is None:
        raise RecipeTypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); pass a "
            f"positive integer such as 128"
        )
    if result <= 0:
        raise ValueError(
            f"{owner}: {name} must be positive, got {value!r}; pass a positive integer such as 128"
        )
    return result
