"""``Float8BlockQuantizer``: casts high-precision tensors to block-scaled FP8
(:class:`Float8BlockwiseQTensor`), the quantizer of the ``Float8BlockScaling`` recipe.

The cast is :func:`transformer_engine.pytorch.cpp_extensions.block_cast.float8_block_cast`: the
native kernel on CUDA (one pass writing both layouts and their scales; a no-op flag is read on
the device, so the cast can be captured in a CUDA graph), the reference's ``block_cast_1d`` /
``block_cast_2d`` elsewhere, bit for bit the same. Row-wise and column-wise copies are each
quantized from the high-precision input.
"""

from __future__ import annotations

import torch

from ...common.recipe import Float8BlockScaling
from .. import reference_blocks
from ..constants import DType, to_torch_fp8_dtype
from ..cpp_extensions.block_cast import float8_block_cast, float8_block_scale_shape
from ..quantized_tensor import Quantizer, _check_high_precision_dtype
from ._block_scaled_tensor import check_cast_input, requantize_into, storage_buffers
from ._float8_blockwise_tensor_class import Float8BlockwiseQTensor
from ._float8_quantize_into import high_precision_source
from .storage.float8_blockwise_tensor_storage import (
    Float8BlockwiseQTensorStorage,
    block_matrix_dims,
    columnwise_shape,
)

__all__ = ["Float8BlockQuantizer"]

_BLOCK = reference_blocks.BLOCK_SCALING_BLOCK_LEN


