"""Buffers of an NVFP4 tensor (``NVFP4BlockScaling``), without a ``torch.Tensor`` wrapper.

Layout contract. The tensor of logical shape ``(d0, ..., dn)`` is cast as the matrix ``[M, K]``
with ``K = dn`` and ``M = d0 * ... * d(n-1)``; the arithmetic is
:mod:`transformer_engine.pytorch.reference_fp4`'s.

``_rowwise_data``
    ``torch.uint8``, shape ``(d0, ..., d(n-1), ceil(K/2))``: E2M1 codes of 1x16 blocks along
    ``K``, two per byte (element ``2i`` in the low nibble).
``_rowwise_scale_inv``
    ``torch.uint8`` E4M3 bytes ``(roundup(M, 128), roundup(ceil(K/16), 4))``, entry ``[i, j]``
    for row ``i``, block ``j``; padding entries are 0.
``_columnwise_data``
    ``torch.uint8``, shape ``(K, ceil(M/2))``: the transposed matrix ``[K, M]`` cast on its own
    (blocks of 16 along ``M``) and packed along ``M``. When ``_columnwise_rht`` is set, every
    full 16-block was multiplied by the RHT matrix before the cast.
``_columnwise_scale_inv``
    ``torch.uint8`` E4M3 bytes ``(roundup(K, 128), roundup(ceil(M/16), 4))``.
``_amax_rowwise``, ``_amax_columnwise``
    float32 ``(1,)``: the amax each copy's global scale ``448 * 6 / amax`` came from (the
    column-wise one measured after the RHT when the quantizer asks for post-RHT amax).

Value = ``e2m1 * e4m3_scale / (448 * 6 / amax)``. Shapes need not be multiples of 16.
"""

from __future__ import annotations

import torch

from ... import reference_fp4 as fp4
from ...constants import DType
from ...utils import round_up_to_nearest_multiple as round_up
from ._block_scaled_storage import (
    BUFFERS,
    BlockScaledTensorStorage,
    check_nominal_dtype,
    resolve_view_shape,
)
from .float8_blockwise_tensor_storage import block_matrix_dims

__all__ = ["NVFP4TensorStorage", "nvfp4_scale_shape", "nvfp4_data_shape", "check_nvfp4_view"]

# The buffers in saving order: the block-scaled four, then the two amaxes.
_BUFFERS = (*BUFFERS, "_amax_rowwise", "_amax_columnwise")
_N = fp4.NVFP4_BLOCK_LEN


