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
from ._block_scaled_tensor import BlockScaledTensorMixin
from .storage.mxfp8_tensor_storage import MXFP8TensorStorage, check_mxfp8_view

__all__ = ["MXFP8Tensor"]


class MXFP8Tensor(BlockScaledTensorMixin, MXFP8TensorStorage, QuantizedTensor):
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

    _quantizer_phrase = "an MXFP8Quantizer"
    _check_view = staticmethod(check_mxfp8_view)
    _columnwise_view_shape = staticmethod(tuple)

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
        anchor = cls._anchor(rowwise_data, columnwise_data)
        cls._check_anchor_shape(shape, rowwise_data, anchor)
        self = QuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=anchor.device
        )
        self._set_mxfp8_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            fp8_dtype, quantizer, with_gemm_swizzled_scales, dtype,
        )  # fmt: skip
        return self

    def _with_buffers(self, shape, buffers: dict, requires_grad: bool = False):
        return MXFP8Tensor(
            shape, self.dtype, fp8_dtype=self._fp8_dtype, quantizer=self._quantizer,
            requires_grad=requires_grad,
            **{name.lstrip("_"): t for name, t in buffers.items()},
        )  # fmt: skip

    # ------------------------------------------------------------------ Python protocol

    def _adopt_buffers(self, value) -> bool:
        if not isinstance(value, MXFP8Tensor):
            return False
        torch._C.TensorBase.data.__set__(self, value)
        meta = value.get_metadata()
        self._set_mxfp8_buffers(*meta.values(), False, value.dtype)
        return True

    def __repr__(self, *, tensor_contents=None) -> str:
        values = self._values_repr()
        return (
            f"MXFP8Tensor(fp8_dtype={self._fp8_dtype.name}, "
            f"dtype={self.dtype}, shape={tuple(self.shape)}, "
            f"device={self.device}, data={values})"
        )

    __str__ = __repr__
