"""The ``MXFP8Tensor`` class: an MXFP8 tensor presented as a high-precision ``torch.Tensor``.

Its public home is :mod:`transformer_engine.pytorch.tensor.mxfp8_tensor`, next to the
quantizer; the class lives here, below the quantizer, so that the quantizer can import it. The
buffers are described in :mod:`transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage`.
Aten operations that keep the blocks intact (detach, alias, views and reshapes of the leading
dims, clone, device moves) keep it an ``MXFP8Tensor``; everything else runs in high precision
on the dequantized values (see
:class:`~transformer_engine.pytorch.quantized_tensor.QuantizedTensor`).
"""

from __future__ import annotations

import torch

from ..quantized_tensor import QuantizedTensor
from .storage.mxfp8_tensor_storage import _BUFFERS, MXFP8TensorStorage, check_mxfp8_view

__all__ = ["MXFP8Tensor"]

aten = torch.ops.aten


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """MXFP8 tensor (32-element blocks, E8M0 scales) as a ``torch.Tensor``.

    Parameters
    ----------
    shape : sequence of int
        Logical shape.
    dtype : torch.dtype
        Nominal dtype: float32, float16 or bfloat16.
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv : keyword
        The buffers (see the storage module's layout contract); at least one layout.
    fp8_dtype : DType or torch.dtype, keyword
    quantizer : MXFP8Quantizer, keyword, optional
    with_gemm_swizzled_scales : bool, keyword, default False
    requires_grad : bool, keyword, default False
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    size = torch.Tensor.size
    shape = torch.Tensor.shape
    device = torch.Tensor.device
    view = torch.Tensor.view

    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        *,
        rowwise_data=None,
        rowwise_scale_inv=None,
        columnwise_data=None,
        columnwise_scale_inv=None,
        fp8_dtype,
        quantizer=None,
        with_gemm_swizzled_scales: bool = False,
        requires_grad: bool = False,
        **unused,
    ):
        shape = torch.Size(shape)
        anchor = rowwise_data if rowwise_data is not None else columnwise_data
        if anchor is None:
            raise ValueError(
                f"{cls.__name__}: rowwise_data and columnwise_data are both None; pass at "
                "least one layout"
            )
        expected = tuple(shape)
        if tuple(anchor.shape) != expected:
            raise ValueError(
                f"{cls.__name__}: shape={tuple(shape)} but the "
                f"{'rowwise' if rowwise_data is not None else 'columnwise'} bytes have shape "
                f"{tuple(anchor.shape)} (expected {expected})"
            )
        self = QuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=anchor.device
        )
        self._set_mxfp8_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            fp8_dtype, quantizer, with_gemm_swizzled_scales, dtype,
        )  # fmt: skip
        return self

    def __init__(self, *args, **kwargs) -> None:
        # Everything happens in __new__; this keeps the storage __init__ from running again.
        pass

    def _with_buffers(self, shape, buffers: dict, requires_grad: bool = False):
        return MXFP8Tensor(
            shape, self.dtype, fp8_dtype=self._fp8_dtype, quantizer=self._quantizer,
            requires_grad=requires_grad,
            **{name.lstrip("_"): t for name, t in buffers.items()},
        )  # fmt: skip

    # ------------------------------------------------------------------ values

    # autograd-aware (the storage's dequantize, first in the MRO, is the plain one)
    dequantize = QuantizedTensor.dequantize

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None):
        """Re-quantize ``tensor`` into this tensor's buffers in place; returns ``self``."""
        if self._quantizer is None:
            raise RuntimeError(
                "MXFP8Tensor.quantize_: this tensor has no quantizer (block scales come from "
                "the values, so one is needed); set tensor._quantizer to an MXFP8Quantizer"
            )
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != tuple(self.shape):
            tensor = tensor.expand(self.shape)
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _quantized_buffers(self) -> list:
        return [getattr(self, name) for name in _BUFFERS]

    def _to_device(self, device: torch.device, *, non_blocking: bool, pin_memory: bool):
        def move(t):
            if t is None:
                return None
            t = t.to(device, non_blocking=non_blocking, copy=True)
            return t.pin_memory() if pin_memory else t

        return self._with_buffers(self.shape, {n: move(getattr(self, n)) for n in _BUFFERS})

    # ------------------------------------------------------------------ Python protocol

    @property
    def data(self) -> torch.Tensor:
        """Detached alias sharing the buffers."""
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if isinstance(value, MXFP8Tensor):
            torch._C.TensorBase.data.__set__(self, value)
            meta = value.get_metadata()
            self._set_mxfp8_buffers(*meta.values(), False, value.dtype)
            return
        with torch.no_grad():
            self.quantize_(value)

    def __repr__(self, *, tensor_contents=None) -> str:
        if self.is_meta:
            values = "<meta: no data>"
        else:
            with torch.no_grad():
                values = repr(self._dequantize_plain())
        return (
            f"MXFP8Tensor(fp8_dtype={self._fp8_dtype.name}, "
            f"dtype={self.dtype}, shape={tuple(self.shape)}, "
            f"device={self.device}, data={values})"
        )

    __str__ = __repr__

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else None
        if isinstance(tensor, MXFP8Tensor):
            if func in (aten.detach.default, aten.alias.default):
                buffers = {n: getattr(tensor, n) for n in _BUFFERS}
                return tensor._with_buffers(tensor.shape, buffers)
            if func is aten.clone.default:
                buffers = {
                    n: (None if getattr(tensor, n) is None else getattr(tensor, n).clone())
                    for n in _BUFFERS
                }
                return tensor._with_buffers(tensor.shape, buffers)
            if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                try:
                    shape = check_mxfp8_view(tensor, args[1])
                except RuntimeError:
                    if func is aten.reshape.default:
                        return _high_precision_reshape(cls, func, types, args, kwargs)
                    raise
                row, col = tensor._rowwise_data, tensor._columnwise_data
                buffers = {
                    "_rowwise_data": None if row is None else row.view(shape),
                    "_rowwise_scale_inv": tensor._rowwise_scale_inv,
                    "_columnwise_data": None if col is None else col.view(shape),
                    "_columnwise_scale_inv": tensor._columnwise_scale_inv,
                }
                return tensor._with_buffers(shape, buffers)
        return QuantizedTensor.__torch_dispatch__.__func__(cls, func, types, args, kwargs)


def _high_precision_reshape(cls, func, types, args, kwargs):
    """A reshape the blocks cannot follow runs in high precision (like any other op)."""
    return QuantizedTensor.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
