"""Where a kernel runs: CUDA tensors go to the native library, all others to the reference."""

from __future__ import annotations

import warnings

import torch

from ...common.native import native_module, native_status
from ..constants import TE_DType
from ..device import native_launch_args

__all__ = ["native_for", "tensor_arg", "launch_args"]

_warned_fallback = False


def native_for(op: str, device: torch.device):
    """The binding module if ``op`` on ``device`` should run natively, else ``None``."""
    global _warned_fallback
    if device.type != "cuda":
        return None
    module = native_module()
    if module is None and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"{op} on {device}: {native_status().reason} This and later CUDA calls run the "
            "reference path, which is correct but slow.",
            RuntimeWarning,
            stacklevel=3,
        )
    return module


# The binding's dtype codes as plain ints: the per-tensor lookup runs for every argument of
# every native call, and int(DType member) each time was a measurable part of the host cost.
_DTYPE_CODES = {dtype: int(code) for dtype, code in TE_DType.items()}


def tensor_arg(t: torch.Tensor | None):
    """A tensor as the binding takes it: ``(data_ptr, shape, dtype code)``; ``None`` stays ``None``.
    The shape goes as the ``torch.Size`` it is (the binding reads any sequence of ints): no list
    is built per argument of every native call."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, _DTYPE_CODES[t.dtype])


def launch_args(device: torch.device) -> tuple[int, int]:
    """``(device_index, stream)`` for a native call on ``device``."""
    return native_launch_args(device)
