"""Reading upstream Transformer Engine's extra state: pickle bytes in a ``torch.uint8`` tensor,
or the older ``io.BytesIO`` holding a ``torch.save`` archive.

Unpickling calls whatever importable callables the bytes name, so a tampered checkpoint could
run arbitrary code. The payload is therefore first inspected *without running it*
(:mod:`pickletools`), collecting the globals it names:

* A payload that names no globals at all can only build builtin containers and scalars, so it
  is read with an unpickler that refuses every global anyway. Such a payload cannot hold a
  recipe or a tensor, i.e. no FP8 state; it reads as ``None`` (nothing to restore), as upstream
  ignores it.
* A payload whose only globals are stateless recipes (and their plain data) and which holds
  no delayed-scaling tensors has nothing to restore either; without the opt-in it reads as
  ``None`` unopened (:mod:`.pickle_policy`, upstream's classification).
* Anything else (the normal case: the recipe object and the tensors are globals) is unpickled
  only when ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``; otherwise a ``RuntimeError`` explains
  the risk and how to convert the checkpoint. ``io.BytesIO`` payloads always need the opt-in,
  as upstream.

An opted-in payload is translated into an ``UnpackedExtraState`` (recipe validated, tensors on
the loading module's device), the same result :mod:`.format` gives for our own format.

Environment variables
---------------------
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``
    ``"1"`` allows unpickling upstream's pickle-based extra state; any other value, or unset,
    refuses it. Read at every load (:func:`.pickle_policy.unsafe_pickle_allowed`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import pickle
import types
import warnings
import zipfile
from typing import Any, NamedTuple

import torch

from ...common.recipe import DelayedScaling, MMParams, QParams, Recipe
from ...common.recipe import _FormatMaxima as _FormatMaximaTuple
from .contents import (
    RECIPE_CLASSES,
    TENSOR_NAMES,
    UnpackedExtraState,
    check_tensor_set,
    copy_plain,
    to_module_device,
)
from .pickle_policy import (
    UNSAFE_PICKLE_EXTRA_STATE_ENV,
    payload_needs_unsafe_load,
    scan_pickle,
    unsafe_pickle_allowed,
)

__all__ = ["unpack_pickled_tensor", "unpack_bytesio"]

# The opt-in and the scanner live in .pickle_policy (shared with upstream's policy API); the
# private names stay importable here for the tests and callers that use them.
_UNSAFE_PICKLE_ENV = UNSAFE_PICKLE_EXTRA_STATE_ENV
_unsafe_pickle_allowed = unsafe_pickle_allowed


def _referenced_globals(payload: bytes) -> list[str]:
    """The ``module.name`` globals a pickle would import (:func:`scan_pickle`'s ``globals``)."""
    return scan_pickle(payload).globals


def _torch_archive_globals(data: bytes) -> list[str] | None:
    """Globals named by the pickle of a ``torch.save`` zip archive; None if not inspectable."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            if len(pickles) != 1:
                return None
            return _referenced_globals(archive.read(pickles[0]))
    except (zipfile.BadZipFile, ValueError):
        return None


def _refusal(kind: str, globals_found: list[str] | None) -> RuntimeError:
    if globals_found is None:
        content = "its content cannot be inspected without unpickling it"
    else:
        unique = list(dict.fromkeys(globals_found))
        shown = ", ".join(unique[:8]) + (f" and {len(unique) - 8} more" if len(unique) > 8 else "")
        content = f"it references {shown}"
    return RuntimeError(
        f"Refusing to load extra state given as {kind}: that is the pickle-based format of "
        f"NVIDIA Transformer Engine, and unpickling runs code named in the payload, so a "
        f"tampered checkpoint can execute arbitrary code in this process ({content}). If you "
        f"trust this checkpoint, set the environment variable "
        f"{_UNSAFE_PICKLE_ENV}=1 for one load, then save the model again: the new checkpoint "
        f"stores extra state as plain tensors and values, which torch.load(..., "
        f"weights_only=True) reads without running code, and later loads need no opt-in."
    )


def _load_storage_bytes_on_cpu(data: bytes) -> Any:
    # Plain-pickled tensors rebuild their storage through torch.storage._load_from_bytes, which
    # restores it on the device that wrote it. Old payloads pickled CUDA tensors (upstream
    # issue #342), and that device may not exist here; map to CPU, then move to the module.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class _OverrideLinearPrecision(NamedTuple):
    """Stand-in for a recipe field of older upstream releases (no longer supported)."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


# Globals of transformer_engine.common.recipe that upstream payloads name but this package
# spells differently or no longer has.
_RECIPE_MODULE = "transformer_engine.common.recipe"
_RECIPE_GLOBAL_STAND_INS = {
    "_FormatHelper": _FormatMaximaTuple,  # the named tuple of each Format member's value
    "_OverrideLinearPrecision": _OverrideLinearPrecision,
}


class _UpstreamUnpickler(pickle.Unpickler):
    """Unpickler for opted-in upstream payloads: CPU storages and upstream recipe names."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.storage" and name == "_load_from_bytes":
            return _load_storage_bytes_on_cpu
        try:
            return super().find_class(module, name)
        except AttributeError:
            if module == _RECIPE_MODULE and name in _RECIPE_GLOBAL_STAND_INS:
                return _RECIPE_GLOBAL_STAND_INS[name]
            raise


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Defence in depth for payloads classified as global-free: any global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"extra state payload names the global {module}.{name}")


# torch.load(pickle_module=...) subclasses `Unpickler` and uses `load` for legacy archives.
_UPSTREAM_PICKLE_MODULE = types.SimpleNamespace(
    Unpickler=_UpstreamUnpickler,
    load=lambda file, **kwargs: _UpstreamUnpickler(file, **kwargs).load(),
    __name__="transformer_engine_upstream_pickle",
)


def _uint8_bytes(state: torch.Tensor) -> bytes:
    if state.is_meta:
        raise ValueError("extra state is a uint8 tensor on the meta device: it holds no bytes")
    flat = state.detach().reshape(-1).cpu().contiguous()
    # Read the bytes straight from the CPU buffer (torch alone, no numpy).
    return ctypes.string_at(flat.data_ptr(), flat.numel())


def _recipe_from_upstream(obj: Any) -> Recipe:
    """A validated recipe from an unpickled upstream recipe object."""
    cls = type(obj)
    if RECIPE_CLASSES.get(cls.__name__) is not cls:
        raise ValueError(
            f"the checkpoint's recipe is a {cls.__module__}.{cls.__qualname__}, which this "
            f"implementation cannot restore (it restores {', '.join(RECIPE_CLASSES)})"
        )
    # The object was built by unpickling, without __init__/__post_init__: its __dict__ holds
    # whatever upstream kept (fields, caches, fields of older releases). Rebuild a validated
    # instance from the fields this class has; fields older releases lacked take defaults.
    stored = vars(obj)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in stored:
            continue
        value = stored[field.name]
        if isinstance(value, (MMParams, QParams)):
            params = type(value)
            value = params(
                **{
                    f.name: vars(value)[f.name]
                    for f in dataclasses.fields(params)
                    if f.name in vars(value)
                }
            )
        kwargs[field.name] = value
    override = stored.get("override_linear_precision")
    if isinstance(override, tuple) and any(override):
        warnings.warn(
            f"the checkpoint's recipe sets override_linear_precision={tuple(override)}, an "
            f"option of older Transformer Engine releases that is not supported; it is ignored",
            UserWarning,
            stacklevel=4,
        )
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the checkpoint's {cls.__name__} recipe is invalid: {exc}") from exc


# TE 1.x stored scale_inv too; it is derived from scale (1/scale) whenever quantizers are built.
_UPSTREAM_DROPPED = ("scale_inv_fwd", "scale_inv_bwd")


def _merge_operation_state(obj: dict) -> dict:
    """Upstream's fusible-operation extra state, ``{"forward": {...}, "backward": {...}}`` (each
    a module-style dict with its own copy of the recipe and its direction's tensors), as one
    module-style dict."""
    unknown = sorted(repr(key) for key in obj if key not in ("forward", "backward"))
    if unknown:
        raise ValueError(
            f"upstream operation extra state has entries {unknown} besides 'forward' and "
            "'backward'; it is not the extra state of a Transformer Engine operation"
        )
    merged: dict = {}
    for mode in ("forward", "backward"):
        part = obj.get(mode) or {}
        if not isinstance(part, dict):
            raise ValueError(
                f"upstream operation extra state {mode!r} is a {type(part).__name__}, not a dict"
            )
        for key, value in part.items():
            if key == "recipe" and "recipe" in merged and merged["recipe"] != value:
                raise ValueError(
                    "upstream operation extra state stores different recipes for forward and "
                    f"backward ({merged['recipe']!r} and {value!r}); one recipe runs both"
                )
            if key == "extra_fp8_variables" and key in merged:
                merged[key] = {**value, **merged[key]} if isinstance(value, dict) else value
                continue
            merged.setdefault(key, value)
    return merged


def _translate_upstream(obj: Any, device: torch.device) -> UnpackedExtraState:
    """Upstream's unpickled dict as ``(recipe, tensors on device, extra)``: a module's, or a
    fusible operation's (``{"forward": ..., "backward": ...}``, merged into one)."""
    if not isinstance(obj, dict):
        raise ValueError(
            f"upstream extra state unpickled to a {type(obj).__name__}, not a dict; it is not "
            f"the extra state of a Transformer Engine module"
        )
    if "recipe" not in obj and ("forward" in obj or "backward" in obj):
        obj = _merge_operation_state(obj)
    known = {"recipe", "extra_fp8_variables", *TENSOR_NAMES, *_UPSTREAM_DROPPED}
    ignored = sorted(repr(key) for key in obj if key not in known)
    if ignored:
        warnings.warn(
            f"upstream extra state entries {ignored} are not used by this implementation and "
            f"are ignored",
            UserWarning,
            stacklevel=3,
        )
    # TE 1.x wrote no recipe: those releases only checkpointed delayed scaling.
    recipe = _recipe_from_upstream(obj["recipe"]) if "recipe" in obj else DelayedScaling()
    tensors = {name: obj[name] for name in TENSOR_NAMES if name in obj}
    check_tensor_set(tensors, "upstream extra state", ValueError)
    extra = obj.get("extra_fp8_variables", {})
    if not isinstance(extra, dict):
        raise ValueError(
            f"upstream extra state 'extra_fp8_variables' must be a dict, got {type(extra).__name__}"
        )
    extra = copy_plain(extra, "upstream extra state 'extra_fp8_variables'", ValueError, exact=False)
    moved = {name: to_module_device(t, device) for name, t in tensors.items()}
    return UnpackedExtraState(recipe, moved, extra)


def unpack_pickled_tensor(state: torch.Tensor, device: torch.device) -> UnpackedExtraState | None:
    """Read upstream's pickle bytes held in a non-empty ``torch.uint8`` tensor.

    ``None`` for a payload naming no globals (it holds no FP8 state); ``RuntimeError`` for any
    other payload unless the opt-in is set; ``ValueError`` for content that is not a
    Transformer Engine module's extra state.
    """
    payload = _uint8_bytes(state)
    found = _referenced_globals(payload)
    if not found:
        # Only builtin scalars and containers: safe to read, but it cannot hold a recipe or a
        # tensor, so there is no FP8 state to restore (upstream ignores such payloads too).
        try:
            obj = _NoGlobalsUnpickler(io.BytesIO(payload)).load()
        except Exception as exc:
            raise ValueError(f"extra state pickle could not be read: {exc}") from exc
        if type(obj) is not dict:
            raise ValueError(
                f"extra state pickle holds a {type(obj).__name__}, not a dict; it is not the "
                f"extra state of a Transformer Engine module"
            )
        return None
    if not _unsafe_pickle_allowed():
        needs_unsafe_load, _ = payload_needs_unsafe_load(payload)
        if not needs_unsafe_load:
            # Only stateless recipes named, no delayed-scaling tensors: nothing to restore, so
            # upstream skips it without unpickling, and so does this reader.
            return None
        raise _refusal("a pickled torch.uint8 tensor", found)
    try:
        obj = _UpstreamUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:
        raise ValueError(f"opted-in extra state pickle could not be unpickled: {exc!r}") from exc
    return _translate_upstream(obj, device)


def unpack_bytesio(state: io.BytesIO, device: torch.device) -> UnpackedExtraState:
    """Read upstream's older ``io.BytesIO`` holding a ``torch.save`` archive (opt-in only)."""
    data = state.getvalue()  # independent of the stream position, which stays untouched
    if not _unsafe_pickle_allowed():
        raise _refusal("an io.BytesIO (a torch.save archive)", _torch_archive_globals(data))
    try:
        obj = torch.load(
            io.BytesIO(data),
            map_location="cpu",
            weights_only=False,
            pickle_module=_UPSTREAM_PICKLE_MODULE,
        )
    except Exception as exc:
        raise ValueError(f"opted-in io.BytesIO extra state could not be loaded: {exc!r}") from exc
    return _translate_upstream(obj, device)
