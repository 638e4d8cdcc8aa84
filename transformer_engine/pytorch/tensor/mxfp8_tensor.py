"""MXFP8 tensors (the ``MXFP8BlockScaling`` recipe): upstream's import path.

* :class:`MXFP8Quantizer` casts a high-precision tensor with one E8M0 (power-of-2) scale per 32
  elements: along the last dim for the row-wise copy, along the leading dims for the
  column-wise copy, each quantized from the input (the cast is
  :func:`transformer_engine.pytorch.cpp_extensions.block_cast.mxfp8_block_cast`: the native
  kernel on CUDA, :func:`transformer_engine.pytorch.reference_blocks.mxfp8_cast` elsewhere, bit for
  bit the same);
* :class:`MXFP8Tensor` (in :mod:`._mxfp8_tensor_class`) is the result;
* its buffers are described in :mod:`transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage`.
"""

from __future__ import annotations

import torch

from ...common.recipe import MXFP8BlockScaling
from .. import reference_blocks
from ..constants import DType, to_torch_fp8_dtype
from ..cpp_extensions.block_cast import mxfp8_block_cast
from ..quantized_tensor import Quantizer, _check_high_precision_dtype
from ._block_scaled_tensor import check_cast_input, requantize_into, storage_buffers
from ._float8_quantize_into import high_precision_source
from ._mxfp8_tensor_class import MXFP8Tensor
from .storage.float8_blockwise_tensor_storage import block_matrix_dims
from .storage.mxfp8_tensor_storage import MXFP8TensorStorage, mxfp8_scale_shape

__all__ = ["MXFP8Quantizer", "MXFP8Tensor"]

_N = reference_blocks.MXFP8_BLOCK_LEN


class MXFP8Quantizer(Quantizer):
    """Quantizer to MXFP8: FP8 values with one E8M0 scale per 32 elements.

    Parameters
    ----------
    fp8_dtype : DType or torch.dtype
        E4M3 or E5M2.
    rowwise, columnwise : bool, keyword-only, default True
        Which copies :meth:`quantize` produces.
    with_2d_quantization : bool, keyword-only, default False
        One scale per 32x32 block, shared by both copies (whose bytes are then equal).
    """

    block_len = _N

    def __init__(
        self,
        fp8_dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        with_2d_quantization: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        self.with_2d_quantization = bool(with_2d_quantization)

    def get_scale_shape(self, shape, columnwise: bool) -> tuple[int, int]:
        """Shape of one copy's (padded, compact) E8M0 scale tensor."""
        return mxfp8_scale_shape(shape, columnwise)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` is whole blocks (both matrix dims multiples of 32), upstream's
        allocator condition. Any shape can be quantized here."""
        m, k = block_matrix_dims(inp.shape)
        return inp.dim() >= 2 and m % _N == 0 and k % _N == 0

    def _cast(self, src: torch.Tensor, *, dst=None, noop_flag=None) -> dict:
        """The buffers of ``src`` for the usages set now (uint8 bytes and E8M0 scales), from
        :func:`cpp_extensions.block_cast.mxfp8_block_cast` (native on CUDA). With ``dst`` (a
        storage holding those usages) the cast writes into its buffers in place, skipped on
        the device when ``noop_flag`` holds 1.0."""
        check_cast_input("MXFP8Quantizer", self, src)
        result = mxfp8_block_cast(
            src, to_torch_fp8_dtype(self.dtype), rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage, two_d=self.with_2d_quantization,
            out=None if dst is None else storage_buffers(dst, self.rowwise_usage,
                                                         self.columnwise_usage),
            noop_flag=noop_flag,
        )  # fmt: skip
        return result._asdict()

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Cast ``tensor`` (a quantized input is dequantized first) to a new
        :class:`MXFP8Tensor`, or its storage when ``internal``."""
        src = high_precision_source(tensor)
        dtype = src.dtype if dtype is None else dtype
        _check_high_precision_dtype("MXFP8Quantizer.quantize", dtype)
        buffers = self._cast(src)
        if self.internal:
            return MXFP8TensorStorage(*buffers.values(), self.dtype, self.copy(), fake_dtype=dtype)
        return MXFP8Tensor(src.shape, dtype, fp8_dtype=self.dtype, quantizer=self.copy(), **buffers)

    def update_quantized(self, src, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into ``dst``'s buffers in place (the copies ``dst`` holds)."""
        if not isinstance(dst, MXFP8TensorStorage):
            raise TypeError(
                f"MXFP8Quantizer.update_quantized: dst must be an MXFP8Tensor or its storage, "
                f"got {type(dst).__name__}"
            )
        return requantize_into(self, "MXFP8Quantizer", src, dst, noop_flag)

    def make_empty(
        self, shape, *, dtype: torch.dtype = torch.float32, device=None,
        requires_grad: bool = False, pin_memory: bool = False,
    ) -> MXFP8Tensor:  # fmt: skip
        """An uninitialised MXFP8 tensor with this quantizer's usages."""
        device = self._resolve_device(device)
        shape = tuple(shape)

        def alloc(size):
            return torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin_memory)

        buffers = {}
        if self.rowwise_usage:
            buffers["rowwise_data"] = alloc(shape)
            buffers["rowwise_scale_inv"] = alloc(mxfp8_scale_shape(shape, False))
        if self.columnwise_usage:
            buffers["columnwise_data"] = alloc(shape)
            buffers["columnwise_scale_inv"] = alloc(mxfp8_scale_shape(shape, True))
        return MXFP8Tensor(
            shape, dtype, fp8_dtype=self.dtype, quantizer=self.copy(),
            requires_grad=requires_grad, **buffers,
        )  # fmt: skip

    def is_requantization_safe(self) -> bool:
        """Power-of-2 scales: dequantizing and quantizing again reproduces the bytes."""
        return True

    def _get_compatible_recipe(self):
        return MXFP8BlockScaling

    def __repr__(self) -> str:
        return (
            f"MXFP8Quantizer(fp8_dtype={self.dtype.name}, "
            f"with_2d_quantization={self.with_2d_quantization}, "
            f"rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
            f"internal={self.internal})"
        )
