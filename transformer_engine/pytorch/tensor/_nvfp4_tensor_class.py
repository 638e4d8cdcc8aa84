"""The ``NVFP4Tensor`` class: an NVFP4 tensor presented as a high-precision ``torch.Tensor``.

Its public home is :mod:`transformer_engine.pytorch.tensor.nvfp4_tensor`, next to the
quantizer; the class lives here, below the quantizer, so that the quantizer can import it. The
buffers are described in :mod:`transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage`.
Aten operations that keep the blocks intact (detach, alias, views and reshapes of the leading
dims, clone, device moves) keep it an ``NVFP4Tensor``; everything else runs in high precision
on the dequantized values (see
:class:`~transformer_engine.pytorch.quantized_tensor.QuantizedTensor`).
"""

from __future__ import annotations

import torch

from ..quantized_tensor import QuantizedTensor
from ._block_scaled_tensor import BlockScaledTensorMixin
from .storage.nvfp4_tensor_storage import (
    NVFP4TensorStorage,
    check_nvfp4_view,
    nvfp4_data_shape,
)

__all__ = ["NVFP4Tensor"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class NVFP4Tensor(BlockScaledTensorMixin, NVFP4TensorStorage, QuantizedTensor):
    """NVFP4 tensor (16-element E2M1 blocks, E4M3 block scales, FP32 global scale).

    Parameters
    ----------
    shape : sequence of int
        Logical shape.
    dtype : torch.dtype
        Nominal dtype: float32, float16 or bfloat16.
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv : keyword
        The packed codes and E4M3 scale bytes (see the storage module's layout contract).
    amax_rowwise, amax_columnwise : keyword
        float32 ``(1,)`` amaxes of the copies present.
    fp4_dtype : DType, keyword, default ``DType.kFloat4E2M1``
    quantizer : NVFP4Quantizer, keyword, optional
    with_gemm_swizzled_scales : bool, keyword, default False
    columnwise_rht, rht_random_sign_mask : bool, keyword
        Whether the column-wise copy went through the RHT, and with which sign vector.
    requires_grad : bool, keyword, default False
    """

    _quantizer_phrase = "an NVFP4Quantizer"
    _check_view = staticmethod(check_nvfp4_view)

    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        *,
        rowwise_data=None,
        rowwise_scale_inv=None,
        columnwise_data=None,
        columnwise_scale_inv=None,
        amax_rowwise=None,
        amax_columnwise=None,
        fp4_dtype=None,
        quantizer=None,
        with_gemm_swizzled_scales: bool = False,
        columnwise_rht: bool = False,
        rht_random_sign_mask: bool = True,
        requires_grad: bool = False,
        **unused,
    ):
        shape = torch.Size(shape)
        anchor = cls._anchor(rowwise_data, columnwise_data)
        self = QuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=anchor.device
        )
        self._set_nvfp4_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            amax_rowwise, amax_columnwise, 10 if fp4_dtype is None else fp4_dtype, quantizer,
            with_gemm_swizzled_scales, dtype, shape, columnwise_rht, rht_random_sign_mask,
        )  # fmt: skip
        return self

    def _with_buffers(self, shape, buffers: dict, requires_grad: bool = False):
        meta = self.get_metadata()
        meta.update({name.lstrip("_"): t for name, t in buffers.items()})
        meta.pop("shape")
        return NVFP4Tensor(shape, self.dtype, requires_grad=requires_grad, **meta)

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return NVFP4TensorStorage._dequantize_plain(self, dtype)

    # ------------------------------------------------------------------ Python protocol

    def _adopt_buffers(self, value) -> bool:
        # Any shape, as the other quantized tensors and torch's setter take (a shape check here
        # sent other shapes to a re-cast that cannot change the shape).
        if not isinstance(value, NVFP4Tensor):
            return False
        torch._C.TensorBase.data.__set__(self, value)
        meta = value.get_metadata()
        self._set_nvfp4_buffers(
            *(meta[n[1:]] for n in self._buffer_names), meta["fp4_dtype"], meta["quantizer"], False,
            value.dtype, meta["shape"], meta["columnwise_rht"], meta["rht_random_sign_mask"],
        )  # fmt: skip
        return True

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        tensor = args[0] if args else None
        if func in _VIEWS and isinstance(tensor, cls):
            # The row-wise bytes are packed along the last dim, so the mixin's view (which
            # gives the bytes the logical shape) does not apply: view them with their own.
            try:
                shape = check_nvfp4_view(tensor, args[1])
            except RuntimeError:
                if func is not aten.reshape.default:
                    raise
                return QuantizedTensor.__torch_dispatch__.__func__(
                    cls, func, types, args, kwargs or {}
                )
            row = tensor._rowwise_data
            buffers = {"_rowwise_data": None if row is None else row.view(
                nvfp4_data_shape(shape, False))}  # fmt: skip
            return tensor._with_buffers(shape, buffers)
        return BlockScaledTensorMixin.__torch_dispatch__.__func__(cls, func, types, args, kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        values = self._values_repr()
        return (
            f"NVFP4Tensor(fp4_dtype=kFloat4E2M1, dtype={self.dtype}, shape={tuple(self.shape)}, "
            f"device={self.device}, data={values})"
        )

    __str__ = __repr__
