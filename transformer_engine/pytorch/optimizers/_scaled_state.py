"""Optimizer state kept in a narrow dtype: the stored tensor and its per-tensor scale.

FusedAdam may keep its moments (and float16 master weights) in float16, bfloat16 or FP8
(``torch.uint8`` holding E4M3 bytes, upstream's convention). bfloat16 has float32's range and
is stored as the value rounded. float16 and FP8 would overflow or flush small moments, so they
are stored scaled: ``stored = value * scale`` with ``scale = range / amax(value)`` (float16's
65504, E4M3's 448), a one-element float32 tensor beside the stored one, recomputed each time the
value is stored (an all-zero or non-finite amax gives scale 1). Reading gives back
``stored / scale`` in float32. Nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch

from ..quantized_tensor import QuantizedTensor

__all__ = ["STATE_DTYPES", "SCALED_RANGE", "zeros_like", "empty_stored", "store", "load"]

# The dtypes a state may be kept in, and the range a scaled one is stretched to.
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
SCALED_RANGE = {torch.float16: 65504.0, torch.uint8: 448.0}


def zeros_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped like ``like`` in ``dtype``: a DTensor parameter (FSDP2) gets a DTensor of
    its own sharding, a quantized one a plain tensor (its ``zeros_like`` would dequantize)."""
    if isinstance(like, QuantizedTensor):
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    return torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def empty_stored(
    like: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A zero state shaped like ``like`` in ``dtype`` (on its device), with its scale (1) or
    ``None`` for an unscaled dtype."""
    stored = zeros_like(like, dtype)
    scale = None
    if dtype in SCALED_RANGE:
        scale = torch.ones(1, dtype=torch.float32, device=like.device)
    return stored, scale


def store(value: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write the float32 ``value`` into ``stored`` (in its dtype), updating ``scale`` in place."""
    if scale is None:
        stored.copy_(value)
        return
    limit = SCALED_RANGE[stored.dtype]
    amax = value.detach().abs().amax().reshape(1).float() if value.numel() else torch.zeros(1)
    amax = amax.to(scale.device)
    usable = torch.isfinite(amax) & (amax > 0)
    new_scale = torch.where(
        usable, torch.full_like(amax, limit) / torch.where(usable, amax, 1.0), 1.0
    )
    scale.copy_(new_scale)
    # amax * (limit / amax) can round a hair above the limit: clamp, so nothing overflows.
    scaled = torch.clamp(value * new_scale, -limit, limit)
    if stored.dtype == torch.uint8:
        stored.copy_(scaled.to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        stored.copy_(scaled)


def load(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 value of ``stored`` (a new tensor, or ``stored`` itself when float32)."""
    if stored.dtype == torch.uint8:
        value = stored.view(torch.float8_e4m3fn).float()
    else:
        value = stored if stored.dtype == torch.float32 else stored.float()
    if scale is not None:
        value = value / scale
    return value
