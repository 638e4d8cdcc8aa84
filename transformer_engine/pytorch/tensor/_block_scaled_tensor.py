"""What the block-scaled tensor classes (``Float8BlockwiseQTensor``, ``MXFP8Tensor``,
``NVFP4Tensor``) share.

Each holds a row-wise and a column-wise copy in named buffers (the storage's ``_buffer_names``)
whose block scales come from the values, so each re-quantizes through its quantizer, moves and
clones buffer by buffer, adopts another tensor's buffers on ``.data = ...``, keeps aten views of
the leading dims quantized, and is built in ``__new__`` from at least one copy. ``copy_`` from a
tensor of the same kind, format, shape and usages copies the buffers byte for byte (a second
quantization would round the column-wise copy again); any other source is re-quantized. A
class supplies the phrase naming its quantizer, its view check, the shape its column-wise bytes
take for a logical shape, and how it adopts another tensor's buffers.
"""

from __future__ import annotations

import torch

from ..constants import HIGH_PRECISION_DTYPES
from ..quantized_tensor import QuantizedTensor
from ._float8_quantize_into import check_data_value, high_precision_source
from ._quantized_setitem import quantized_setitem

__all__ = [
    "BlockScaledTensorMixin",
    "check_cast_input",
    "raw_copy",
    "requantize_into",
    "storage_buffers",
]

aten = torch.ops.aten


class BlockScaledTensorMixin:
    """Methods of a block-scaled ``QuantizedTensor`` subclass (listed first in its bases)."""

    # ``_buffer_names`` (the buffer attributes in saving order) comes from the storage base.
    #: how the quantize_ error names the quantizer to set ("a Float8BlockQuantizer")
    _quantizer_phrase: str = ""

    __torch_function__ = torch._C._disabled_torch_function_impl

    # torch.Tensor's geometry, not the storage's (the storage comes earlier in the MRO)
    size = torch.Tensor.size
    shape = torch.Tensor.shape
    device = torch.Tensor.device
    view = torch.Tensor.view

    # autograd-aware (the storage's dequantize, earlier in the MRO, is the plain one)
    dequantize = QuantizedTensor.dequantize

    def __init__(self, *args, **kwargs) -> None:
        # Everything happens in __new__; this keeps the storage __init__ from running again.
        pass

    @classmethod
    def _anchor(cls, rowwise_data, columnwise_data) -> torch.Tensor:
        """The buffer ``__new__`` takes the device from: the row-wise data, else the
        column-wise data; ValueError when both are None."""
        anchor = rowwise_data if rowwise_data is not None else columnwise_data
        if anchor is None:
            raise ValueError(
                f"{cls.__name__}: rowwise_data and columnwise_data are both None; pass at "
                "least one layout"
            )
        return anchor

    @classmethod
    def _check_anchor_shape(cls, shape, rowwise_data, anchor) -> None:
        """ValueError unless ``anchor`` (see :meth:`_anchor`) has the shape its layout's
        bytes take for the logical ``shape``."""
        expected = tuple(shape) if rowwise_data is not None else cls._columnwise_view_shape(shape)
        if tuple(anchor.shape) != expected:
            raise ValueError(
                f"{cls.__name__}: shape={tuple(shape)} but the "
                f"{'rowwise' if rowwise_data is not None else 'columnwise'} bytes have shape "
                f"{tuple(anchor.shape)} (expected {expected})"
            )

    def _values_repr(self) -> str:
        """The dequantized values as ``__repr__`` shows them (a placeholder on meta)."""
        if self.is_meta:
            return "<meta: no data>"
        with torch.no_grad():
            return repr(self._dequantize_plain())

    @staticmethod
    def _check_view(tensor, shape) -> torch.Size:
        """The checked target shape of a view, or RuntimeError when the blocks cannot follow."""
        raise NotImplementedError

    @staticmethod
    def _columnwise_view_shape(shape) -> tuple:
        """The shape of the column-wise bytes of a tensor of logical ``shape``."""
        raise NotImplementedError

    def _adopt_buffers(self, value) -> bool:
        """``self.data = value``: take ``value``'s buffers when it is of this kind (True)."""
        raise NotImplementedError

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None):
        """Re-quantize ``tensor`` into this tensor's buffers in place; returns ``self``."""
        if self._quantizer is None:
            raise RuntimeError(
                f"{type(self).__name__}.quantize_: this tensor has no quantizer (block scales "
                "come from the values, so one is needed); set tensor._quantizer to "
                f"{self._quantizer_phrase}"
            )
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != tuple(self.shape):
            tensor = tensor.expand(self.shape)
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _quantized_buffers(self) -> list:
        return [getattr(self, name) for name in self._buffer_names]

    def _to_device(self, device: torch.device, *, non_blocking: bool, pin_memory: bool):
        def move(t):
            if t is None:
                return None
            t = t.to(device, non_blocking=non_blocking, copy=True)
            return t.pin_memory() if pin_memory else t

        buffers = {n: move(getattr(self, n)) for n in self._buffer_names}
        return self._with_buffers(self.shape, buffers)

    def __setitem__(self, key, value) -> None:
        # Indexing gives a dequantized copy (blocks are not sliced in place), so torch's write
        # into it never reached this tensor; the write is re-quantized into it instead.
        quantized_setitem(self, key, value, writes_through=False)

    @property
    def data(self) -> torch.Tensor:
        """Detached alias sharing the buffers."""
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if self._adopt_buffers(value):
            return
        check_data_value(type(self).__name__, value, self.shape)
        retyped = value.dtype != self.dtype and value.dtype in HIGH_PRECISION_DTYPES
        if retyped and self._quantizer is not None:
            # The nominal dtype follows the assigned tensor's, as torch's setter and
            # Float8Tensor's do (module.half() left block-scaled weights calling themselves
            # bfloat16): quantize into new buffers of that dtype and take them.
            quantizer = self._quantizer.copy()
            usages = self.get_usages()
            quantizer.set_usage(rowwise=usages["rowwise"], columnwise=usages["columnwise"])
            quantizer.internal = False
            with torch.no_grad():
                self._adopt_buffers(quantizer.quantize_impl(high_precision_source(value)))
            return
        with torch.no_grad():
            self.quantize_(value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else None
        if isinstance(tensor, cls):
            names = cls._buffer_names
            if func is aten.copy_.default and raw_copy(tensor, args[1], **kwargs):
                return tensor
            if func in (aten.detach.default, aten.alias.default):
                return tensor._with_buffers(tensor.shape, {n: getattr(tensor, n) for n in names})
            if func is aten.clone.default:
                buffers = {
                    n: (None if getattr(tensor, n) is None else getattr(tensor, n).clone())
                    for n in names
                }
                return tensor._with_buffers(tensor.shape, buffers)
            if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                try:
                    shape = cls._check_view(tensor, args[1])
                except RuntimeError:
                    if func is not aten.reshape.default:
                        raise
                    # a reshape the blocks cannot follow runs in high precision, like any op
                    return QuantizedTensor.__torch_dispatch__.__func__(
                        cls, func, types, args, kwargs
                    )
                row, col = tensor._rowwise_data, tensor._columnwise_data
                buffers = {
                    "_rowwise_data": None if row is None else row.view(shape),
                    "_rowwise_scale_inv": tensor._rowwise_scale_inv,
                    "_columnwise_data": (
                        None if col is None else col.view(cls._columnwise_view_shape(shape))
                    ),
                    "_columnwise_scale_inv": tensor._columnwise_scale_inv,
                }
                return tensor._with_buffers(shape, buffers)
        return QuantizedTensor.__torch_dispatch__.__func__(cls, func, types, args, kwargs)


def raw_copy(dst, src, non_blocking: bool = False) -> bool:
    """``dst.copy_(src)`` buffer by buffer (data, scales, NVFP4's amaxes, every layout present)
    when ``src`` is of ``dst``'s class, format (:meth:`_format_key`), shape and usages, with
    buffers of the same shapes; returns whether it copied (False: nothing was written)."""
    if type(src) is not type(dst) or dst.is_meta or src.is_meta:
        return False
    if tuple(src.size()) != tuple(dst.size()) or src.get_usages() != dst.get_usages():
        return False
    if src._format_key() != dst._format_key():
        return False
    for name in dst._buffer_names:
        mine, theirs = getattr(dst, name), getattr(src, name)
        if (mine is None) != (theirs is None):
            return False
        if mine is not None and (mine.shape != theirs.shape or mine.dtype != theirs.dtype):
            return False
    dst._copy_buffers_from(src, non_blocking=non_blocking)
    return True


def check_cast_input(owner: str, quantizer, src: torch.Tensor) -> None:
    """What a block-scaled quantizer's cast checks first: at least one usage set, and a
    float32/float16/bfloat16 ``src``. ``owner`` names the quantizer class in errors."""
    if not (quantizer.rowwise_usage or quantizer.columnwise_usage):
        raise ValueError(
            f"{owner}: rowwise and columnwise usage are both False; set at least one with "
            "set_usage(...)"
        )
    if src.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{owner}: input dtype {src.dtype} is not supported; quantize a float32, float16 or "
            "bfloat16 tensor"
        )


