"""Argument checks shared by the kernel wrappers.

Every check runs before any allocation or launch, so a refused call changes
nothing. Messages name the operation, the argument, the offending value and
the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..device import check_same_device, reject_meta

__all__ = [
    "check_tensor",
    "check_dtype",
    "check_fp32_scalar",
    "check_output",
    "check_tensors_on",
]


def check_tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {names}")


def check_fp32_scalar(op: str, name: str, t: torch.Tensor | None) -> None:
    """A one-element, contiguous float32 tensor (scale, amax, scale_inv, no-op flag)."""
    if t is None:
        return
    check_tensor(op, name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be float32, got {t.dtype}; pass {name}.float()")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must hold exactly one element, got shape {tuple(t.shape)}")


def check_output(
    op: str,
    name: str,
    t: torch.Tensor | None,
    shape: Sequence[int],
    dtypes: Iterable[torch.dtype],
) -> None:
    """A caller-provided output buffer: right dtype, exact shape, contiguous."""
    if t is None:
        return
    check_tensor(op, name, t)
    check_dtype(op, name, t, dtypes)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; pass a contiguous buffer")


def check_tensors_on(op: str, anchor_name: str, anchor: torch.Tensor, **tensors) -> None:
    """No meta tensors, and everything on the anchor's (the execution) device."""
    reject_meta(op, **{anchor_name: anchor, **tensors})
    check_same_device(op, anchor_name, anchor, **tensors)
