"""The FP8 operand interface of the GEMM, and its validation.

An FP8 GEMM operand (per-tensor scaling) is anything with the method

``float8_gemm_input(columnwise: bool = False) -> (values, scale_inv)``

* ``values``: with ``columnwise=False`` the FP8 values in the operand's logical shape; with
  ``columnwise=True`` the same values with the last dimension first, ``(last, *leading)`` (the
  copy that column-wise usage keeps). Typed ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``;
  ``None`` when the operand does not hold that layout.
* ``scale_inv``: one-element float32 tensor; real value = FP8 value * ``scale_inv``.

This layer owns the interface: :class:`Float8GemmOperand` is its plain-tensor form, and the
tensor layer's ``Float8Tensor`` and ``Float8TensorStorage`` implement the method over their
buffers. The GEMM reads nothing else of an operand.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..constants import FP8_DTYPES
from ..device import is_non_tn_fp8_gemm_supported
from ._validation import check_dtype, check_fp32_scalar, check_tensor
from .cast import dequantize, transposed_shape

__all__ = ["Float8GemmOperand", "is_float8_operand", "CheckedFloat8Operand"]

_OP = "general_gemm"


class Float8GemmOperand(NamedTuple):
    """An FP8 GEMM operand as plain torch tensors.

    Attributes:
        data: FP8 values in the operand's logical shape, or ``None``.
        transpose: the same values with the last dimension first, ``(last, *leading)``, or
            ``None``.
        scale_inv: one-element float32 ``1 / scale`` shared by both layouts.
    """

    data: torch.Tensor | None
    transpose: torch.Tensor | None
    scale_inv: torch.Tensor

    def float8_gemm_input(self, columnwise: bool = False):
        """``(transpose if columnwise else data, scale_inv)`` (see the module docstring)."""
        return (self.transpose if columnwise else self.data), self.scale_inv


def is_float8_operand(operand) -> bool:
    """Whether ``operand`` implements the FP8 operand interface (before any tensor check:
    ``Float8Tensor`` is a ``torch.Tensor`` too)."""
    return hasattr(operand, "float8_gemm_input")


class CheckedFloat8Operand:
    """Both layouts of an FP8 operand, validated: dtypes, ``scale_inv``, agreeing shapes."""

    def __init__(self, name: str, operand):
        self.name = name
        data, scale_inv = operand.float8_gemm_input(False)
        transpose, _ = operand.float8_gemm_input(True)
        if data is None and transpose is None:
            raise ValueError(
                f"{_OP}: FP8 operand {name} holds no data ({name}.data and {name}.transpose are "
                "both None); quantize it with rowwise or columnwise usage first"
            )
        for attr, t in (("data", data), ("transpose", transpose)):
            if t is not None:
                check_tensor(_OP, f"{name}.{attr}", t)
                check_dtype(_OP, f"{name}.{attr}", t, FP8_DTYPES)
        if data is not None and transpose is not None and data.dtype != transpose.dtype:
            raise TypeError(
                f"{_OP}: {name}.transpose is {transpose.dtype} but {name}.data is {data.dtype}; "
                "both layouts of an operand hold the same FP8 values (refresh the stale copy)"
            )
        check_fp32_scalar(_OP, f"{name}.scale_inv", scale_inv)
        self.data, self.transpose, self.scale_inv = data, transpose, scale_inv
        self.dtype = (data if data is not None else transpose).dtype
        if data is not None:
            self.shape = tuple(data.shape)
            if data.dim() == 0:
                raise ValueError(f"{_OP}: {name} is 0-d; a GEMM operand needs at least one dim")
            if transpose is not None and tuple(transpose.shape) != transposed_shape(self.shape):
                raise ValueError(
                    f"{_OP}: {name}.transpose has shape {tuple(transpose.shape)} but "
                    f"{name}.data has shape {self.shape}; expected the transpose to be "
                    f"{transposed_shape(self.shape)} (refresh the stale transposed copy)"
                )
        else:
            t_shape = tuple(transpose.shape)
            if len(t_shape) == 0:
                raise ValueError(f"{_OP}: {name}.transpose is 0-d; expected (last, *leading)")
            self.shape = (*t_shape[1:], t_shape[0])

    def tensors(self) -> dict:
        return {
            f"{self.name}.data": self.data,
            f"{self.name}.transpose": self.transpose,
            f"{self.name}.scale_inv": self.scale_inv,
        }

    def rowwise(self, layout: str) -> torch.Tensor:
        """The FP8 values in the operand's own (logical) orientation."""
        if self.data is None:
            raise ValueError(
                f"{_OP}: layout {layout!r} reads {self.name} rowwise, but {self.name} has no "
                f"rowwise FP8 data ({self.name}.data is None); quantize it with rowwise usage"
            )
        return self.data

    def columnwise(self, layout: str) -> torch.Tensor:
        """The FP8 values with the last dimension first: ``(last, *leading)``."""
        if self.transpose is not None:
            return self.transpose
        if self.data is not None and is_non_tn_fp8_gemm_supported(self.data.device):
            return self.data.reshape(-1, self.shape[-1]).t().contiguous()
        raise ValueError(
            f"{_OP}: layout {layout!r} reads {self.name} columnwise, but {self.name} has no "
            f"columnwise (transposed) FP8 data ({self.name}.transpose is None); quantize it "
            "with columnwise usage"
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The high-precision tensor in the operand's logical shape."""
        if self.data is not None:
            return dequantize(self.data, self.scale_inv, dtype)
        # Contiguous, so the GEMM does not depend on which buffer the values came from.
        return dequantize(self.transpose, self.scale_inv, dtype).movedim(0, -1).contiguous()
