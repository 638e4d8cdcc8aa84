"""Checkpoint format of a module's FP8 state: what ``get_extra_state`` returns.

Why a format of our own
-----------------------
NVIDIA Transformer Engine stores a module's FP8 state (recipe, scales, amax histories) as
``pickle.dumps(dict)`` bytes inside a ``torch.uint8`` tensor. Reading such a checkpoint means
unpickling those bytes, and unpickling calls whatever importable callables the bytes name: a
tampered checkpoint runs arbitrary code, and ``torch.load(..., weights_only=True)`` cannot
stop it because the pickle hides inside an ordinary tensor. Here the extra state is instead a
dict of tensors and plain values, which ``torch.load(..., weights_only=True)`` reads without
running any code::

    {
        "format": "transformer_engine/extra_state",
        "version": 1,
        "recipe": {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID", ...},
        "tensors": {
            "scale_fwd": float32 [N_fwd], "amax_history_fwd": float32 [L, N_fwd],
            "scale_bwd": float32 [N_bwd], "amax_history_bwd": float32 [L, N_bwd],
        },
        "extra": {...},  # str, int, float, bool, None, and lists/tuples/str-keyed dicts of those
    }

The tensors are CPU copies, whatever device the module was on when it was saved, and
:func:`unpack_extra_state` puts them on the device the *loading* module lives on (DESIGN.md
section 3.4): a checkpoint written on ``cuda:3`` loads into a module on ``cuda:0`` or on CPU.
``"tensors"`` holds a subset of the four names (current scaling keeps none).

A recipe callable (``amax_compute_algo`` or ``scaling_factor_compute_algo`` of
:class:`DelayedScaling`) cannot be stored as plain data: it is written as the string
``"<callable>"`` and read back as the field's default, with a ``UserWarning`` saying the
callable must be set again.

Reading upstream checkpoints
----------------------------
:func:`unpack_extra_state` also reads upstream's formats: a ``torch.uint8`` tensor of pickle
bytes, and the older ``io.BytesIO`` holding a ``torch.save`` archive. The pickle is first
inspected *without running it* (:mod:`pickletools`), collecting the globals it names:

* A payload that names no globals at all can only build builtin containers and scalars, so it
  is read with an unpickler that refuses every global anyway. Such a payload cannot hold a
  recipe or a tensor, i.e. no FP8 state; it reads as ``None`` (nothing to restore), as upstream
  ignores it.
* Anything else (the normal case: the recipe object and the tensors are globals) is unpickled
  only when ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``; otherwise :func:`unpack_extra_state`
  raises ``RuntimeError`` explaining the risk and how to convert the checkpoint. ``io.BytesIO``
  payloads always need the opt-in, as upstream.

Environment variables
---------------------
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``
    ``"1"`` allows unpickling upstream's pickle-based extra state; any other value, or unset,
    refuses it. Read at every load, by :func:`_unsafe_pickle_allowed`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ...common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
    Recipe,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TENSOR_NAMES",
    "CALLABLE_PLACEHOLDER",
    "UnpackedExtraState",
    "pack_extra_state",
    "unpack_extra_state",
    "recipe_to_dict",
    "recipe_from_dict",
]

FORMAT_NAME = "transformer_engine/extra_state"
FORMAT_VERSION = 1
TENSOR_NAMES = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
CALLABLE_PLACEHOLDER = "<callable>"

_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
_STATE_KEYS = ("format", "version", "recipe", "tensors", "extra")
_RECIPE_CLASSES: dict[str, type[Recipe]] = {
    "DelayedScaling": DelayedScaling,
    "Float8CurrentScaling": Float8CurrentScaling,
}
# Float8CurrentScaling's per-role QParams are class attributes, not constructor fields.
_QPARAMS_ATTRS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_MMPARAMS_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
_CALLABLE_FIELDS = ("amax_compute_algo", "scaling_factor_compute_algo")
_PLAIN_SCALARS = (str, int, float, bool, type(None))
_ANOTHER_LAYOUT = "the checkpoint comes from another layout or version of transformer_engine"


class UnpackedExtraState(NamedTuple):
    """What :func:`unpack_extra_state` returns; unpacks as ``recipe, tensors, extra``."""

    recipe: Recipe
    tensors: dict[str, torch.Tensor]
    extra: dict[str, Any]


def _unsafe_pickle_allowed() -> bool:
    """Whether ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` is ``"1"``, read at call time."""
    return os.environ.get(_UNSAFE_PICKLE_ENV, "0") == "1"


# ------------------------------------------------------------------ plain values


def _copy_plain(value: Any, path: str, error: type[Exception], *, exact: bool = True) -> Any:
    """A copy of ``value`` made only of types ``torch.load(weights_only=True)`` accepts.

    Writing (``exact=True``) compares container types exactly: an ``OrderedDict`` or a list
    subclass would be stored as a reference to its class, which a weights-only load may refuse.
    Reading (``exact=False``) also takes subclasses of dict, list and tuple, which state-dict
    tooling may have substituted, and returns the plain types. Scalars are always compared
    exactly: an ``IntEnum`` is a class reference too.
    """
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    for plain in (list, tuple):
        if kind is plain or (not exact and isinstance(value, plain)):
            return plain(
                _copy_plain(item, f"{path}[{i}]", error, exact=exact)
                for i, item in enumerate(value)
            )
    if kind is dict or (not exact and isinstance(value, dict)):
        copied = {}
        for key, item in value.items():
            if type(key) is not str:
                raise error(
                    f"{path} has the key {key!r} ({type(key).__name__}); extra state dicts "
                    f"must have str keys"
                )
            copied[key] = _copy_plain(item, f"{path}[{key!r}]", error, exact=exact)
        return copied
    raise error(
        f"{path} is {value!r} ({kind.__name__}); extra state may hold only str, int, float, "
        f"bool, None and lists, tuples and str-keyed dicts of those (exact types, so "
        f"torch.load(weights_only=True) can read them): convert it, e.g. int(value) or "
        f"dict(value)"
    )


# ------------------------------------------------------------------ recipes


def _encode_recipe_value(owner: str, name: str, value: Any) -> Any:
    if isinstance(value, Format):
        return value.name
    if isinstance(value, (MMParams, QParams)):
        return dataclasses.asdict(value)
    if type(value) in _PLAIN_SCALARS:
        return value
    if name in _CALLABLE_FIELDS and callable(value):
        # A function cannot be stored as data; the loader restores the default and warns.
        return CALLABLE_PLACEHOLDER
    raise TypeError(f"{owner}.{name}={value!r} ({type(value).__name__}) cannot be checkpointed")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data: ``{"type": class name, field: value, ...}``.

    Parameters
    ----------
    recipe : DelayedScaling or Float8CurrentScaling
        The recipe to store (exactly these classes, not subclasses, so that the stored
        ``"type"`` rebuilds the same class).

    Returns
    -------
    dict
        Every constructor field: ``Format`` as its member name (``"HYBRID"``), ``MMParams`` as
        ``{"use_split_accumulator": bool}``, a callable algorithm as ``"<callable>"``. For
        :class:`Float8CurrentScaling` also its class-level ``fp8_quant_*`` ``QParams`` as dicts,
        so a loader can tell when its own differ.

    Raises
    ------
    ValueError
        ``recipe`` is not a recipe this format can store.
    """
    cls = type(recipe)
    if _RECIPE_CLASSES.get(cls.__name__) is not cls:
        raise ValueError(
            f"recipe {recipe!r} ({cls.__module__}.{cls.__qualname__}) cannot be stored in a "
            f"checkpoint; this format stores {' and '.join(_RECIPE_CLASSES)} recipes"
        )
    stored: dict[str, Any] = {"type": cls.__name__}
    for field in dataclasses.fields(cls):
        stored[field.name] = _encode_recipe_value(
            cls.__name__, field.name, getattr(recipe, field.name)
        )
    if cls is Float8CurrentScaling:
        for attr in _QPARAMS_ATTRS:
            stored[attr] = dataclasses.asdict(getattr(recipe, attr))
    return stored


def _params_from_dict(cls: type, value: Any, where: str) -> Any:
    """Rebuild an ``MMParams``/``QParams`` from its dict, naming ``where`` in errors."""
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} must be a dict of {cls.__name__} fields, got {value!r}; {_ANOTHER_LAYOUT}"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(value) - names))
    missing = sorted(names - set(value))
    if unknown or missing:
        raise ValueError(
            f"{where}: unknown {cls.__name__} fields {unknown}, missing fields {missing}; "
            f"{_ANOTHER_LAYOUT}"
        )
    try:
        return cls(**value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} is invalid: {exc}") from exc


def _field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _decode_recipe_field(cls: type, name: str, value: Any) -> Any:
    where = f"checkpoint recipe {cls.__name__}.{name}"
    if name == "fp8_format":
        if type(value) is not str or value not in Format.__members__:
            raise ValueError(
                f"{where}={value!r} is not a Format name ({', '.join(Format.__members__)}); "
                f"{_ANOTHER_LAYOUT}"
            )
        return Format[value]
    if name in _MMPARAMS_FIELDS:
        return _params_from_dict(MMParams, value, where)
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
        ``{"type": "DelayedScaling" | "Float8CurrentScaling", <every field>}``.

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
        raise ValueError(f"checkpoint recipe must be a dict, got {stored!r}; {_ANOTHER_LAYOUT}")
    type_name = stored.get("type")
    cls = _RECIPE_CLASSES.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise ValueError(
            f"checkpoint recipe type {type_name!r} is unknown (this build reads "
            f"{', '.join(_RECIPE_CLASSES)}); {_ANOTHER_LAYOUT}"
        )
    field_names = [f.name for f in dataclasses.fields(cls)]
    expected = set(field_names) | (set(_QPARAMS_ATTRS) if cls is Float8CurrentScaling else set())
    unknown = sorted(map(str, set(stored) - expected - {"type"}))
    if unknown:
        raise ValueError(
            f"checkpoint recipe {type_name} has unknown fields {unknown}; {_ANOTHER_LAYOUT}"
        )
    missing = sorted(expected - set(stored))
    if missing:
        raise ValueError(f"checkpoint recipe {type_name} lacks fields {missing}; {_ANOTHER_LAYOUT}")
    kwargs = {name: _decode_recipe_field(cls, name, stored[name]) for name in field_names}
    try:
        recipe = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint recipe {type_name} is invalid: {exc}") from exc
    if cls is Float8CurrentScaling:
        for attr in _QPARAMS_ATTRS:
            saved = _params_from_dict(
                QParams, stored[attr], f"checkpoint recipe {type_name}.{attr}"
            )
            current = getattr(cls, attr)
            if saved != current:
                warnings.warn(
                    f"checkpoint recipe Float8CurrentScaling.{attr} was {saved}, this process "
                    f"uses {current}: it is a class attribute fixed when "
                    f"transformer_engine.common.recipe is imported, from "
                    f"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES; set that variable as in the run "
                    f"that wrote the checkpoint to quantize the same way",
                    UserWarning,
                    stacklevel=2,
                )
    return recipe


# ------------------------------------------------------------------ tensors


def _check_tensor_set(tensors: Mapping[str, Any], where: str, type_error: type[Exception]) -> None:
    """Names among TENSOR_NAMES, float32 tensors, scale [N] paired with history [L, N]."""
    for name, tensor in tensors.items():
        if name not in TENSOR_NAMES:
            raise ValueError(
                f"{where} has the entry {name!r}; expected a subset of {list(TENSOR_NAMES)}"
            )
        if not isinstance(tensor, torch.Tensor):
            raise type_error(
                f"{where}[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}"
            )
        if tensor.dtype != torch.float32:
            raise type_error(f"{where}[{name!r}] must be float32, got {tensor.dtype}")
    for direction in ("fwd", "bwd"):
        scale = tensors.get(f"scale_{direction}")
        history = tensors.get(f"amax_history_{direction}")
        if scale is None and history is None:
            continue
        if scale is None or history is None:
            raise ValueError(
                f"{where} has only one of 'scale_{direction}' and 'amax_history_{direction}'; "
                f"delayed-scaling state needs both"
            )
        if scale.dim() != 1 or history.dim() != 2 or history.shape[1] != scale.shape[0]:
            raise ValueError(
                f"{where}: scale_{direction} {tuple(scale.shape)} and amax_history_{direction} "
                f"{tuple(history.shape)} must have shapes [N] and [L, N]"
            )


def _cpu_copy(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.is_meta:
        raise ValueError(
            f"fp8_meta_tensors[{name!r}] is on the meta device and holds no values; "
            f"materialize the module (reset_parameters / to_empty) before saving it"
        )
    # A fresh dense tensor, so the checkpoint stores exactly these values (not a larger
    # storage a view may share) and later in-place updates of the live state cannot reach it.
    # The copy is blocking, which waits on the stream of the tensor's own device; upstream's
    # non_blocking copy followed by torch.cuda.synchronize() waited on the current device only.
    return torch.empty(tuple(tensor.shape), dtype=torch.float32).copy_(tensor.detach())


def _to_module_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Always a copy: the caller may adopt it as live state, which must not alias the tensor of
    # the state dict being loaded (the same state dict may be loaded into several modules).
    return tensor.detach().to(device=device, copy=True).contiguous()


def _target_device(device: Any) -> torch.device:
    if device is None:
        raise ValueError(
            "unpack_extra_state needs device=...: the device of the module's parameters, where "
            "its FP8 state lives (state follows its module, DESIGN.md section 3.4)"
        )
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        raise ValueError(
            f"device={device} names no CUDA index; pass the module's device (e.g. "
            f"weight.device, cuda:N) so the state lands next to its weights"
        )
    return device


# ------------------------------------------------------------------ our format


def pack_extra_state(
    recipe: Recipe, fp8_meta_tensors: dict[str, torch.Tensor], extra: dict
) -> dict[str, Any]:
    """Build the object a module returns from ``get_extra_state()``.

    Parameters
    ----------
    recipe : DelayedScaling or Float8CurrentScaling
        The module's recipe.
    fp8_meta_tensors : dict of str to torch.Tensor
        The live state, a subset of ``"scale_fwd"``, ``"amax_history_fwd"``, ``"scale_bwd"``,
        ``"amax_history_bwd"`` (each scale ``[N]`` float32 paired with its history ``[L, N]``
        float32), on any device; they are copied, never referenced.
    extra : dict
        Other module state to keep (e.g. ``fp8_meta`` flags): str keys; values str, int, float,
        bool, None, or lists, tuples and str-keyed dicts of those. Copied.

    Returns
    -------
    dict
        ``{"format": "transformer_engine/extra_state", "version": 1, "recipe":
        recipe_to_dict(recipe), "tensors": {name: CPU float32 copy}, "extra": copy of extra}``,
        readable by ``torch.load(..., weights_only=True)``.

    Raises
    ------
    TypeError
        ``extra`` holds a value that is not plain (the message names its key), or a tensor
        entry is not a float32 tensor.
    ValueError
        Unknown tensor name, unpaired or misshapen tensors, a meta tensor, or a recipe this
        format cannot store.
    """
    if type(extra) is not dict:
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    extra_copy = _copy_plain(extra, "extra", TypeError)
    if not isinstance(fp8_meta_tensors, Mapping):
        raise TypeError(
            f"fp8_meta_tensors must be a dict of tensors, got {type(fp8_meta_tensors).__name__}"
        )
    _check_tensor_set(fp8_meta_tensors, "fp8_meta_tensors", TypeError)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "recipe": recipe_to_dict(recipe),
        "tensors": {name: _cpu_copy(t, name) for name, t in fp8_meta_tensors.items()},
        "extra": extra_copy,
    }


def _unpack_ours(state: dict, device: torch.device) -> UnpackedExtraState:
    found_format = state.get("format")
    if found_format != FORMAT_NAME:
        keys = sorted(map(repr, state))
        raise ValueError(
            f"extra state is a dict with format={found_format!r} and keys {keys}, not "
            f"{FORMAT_NAME!r}; {_ANOTHER_LAYOUT}"
        )
    version = state.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ValueError(
            f"extra state has version={version!r}; this build reads {FORMAT_NAME!r} version "
            f"{FORMAT_VERSION}; {_ANOTHER_LAYOUT}"
        )
    unknown = sorted(map(repr, set(state) - set(_STATE_KEYS)))
    missing = sorted(set(_STATE_KEYS) - set(state))
    if unknown or missing:
        raise ValueError(
            f"extra state has unknown entries {unknown} and lacks {missing}; {_ANOTHER_LAYOUT}"
        )
    recipe = recipe_from_dict(state["recipe"])
    tensors = state["tensors"]
    if not isinstance(tensors, dict):
        raise ValueError(f"extra state 'tensors' must be a dict, got {type(tensors).__name__}")
    _check_tensor_set(tensors, "extra state 'tensors'", ValueError)
    if not isinstance(state["extra"], dict):
        raise ValueError(f"extra state 'extra' must be a dict, got {type(state['extra']).__name__}")
    extra = _copy_plain(state["extra"], "extra state 'extra'", ValueError, exact=False)
    moved = {name: _to_module_device(t, device) for name, t in tensors.items()}
    return UnpackedExtraState(recipe, moved, extra)


def unpack_extra_state(state: Any, *, device: Any) -> UnpackedExtraState | None:
    """Read what a module's ``set_extra_state()`` receives, with tensors on ``device``.

    Parameters
    ----------
    state : dict, torch.Tensor, io.BytesIO or None
        :func:`pack_extra_state`'s dict (possibly after ``torch.save``/``torch.load``), or
        upstream's formats: a ``torch.uint8`` tensor of pickle bytes, or an ``io.BytesIO``
        holding a ``torch.save`` archive. ``None`` or an empty tensor mean "no FP8 state".
    device : torch.device or str
        The loading module's device (where its parameters live); every returned tensor is a
        fresh copy there, whatever device wrote the checkpoint. ``"meta"`` is accepted.

    Returns
    -------
    UnpackedExtraState or None
        ``(recipe, tensors, extra)``: the validated recipe; a dict with a subset of
        ``"scale_fwd"``, ``"amax_history_fwd"``, ``"scale_bwd"``, ``"amax_history_bwd"``
        (float32, ``[N]`` and ``[L, N]``, on ``device``); and the stored extra values (for
        upstream payloads, their ``"extra_fp8_variables"`` as stored). ``None`` when there is
        no FP8 state to restore: ``None``, an empty tensor, or a pickle without globals.

    Raises
    ------
    RuntimeError
        An upstream pickle payload while ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` is not
        ``"1"``; nothing is unpickled.
    ValueError
        A dict of another layout or version, invalid content, a payload that is not a
        Transformer Engine module's extra state, or a missing/ambiguous ``device``.
    TypeError
        ``state`` is of none of the accepted types.

    Warns
    -----
    UserWarning
        See :func:`recipe_from_dict`; also upstream entries that are ignored.
    """
    device = _target_device(device)
    if state is None:
        return None
    if isinstance(state, dict):
        return _unpack_ours(state, device)
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return None
        if state.dtype != torch.uint8:
            raise ValueError(
                f"extra state is a {state.dtype} tensor of shape {tuple(state.shape)}; a "
                f"tensor is only read as upstream's pickle bytes, which are torch.uint8"
            )
        return _upstream().unpack_pickled_tensor(state, device)
    if isinstance(state, io.BytesIO):
        return _upstream().unpack_bytesio(state, device)
    raise TypeError(
        f"extra state of type {type(state).__name__} is not understood; expected the dict of "
        f"pack_extra_state, a torch.uint8 tensor, an io.BytesIO, or None"
    )


def _upstream():
    """The upstream-pickle reader, imported when such a payload arrives (it imports this module)."""
    from . import _extra_state_upstream

    return _extra_state_upstream
