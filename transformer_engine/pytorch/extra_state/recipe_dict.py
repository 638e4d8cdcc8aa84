"""A checkpointed recipe as plain data: :func:`recipe_to_dict` and :func:`recipe_from_dict`.

The ``"recipe"`` entry of our extra-state format (:mod:`.format`) is this dict, so that
``torch.load(..., weights_only=True)`` reads it without naming any class. A recipe callable
(``amax_compute_algo`` or ``scaling_factor_compute_algo`` of :class:`DelayedScaling`) cannot be
stored as plain data: it is written as the string ``"<callable>"`` and read back as the field's
default, with a ``UserWarning`` saying the callable must be set again.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ...common.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)
from .contents import ANOTHER_LAYOUT, PLAIN_SCALARS
from .contents import RECIPE_CLASSES as _STATE_RECIPE_CLASSES

__all__ = ["CALLABLE_PLACEHOLDER", "recipe_to_dict", "recipe_from_dict"]

CALLABLE_PLACEHOLDER = "<callable>"

# The recipes a checkpoint can name: those of the extra-state contents and the block-scaled
# ones (stateless like Float8CurrentScaling: only the recipe itself is stored).
RECIPE_CLASSES = {
    **_STATE_RECIPE_CLASSES,
    "Float8BlockScaling": Float8BlockScaling,
    "MXFP8BlockScaling": MXFP8BlockScaling,
    "NVFP4BlockScaling": NVFP4BlockScaling,
}

# The environment variable each recipe's class-level QParams are read from, at import.
_QPARAMS_ENV = {
    Float8CurrentScaling: "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
    Float8BlockScaling: "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
}

# Float8CurrentScaling's and Float8BlockScaling's per-role QParams are class attributes, not
# constructor fields.
_QPARAMS_ATTRS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_MMPARAMS_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
_CALLABLE_FIELDS = ("amax_compute_algo", "scaling_factor_compute_algo")
# NVFP4BlockScaling's per-role QParams: fields derived at construction (init=False), stored and
# assigned back after it.
_FP4_QPARAMS_FIELDS = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")


def _encode_recipe_value(owner: str, name: str, value: Any) -> Any:
    if isinstance(value, Format):
        return value.name
    if isinstance(value, (MMParams, QParams)):
        return dataclasses.asdict(value)
    if type(value) in PLAIN_SCALARS:
        return value
    if name in _CALLABLE_FIELDS and callable(value):
        # A function cannot be stored as data; the loader restores the default and warns.
        return CALLABLE_PLACEHOLDER
    raise TypeError(f"{owner}.{name}={value!r} ({type(value).__name__}) cannot be checkpointed")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data: ``{"type": class name, field: value, ...}``.

    Parameters
    ----------
    recipe : DelayedScaling, Float8CurrentScaling or Float8BlockScaling
        The recipe to store (exactly these classes, not subclasses, so that the stored
        ``"type"`` rebuilds the same class).

    Returns
    -------
    dict
        Every constructor field: ``Format`` as its member name (``"HYBRID"``), ``MMParams`` as
        ``{"use_split_accumulator": bool}``, a callable algorithm as ``"<callable>"``. For
        :class:`Float8CurrentScaling` and :class:`Float8BlockScaling` also their class-level
        ``fp8_quant_*`` ``QParams`` as dicts,
        so a loader can tell when its own differ.

    Raises
    ------
    ValueError
        ``recipe`` is not a recipe this format can store.
    """
    cls = type(recipe)
    if RECIPE_CLASSES.get(cls.__name__) is not cls:
        raise ValueError(
            f"recipe {recipe!r} ({cls.__module__}.{cls.__qualname__}) cannot be stored in a "
            f"checkpoint; this format stores {' and '.join(RECIPE_CLASSES)} recipes"
        )
    stored: dict[str, Any] = {"type": cls.__name__}
    for field in dataclasses.fields(cls):
        stored[field.name] = _encode_recipe_value(
            cls.__name__, field.name, getattr(recipe, field.name)
        )
    if cls in _QPARAMS_ENV:
        for attr in _QPARAMS_ATTRS:
            stored[attr] = dataclasses.asdict(getattr(recipe, attr))
    return stored


