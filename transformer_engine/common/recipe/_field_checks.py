"""Checks of single recipe field values, shared by construction and assignment.

Every check takes the owner's class name, the field name and the value, raises ``TypeError``
(wrong type) or ``ValueError`` (wrong value) with a message naming the field, the value and the
fix, and returns the value to store (integers normalised to ``int``). Checks that need the
recipe types themselves (``Format``, ``MMParams``) live beside those types.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import Any

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


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}: {name} must be a bool, got {value!r} ({type_name(value)}); "
            f"pass True or False"
        )
    return value


def check_int_at_least(owner: str, name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass, but margin=True is far more likely a mistake than a request for 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); "
            f"pass an integer >= {minimum}"
        )
    if value < minimum:
        raise ValueError(
            f"{owner}: {name} must be >= {minimum}, got {value}; pass {minimum} or more"
        )
    return int(value)


def check_backward_override(owner: str, name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
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
    check_backward_override(owner, name, value)
    if value is not None:
        raise ValueError(
            f"{owner}: {name}={value!r} is not supported with delayed scaling; leave "
            f"{name}=None, or use Float8CurrentScaling"
        )
    return None


def check_amax_compute_algo(owner: str, name: str, value: Any) -> Any:
    if isinstance(value, str):
        if value not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"{owner}: {name}={value!r} is not supported; pass 'max', 'most_recent' or a "
                f"callable mapping the amax history [L, N] to amaxes [N]"
            )
    elif not callable(value):
        raise TypeError(
            f"{owner}: {name} must be 'max', 'most_recent' or a callable, got {value!r} "
            f"({type_name(value)})"
        )
    return value


def check_optional_callable(owner: str, name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(
            f"{owner}: {name} must be None or a callable (amax, scale, fp8_max, recipe) -> "
            f"scale, got {value!r} ({type_name(value)})"
        )
    return value


def check_qfactory(owner: str, name: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(
            f"{owner}: {name} must be a callable taking a QuantizerRole (or None) and returning "
            f"a Quantizer or a QuantizerRequest, got {value!r} ({type_name(value)}); pass e.g. "
            f"transformer_engine.pytorch.custom_recipes.quantizer_factories.current_scaling_factory"
        )
    return value


def check_alignment(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); pass a "
            f"positive integer such as 128"
        )
    if value <= 0:
        raise ValueError(
            f"{owner}: {name} must be positive, got {value}; pass a positive integer such as 128"
        )
    return int(value)


def not_a_field_message(cls: type, name: str) -> str:
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    if hasattr(cls, name):
        return (
            f"{cls.__name__}.{name} is a class attribute shared by every {cls.__name__}, not a "
            f"field of one recipe, and cannot be assigned on an instance; the fields are: "
            f"{fields}"
        )
    return f"{cls.__name__} has no field {name!r}; its fields are: {fields}"