def nvfp4_scale_shape(shape, columnwise: bool) -> tuple[int, int]:
    """Shape of the (padded) E4M3 scale tensor of one copy of a tensor of ``shape``."""
    m, k = block_matrix_dims(shape)
    if columnwise:
        m, k = k, m
    return round_up(m, 128), round_up(-(-k // _N), 4)


def nvfp4_data_shape(shape, columnwise: bool) -> tuple[int, ...]:
    """Shape of one copy's packed bytes for a tensor of logical ``shape``."""
    m, k = block_matrix_dims(shape)
    if columnwise:
        return k, -(-m // 2)
    return (*tuple(shape)[:-1], -(-k // 2)) if shape else (1,)


def _checked(owner: str, name: str, t, dtype: torch.dtype):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype == torch.float8_e4m3fn and dtype == torch.uint8:
        return t.view(torch.uint8)
    if t.dtype != dtype:
        raise TypeError(f"{owner}: {name} has dtype {t.dtype}; it must be {dtype}")
    return t


class NVFP4TensorStorage(BlockScaledTensorStorage):
    """NVFP4 buffers: row-wise and column-wise packed E2M1 codes, E4M3 block scales, amaxes.

    ``dequantize`` reads the row-wise copy when present, else the column-wise one with its RHT
    undone.

    Parameters (positional, as upstream's)
    ----------
    rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv : torch.Tensor or None
        See the module's layout contract (``uint8``).
    amax_rowwise, amax_columnwise : torch.Tensor or None
        float32 ``(1,)`` amaxes of the copies.
    fp4_dtype : DType, default ``DType.kFloat4E2M1``
    quantizer : NVFP4Quantizer or None
    with_gemm_swizzled_scales : bool, default False
        Only False (scales are compact; GEMMs here are emulated).
    fake_dtype : torch.dtype, keyword, default torch.float32
    shape : sequence of int, keyword, optional
        Logical shape; by default read from the bytes (``K = 2 * bytes per row``).
    columnwise_rht, rht_random_sign_mask : bool, keyword, default False, True
        Whether the column-wise copy went through the RHT, and with which sign vector.
    """

    _buffer_names = _BUFFERS
    _format_name = "NVFP4"

    def __init__(
        self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
        amax_rowwise, amax_columnwise, fp4_dtype=DType.kFloat4E2M1, quantizer=None,
        with_gemm_swizzled_scales: bool = False, *, fake_dtype: torch.dtype = torch.float32,
        shape=None, columnwise_rht: bool = False, rht_random_sign_mask: bool = True,
    ) -> None:  # fmt: skip
        self._set_nvfp4_buffers(
            rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            amax_rowwise, amax_columnwise, fp4_dtype, quantizer, with_gemm_swizzled_scales,
            fake_dtype, shape, columnwise_rht, rht_random_sign_mask,
        )  # fmt: skip

    def _set_nvfp4_buffers(
        self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
        amax_rowwise, amax_columnwise, fp4_dtype, quantizer, with_gemm_swizzled_scales,
        fake_dtype, shape, columnwise_rht, rht_random_sign_mask,
    ) -> None:  # fmt: skip
        owner = type(self).__name__
        check_nominal_dtype(owner, fake_dtype)
        if with_gemm_swizzled_scales:
            raise NotImplementedError(
                f"{owner}: with_gemm_swizzled_scales=True is not supported: scales are kept "
                "compact because NVFP4 GEMMs here are emulated; pass compact scales"
            )
        if DType.cast(fp4_dtype) != DType.kFloat4E2M1:
            raise ValueError(f"{owner}: fp4_dtype={fp4_dtype!r}; NVFP4 data is DType.kFloat4E2M1")
        dtypes = (torch.uint8, torch.uint8, torch.uint8, torch.uint8, torch.float32, torch.float32)
        given = (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                 amax_rowwise, amax_columnwise)  # fmt: skip
        bufs = [_checked(owner, n[1:], t, d) for n, t, d in zip(_BUFFERS, given, dtypes)]
        for name, trio in (("rowwise", (bufs[0], bufs[1], bufs[4])),
                           ("columnwise", (bufs[2], bufs[3], bufs[5]))):  # fmt: skip
            if len({t is None for t in trio}) != 1:
                raise ValueError(
                    f"{owner}: {name}_data, {name}_scale_inv and amax_{name} must be given together"
                )
        if bufs[0] is None and bufs[2] is None:
            raise ValueError(f"{owner}: pass at least one copy (rowwise or columnwise buffers)")
        if shape is None:
            if bufs[0] is not None:
                shape = (*bufs[0].shape[:-1], 2 * bufs[0].shape[-1])
            else:
                shape = (2 * bufs[2].shape[1], bufs[2].shape[0])
        shape = torch.Size(shape)
        for columnwise, data in ((False, bufs[0]), (True, bufs[2])):
            if data is not None and tuple(data.shape) != nvfp4_data_shape(shape, columnwise):
                raise ValueError(
                    f"{owner}: {'columnwise' if columnwise else 'rowwise'}_data has shape "
                    f"{tuple(data.shape)}, expected {nvfp4_data_shape(shape, columnwise)} for "
                    f"the logical shape {tuple(shape)}"
                )
        for name, t in zip(_BUFFERS, bufs):
            setattr(self, name, t)
        self._logical_shape = shape
        self._fp4_dtype = DType.kFloat4E2M1
        self._quantizer = quantizer
        self._with_gemm_swizzled_scales = False
        self._dtype = fake_dtype
        self._columnwise_rht = bool(columnwise_rht)
        self._rht_random_sign_mask = bool(rht_random_sign_mask)

    # ------------------------------------------------------------------ geometry

    def size(self, *args, **kwargs):
        """Logical shape (``torch.Size``), or one dimension of it."""
        shape = self._logical_shape
        return shape[args[0]] if args else shape[kwargs["dim"]] if "dim" in kwargs else shape

    def _rht_key(self):
        """Sign-mask flag of the column-wise RHT, ``None`` without one."""
        return self._rht_random_sign_mask if self._columnwise_rht else None

    # ------------------------------------------------------------------ values

    def nvfp4_gemm_input(self, columnwise: bool = False):
        """``(values, rht)``: one copy as a float32 ``[M, K]`` matrix (``None`` when absent),
        and the RHT sign-mask flag it carries along ``M`` (``None``: not transformed). What
        the emulated NVFP4 GEMM multiplies."""
        m, k = block_matrix_dims(self.size())
        if columnwise:
            if self._columnwise_data is None:
                return None, None
            codes = fp4.unpack_fp4(self._columnwise_data, m)
            values = fp4.nvfp4_dequantize(codes, self._columnwise_scale_inv, self._amax_columnwise)
            return values.t(), self._rht_key()
        if self._rowwise_data is None:
            return None, None
        codes = fp4.unpack_fp4(self._rowwise_data.reshape(m, -(-k // 2)), k)
        return fp4.nvfp4_dequantize(codes, self._rowwise_scale_inv, self._amax_rowwise), None

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._dequantize_dtype(dtype)
        shape = self.size()
        if self.device.type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        values, rht = self.nvfp4_gemm_input(self._rowwise_data is None)
        if rht is not None:  # undo the transform (along M: the rows of the transpose)
            values = fp4.apply_rht(values.t(), inverse=True, with_random_sign_mask=rht).t()
        return values.contiguous().reshape(shape).to(dtype)

    # ------------------------------------------------------------------ saving, copying

    def _format_key(self) -> tuple:
        """E2M1, and the column-wise RHT (whether, and with which signs)."""
        return (self._fp4_dtype, self._rht_key())

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the buffers)."""
        meta = {name[1:]: getattr(self, name) for name in _BUFFERS}
        meta.update(
            fp4_dtype=self._fp4_dtype, quantizer=self._quantizer, shape=self._logical_shape,
            columnwise_rht=self._columnwise_rht, rht_random_sign_mask=self._rht_random_sign_mask,
        )  # fmt: skip
        return meta

    def copy_from_storage(self, src: NVFP4TensorStorage) -> None:
        """Copy ``src``'s buffers into this object's (same shape and RHT)."""
        if not isinstance(src, NVFP4TensorStorage):
            raise TypeError(
                f"copy_from_storage: src must be an NVFP4TensorStorage, got {type(src).__name__}"
            )
        if tuple(src.size()) != tuple(self.size()) or src._rht_key() != self._rht_key():
            raise ValueError(
                f"copy_from_storage: src has shape {tuple(src.size())} and RHT "
                f"{src._rht_key()}, this tensor {tuple(self.size())} and {self._rht_key()}; "
                "both must match"
            )
        self._copy_buffers_from(src)

    def view(self, shape) -> NVFP4TensorStorage:
        """Storage sharing the buffers with new leading dims (see :func:`check_nvfp4_view`)."""
        shape = check_nvfp4_view(self, shape)
        meta = self.get_metadata()
        row = meta["rowwise_data"]
        meta["rowwise_data"] = None if row is None else row.view(nvfp4_data_shape(shape, False))
        meta["shape"] = shape
        return NVFP4TensorStorage(**meta, fake_dtype=self._dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={tuple(self.size())}, fp4_dtype=kFloat4E2M1, "
            f"dtype={self._dtype}, usages={self.get_usages()})"
        )


def check_nvfp4_view(tensor, shape) -> torch.Size:
    """The target shape of a view after checking that the blocks survive it: only the leading
    dims may change (the last dim, along which row-wise blocks and packing run, is kept)."""
    old = tuple(tensor.size())
    shape = resolve_view_shape(tensor, shape)
    if not old or not shape or shape[-1] != old[-1]:
        raise RuntimeError(
            f"{type(tensor).__name__}: view {old} -> {tuple(shape)} changes the last dim; an "
            "NVFP4 tensor can only change its leading dims (dequantize first for other shapes)"
        )
    return shape
