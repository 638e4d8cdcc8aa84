"""Buffers of a block-scaled FP8 tensor (``Float8BlockScaling``), without a ``torch.Tensor``
wrapper.

Layout contract. The tensor of logical shape ``(d0, ..., dn)`` is cast as the matrix
``[M, K]`` with ``K = dn`` and ``M = d0 * ... * d(n-1)`` (a 1-D tensor is one row, a 0-d
tensor one element):

``_rowwise_data``
    ``torch.uint8`` of the logical shape: FP8 bytes scaled per 1x128 tile along ``K`` (1-D
    blocks) or per 128x128 block (2-D blocks). ``None`` when absent.
``_rowwise_scale_inv``
    ``torch.float32`` in the GEMM_READY layout: 1-D ``(ceil(K/128), roundup(M, 4))`` (already
    transposed: entry ``[j, i]`` is row ``i``, tile ``j``); 2-D ``(ceil(M/128),
    roundup(ceil(K/128), 4))``.
``_columnwise_data``
    ``torch.uint8`` of shape ``(dn, d0, ..., d(n-1))``: the transposed matrix ``[K, M]`` cast on
    its own (1-D: 1x128 tiles along ``M``, quantized from the high-precision input, so it is
    *not* the transpose of the row-wise bytes; 2-D: the same blocks, so it is).
``_columnwise_scale_inv``
    1-D ``(ceil(M/128), roundup(K, 4))``; 2-D ``(ceil(K/128), roundup(ceil(M/128), 4))``.
``_fp8_dtype``, ``_quantizer``, ``_is_2D_scaled``, ``_dtype``
    FP8 format (``DType``), the quantizer (a copy), 2-D blocks or not, nominal dtype.

Real value = FP8 value * the block's ``scale_inv``. GEMMs read these buffers only through
:meth:`Float8BlockwiseQTensorStorage.block_float8_gemm_input`.
"""

from __future__ import annotations

import math

import torch

from ... import reference_blocks
from ...constants import DType, to_torch_fp8_dtype
from ._block_scaled_storage import BlockScaledTensorStorage, check_nominal_dtype, resolve_view_shape

__all__ = ["Float8BlockwiseQTensorStorage", "block_matrix_dims", "columnwise_shape"]


