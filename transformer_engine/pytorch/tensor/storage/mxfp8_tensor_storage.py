"""Buffers of an MXFP8 tensor (``MXFP8BlockScaling``), without a ``torch.Tensor`` wrapper.

Layout contract. The tensor of logical shape ``(d0, ..., dn)`` is cast as the matrix ``[M, K]``
with ``K = dn`` and ``M = d0 * ... * d(n-1)``. Both copies keep the logical shape (neither is
transposed):

``_rowwise_data`` / ``_rowwise_scale_inv``
    ``torch.uint8`` FP8 bytes, one E8M0 byte per 32 elements along ``K``; scales
    ``(roundup(M, 128), roundup(ceil(K/32), 4))``, entry ``[i, j]`` for row ``i``, block ``j``.
``_columnwise_data`` / ``_columnwise_scale_inv``
    FP8 bytes quantized on their own with 32-element blocks along ``M``; scales
    ``(roundup(ceil(M/32), 4), roundup(K, 128))``, entry ``[j, k]`` for block ``j``, column ``k``.

Scales are compact (row-major, not GEMM-swizzled: ``_with_gemm_swizzled_scales`` is False);
padding entries are 0. Real value = FP8 value * ``2^(e-127)``. Shapes need not be multiples of
32 (partial blocks are zero-padded for the amax), unlike upstream's allocator.
"""

from __future__ import annotations

import torch

from ... import reference_blocks
from ...constants import DType, to_torch_fp8_dtype
from ...reference import transpose_last_dim_first
from ...utils import round_up_to_nearest_multiple as round_up
from ._block_scaled_storage import (
    BUFFERS,
    BlockScaledTensorStorage,
    check_nominal_dtype,
    resolve_view_shape,
)
from .float8_blockwise_tensor_storage import block_matrix_dims

__all__ = ["MXFP8TensorStorage", "mxfp8_scale_shape", "check_mxfp8_view"]

_N = reference_blocks.MXFP8_BLOCK_LEN


