"""Version 1 of our extra-state format: a dict of tensors and plain values (read only).

Earlier versions of this package returned this dict from ``get_extra_state()``; checkpoints
they wrote keep loading. It is read by ``torch.load(..., weights_only=True)`` without running
code, but safetensors (and so Hugging Face ``save_pretrained``) cannot hold it, which is why
:mod:`.bytes_format` (version 2) replaced it for writing. The layout::

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

``"recipe"`` is :func:`.recipe_dict.recipe_to_dict`'s plain data; ``"tensors"`` holds a subset
of the four names (current scaling keeps none), CPU tensors as written (a ``map_location`` may
have moved them anywhere); ``"extra"`` holds other module values (``num_gemms``).
"""

from __future__ import annotations

from typing import Any

from .contents import ANOTHER_LAYOUT, FORMAT_NAME

__all__ = ["VERSION", "read"]

VERSION = 1

_STATE_KEYS = ("format", "version", "recipe", "tensors", "extra")


def read(state: dict) -> tuple[Any, Any, Any]:
    """Check a v1 dict's layout; returns its ``(recipe, tensors, extra)`` as stored.

    Raises
    ------
    ValueError
        A dict of another format or version, unknown or missing entries, or ``"tensors"`` that
        is not a dict. The recipe, tensor set and extra values are validated by the caller.
    """
    found_format = state.get("format")
    if found_format != FORMAT_NAME:
        keys = sorted(map(repr, state))
        raise ValueError(
            f"extra state is a dict with format={found_format!r} and keys {keys}, not "
            f"{FORMAT_NAME!r}; {ANOTHER_LAYOUT}"
        )
    version = state.get("version")
    if type(version) is not int or version != VERSION:
        raise ValueError(
            f"extra state is a dict with version={version!r}; this build reads {FORMAT_NAME!r} "
            f"dicts of version {VERSION} (version 2 is a torch.uint8 tensor); {ANOTHER_LAYOUT}"
        )
    unknown = sorted(map(repr, set(state) - set(_STATE_KEYS)))
    missing = sorted(set(_STATE_KEYS) - set(state))
    if unknown or missing:
        raise ValueError(
            f"extra state has unknown entries {unknown} and lacks {missing}; {ANOTHER_LAYOUT}"
        )
    tensors = state["tensors"]
    if not isinstance(tensors, dict):
        raise ValueError(f"extra state 'tensors' must be a dict, got {type(tensors).__name__}")
    return state["recipe"], tensors, state["extra"]