def block_matrix_dims(shape) -> tuple[int, int]:
    """``(M, K)`` of the matrix a tensor of ``shape`` is cast as."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def columnwise_shape(shape) -> tuple:
    """Shape of the column-wise bytes: ``(last, *leading)`` (``()`` for a 0-d tensor)."""
    shape = tuple(shape)
    return (shape[-1], *shape[:-1]) if shape else ()


def _as_uint8(name: str, t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} has dtype {t.dtype}; FP8 bytes must be torch.uint8 or torch FP8")
    return t


class Float8BlockwiseQTensorStorage(BlockScaledTensorStorage):
    """Block-scaled FP8 buffers: row-wise and column-wise bytes with their block scales.

    Parameters (positional, as upstream's)
    ----------
    rowwise_data, rowwise_scale_inv : torch.Tensor or None
        Row-wise bytes (logical shape) and their scale-inverses.
    columnwise_data, columnwise_scale_inv : torch.Tensor or None
        Column-wise bytes ``(last, *leading)`` and their scale-inverses.
    fp8_dtype : DType or torch.dtype
        FP8 format.
    quantizer : Float8BlockQuantizer or None
        Used to re-quantize in place.
    is_2D_scaled : bool
        128x128 blocks (True) or 1x128 tiles (False).
    fake_dtype : torch.dtype, keyword, default torch.float32
        Nominal high-precision dtype.
    """

    def __init__(
        self,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        quantizer,
        is_2D_scaled: bool,
        *,
        fake_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._set_block_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            fp8_dtype, quantizer, is_2D_scaled, fake_dtype,
        )  # fmt: skip

    @classmethod
    def _from_cast(cls, buffers, fp8_dtype: DType, quantizer, is_2D_scaled: bool, fake_dtype):
        """A storage around the buffers a :class:`Float8BlockQuantizer` cast just produced
        (``float8_block_cast``'s result: uint8 bytes and float32 scales of matching shapes, each
        layout's pair together): the checks of ``__init__`` are skipped, which matters on the
        linear layers' per-call path. ``fake_dtype`` must already be checked."""
        self = cls.__new__(cls)
        self._rowwise_data = buffers.rowwise_data
        self._rowwise_scale_inv = buffers.rowwise_scale_inv
        self._columnwise_data = buffers.columnwise_data
        self._columnwise_scale_inv = buffers.columnwise_scale_inv
        self._fp8_dtype = fp8_dtype
        self._quantizer = quantizer
        self._is_2D_scaled = is_2D_scaled
        self._dtype = fake_dtype
        return self

    def _set_block_buffers(
        self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
        fp8_dtype, quantizer, is_2D_scaled, fake_dtype,
    ) -> None:  # fmt: skip
        owner = type(self).__name__
        check_nominal_dtype(owner, fake_dtype)
        rowwise_data = _as_uint8("rowwise_data", rowwise_data)
        columnwise_data = _as_uint8("columnwise_data", columnwise_data)
        for name, data, scale in (
            ("rowwise", rowwise_data, rowwise_scale_inv),
            ("columnwise", columnwise_data, columnwise_scale_inv),
        ):
            if (data is None) != (scale is None):
                raise ValueError(
                    f"{owner}: {name}_data and {name}_scale_inv must be given together"
                )
            if scale is not None and scale.dtype != torch.float32:
                raise TypeError(f"{owner}: {name}_scale_inv must be float32, got {scale.dtype}")
        if rowwise_data is not None and columnwise_data is not None:
            expected = columnwise_shape(rowwise_data.shape)
            if tuple(columnwise_data.shape) != expected:
                raise ValueError(
                    f"{owner}: columnwise_data has shape {tuple(columnwise_data.shape)}; for "
                    f"rowwise_data of shape {tuple(rowwise_data.shape)} it must be {expected}"
                )
        self._rowwise_data = rowwise_data
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_data = columnwise_data
        self._columnwise_scale_inv = columnwise_scale_inv
        self._fp8_dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        self._quantizer = quantizer
        self._is_2D_scaled = bool(is_2D_scaled)
        self._dtype = fake_dtype

    # ------------------------------------------------------------------ geometry

    def size(self, *args, **kwargs):
        """Logical shape (``torch.Size``), or one dimension of it."""
        if self._rowwise_data is not None:
            shape = self._rowwise_data.shape
        elif self._columnwise_data is not None:
            t = self._columnwise_data.shape
            shape = torch.Size((*t[1:], t[0])) if len(t) else torch.Size(())
        else:
            raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")
        return shape[args[0]] if args else shape[kwargs["dim"]] if "dim" in kwargs else shape

    # ------------------------------------------------------------------ values

    def _dequantize_layout(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        """The matrix of one layout in ``dtype``: ``[M, K]`` row-wise, ``[K, M]`` column-wise."""
        fp8 = to_torch_fp8_dtype(self._fp8_dtype)
        m, k = block_matrix_dims(self.size())
        if columnwise:
            data, scale, rows, cols = self._columnwise_data, self._columnwise_scale_inv, k, m
        else:
            data, scale, rows, cols = self._rowwise_data, self._rowwise_scale_inv, m, k
        matrix = data.view(fp8).reshape(rows, cols)
        if self._is_2D_scaled:
            return reference_blocks.block_dequantize_2d(matrix, scale, dtype)
        return reference_blocks.block_dequantize_1d(matrix, scale, dtype)

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._dequantize_dtype(dtype)
        shape = self.size()
        if self.device.type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        if self._rowwise_data is not None:
            return self._dequantize_layout(False, dtype).reshape(shape)
        return self._dequantize_layout(True, dtype).t().contiguous().reshape(shape)

    # ------------------------------------------------------------------ GEMM operand

    def block_float8_gemm_input(self, columnwise: bool = False):
        """``(values, scale_inv, is_2D_scaled)`` of one layout for a block-scaled GEMM.

        ``values`` is the 2-D FP8 matrix (typed ``torch.float8_*``; ``[M, K]`` row-wise,
        ``[K, M]`` column-wise) or ``None`` when the layout is absent; ``scale_inv`` is that
        layout's GEMM_READY scale-inverse tensor (see the module docstring).
        """
        data = self._columnwise_data if columnwise else self._rowwise_data
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        if data is None:
            return None, scale, self._is_2D_scaled
        values = data.view(to_torch_fp8_dtype(self._fp8_dtype))
        if data.dim() != 2:
            # 2-D bytes (a linear layer's operands) are the matrix already: no reshape dispatch.
            m, k = block_matrix_dims(self.size())
            values = values.reshape((k, m) if columnwise else (m, k))
        return values, scale, self._is_2D_scaled

    # ------------------------------------------------------------------ usages

    def _create_copy(self, name: str) -> None:
        """The missing ``name`` copy from the other one (2-D blocks only)."""
        if name == "rowwise":
            self._create_rowwise()
        else:
            self._create_columnwise()

    def _create_columnwise(self) -> None:
        """Column-wise copy from the row-wise one: 2-D blocks only (symmetric blocks, so the
        bytes and the block scales are transposes); 1-D tiles would need the input again."""
        if not self._is_2D_scaled:
            raise RuntimeError(
                f"{type(self).__name__}: the column-wise copy of a 1x128-scaled tensor is its "
                "own quantization of the high-precision input and cannot be made from the "
                "row-wise bytes; quantize again with columnwise usage"
            )
        if self._rowwise_data is None:
            raise RuntimeError(f"{type(self).__name__}: no row-wise data to transpose")
        self._columnwise_data, self._columnwise_scale_inv = _transposed_2d(
            self._rowwise_data, self._rowwise_scale_inv, self.size()
        )

    def _create_rowwise(self) -> None:
        if not self._is_2D_scaled:
            raise RuntimeError(
                f"{type(self).__name__}: row-wise data was requested but only the column-wise "
                "copy of a 1x128-scaled tensor exists; quantize the high-precision tensor again "
                "with rowwise usage"
            )
        shape = self.size()
        m, k = block_matrix_dims(shape)
        data, scale = _transposed_2d(self._columnwise_data, self._columnwise_scale_inv, (k, m))
        self._rowwise_data = data.reshape(shape)
        self._rowwise_scale_inv = scale

    def _format_key(self) -> tuple:
        """The FP8 format and the block shape (128x128 or 1x128)."""
        return (self._fp8_dtype, self._is_2D_scaled)

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the buffers)."""
        return {**super().get_metadata(), "is_2D_scaled": self._is_2D_scaled}

    # ------------------------------------------------------------------ saving, copying

    def copy_from_storage(self, src: Float8BlockwiseQTensorStorage) -> None:
        """Copy ``src``'s bytes and scales into this object's buffers (same shape, dtype and
        block kind)."""
        if not isinstance(src, Float8BlockwiseQTensorStorage):
            raise TypeError(
                f"copy_from_storage: src must be a Float8BlockwiseQTensorStorage, got "
                f"{type(src).__name__}"
            )
        if src._fp8_dtype != self._fp8_dtype or src._is_2D_scaled != self._is_2D_scaled:
            raise ValueError(
                f"copy_from_storage: src is {src._fp8_dtype.name} "
                f"{'2D' if src._is_2D_scaled else '1D'}-scaled, this tensor "
                f"{self._fp8_dtype.name} {'2D' if self._is_2D_scaled else '1D'}-scaled; both "
                "must match"
            )
        if tuple(src.size()) != tuple(self.size()):
            raise ValueError(
                f"copy_from_storage: shapes differ ({tuple(src.size())} into {tuple(self.size())})"
            )
        self._copy_buffers_from(src)

    def view(self, shape) -> Float8BlockwiseQTensorStorage:
        """Storage sharing the buffers with new leading dims (see :func:`check_block_view`)."""
        shape = check_block_view(self, shape)
        row = self._rowwise_data.view(shape) if self._rowwise_data is not None else None
        col = self._columnwise_data
        if col is not None:
            col = col.view(columnwise_shape(shape))
        return Float8BlockwiseQTensorStorage(
            row, self._rowwise_scale_inv, col, self._columnwise_scale_inv, self._fp8_dtype,
            self._quantizer, self._is_2D_scaled, fake_dtype=self._dtype,
        )  # fmt: skip

    def __repr__(self) -> str:
        try:
            shape = tuple(self.size())
        except RuntimeError:
            shape = "cleared"
        return (
            f"{type(self).__name__}(shape={shape}, fp8_dtype={self._fp8_dtype.name}, "
            f"is_2D_scaled={self._is_2D_scaled}, dtype={self._dtype}, "
            f"usages={self.get_usages()})"
        )


def check_block_view(tensor, shape) -> torch.Size:
    """The target shape of a view, after checking that the block structure survives it.

    1-D tiles keep their meaning when only the leading dims change (the last dim is kept);
    2-D blocks need the last two dims kept. Anything else raises ``RuntimeError``.
    """
    old = tuple(tensor.size())
    shape = resolve_view_shape(tensor, shape)
    keep = 2 if tensor._is_2D_scaled else 1
    if len(old) < keep or len(shape) < keep or tuple(shape[-keep:]) != old[-keep:]:
        what = "last two dims" if keep == 2 else "last dim"
        raise RuntimeError(
            f"{type(tensor).__name__}: view {old} -> {tuple(shape)} changes the {what}; a "
            f"{'128x128' if keep == 2 else '1x128'}-block-scaled tensor can only change its "
            "leading dims (dequantize first for other shapes)"
        )
    return shape


def _transposed_2d(data: torch.Tensor, scale_inv: torch.Tensor, shape):
    """The other layout of 2-D-block bytes: transposed bytes ``(last, *leading)`` of the
    matrix ``[M, K]`` of ``shape``, and the transposed block scales, padded as GEMM_READY."""
    m, k = block_matrix_dims(shape)
    n = reference_blocks.BLOCK_SCALING_BLOCK_LEN
    mb, kb = -(-m // n), -(-k // n)
    t = data.reshape(m, k).t().contiguous().reshape(columnwise_shape(tuple(shape)))
    s = torch.zeros(kb, -(-mb // 4) * 4, dtype=torch.float32, device=scale_inv.device)
    s[:, :mb] = scale_inv[:mb, :kb].t()
    return t, s