def storage_buffers(dst, rowwise: bool, columnwise: bool) -> tuple:
    """``dst``'s buffers for the given usages, in the order row-wise data and scales,
    column-wise data and scales (``None`` for a usage not asked for)."""
    row = (dst._rowwise_data, dst._rowwise_scale_inv) if rowwise else (None, None)
    col = (dst._columnwise_data, dst._columnwise_scale_inv) if columnwise else (None, None)
    return (*row, *col)


def requantize_into(quantizer, owner: str, src, dst, noop_flag: torch.Tensor | None):
    """A block-scaled quantizer's ``update_quantized`` once ``dst``'s kind is checked: cast
    ``src`` with ``quantizer`` straight into the buffers of the layouts ``dst`` holds
    (``quantizer._cast(src, dst=dst, noop_flag=...)``). ``noop_flag`` 1.0 leaves ``dst`` as it
    is; the cast reads it on the device for CUDA tensors (no host synchronisation), except when
    the quantizer's FP8 format differs from ``dst``'s, whose recorded format then depends on
    the flag. ``owner`` names the quantizer class in errors."""
    src = high_precision_source(src)
    if tuple(src.shape) != tuple(dst.size()):
        raise ValueError(
            f"{owner}.update_quantized: src has shape {tuple(src.shape)} but dst has shape "
            f"{tuple(dst.size())}"
        )
    if (
        noop_flag is not None
        and quantizer.dtype != dst._fp8_dtype
        and float(noop_flag.reshape(-1)[0]) == 1.0
    ):
        return dst
    usages = dst.get_usages()
    saved = quantizer.rowwise_usage, quantizer.columnwise_usage
    quantizer.set_usage(rowwise=usages["rowwise"], columnwise=usages["columnwise"])
    try:
        quantizer._cast(src.to(dst.device), dst=dst, noop_flag=noop_flag)
    finally:
        quantizer.set_usage(rowwise=saved[0], columnwise=saved[1])
    dst._fp8_dtype = quantizer.dtype
    return dst
