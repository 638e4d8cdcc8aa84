"""What a module's extra state holds, and the checks and copies every reader applies to it.

Both readers (:mod:`.format` for our plain-data format, :mod:`.upstream_pickle` for upstream's
pickles) produce the same :class:`UnpackedExtraState` from the same pieces: a recipe of one of
:data:`RECIPE_CLASSES`, a subset of :data:`TENSOR_NAMES`, and plain "extra" values. The rules
for those pieces live here, below both readers, so neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ...common.recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = [
    "FORMAT_NAME",
    "TENSOR_NAMES",
    "RECIPE_CLASSES",
    "PLAIN_SCALARS",
    "ANOTHER_LAYOUT",
    "UnpackedExtraState",
    "copy_plain",
    "check_tensor_set",
    "cpu_copy",
    "to_module_device",
]

# The name both versions of our format carry (the v1 dict's "format", the v2 header's).
FORMAT_NAME = "transformer_engine/extra_state"

TENSOR_NAMES = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")

# The recipes a checkpoint can hold, by class name (the name is what our format stores).
RECIPE_CLASSES: dict[str, type[Recipe]] = {
    "DelayedScaling": DelayedScaling,
    "Float8CurrentScaling": Float8CurrentScaling,
}

# Scalar types torch.load(weights_only=True) reads without naming a class.
PLAIN_SCALARS = (str, int, float, bool, type(None))

# The hint every "this is not what we wrote" error ends with.
ANOTHER_LAYOUT = "the checkpoint comes from another layout or version of transformer_engine"


class UnpackedExtraState(NamedTuple):
    """What ``unpack_extra_state`` returns; unpacks as ``recipe, tensors, extra``."""

    recipe: Recipe
    tensors: dict[str, torch.Tensor]
    extra: dict[str, Any]


def copy_plain(value: Any, path: str, error: type[Exception], *, exact: bool = True) -> Any:
    """A copy of ``value`` made only of types ``torch.load(weights_only=True)`` accepts.

    Writing (``exact=True``) compares container types exactly: an ``OrderedDict`` or a list
    subclass would be stored as a reference to its class, which a weights-only load may refuse.
    Reading (``exact=False``) also takes subclasses of dict, list and tuple, which state-dict
    tooling may have substituted, and returns the plain types. Scalars are always compared
    exactly: an ``IntEnum`` is a class reference too.
    """
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return value
    for plain in (list, tuple):
        if kind is plain or (not exact and isinstance(value, plain)):
            return plain(
                copy_plain(item, f"{path}[{i}]", error, exact=exact) for i, item in enumerate(value)
            )
    if kind is dict or (not exact and isinstance(value, dict)):
        copied = {}
        for key, item in value.items():
            if type(key) is not str:
                raise error(
                    f"{path} has the key {key!r} ({type(key).__name__}); extra state dicts "
                    f"must have str keys"
                )
            copied[key] = copy_plain(item, f"{path}[{key!r}]", error, exact=exact)
        return copied
    raise error(
        f"{path} is {value!r} ({kind.__name__}); extra state may hold only str, int, float, "
        f"bool, None and lists, tuples and str-keyed dicts of those (exact types, so "
        f"torch.load(weights_only=True) can read them): convert it, e.g. int(value) or "
        f"dict(value)"
    )


def check_tensor_set(tensors: Mapping[str, Any], where: str, type_error: type[Exception]) -> None:
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


def cpu_copy(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A dense float32 CPU copy of live state ``fp8_meta_tensors[name]``, for a checkpoint."""
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


def to_module_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh contiguous copy of a loaded tensor on the loading module's ``device``."""
    # Always a copy: the caller may adopt it as live state, which must not alias the tensor of
    # the state dict being loaded (the same state dict may be loaded into several modules).
    return tensor.detach().to(device=device, copy=True).contiguous()
