"""``t[key] = value`` for quantized tensors.

torch runs an indexed write as "index ``t``, then ``copy_`` into the result". That writes into
``t`` only when the indexing gives a quantized view of ``t``'s bytes (a ``Float8Tensor``'s
dim-0 slices and rows). Every other index (a column, a strided slice, any index of a
block-scaled tensor) gives a dequantized copy, and the write went into that copy: ``t`` kept
its old values without a word. Such writes go through the dequantized values instead, and the
result is re-quantized into ``t`` (as any other in-place op on a quantized tensor is).
"""

from __future__ import annotations

import torch

from ..quantized_tensor import QuantizedTensor

__all__ = ["is_dim0_view_key", "quantized_setitem"]


def is_dim0_view_key(key) -> bool:
    """Whether ``t[key]`` selects along dim 0 only: an int or a step-1 slice, followed by
    nothing but full slices (``:``) and ``...``."""
    parts = key if isinstance(key, tuple) else (key,)
    if not parts:
        return False
    first, rest = parts[0], parts[1:]
    if isinstance(first, bool):
        return False
    if not (isinstance(first, int) or (isinstance(first, slice) and first.step in (None, 1))):
        return False
    return all(p is Ellipsis or (isinstance(p, slice) and p == slice(None)) for p in rest)


def quantized_setitem(tensor, key, value, *, writes_through: bool) -> None:
    """``tensor[key] = value``; ``writes_through`` when ``tensor[key]`` is a quantized view
    of ``tensor``'s bytes (torch's own write then reaches them)."""
    if writes_through:
        torch.Tensor.__setitem__(tensor, key, value)
        return
    if torch.is_grad_enabled() and tensor.requires_grad:
        # Autograd records the write (or refuses it on a leaf) as for any tensor; the values
        # are then written below.
        torch.Tensor.__setitem__(tensor, key, value)
    with torch.no_grad():
        values = tensor._dequantize_plain()
        values[key] = value._dequantize_plain() if isinstance(value, QuantizedTensor) else value
        tensor.quantize_(values)
