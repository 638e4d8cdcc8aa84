"""What the block-scaled storages (``Float8BlockwiseQTensorStorage``, ``MXFP8TensorStorage``,
``NVFP4TensorStorage``) share: a row-wise and a column-wise copy, each held in named buffers
(data and scale-inverses, and NVFP4's amaxes), handed out and taken back in a fixed order for
autograd saving, copied and released buffer by buffer, and read back as data tensors; and the
first step of checking a view (resolving ``-1``, keeping the element count); the nominal-dtype
check of their constructors."""

from __future__ import annotations

import math

import torch

from ...constants import HIGH_PRECISION_DTYPES
from ...quantized_tensor import QuantizedTensorStorage

__all__ = ["BUFFERS", "BlockScaledTensorStorage", "check_nominal_dtype", "resolve_view_shape"]

# The buffers in saving order: row-wise data and scales, then column-wise data and scales.
BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class BlockScaledTensorStorage(QuantizedTensorStorage):
    """Base of the block-scaled storages: the buffer bookkeeping they keep identically."""

    #: the buffer attributes in saving order (a storage with more buffers lists its own)
    _buffer_names: tuple[str, ...] = BUFFERS
    #: the format named when a missing copy is asked for ("MXFP8")
    _format_name: str = ""

    @property
    def shape(self) -> torch.Size:
        """Logical shape."""
        return self.size()

    def _dequantize_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """The dtype a dequantize returns: ``dtype``, default the nominal one."""
        if dtype is None:
            return self._dtype
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            # An integer or bool result truncated or wrapped the values without a word.
            raise TypeError(
                f"{type(self).__name__}.dequantize: dtype={dtype} is not a floating-point dtype; "
                "use torch.float32, torch.float16 or torch.bfloat16"
            )
        return dtype

    @property
    def device(self) -> torch.device:
        """Device of the buffers."""
        for name in self._buffer_names:
            t = getattr(self, name)
            if t is not None:
                return t.device
        raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values as a plain tensor (row-wise copy preferred), in ``dtype`` (default nominal)."""
        return self._dequantize_plain(dtype)

    def get_usages(self) -> dict[str, bool]:
        """``{"rowwise": ..., "columnwise": ...}`` for the copies present now."""
        return {
            "rowwise": self._rowwise_data is not None,
            "columnwise": self._columnwise_data is not None,
        }

    def _create_copy(self, name: str) -> None:
        """Make the missing ``name`` copy ("rowwise" or "columnwise") from the other one. By
        default it cannot be: each copy is its own quantization of the high-precision input."""
        raise RuntimeError(
            f"{type(self).__name__}: {name} data was requested but only the other copy exists; "
            f"an {self._format_name} copy is its own quantization of the high-precision tensor, "
            f"so quantize it again with {name} usage"
        )

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Make the copies that are required and missing (see ``_create_copy``) and drop those
        that are not; ``None`` keeps a copy as it is."""
        rowwise = self._rowwise_data is not None if rowwise_usage is None else bool(rowwise_usage)
        columnwise = (
            self._columnwise_data is not None if columnwise_usage is None else columnwise_usage
        )
        if not rowwise and not columnwise:
            raise ValueError(
                f"{type(self).__name__}.update_usage: rowwise_usage and columnwise_usage would "
                "both be False, leaving no data; keep at least one (or call clear())"
            )
        if rowwise and self._rowwise_data is None:
            self._create_copy("rowwise")
        if columnwise and self._columnwise_data is None:
            self._create_copy("columnwise")
        for name, keep in (("rowwise", rowwise), ("columnwise", columnwise)):
            if not keep:  # the copy's buffers: _{name}_data, _{name}_scale_inv (, _amax_{name})
                for attr in self._buffer_names:
                    if attr.startswith(f"_{name}_") or attr.endswith(f"_{name}"):
                        setattr(self, attr, None)

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """``(_rowwise_data, _columnwise_data)``, or one of them."""
        if rowwise_data and columnwise_data:
            return self._rowwise_data, self._columnwise_data
        if rowwise_data:
            return self._rowwise_data
        if columnwise_data:
            return self._columnwise_data
        raise ValueError("get_data_tensors: request rowwise_data and/or columnwise_data")

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the buffers)."""
        return {
            "rowwise_data": self._rowwise_data,
            "rowwise_scale_inv": self._rowwise_scale_inv,
            "columnwise_data": self._columnwise_data,
            "columnwise_scale_inv": self._columnwise_scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "quantizer": self._quantizer,
        }

    def prepare_for_saving(self):
        """Hand out the buffers (``_buffer_names`` order) and drop them here."""
        tensors = [getattr(self, name) for name in self._buffer_names]
        for name in self._buffer_names:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors):
        """Take the buffers from the front of ``tensors``; return the rest."""
        count = len(self._buffer_names)
        if len(tensors) < count:
            raise ValueError(
                f"{type(self).__name__}.restore_from_saved: expected at least {count} tensors, "
                f"got {len(tensors)}"
            )
        for name, t in zip(self._buffer_names, tensors):
            setattr(self, name, t)
        return list(tensors[count:])

    def _format_key(self) -> tuple:
        """What two storages of one kind must share for equal buffers to mean equal values
        (the element format; a kind adds its block shape or column-wise transform)."""
        return (self._fp8_dtype,)

    def _copy_buffers_from(self, src, non_blocking: bool = False) -> None:
        """``copy_from_storage`` once ``src`` is checked to match: copy each buffer this object
        holds from ``src``'s (which must hold it too)."""
        for name in self._buffer_names:
            mine, theirs = getattr(self, name), getattr(src, name)
            if mine is None:
                continue
            if theirs is None:
                raise ValueError(
                    f"copy_from_storage: src has no {name} (its usages are {src.get_usages()})"
                )
            mine.copy_(theirs, non_blocking=non_blocking)

    def clear(self) -> None:
        """Release the buffers."""
        for name in self._buffer_names:
            setattr(self, name, None)


def resolve_view_shape(tensor, shape) -> torch.Size:
    """``shape`` with a single ``-1`` filled in from ``tensor``'s size; RuntimeError when the
    element count differs. (Each kind then checks that its blocks survive the view.)"""
    old = tuple(tensor.size())
    shape = list(shape)
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = math.prod(old) // known if known else 0
    shape = torch.Size(shape)
    if math.prod(shape) != math.prod(old):
        raise RuntimeError(f"shape {tuple(shape)} is invalid for a tensor of shape {old}")
    return shape


def check_nominal_dtype(owner: str, fake_dtype) -> None:
    """TypeError naming ``owner`` unless ``fake_dtype`` is a supported nominal dtype."""
    if fake_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{owner}: nominal dtype {fake_dtype!r} is not supported; use torch.float32, "
            "torch.float16 or torch.bfloat16"
        )