def mxfp8_scale_shape(shape, columnwise: bool) -> tuple[int, int]:
    """Shape of the (padded, compact) E8M0 scale tensor of one copy of a tensor of ``shape``."""
    m, k = block_matrix_dims(shape)
    if columnwise:
        return round_up(-(-m // _N), 4), round_up(k, 128)
    return round_up(m, 128), round_up(-(-k // _N), 4)


def _as_uint8(name: str, t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} has dtype {t.dtype}; MXFP8 buffers must be torch.uint8")
    return t


class MXFP8TensorStorage(BlockScaledTensorStorage):
    """MXFP8 buffers: row-wise and column-wise bytes with their E8M0 block scales.

    Parameters (positional, as upstream's)
    ----------
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv : torch.Tensor or None
        See the module's layout contract (``uint8``).
    fp8_dtype : DType or torch.dtype
    quantizer : MXFP8Quantizer or None
    with_gemm_swizzled_scales : bool, default False
        Only False: scales are kept compact (no native MXFP8 GEMM reads swizzled ones here).
    fake_dtype : torch.dtype, keyword, default torch.float32
    """

    _format_name = "MXFP8"

    def __init__(
        self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
        fp8_dtype, quantizer=None, with_gemm_swizzled_scales: bool = False, *,
        fake_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self._set_mxfp8_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            fp8_dtype, quantizer, with_gemm_swizzled_scales, fake_dtype,
        )  # fmt: skip

    def _set_mxfp8_buffers(
        self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
        fp8_dtype, quantizer, with_gemm_swizzled_scales, fake_dtype,
    ) -> None:  # fmt: skip
        owner = type(self).__name__
        check_nominal_dtype(owner, fake_dtype)
        if with_gemm_swizzled_scales:
            raise NotImplementedError(
                f"{owner}: with_gemm_swizzled_scales=True is not supported: scales are kept "
                "compact because GEMMs here are emulated (swizzled scales are cuBLAS's layout "
                "for native Blackwell MXFP8 GEMMs); pass compact scales"
            )
        bufs = [_as_uint8(n, t) for n, t in zip(BUFFERS, (
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv))]  # fmt: skip
        for name, data, scale in (("rowwise", bufs[0], bufs[1]), ("columnwise", bufs[2], bufs[3])):
            if (data is None) != (scale is None):
                raise ValueError(
                    f"{owner}: {name}_data and {name}_scale_inv must be given together"
                )
        if bufs[0] is not None and bufs[2] is not None and bufs[0].shape != bufs[2].shape:
            raise ValueError(
                f"{owner}: rowwise_data {tuple(bufs[0].shape)} and columnwise_data "
                f"{tuple(bufs[2].shape)} must both have the logical shape"
            )
        for name, t in zip(BUFFERS, bufs):
            setattr(self, name, t)
        self._fp8_dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        self._quantizer = quantizer
        self._with_gemm_swizzled_scales = False
        self._dtype = fake_dtype

    # ------------------------------------------------------------------ geometry

    def size(self, *args, **kwargs):
        """Logical shape (``torch.Size``), or one dimension of it."""
        data = self._rowwise_data if self._rowwise_data is not None else self._columnwise_data
        if data is None:
            raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")
        shape = data.shape
        return shape[args[0]] if args else shape[kwargs["dim"]] if "dim" in kwargs else shape

    # ------------------------------------------------------------------ values

    def mxfp8_gemm_input(self, columnwise: bool = False, dtype=torch.float32):
        """The ``[M, K]`` matrix of one copy dequantized (``None`` when that copy is absent):
        what the emulated MXFP8 GEMM multiplies."""
        fp8 = to_torch_fp8_dtype(self._fp8_dtype)
        m, k = block_matrix_dims(self.size())
        if columnwise:
            if self._columnwise_data is None:
                return None
            # The row-wise dequantize of the transpose, transposed back (column-major: the
            # layout the emulated GEMM reads). The FP8 bytes are transposed first (a fast
            # multithreaded byte copy on the CPU), so no float32 pass walks a strided view
            # (4.5 -> 0.9 ms at 1024 x 1024); the values are exact either way.
            data_t = transpose_last_dim_first(self._columnwise_data.view(fp8).reshape(m, k))
            scale_t = self._columnwise_scale_inv.t()
            return reference_blocks.mxfp8_dequantize(data_t, scale_t, dtype).t()
        if self._rowwise_data is None:
            return None
        data = self._rowwise_data.view(fp8).reshape(m, k)
        return reference_blocks.mxfp8_dequantize(data, self._rowwise_scale_inv, dtype)

    def mxfp8_gemm_scale_exponents(self, columnwise: bool = False) -> tuple[int, int] | None:
        """``(min, max)`` of the binary exponents ``e - 127`` of the E8M0 scales of one copy's
        blocks (the copy :meth:`mxfp8_gemm_input` reads), or ``None`` when the copy is absent or
        empty or a scale is the denormal ``2**-127`` (byte 0) or NaN (255): what the emulated
        GEMM needs to decide whether BF16 math is exact (``fp8_gemm_cpu.bf16_math_is_exact``)."""
        m, k = block_matrix_dims(self.size())
        n = reference_blocks.MXFP8_BLOCK_LEN
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        if scale is None:
            return None
        # the blocks' region of the (padded) scales, as mxfp8_gemm_input reads them
        exponents = scale.t()[:k, : -(-m // n)] if columnwise else scale[:m, : -(-k // n)]
        if exponents.numel() == 0:
            return None
        low, high = torch.aminmax(exponents.to(torch.int32))
        low, high = int(low), int(high)
        if low == 0 or high == 255:
            return None
        return low - 127, high - 127

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._dequantize_dtype(dtype)
        shape = self.size()
        if self.device.type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        values = self.mxfp8_gemm_input(self._rowwise_data is None, dtype)
        return values.contiguous().reshape(shape)

    # ------------------------------------------------------------------ saving, copying

    def copy_from_storage(self, src: MXFP8TensorStorage) -> None:
        """Copy ``src``'s bytes and scales into this object's buffers (same shape and dtype)."""
        if not isinstance(src, MXFP8TensorStorage):
            raise TypeError(
                f"copy_from_storage: src must be an MXFP8TensorStorage, got {type(src).__name__}"
            )
        if src._fp8_dtype != self._fp8_dtype or tuple(src.size()) != tuple(self.size()):
            raise ValueError(
                f"copy_from_storage: src is {src._fp8_dtype.name} {tuple(src.size())}, this "
                f"tensor {self._fp8_dtype.name} {tuple(self.size())}; both must match"
            )
        self._copy_buffers_from(src)

    def view(self, shape) -> MXFP8TensorStorage:
        """Storage sharing the buffers with new leading dims (see :func:`check_mxfp8_view`)."""
        shape = check_mxfp8_view(self, shape)
        row, col = self._rowwise_data, self._columnwise_data
        return MXFP8TensorStorage(
            None if row is None else row.view(shape), self._rowwise_scale_inv,
            None if col is None else col.view(shape), self._columnwise_scale_inv,
            self._fp8_dtype, self._quantizer, fake_dtype=self._dtype,
        )  # fmt: skip

    def __repr__(self) -> str:
        try:
            shape = tuple(self.size())
        except RuntimeError:
            shape = "cleared"
        return (
            f"{type(self).__name__}(shape={shape}, fp8_dtype={self._fp8_dtype.name}, "
            f"dtype={self._dtype}, usages={self.get_usages()})"
        )


def check_mxfp8_view(tensor, shape) -> torch.Size:
    """The target shape of a view after checking that the blocks survive it: only the leading
    dims may change (the last dim, along which row-wise blocks run, is kept)."""
    old = tuple(tensor.size())
    shape = resolve_view_shape(tensor, shape)
    if not old or not shape or shape[-1] != old[-1]:
        raise RuntimeError(
            f"{type(tensor).__name__}: view {old} -> {tuple(shape)} changes the last dim; an "
            "MXFP8 tensor can only change its leading dims (dequantize first for other shapes)"
        )
    return shape