class Float8BlockQuantizer(Quantizer):
    """Quantizer to FP8 with one float32 scale per 1x128 tile or 128x128 block.

    Parameters
    ----------
    fp8_dtype : DType or torch.dtype
        E4M3 or E5M2.
    rowwise, columnwise : bool, keyword-only, required
        Which layouts :meth:`quantize` produces.
    amax_epsilon : float, default 0.0
        Lower bound of every block's amax before its scale is computed.
    force_pow_2_scales : bool, default True
        Round every block scale down to a power of 2.
    block_scaling_dim : int, default 2
        1: 1x128 tiles (along the last dim row-wise, along the leading dims column-wise);
        2: 128x128 blocks (shared by both layouts).
    """

    block_len = _BLOCK

    def __init__(
        self,
        fp8_dtype,
        *,
        rowwise: bool,
        columnwise: bool,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        block_scaling_dim: int = 2,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        if isinstance(block_scaling_dim, bool) or block_scaling_dim not in (1, 2):
            raise ValueError(
                f"Float8BlockQuantizer: block_scaling_dim={block_scaling_dim!r} is not "
                "supported; pass 1 (1x128 tiles) or 2 (128x128 blocks)"
            )
        epsilon = float(amax_epsilon)
        if not epsilon >= 0 or epsilon == float("inf"):
            raise ValueError(
                f"Float8BlockQuantizer: amax_epsilon={amax_epsilon!r} must be finite and >= 0"
            )
        self.block_scaling_dim = int(block_scaling_dim)
        self.amax_epsilon = epsilon
        self.force_pow_2_scales = bool(force_pow_2_scales)

    # ------------------------------------------------------------------ shapes

    def get_scale_shape(self, shape, columnwise: bool) -> tuple[int, int]:
        """Shape of the GEMM_READY scale-inverse tensor of one layout of a tensor of
        ``shape`` (see the storage module's layout contract)."""
        return float8_block_scale_shape(shape, self.block_scaling_dim, columnwise)

    def get_columnwise_shape(self, shape) -> tuple:
        """Shape of the column-wise bytes: ``(last, *leading)``."""
        return columnwise_shape(shape)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` is whole blocks (ndim >= 2, both matrix dims multiples of 128): the
        condition of upstream's FP8 all-gather. Any shape can be quantized."""
        if inp.dim() < 2:
            return False
        m, k = block_matrix_dims(inp.shape)
        return m % _BLOCK == 0 and k % _BLOCK == 0

    # ------------------------------------------------------------------ casting

    def _cast(self, src: torch.Tensor, *, dst=None, noop_flag=None) -> dict:
        """The buffers of ``src`` for the usages set now (uint8 bytes, float32 scales), from
        :func:`cpp_extensions.block_cast.float8_block_cast` (native on CUDA). With ``dst`` (a
        storage holding those usages) the cast writes into its buffers in place, skipped on
        the device when ``noop_flag`` holds 1.0."""
        return self._cast_result(src, dst=dst, noop_flag=noop_flag)._asdict()

    def _cast_result(self, src: torch.Tensor, *, dst=None, noop_flag=None):
        """:meth:`_cast`'s ``BlockCastResult`` itself."""
        check_cast_input("Float8BlockQuantizer", self, src)
        return float8_block_cast(
            src, to_torch_fp8_dtype(self.dtype), block_scaling_dim=self.block_scaling_dim,
            rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
            out=None if dst is None else storage_buffers(dst, self.rowwise_usage,
                                                         self.columnwise_usage),
            noop_flag=noop_flag,
        )  # fmt: skip

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Cast ``tensor`` (a quantized input is dequantized first) to a new block-scaled
        tensor: a :class:`Float8BlockwiseQTensor`, or its storage when ``internal``."""
        src = high_precision_source(tensor)
        dtype = src.dtype if dtype is None else dtype
        _check_high_precision_dtype("Float8BlockQuantizer.quantize", dtype)
        if self.internal:
            # The linear layers' per-call operands: the cast's own buffers need none of the
            # constructor's checks.
            fp8_dtype = self.dtype
            if not isinstance(fp8_dtype, DType):  # reassigned after construction
                fp8_dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
            return Float8BlockwiseQTensorStorage._from_cast(
                self._cast_result(src), fp8_dtype, self.copy(), self.block_scaling_dim == 2,
                dtype,
            )  # fmt: skip
        return Float8BlockwiseQTensor(
            src.shape, dtype, fp8_dtype=self.dtype, quantizer=self.copy(),
            is_2D_scaled=self.block_scaling_dim == 2, **self._cast(src),
        )  # fmt: skip

    def update_quantized(self, src, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into ``dst``'s buffers in place (the layouts ``dst`` holds)."""
        if not isinstance(dst, Float8BlockwiseQTensorStorage):
            raise TypeError(
                f"Float8BlockQuantizer.update_quantized: dst must be a Float8BlockwiseQTensor "
                f"or its storage, got {type(dst).__name__}"
            )
        if dst._is_2D_scaled != (self.block_scaling_dim == 2):
            raise ValueError(
                f"Float8BlockQuantizer.update_quantized: dst is "
                f"{'2D' if dst._is_2D_scaled else '1D'}-scaled but this quantizer casts "
                f"block_scaling_dim={self.block_scaling_dim}; use dst's own quantizer"
            )
        return requantize_into(self, "Float8BlockQuantizer", src, dst, noop_flag)

    def make_empty(
        self,
        shape,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ) -> Float8BlockwiseQTensor:
        """An uninitialised block-scaled tensor with this quantizer's usages."""
        device = self._resolve_device(device)
        shape = tuple(shape)

        def alloc(size, kind):
            return torch.empty(size, dtype=kind, device=device, pin_memory=pin_memory)

        buffers = {}
        if self.rowwise_usage:
            buffers["rowwise_data"] = alloc(shape, torch.uint8)
            buffers["rowwise_scale_inv"] = alloc(self.get_scale_shape(shape, False), torch.float32)
        if self.columnwise_usage:
            buffers["columnwise_data"] = alloc(columnwise_shape(shape), torch.uint8)
            buffers["columnwise_scale_inv"] = alloc(
                self.get_scale_shape(shape, True), torch.float32
            )
        return Float8BlockwiseQTensor(
            shape, dtype, fp8_dtype=self.dtype, quantizer=self.copy(),
            is_2D_scaled=self.block_scaling_dim == 2, requires_grad=requires_grad, **buffers,
        )  # fmt: skip

    # ------------------------------------------------------------------ misc

    def is_requantization_safe(self) -> bool:
        """Dequantizing and quantizing again reproduces the bytes only with pow-2 scales."""
        return self.force_pow_2_scales

    def _get_compatible_recipe(self):
        return Float8BlockScaling

    def __repr__(self) -> str:
        return (
            f"Float8BlockQuantizer(fp8_dtype={self.dtype.name}, "
            f"block_scaling_dim={self.block_scaling_dim}, "
            f"force_pow_2_scales={self.force_pow_2_scales}, amax_epsilon={self.amax_epsilon}, "
            f"rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
            f"internal={self.internal})"
        )
