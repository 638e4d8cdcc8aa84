"""Our checkpoint format of a module's FP8 state: what ``get_extra_state`` returns and
``set_extra_state`` reads.

Why a format of our own
-----------------------
NVIDIA Transformer Engine stores a module's FP8 state (recipe, scales, amax histories) as
``pickle.dumps(dict)`` bytes inside a ``torch.uint8`` tensor. Reading such a checkpoint means
unpickling those bytes, and unpickling calls whatever importable callables the bytes name: a
tampered checkpoint runs arbitrary code, and ``torch.load(..., weights_only=True)`` cannot
stop it because the pickle hides inside an ordinary tensor.

What is written (version 2)
---------------------------
Like upstream, the extra state is a 1-D ``torch.uint8`` CPU tensor, so safetensors, Hugging
Face ``save_pretrained``, accelerate and ``torch.distributed.checkpoint`` carry it as they carry
any tensor: :func:`empty_extra_state` (no elements) when there is no FP8 state, else
:func:`pack_extra_state`'s bytes: a magic prefix, a JSON header (recipe, extra values, tensor
table) and the raw tensor bytes, laid out in :mod:`.bytes_format`. Nothing in it is a pickle.

What is read
------------
:func:`unpack_extra_state` takes, in this order: ``None`` or an empty tensor (no state);
version 2 bytes (recognized by their magic); the version 1 dict earlier versions of this
package wrote (:mod:`.dict_format`); and upstream's pickle bytes or ``io.BytesIO``
(:mod:`.upstream_pickle`, refused unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``).

Saved tensors are CPU copies, whatever device the module was on; loading puts them on the
device the *loading* module lives on (docs/architecture.md, section "device contract"): a
checkpoint written on ``cuda:3`` loads into a module on ``cuda:0`` or on CPU.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from ...common.recipe import Recipe
from . import bytes_format, dict_format, upstream_pickle
from .contents import (
    FORMAT_NAME,
    UnpackedExtraState,
    check_tensor_set,
    copy_plain,
    cpu_copy,
    to_module_device,
)
from .recipe_dict import recipe_from_dict, recipe_to_dict

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "empty_extra_state",
    "pack_extra_state",
    "unpack_extra_state",
]

FORMAT_VERSION = bytes_format.VERSION  # what pack_extra_state writes
READABLE_VERSIONS = (dict_format.VERSION, bytes_format.VERSION)


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


def empty_extra_state() -> torch.Tensor:
    """The extra state of a module or operation with no FP8 state to save: an empty
    ``torch.uint8`` CPU tensor (upstream's convention, which its loaders skip)."""
    return torch.empty(0, dtype=torch.uint8)


def pack_extra_state(
    recipe: Recipe, fp8_meta_tensors: dict[str, torch.Tensor], extra: dict
) -> torch.Tensor:
    """Build what a module with FP8 state returns from ``get_extra_state()``.

    Parameters
    ----------
    recipe : DelayedScaling or Float8CurrentScaling
        The module's recipe.
    fp8_meta_tensors : dict of str to torch.Tensor
        The live state, a subset of ``"scale_fwd"``, ``"amax_history_fwd"``, ``"scale_bwd"``,
        ``"amax_history_bwd"`` (each scale ``[N]`` float32 paired with its history ``[L, N]``
        float32), on any device; their values are copied.
    extra : dict
        Other module state to keep (e.g. ``num_gemms``): str keys; values str, int, float
        (non-finite ones included), bool, None, or lists, tuples and str-keyed dicts of those.
        Tuples are read back as lists.

    Returns
    -------
    torch.Tensor
        A fresh 1-D ``torch.uint8`` CPU tensor holding version 2 of the format
        (:mod:`.bytes_format`): magic, JSON header with ``recipe_to_dict(recipe)``, ``extra``
        and the tensor table, then the tensors' little-endian bytes. Readable by
        ``torch.load(..., weights_only=True)`` and safetensors; contains no pickle.

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
    tensors = {name: cpu_copy(t, name) for name, t in fp8_meta_tensors.items()}
    return bytes_format.encode(recipe_to_dict(recipe), tensors, extra_copy)


def _finish(recipe: Any, tensors: Any, extra: Any, device: torch.device) -> UnpackedExtraState:
    """Validate the pieces either version of our format stored; tensors to ``device``."""
    recipe = recipe_from_dict(recipe)
    check_tensor_set(tensors, "extra state 'tensors'", ValueError)
    if not isinstance(extra, dict):
        raise ValueError(f"extra state 'extra' must be a dict, got {type(extra).__name__}")
    extra = copy_plain(extra, "extra state 'extra'", ValueError, exact=False)
    moved = {name: to_module_device(t, device) for name, t in tensors.items()}
    return UnpackedExtraState(recipe, moved, extra)


def _unpack_tensor(state: torch.Tensor, device: torch.device) -> UnpackedExtraState | None:
    if state.numel() == 0:
        return None
    if state.dtype != torch.uint8:
        raise ValueError(
            f"extra state is a {state.dtype} tensor of shape {tuple(state.shape)}; extra state "
            f"tensors are torch.uint8 bytes (this format's version 2, or upstream's pickle)"
        )
    if state.is_meta:
        raise ValueError(
            "extra state is a torch.uint8 tensor on the meta device: it holds no bytes; load "
            "the checkpoint onto a real device (e.g. map_location='cpu')"
        )
    flat = state.detach().reshape(-1).cpu().contiguous()
    if bytes_format.has_magic(flat):
        return _finish(*bytes_format.decode(flat), device)
    return upstream_pickle.unpack_pickled_tensor(flat, device)


def unpack_extra_state(state: Any, *, device: Any) -> UnpackedExtraState | None:
    """Read what a module's ``set_extra_state()`` receives, with tensors on ``device``.

    Parameters
    ----------
    state : torch.Tensor, dict, io.BytesIO or None
        Tried in this order: ``None`` or an empty tensor mean "no FP8 state";
        :func:`pack_extra_state`'s ``torch.uint8`` bytes (version 2, on any device, e.g.
        after ``torch.load`` or ``safetensors.torch.load_file``); the version 1 dict earlier
        versions of this package wrote; upstream's formats, a ``torch.uint8`` tensor of pickle
        bytes or an ``io.BytesIO`` holding a ``torch.save`` archive.
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
        no FP8 state to restore: ``None``, an empty tensor, or an upstream pickle without
        globals or with only stateless recipes.

    Raises
    ------
    RuntimeError
        An upstream pickle payload while ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` is not
        ``"1"``; nothing is unpickled.
    ValueError
        Malformed version 2 bytes (truncated, bad header, wrong sizes), a dict of another
        layout or version, invalid content, a payload that is not a Transformer Engine
        module's extra state, or a missing/ambiguous ``device``. Nothing is returned half
        read, so a caller that raises before changing itself stays unchanged.
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
    if isinstance(state, torch.Tensor):
        return _unpack_tensor(state, device)
    if isinstance(state, dict):
        return _finish(*dict_format.read(state), device)
    if isinstance(state, io.BytesIO):
        return upstream_pickle.unpack_bytesio(state, device)
    raise TypeError(
        f"extra state of type {type(state).__name__} is not understood; expected a "
        f"torch.uint8 tensor (pack_extra_state's bytes, or upstream's), the version 1 dict of "
        f"earlier versions of this package, an io.BytesIO, or None"
    )
