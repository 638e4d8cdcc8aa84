"""Upstream's entry points take element types as ``DType`` values; these turn such an argument
into the torch dtype the wrappers of :mod:`transformer_engine.pytorch.cpp_extensions` take, with
an error that names the argument."""

from __future__ import annotations

import torch

from transformer_engine.pytorch.constants import HIGH_PRECISION_DTYPES, DType, TE_DType_To_Torch

__all__ = ["high_precision_dtype", "torch_dtype"]


def torch_dtype(op: str, name: str, value) -> torch.dtype:
    """The torch dtype of a ``DType`` (an ``int`` value or a ``torch.dtype`` are accepted too)."""
    try:
        dtype = TE_DType_To_Torch.get(DType.cast(value))
    except (TypeError, ValueError):
        dtype = None
    if dtype is None:
        raise TypeError(
            f"{op}: {name}={value!r} is not an element type with a torch dtype; pass a "
            "transformer_engine_torch.DType such as DType.kBFloat16"
        )
    return dtype


def high_precision_dtype(op: str, name: str, value) -> torch.dtype:
    """:func:`torch_dtype`, restricted to float32, float16 and bfloat16."""
    dtype = torch_dtype(op, name, value)
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{op}: {name}={value!r} is not a high-precision type; use DType.kFloat32, "
            "DType.kFloat16 or DType.kBFloat16"
        )
    return dtype
