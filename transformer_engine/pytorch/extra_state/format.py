"""Our checkpoint format of a module's FP8 state: what ``get_extra_state`` returns.

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
:func:`unpack_extra_state` puts them on the device the *loading* module lives on
(docs/architecture.md, section "device contract"): a checkpoint written on ``cuda:3`` loads
into a module on ``cuda:0`` or on CPU. ``"tensors"`` holds a subset of the four names (current
scaling keeps none). ``"recipe"`` is :func:`.recipe_dict.recipe_to_dict`'s plain-data form of
the recipe.

:func:`unpack_extra_state` also reads upstream's pickle-based formats, through
:mod:`.upstream_pickle`, which refuses to unpickle them unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from ...common.recipe import Recipe
from . import upstream_pickle
from .contents import (
    ANOTHER_LAYOUT,
    UnpackedExtraState,
    check_tensor_set,
    copy_plain,
    cpu_copy,
    to_module_device,
)
from .recipe_dict import recipe_from_dict, recipe_to_dict

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "pack_extra_state", "unpack_extra_state"]

FORMAT_NAME = "transformer_engine/extra_state"
FORMAT_VERSION = 1

_STATE_KEYS = ("format", "version", "recipe", "tensors", "extra")


def _target_device(device: Any) -> torch.device:
    if device is None:
        raise ValueError(
            "unpack_extra_state needs device=...: the device of the module's parameters, where "
            "its FP8 state lives (state follows its module: docs/architecture.md, section "
            '"device contract")'
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
    extra_copy = copy_plain(extra, "extra", TypeError)
    if not isinstance(fp8_meta_tensors, Mapping):
        raise TypeError(
            f"fp8_meta_tensors must be a dict of tensors, got {type(fp8_meta_tensors).__name__}"
        )
    check_tensor_set(fp8_meta_tensors, "fp8_meta_tensors", TypeError)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "recipe": recipe_to_dict(recipe),
        "tensors": {name: cpu_copy(t, name) for name, t in fp8_meta_tensors.items()},
        "extra": extra_copy,
    }


def _unpack_ours(state: dict, device: torch.device) -> UnpackedExtraState:
    found_format = state.get("format")
    if found_format != FORMAT_NAME:
        keys = sorted(map(repr, state))
        raise ValueError(
            f"extra state is a dict with format={found_format!r} and keys {keys}, not "
            f"{FORMAT_NAME!r}; {ANOTHER_LAYOUT}"
        )
    version = state.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ValueError(
            f"extra state has version={version!r}; this build reads {FORMAT_NAME!r} version "
            f"{FORMAT_VERSION}; {ANOTHER_LAYOUT}"
        )
    unknown = sorted(map(repr, set(state) - set(_STATE_KEYS)))
    missing = sorted(set(_STATE_KEYS) - set(state))
    if unknown or missing:
        raise ValueError(
            f"extra state has unknown entries {unknown} and lacks {missing}; {ANOTHER_LAYOUT}"
        )
    recipe = recipe_from_dict(state["recipe"])
    tensors = state["tensors"]
    if not isinstance(tensors, dict):
        raise ValueError(f"extra state 'tensors' must be a dict, got {type(tensors).__name__}")
    check_tensor_set(tensors, "extra state 'tensors'", ValueError)
    if not isinstance(state["extra"], dict):
        raise ValueError(f"extra state 'extra' must be a dict, got {type(state['extra']).__name__}")
    extra = copy_plain(state["extra"], "extra state 'extra'", ValueError, exact=False)
    moved = {name: to_module_device(t, device) for name, t in tensors.items()}
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
        return upstream_pickle.unpack_pickled_tensor(state, device)
    if isinstance(state, io.BytesIO):
        return upstream_pickle.unpack_bytesio(state, device)
    raise TypeError(
        f"extra state of type {type(state).__name__} is not understood; expected the dict of "
        f"pack_extra_state, a torch.uint8 tensor, an io.BytesIO, or None"
    )
