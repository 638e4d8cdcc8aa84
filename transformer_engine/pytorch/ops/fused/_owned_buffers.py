"""Arithmetic into buffers a fused operation owns, with the bits of the out-of-place form.

A fused operation may write into a tensor it has just produced (a GEMM output, a gradient from
a local autograd call) instead of allocating another buffer, when no one else can see that
tensor and the in-place form computes exactly the same elementwise operation: ``a.add_(b)``
and ``a + b`` run the same kernel, and IEEE addition is commutative, so ``b + a`` has the same
bits too.
"""

from __future__ import annotations

import torch

__all__ = ["add_into_fresh"]


# tensors whose values are their storage (a quantized tensor's are not)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _can_receive(fresh: torch.Tensor, other: torch.Tensor, others) -> bool:
    """Whether ``fresh += other`` gives ``fresh + other``'s dtype, shape and bits without
    touching any memory but ``fresh``'s own."""
    return (
        type(fresh) is torch.Tensor
        and type(other) in _PLAIN
        and not fresh.requires_grad
        and fresh.is_contiguous()
        and torch.result_type(fresh, other) == fresh.dtype
        and torch.broadcast_shapes(fresh.shape, other.shape) == fresh.shape
        and fresh.device == other.device
        and fresh.numel() > 0
        and all(
            # a quantized tensor's buffers are FP8 bytes of their own, never ``fresh``
            type(t) not in _PLAIN or _storage(t) != _storage(fresh)
            for t in (other, *others)
        )
    )


def add_into_fresh(fresh: torch.Tensor, other: torch.Tensor, *, not_aliasing=()) -> torch.Tensor:
    """``fresh + other``, written into ``fresh`` when that is safe (else a new tensor).

    ``fresh`` must be a tensor the caller has just made and hands over: its values are
    overwritten. ``not_aliasing``: tensors the caller must not see change (``fresh`` is
    written only if it shares storage with none of them, e.g. the incoming gradient a
    backward passed straight through).
    """
    if _can_receive(fresh, other, not_aliasing):
        return fresh.add_(other)
    return fresh + other
