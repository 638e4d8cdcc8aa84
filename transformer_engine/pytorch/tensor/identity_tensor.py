"""``IdentityQuantizer``: the quantizer that leaves a tensor in high precision.

A ``CustomRecipe`` factory must answer every slot (``None`` is refused), so "do not quantize
this slot" needs a quantizer of its own: this one. Its "quantized" result is the high-precision
tensor itself (cast to the quantizer's ``dtype`` when one is set), so a GEMM that receives it
runs in high precision for that operand: both operands identity gives a plain high-precision
GEMM; one FP8 operand and one identity operand gives the GEMM's mixed path (the FP8 operand is
dequantized to the other's dtype).

Unlike upstream, whose result is an ``IdentityTensor`` wrapper (or an ``IdentityTensorStorage``
for internal use), the result here is an ordinary ``torch.Tensor``: there is nothing quantized
to wrap, and every consumer of a plain tensor (the GEMM, ``prepare_for_saving``, autograd) takes
it as it is. ``IdentityTensor`` and ``IdentityTensorStorage`` are therefore not provided.
"""

from __future__ import annotations

import torch

from ..constants import HIGH_PRECISION_DTYPES
from ..quantized_tensor import QuantizedTensor, Quantizer

__all__ = ["IdentityQuantizer"]


class IdentityQuantizer(Quantizer):
    """Quantizer whose result is the high-precision input itself.

    Parameters
    ----------
    dtype : torch.dtype, optional
        float32, float16 or bfloat16: the result is the input cast to it. ``None`` (default)
        keeps the dtype asked for by the call (``quantize(x, dtype=...)``), else the input's.
    rowwise, columnwise : bool
        Usage flags, kept for the quantizer interface; a high-precision tensor serves both
        layouts, so they change nothing.
    """

    def __init__(
        self, *, dtype: torch.dtype | None = None, rowwise: bool = True, columnwise: bool = True
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"IdentityQuantizer: dtype={dtype!r} is not a high-precision dtype; use "
                "torch.float32, torch.float16, torch.bfloat16 or None (keep the input's)"
            )
        self.dtype = dtype

    def _result_dtype(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
        return self.dtype or dtype or tensor.dtype

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """``tensor`` itself when no cast is needed, else ``tensor`` cast (a new tensor)."""
        if not self.is_quantizable(tensor):
            raise TypeError(
                f"IdentityQuantizer: expected a float32, float16 or bfloat16 tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
            )
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()  # a quantized input: its high-precision values
        target = self._result_dtype(tensor, dtype)
        return tensor if tensor.dtype == target else tensor.to(target)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        """Copy ``src`` into the plain tensor ``dst`` (nothing when ``noop_flag`` holds 1)."""
        if not isinstance(dst, torch.Tensor):
            raise TypeError(
                f"IdentityQuantizer.update_quantized: dst must be the plain tensor this "
                f"quantizer produced, got {type(dst).__name__}"
            )
        if noop_flag is None:
            return dst.copy_(src)
        # No host sync: keep dst where the flag says so, on the device.
        return dst.copy_(torch.where(noop_flag.reshape(()) == 1.0, dst, src.to(dst.dtype)))

    def make_empty(
        self,
        shape,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ) -> torch.Tensor:
        """An uninitialised plain tensor (``device`` is required: this quantizer has no state)."""
        return torch.empty(
            tuple(shape),
            dtype=self.dtype or dtype,
            device=self._resolve_device(device),
            requires_grad=requires_grad,
            pin_memory=pin_memory,
        )

    def is_requantization_safe(self) -> bool:
        """Dequantizing and quantizing again gives the same values (nothing is rounded)."""
        return True

    def __repr__(self) -> str:
        return f"IdentityQuantizer(dtype={self.dtype})"
