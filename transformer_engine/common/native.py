"""Locate and load the native library (``libtransformer_engine.so`` + its binding).

Importing never fails because of the native library: a pure-Python build
(``NVTE_BUILD_NATIVE=0``) or a machine without the CUDA driver still gets the
CPU reference path. ``native_status()`` says whether the library is present
and, if not, why; ``python -m transformer_engine`` prints it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

__all__ = ["NativeStatus", "native_status", "native_module"]


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native CUDA library was loaded, where from, and why not."""

    available: bool
    reason: str
    path: str | None = None

    def __str__(self) -> str:
        if self.available:
            return f"native library loaded from {self.path}"
        return f"native library not available: {self.reason}"


_module = None
_status: NativeStatus | None = None


def _load() -> NativeStatus:
    global _module
    try:
        module = importlib.import_module("transformer_engine._native")
    except ModuleNotFoundError as err:
        if err.name != "transformer_engine._native":
            return NativeStatus(False, f"the binding failed to import: {err}")
        return NativeStatus(
            False,
            "this installation has no native library (built with NVTE_BUILD_NATIVE=0, or "
            "imported from a source tree that was never built); CUDA tensors use the "
            "pure-PyTorch reference path. Reinstall with nvcc available: "
            "`pip install --no-build-isolation .`",
        )
    except ImportError as err:
        return NativeStatus(False, f"the native library is installed but failed to load: {err}")
    _module = module
    return NativeStatus(True, "", os.path.dirname(os.path.abspath(module.__file__)))


def native_status() -> NativeStatus:
    """Load the native library once and report the outcome."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def native_module():
    """The binding module, or ``None`` when the native library is unavailable."""
    native_status()
    return _module
