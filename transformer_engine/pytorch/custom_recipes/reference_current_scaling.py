"""``CurrentScalingQuantizerRef``: current scaling written out in plain PyTorch.

A readable reference for writing custom quantizers: ``quantize(x)`` produces the same
``Float8Tensor`` bytes and scale as
:class:`~transformer_engine.pytorch.tensor.float8_tensor.Float8CurrentScalingQuantizer`, but
every step of the cast is a visible torch operation (no kernel call), on the tensor's device.
(Inside modules, returned from a ``CustomRecipe`` factory, it is not yet verified to give the
library quantizer's bits; use it as a reference for standalone casts.)
"""

from __future__ import annotations

import torch

from ..cpp_extensions.cast import QuantizeResult
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer
from ..tensor.storage.float8_tensor_storage import transpose_bytes

__all__ = ["CurrentScalingQuantizerRef"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


class CurrentScalingQuantizerRef(Float8CurrentScalingQuantizer):
    """Current-scaling FP8 quantizer computed with plain torch operations.

    Takes :class:`Float8CurrentScalingQuantizer`'s arguments (``fp8_dtype``, ``rowwise``,
    ``columnwise``, ``force_pow_2_scales``, ``amax_epsilon``); amax reduction across processes
    is not part of the reference (``with_amax_reduction=True`` is refused).

    The cast of ``x``:

    1. ``amax = max |x|`` in float32 over the non-NaN elements (as the current-scaling kernel:
       a NaN element does not turn every scale into 1), then ``amax = max(amax, amax_epsilon)``;
    2. ``scale = fp8_max / amax``, except 1 when that amax is 0, infinite or NaN, and
       ``FLT_MAX`` when the quotient overflows; with ``force_pow_2_scales`` the scale is rounded
       down to a power of 2 (its mantissa bits cleared);
    3. ``data = fp8(clamp(float32(x) * scale, -fp8_max, fp8_max))`` (round to nearest even,
       NaN stays NaN); ``scale_inv = 1 / scale``; the column-wise copy is ``data`` transposed.
    """

    def __init__(self, fp8_dtype, *args, **kwargs) -> None:
        super().__init__(fp8_dtype, *args, **kwargs)
        if self.with_amax_reduction:
            raise ValueError(
                "CurrentScalingQuantizerRef: with_amax_reduction=True is not supported by the "
                "reference; use Float8CurrentScalingQuantizer for distributed amax reduction"
            )

    def _torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if "E4M3" in self.dtype.name else torch.float8_e5m2

    def reference_scale(self, x: torch.Tensor) -> torch.Tensor:
        """Steps 1 and 2: the one-element float32 scale of ``x``."""
        fp8_max = torch.finfo(self._torch_dtype()).max
        magnitudes = x.detach().float().abs()
        magnitudes = torch.where(torch.isnan(magnitudes), 0.0, magnitudes)
        amax = magnitudes.amax().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
        amax = torch.where(amax < self.amax_epsilon, torch.full_like(amax, self.amax_epsilon), amax)
        degenerate = (amax == 0) | ~torch.isfinite(amax)
        # a tensor numerator: `float / tensor` runs as reciprocal-then-multiply (two roundings)
        scale = torch.where(
            degenerate, torch.ones_like(amax), torch.full_like(amax, fp8_max) / amax
        )
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
        if self.force_pow_2_scales:
            bits = scale.view(torch.int32) & torch.tensor(-(1 << 23), dtype=torch.int32)
            scale = bits.view(torch.float32)
        return scale

    def _cast(self, src, with_transpose: bool, with_dbias: bool):
        fp8_dtype = self._torch_dtype()
        fp8_max = torch.finfo(fp8_dtype).max
        scale = self.reference_scale(src)
        data = (src.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
        transpose = None
        if with_transpose:
            transpose = transpose_bytes(data.view(torch.uint8)).view(fp8_dtype)
        dbias = src.reshape(-1, src.shape[-1]).sum(0) if with_dbias else None
        return QuantizeResult(data, transpose, torch.reciprocal(scale)), dbias

    def __repr__(self) -> str:
        return f"CurrentScalingQuantizerRef(fp8_dtype={self.dtype.name})"
