"""NVFP4 tensors (the ``NVFP4BlockScaling`` recipe): upstream's import path.

* :class:`NVFP4Quantizer` casts a high-precision tensor to E2M1 with one E4M3 scale per 16
  elements and an FP32 global scale from the tensor's amax (the arithmetic is
  :mod:`transformer_engine.pytorch.reference_fp4`'s, on every device), optionally with 16x16
  blocks, a random Hadamard transform of the column-wise copy and stochastic rounding;
* :class:`NVFP4Tensor` (in :mod:`._nvfp4_tensor_class`) is the result;
* its buffers are described in :mod:`transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage`.
"""

from __future__ import annotations

import torch

from ...common.recipe import NVFP4BlockScaling
from .. import reference_fp4 as fp4
from ..constants import DType
from ..quantized_tensor import Quantizer, _check_high_precision_dtype
from ._block_scaled_tensor import check_cast_input
from ._float8_quantize_into import high_precision_source
from ._nvfp4_tensor_class import NVFP4Tensor
from .storage.float8_blockwise_tensor_storage import block_matrix_dims
from .storage.nvfp4_tensor_storage import NVFP4TensorStorage, nvfp4_data_shape, nvfp4_scale_shape

__all__ = ["NVFP4Quantizer", "NVFP4Tensor"]

_N = fp4.NVFP4_BLOCK_LEN
_BUFFER_KEYS = (
    "rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
    "amax_rowwise", "amax_columnwise",
)  # fmt: skip


def _not_built(option: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"NVFP4Quantizer: {option} is not built in this package ({why})")