def _params_from_dict(cls: type, value: Any, where: str) -> Any:
    """Rebuild an ``MMParams``/``QParams`` from its dict, naming ``where`` in errors."""
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} must be a dict of {cls.__name__} fields, got {value!r}; {ANOTHER_LAYOUT}"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(value) - names))
    missing = sorted(names - set(value))
    if unknown or missing:
        raise ValueError(
            f"{where}: unknown {cls.__name__} fields {unknown}, missing fields {missing}; "
            f"{ANOTHER_LAYOUT}"
        )
    try:
        return cls(**value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} is invalid: {exc}") from exc


def _field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _decode_recipe_field(cls: type, name: str, value: Any) -> Any:
    where = f"checkpoint recipe {cls.__name__}.{name}"
    if name in ("fp8_format", "fp4_format"):
        if type(value) is not str or value not in Format.__members__:
            raise ValueError(
                f"{where}={value!r} is not a Format name ({', '.join(Format.__members__)}); "
                f"{ANOTHER_LAYOUT}"
            )
        return Format[value]
    if name in _MMPARAMS_FIELDS:
        return _params_from_dict(MMParams, value, where)
    if name in _FP4_QPARAMS_FIELDS:
        return _params_from_dict(QParams, value, where)
    if name in _CALLABLE_FIELDS and isinstance(value, str) and value == CALLABLE_PLACEHOLDER:
        default = _field_defaults(cls)[name]
        warnings.warn(
            f"{where} was a callable, which a checkpoint cannot store; it is restored as the "
            f"default {default!r}. Set the callable again: build the recipe with "
            f"{name}=<your function> and pass it to te.autocast(recipe=...)",
            UserWarning,
            stacklevel=4,
        )
        return default
    return value


def recipe_from_dict(stored: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from :func:`recipe_to_dict`'s output.

    Parameters
    ----------
    stored : dict
        ``{"type": "DelayedScaling" | "Float8CurrentScaling" | "Float8BlockScaling", <every
        field>}``.

    Returns
    -------
    Recipe
        A validated recipe equal, field for field, to the one stored (a stored callable comes
        back as the field's default, with a ``UserWarning``).

    Raises
    ------
    ValueError
        Unknown ``"type"``, unknown or missing field, or an invalid value; the message names it.

    Warns
    -----
    UserWarning
        A callable algorithm was replaced by its default; or the stored ``Float8CurrentScaling``
        ``fp8_quant_*`` parameters differ from this process's (they are class attributes, fixed
        at import from ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``, so the stored values are
        reported, not applied).
    """
    if not isinstance(stored, dict):
        raise ValueError(f"checkpoint recipe must be a dict, got {stored!r}; {ANOTHER_LAYOUT}")
    type_name = stored.get("type")
    cls = RECIPE_CLASSES.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise ValueError(
            f"checkpoint recipe type {type_name!r} is unknown (this build reads "
            f"{', '.join(RECIPE_CLASSES)}); {ANOTHER_LAYOUT}"
        )
    field_names = [f.name for f in dataclasses.fields(cls)]
    expected = set(field_names) | (set(_QPARAMS_ATTRS) if cls in _QPARAMS_ENV else set())
    unknown = sorted(map(str, set(stored) - expected - {"type"}))
    if unknown:
        raise ValueError(
            f"checkpoint recipe {type_name} has unknown fields {unknown}; {ANOTHER_LAYOUT}"
        )
    missing = sorted(expected - set(stored))
    if missing:
        raise ValueError(f"checkpoint recipe {type_name} lacks fields {missing}; {ANOTHER_LAYOUT}")
    values = {name: _decode_recipe_field(cls, name, stored[name]) for name in field_names}
    derived = {f.name for f in dataclasses.fields(cls) if not f.init}
    try:
        recipe = cls(**{n: v for n, v in values.items() if n not in derived})
        for name in derived:
            setattr(recipe, name, values[name])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint recipe {type_name} is invalid: {exc}") from exc
    if cls in _QPARAMS_ENV:
        for attr in _QPARAMS_ATTRS:
            saved = _params_from_dict(
                QParams, stored[attr], f"checkpoint recipe {type_name}.{attr}"
            )
            current = getattr(cls, attr)
            if saved != current:
                warnings.warn(
                    f"checkpoint recipe {type_name}.{attr} was {saved}, this process "
                    f"uses {current}: it is a class attribute fixed when "
                    f"transformer_engine.common.recipe is imported, from "
                    f"{_QPARAMS_ENV[cls]}; set that variable as in the run "
                    f"that wrote the checkpoint to quantize the same way",
                    UserWarning,
                    stacklevel=2,
                )
    return recipe