class NVFP4Quantizer(Quantizer):
    """Quantizer to NVFP4: E2M1 values, E4M3 scales per 16 elements, an FP32 global scale.

    Parameters
    ----------
    fp4_dtype : DType, default ``DType.kFloat4E2M1``
        The only FP4 format.
    rowwise, columnwise : bool, default True
        Which copies :meth:`quantize` produces.
    with_amax_reduction : bool, default False
        All-reduce (MAX) each global amax over ``amax_reduction_group`` (when
        ``torch.distributed`` is initialized), so every rank uses one global scale.
    amax_reduction_group : ProcessGroup, optional
        Dropped when pickled.
    with_rht : bool, default False
        Random Hadamard transform of the column-wise copy (along ``M``) before its cast.
    with_post_rht_amax : bool, default False
        Take the column-wise copy's global amax after the RHT (else the input's).
    with_2d_quantization : bool, default False
        16x16 blocks (the column-wise copy, when not RHT-transformed, is then the exact
        transpose of the row-wise one).
    stochastic_rounding : bool, default False
        Round each value up or down at random, unbiased; draws from :attr:`generator`, or
        the device's default generator (reproducible under ``torch.manual_seed``).
    row_scaled_nvfp4, nvfp4_use_4over6 : bool, default False
        Not built: True raises ``NotImplementedError``.
    nvfp4_e4m3_max : int, default 448
        Only 448 (other values belong to 4over6).
    nvfp4_4over6_err_mode : {"MAE", "MSE"}, default "MAE"
        Kept for upstream's signature (4over6 is not built).
    with_random_sign_mask : bool, default True
        Multiply the Hadamard matrix by the fixed sign vector ``reference_fp4.RHT_SIGNS``.
    """

    block_len = _N

    def __init__(
        self,
        fp4_dtype=DType.kFloat4E2M1,
        rowwise: bool = True,
        columnwise: bool = True,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        with_rht: bool = False,
        with_post_rht_amax: bool = False,
        with_2d_quantization: bool = False,
        stochastic_rounding: bool = False,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
        nvfp4_4over6_err_mode: str = "MAE",
        with_random_sign_mask: bool = True,
    ) -> None:
        if DType.cast(fp4_dtype) != DType.kFloat4E2M1:
            raise ValueError(
                f"NVFP4Quantizer: fp4_dtype={fp4_dtype!r}; the only FP4 format is DType.kFloat4E2M1"
            )
        if row_scaled_nvfp4:
            raise _not_built("row_scaled_nvfp4=True", "per-row global scales of activations")
        if nvfp4_use_4over6:
            raise _not_built("nvfp4_use_4over6=True", "the 4over6 block-scale search")
        if nvfp4_e4m3_max != 448:
            raise _not_built(
                f"nvfp4_e4m3_max={nvfp4_e4m3_max!r}", "only 448 is built; other maxima are 4over6's"
            )
        mode = str(nvfp4_4over6_err_mode).upper()
        if mode not in ("MAE", "MSE"):
            raise ValueError(
                f"NVFP4Quantizer: nvfp4_4over6_err_mode={nvfp4_4over6_err_mode!r}; pass 'MAE' "
                "or 'MSE'"
            )
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType.kFloat4E2M1
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.with_rht = bool(with_rht)
        self.with_post_rht_amax = bool(with_post_rht_amax)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.row_scaled_nvfp4 = False
        self.nvfp4_use_4over6 = False
        self.nvfp4_e4m3_max = 448
        self.nvfp4_4over6_err_mode = mode
        self.with_random_sign_mask = bool(with_random_sign_mask)
        #: torch.Generator for stochastic rounding (None: the device's default generator)
        self.generator = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["amax_reduction_group"] = None  # process groups do not pickle
        state["generator"] = None
        return state

    def get_scale_shape(self, shape, columnwise: bool) -> tuple[int, int]:
        """Shape of one copy's (padded) E4M3 scale tensor."""
        return nvfp4_scale_shape(shape, columnwise)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` is whole 16-blocks both ways (any shape can be quantized here)."""
        m, k = block_matrix_dims(inp.shape)
        return inp.dim() >= 2 and m % _N == 0 and k % _N == 0

    def _amax(self, a: torch.Tensor) -> torch.Tensor:
        amax = fp4.global_amax(a)
        if self.with_amax_reduction:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
        return amax

    def _cast(self, src: torch.Tensor) -> dict:
        """The buffers of ``src`` for the usages set now."""
        check_cast_input("NVFP4Quantizer", self, src)
        shape = tuple(src.shape)
        m, k = block_matrix_dims(shape)
        matrix = src.detach().reshape(m, k).float()
        sr = {"stochastic": self.stochastic_rounding, "generator": self.generator}
        out = dict.fromkeys(_BUFFER_KEYS)

        def scales(columnwise, compact):
            s = torch.zeros(nvfp4_scale_shape(shape, columnwise), dtype=torch.uint8,
                            device=src.device)  # fmt: skip
            s[: compact.shape[0], : compact.shape[1]] = compact
            return s

        amax = self._amax(matrix)
        two_d_columnwise = self.columnwise_usage and not self.with_rht
        if self.with_2d_quantization and (self.rowwise_usage or two_d_columnwise):
            codes, tiles = fp4.nvfp4_cast(matrix, amax, two_d=True, **sr)
            if self.rowwise_usage:
                out["rowwise_data"] = fp4.pack_fp4(codes).reshape(nvfp4_data_shape(shape, False))
                out["rowwise_scale_inv"] = scales(False, tiles.repeat_interleave(_N, 0)[:m])
                out["amax_rowwise"] = amax
            if two_d_columnwise:
                out["columnwise_data"] = fp4.pack_fp4(codes.t())
                out["columnwise_scale_inv"] = scales(True, tiles.t().repeat_interleave(_N, 0)[:k])
                out["amax_columnwise"] = amax.clone()
        elif self.rowwise_usage:
            codes, s = fp4.nvfp4_cast(matrix, amax, **sr)
            out["rowwise_data"] = fp4.pack_fp4(codes).reshape(nvfp4_data_shape(shape, False))
            out["rowwise_scale_inv"] = scales(False, s)
            out["amax_rowwise"] = amax
        if self.columnwise_usage and out["columnwise_data"] is None:
            t = matrix.t()
            col_amax = amax.clone()
            if self.with_rht:
                t = fp4.apply_rht(t, with_random_sign_mask=self.with_random_sign_mask)
                if self.with_post_rht_amax:
                    col_amax = self._amax(t)
            codes, s = fp4.nvfp4_cast(t, col_amax, **sr)
            out["columnwise_data"] = fp4.pack_fp4(codes)
            out["columnwise_scale_inv"] = scales(True, s)
            out["amax_columnwise"] = col_amax
        return out

    def _flags(self) -> dict:
        return {
            "columnwise_rht": self.with_rht and self.columnwise_usage,
            "rht_random_sign_mask": self.with_random_sign_mask,
        }

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Cast ``tensor`` (a quantized input is dequantized first) to a new
        :class:`NVFP4Tensor`, or its storage when ``internal``."""
        src = high_precision_source(tensor)
        dtype = src.dtype if dtype is None else dtype
        _check_high_precision_dtype("NVFP4Quantizer.quantize", dtype)
        buffers = self._cast(src)
        if self.internal:
            return NVFP4TensorStorage(
                *buffers.values(), DType.kFloat4E2M1, self.copy(), fake_dtype=dtype,
                shape=src.shape, **self._flags(),
            )  # fmt: skip
        return NVFP4Tensor(src.shape, dtype, quantizer=self.copy(), **buffers, **self._flags())

    def update_quantized(self, src, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into ``dst``'s buffers in place (the copies ``dst`` holds)."""
        if not isinstance(dst, NVFP4TensorStorage):
            raise TypeError(
                f"NVFP4Quantizer.update_quantized: dst must be an NVFP4Tensor or its storage, "
                f"got {type(dst).__name__}"
            )
        src = high_precision_source(src)
        if tuple(src.shape) != tuple(dst.size()):
            raise ValueError(
                f"NVFP4Quantizer.update_quantized: src has shape {tuple(src.shape)} but dst has "
                f"shape {tuple(dst.size())}"
            )
        usages = dst.get_usages()
        saved = self.rowwise_usage, self.columnwise_usage
        self.set_usage(rowwise=usages["rowwise"], columnwise=usages["columnwise"])
        try:
            buffers = self._cast(src.to(dst.device))
            flags = self._flags()
        finally:
            self.set_usage(rowwise=saved[0], columnwise=saved[1])
        # The flag is read on the device (no host synchronisation): 1.0 keeps dst's values.
        keep = None if noop_flag is None else noop_flag.reshape(-1)[0].to(dst.device) == 1.0
        for name, value in buffers.items():
            if value is not None:
                old = getattr(dst, "_" + name)
                old.copy_(value if keep is None else torch.where(keep, old, value))
        dst._columnwise_rht = flags["columnwise_rht"]
        dst._rht_random_sign_mask = flags["rht_random_sign_mask"]
        return dst

    def make_empty(
        self, shape, *, dtype: torch.dtype = torch.float32, device=None,
        requires_grad: bool = False, pin_memory: bool = False,
    ) -> NVFP4Tensor:  # fmt: skip
        """An uninitialised NVFP4 tensor with this quantizer's usages (amaxes 0)."""
        device = self._resolve_device(device)
        shape = tuple(shape)

        def alloc(size, dtype=torch.uint8):
            return torch.empty(size, dtype=dtype, device=device, pin_memory=pin_memory)

        buffers = {}
        for prefix, columnwise, wanted in (("rowwise", False, self.rowwise_usage),
                                           ("columnwise", True, self.columnwise_usage)):  # fmt: skip
            if wanted:
                buffers[f"{prefix}_data"] = alloc(nvfp4_data_shape(shape, columnwise))
                buffers[f"{prefix}_scale_inv"] = alloc(nvfp4_scale_shape(shape, columnwise))
                buffers[f"amax_{prefix}"] = alloc((1,), torch.float32).zero_()
        return NVFP4Tensor(
            shape, dtype, quantizer=self.copy(), requires_grad=requires_grad, **buffers,
            **self._flags(),
        )  # fmt: skip

    def _get_compatible_recipe(self):
        return NVFP4BlockScaling

    def __repr__(self) -> str:
        return (
            f"NVFP4Quantizer(with_rht={self.with_rht}, "
            f"with_post_rht_amax={self.with_post_rht_amax}, "
            f"with_2d_quantization={self.with_2d_quantization}, "
            f"stochastic_rounding={self.stochastic_rounding}, "
            f"rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
            f"internal={self.internal})"
        )
