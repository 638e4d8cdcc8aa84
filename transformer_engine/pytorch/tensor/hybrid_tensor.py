"""Hybrid quantization: the row-wise copy of a tensor in one format, the column-wise in another.

A GEMM reads each operand in one layout (fprop: both row-wise; dgrad: the output gradient
row-wise and the weight column-wise; wgrad: both column-wise; see
:mod:`transformer_engine.pytorch.cpp_extensions.gemm`), so the two copies of a tensor never meet
in one product: each can have its own format. :class:`HybridQuantizer` quantizes the row-wise
copy with one quantizer and the column-wise copy with another, for instance MXFP8 for the
forward GEMM and NVFP4 for the backward ones (``custom_recipes.quantizer_factory_zoo``), and a
``CustomRecipe`` factory answers a slot with it like with any quantizer.

Its result, :class:`HybridQuantizedTensorStorage` (or the :class:`HybridQuantizedTensor`
``torch.Tensor``), holds the two results as they are, each with its one usage. A GEMM takes the
copy its layout reads (``hybrid_gemm_operand``) and computes with that format's GEMM; operands
of two different formats meet in the emulated block-scaled GEMMs, which dequantize the one that
is not theirs (exact values, no shortcut). A missing copy cannot be made from the other (each
is its own quantization of the high-precision tensor): asking for it raises, as for the
block-scaled formats.
"""

from __future__ import annotations

import copy

import torch

from ..quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    _check_high_precision_dtype,
    prepare_for_saving,
    restore_from_saved,
)
from ._float8_quantize_into import high_precision_source

__all__ = ["HybridQuantizer", "HybridQuantizedTensor", "HybridQuantizedTensorStorage"]

_SOURCES = ("original", "rowwise_dequantized")
aten = torch.ops.aten


def _values_of(part, dtype: torch.dtype) -> torch.Tensor:
    """High-precision values of one copy (a storage, a quantized tensor or a plain tensor)."""
    if isinstance(part, QuantizedTensor):
        return part._dequantize_plain(dtype)
    if isinstance(part, QuantizedTensorStorage):
        return part.dequantize(dtype=dtype)
    return part.to(dtype)


def _sub_quantizer(quantizer, which: str, *, rowwise: bool) -> Quantizer:
    if isinstance(quantizer, HybridQuantizer):
        raise TypeError(
            f"HybridQuantizer: {which} is a HybridQuantizer; each copy takes one format, so "
            "pass the quantizer of that format"
        )
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"HybridQuantizer: {which} must be a Quantizer (a concrete one: a "
            f"QuantizerRequest such as DelayedScalingRequest cannot be nested), got "
            f"{type(quantizer).__name__}"
        )
    sub = quantizer.copy()
    sub.set_usage(rowwise=rowwise, columnwise=not rowwise)
    sub.internal = True  # the parts are storages; the hybrid wrapper is the tensor
    return sub


class HybridQuantizer(Quantizer):
    """Quantizer whose row-wise copy comes from one quantizer and column-wise copy from another.

    Parameters
    ----------
    rowwise_quantizer : Quantizer, keyword-only
        Quantizes the row-wise copy (read by the forward GEMM, and by dgrad for the output
        gradient). Used for row-wise usage only.
    columnwise_quantizer : Quantizer, keyword-only
        Quantizes the column-wise copy (read by dgrad for the weight and by wgrad). Used for
        column-wise usage only.
    columnwise_source : {"original", "rowwise_dequantized"}, keyword-only
        ``"original"`` (default): the column-wise copy is quantized from the high-precision
        input. ``"rowwise_dequantized"``: from the row-wise copy's dequantized values, so both
        copies carry the row-wise format's rounding (the row-wise copy is made for that even
        when only column-wise usage is asked for).

    Both quantizers are copied (the given objects are not changed); a ``QuantizerRequest`` or a
    ``HybridQuantizer`` in either place raises ``TypeError``.
    """

    def __init__(
        self,
        *,
        rowwise_quantizer: Quantizer,
        columnwise_quantizer: Quantizer,
        columnwise_source: str = "original",
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        if columnwise_source not in _SOURCES:
            raise ValueError(
                f"HybridQuantizer: columnwise_source={columnwise_source!r}; use 'original' "
                "(quantize the column-wise copy from the input) or 'rowwise_dequantized'"
            )
        rowwise_part = _sub_quantizer(rowwise_quantizer, "rowwise_quantizer", rowwise=True)
        columnwise_part = _sub_quantizer(
            columnwise_quantizer, "columnwise_quantizer", rowwise=False
        )
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.rowwise_quantizer = rowwise_part
        self.columnwise_quantizer = columnwise_part
        self.columnwise_source = columnwise_source

    # ------------------------------------------------------------------ quantization

    def _parts(self, src: torch.Tensor, dtype: torch.dtype):
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(
                "HybridQuantizer: rowwise and columnwise usage are both off; set_usage(...) "
                "one of them before quantizing"
            )
        rowwise = None
        if self.rowwise_usage:
            rowwise = self.rowwise_quantizer.quantize_impl(src, dtype=dtype)
        columnwise = None
        if self.columnwise_usage:
            col_src = self._columnwise_source(src, rowwise)
            columnwise = self.columnwise_quantizer.quantize_impl(col_src, dtype=dtype)
        return rowwise, columnwise

    def _columnwise_source(self, src: torch.Tensor, rowwise) -> torch.Tensor:
        """What the column-wise copy is quantized from: ``src``, or with
        ``columnwise_source="rowwise_dequantized"`` the row-wise copy's values (``rowwise``,
        made here when the caller holds none)."""
        if self.columnwise_source != "rowwise_dequantized":
            return src
        if rowwise is None:
            rowwise = self.rowwise_quantizer.quantize_impl(src)
        return _values_of(rowwise, src.dtype)

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Both copies of ``tensor`` (those of the usages set now) in a new
        :class:`HybridQuantizedTensor`, or its storage when ``internal``."""
        src = high_precision_source(tensor)
        dtype = src.dtype if dtype is None else dtype
        _check_high_precision_dtype("HybridQuantizer.quantize", dtype)
        rowwise, columnwise = self._parts(src, dtype)
        if self.internal:
            return HybridQuantizedTensorStorage(
                rowwise, columnwise, shape=src.shape, dtype=dtype, quantizer=self.copy()
            )
        return HybridQuantizedTensor(
            src.shape, dtype, rowwise=rowwise, columnwise=columnwise, quantizer=self.copy()
        )

    def update_quantized(self, src, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into each copy ``dst`` holds, in place (each copy by its own
        quantizer's ``update_quantized``)."""
        if not isinstance(dst, HybridQuantizedTensorStorage):
            raise TypeError(
                "HybridQuantizer.update_quantized: dst must be a HybridQuantizedTensor or its "
                f"storage, got {type(dst).__name__}"
            )
        if tuple(src.shape) != tuple(dst.size()):
            raise ValueError(
                f"HybridQuantizer.update_quantized: src has shape {tuple(src.shape)}, dst "
                f"{tuple(dst.size())}"
            )
        src = high_precision_source(src)
        if dst._rowwise is not None:
            self.rowwise_quantizer.update_quantized(src, dst._rowwise, noop_flag=noop_flag)
        if dst._columnwise is not None:
            col_src = self._columnwise_source(src, dst._rowwise)
            self.columnwise_quantizer.update_quantized(
                col_src, dst._columnwise, noop_flag=noop_flag
            )
        return dst

    def make_empty(
        self, shape, *, dtype: torch.dtype = torch.float32, device=None,
        requires_grad: bool = False, pin_memory: bool = False,
    ) -> HybridQuantizedTensor:  # fmt: skip
        """An uninitialised hybrid tensor with this quantizer's usages (each copy from its
        quantizer's ``make_empty``)."""
        device = self._resolve_device(device)
        kw = {"dtype": dtype, "device": device, "pin_memory": pin_memory}
        rowwise = self.rowwise_quantizer.make_empty(shape, **kw) if self.rowwise_usage else None
        columnwise = (
            self.columnwise_quantizer.make_empty(shape, **kw) if self.columnwise_usage else None
        )
        return HybridQuantizedTensor(
            shape, dtype, rowwise=rowwise, columnwise=columnwise, quantizer=self.copy(),
            requires_grad=requires_grad,
        )  # fmt: skip

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Let both quantizers record ``tensor``'s statistics."""
        self.rowwise_quantizer.calibrate(tensor)
        self.columnwise_quantizer.calibrate(tensor)

    def _state_device(self) -> torch.device | None:
        return self.rowwise_quantizer._state_device() or self.columnwise_quantizer._state_device()

    def copy(self) -> HybridQuantizer:
        """A copy with independent usage flags and copies of both quantizers (whose state
        tensors, if any, are shared as a quantizer's copy shares them)."""
        new = copy.copy(self)
        new.rowwise_quantizer = self.rowwise_quantizer.copy()
        new.columnwise_quantizer = self.columnwise_quantizer.copy()
        return new

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether both quantizers accept ``inp``."""
        return self.rowwise_quantizer.is_quantizable(
            inp
        ) and self.columnwise_quantizer.is_quantizable(inp)

    def is_requantization_safe(self) -> bool:
        """Whether both copies survive a dequantize-quantize round trip."""
        return (
            self.rowwise_quantizer.is_requantization_safe()
            and self.columnwise_quantizer.is_requantization_safe()
        )

    def __repr__(self) -> str:
        return (
            f"HybridQuantizer(rowwise_quantizer={self.rowwise_quantizer!r}, "
            f"columnwise_quantizer={self.columnwise_quantizer!r}, "
            f"columnwise_source={self.columnwise_source!r}, rowwise_usage={self.rowwise_usage}, "
            f"columnwise_usage={self.columnwise_usage}, internal={self.internal})"
        )


class HybridQuantizedTensorStorage(QuantizedTensorStorage):
    """The two copies a :class:`HybridQuantizer` made, each in its own format.

    Parameters
    ----------
    rowwise, columnwise
        The row-wise and column-wise results (quantized storages or tensors, or plain tensors
        for an ``IdentityQuantizer``); ``None`` for a copy not made.
    shape : torch.Size, keyword-only
        Logical shape.
    dtype : torch.dtype, keyword-only
        Nominal dtype (what the values dequantize to).
    quantizer : HybridQuantizer, keyword-only, optional
    """

    def __init__(self, rowwise, columnwise, *, shape, dtype: torch.dtype, quantizer=None):
        self._set_parts(rowwise, columnwise, shape, dtype, quantizer)

    def _set_parts(self, rowwise, columnwise, shape, dtype, quantizer) -> None:
        self._rowwise = rowwise
        self._columnwise = columnwise
        self._shape = torch.Size(shape)
        self._dtype = dtype
        self._quantizer = quantizer
        self._saved_parts = None

    @property
    def rowwise_sub_storage(self):
        """The row-wise copy (``None`` when not held)."""
        return self._rowwise

    @property
    def columnwise_sub_storage(self):
        """The column-wise copy (``None`` when not held)."""
        return self._columnwise

    def size(self, *args, **kwargs):
        """Logical shape (``torch.Size``), or one dimension of it."""
        if args:
            return self._shape[args[0]]
        return self._shape[kwargs["dim"]] if "dim" in kwargs else self._shape

    @property
    def shape(self) -> torch.Size:
        """Logical shape."""
        return self._shape

    @property
    def device(self) -> torch.device:
        """Device of the copies."""
        for part in (self._rowwise, self._columnwise):
            if part is not None:
                return part.device
        raise RuntimeError(f"{type(self).__name__} holds no copies (cleared or saved)")

    # ------------------------------------------------------------------ values and GEMMs

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values as a plain tensor (from the row-wise copy when held), in ``dtype``."""
        dtype = self._dtype if dtype is None else dtype
        part = self._rowwise if self._rowwise is not None else self._columnwise
        if part is None:
            raise RuntimeError(f"{type(self).__name__} holds no copies (cleared or saved)")
        return _values_of(part, dtype)

    def hybrid_gemm_operand(self, columnwise: bool):
        """The copy a GEMM layout reads, as that format's operand (``None`` when not held)."""
        return self._columnwise if columnwise else self._rowwise

    def float8_gemm_input(self, columnwise: bool = False):
        """The per-tensor FP8 GEMM interface of the copy ``columnwise`` names, so that two
        per-tensor FP8 copies take the FP8 GEMM's fast path; ``AttributeError`` for a copy of
        another format (the GEMM then takes its general path, which unwraps the copy)."""
        part = self.hybrid_gemm_operand(columnwise)
        if part is None:
            return None, None
        return part.float8_gemm_input(columnwise)

    # ------------------------------------------------------------------ usages

    def get_usages(self) -> dict[str, bool]:
        """``{"rowwise": ..., "columnwise": ...}`` for the copies held now."""
        return {"rowwise": self._rowwise is not None, "columnwise": self._columnwise is not None}

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Drop the copies that are not required (``None`` keeps a copy as it is); a required
        copy that is missing raises ``RuntimeError`` (it cannot be made from the other)."""
        rowwise = self._rowwise is not None if rowwise_usage is None else bool(rowwise_usage)
        columnwise = (
            self._columnwise is not None if columnwise_usage is None else bool(columnwise_usage)
        )
        if not rowwise and not columnwise:
            raise ValueError(
                f"{type(self).__name__}.update_usage: rowwise_usage and columnwise_usage would "
                "both be False, leaving no data; keep at least one"
            )
        for name, wanted, part in (
            ("rowwise", rowwise, self._rowwise),
            ("columnwise", columnwise, self._columnwise),
        ):
            if wanted and part is None:
                raise RuntimeError(
                    f"{type(self).__name__}: {name} data was requested but only the other copy "
                    f"exists; a hybrid copy is its own quantization of the high-precision "
                    f"tensor, so quantize it again with {name} usage"
                )
        if not rowwise:
            self._rowwise = None
        if not columnwise:
            self._columnwise = None

    # ------------------------------------------------------------------ saving

    def prepare_for_saving(self):
        """Hand out both copies' buffers (row-wise first) and drop them here."""
        tensors, self._saved_parts = prepare_for_saving(self._rowwise, self._columnwise)
        self._rowwise = self._columnwise = None
        return tensors, self

    def restore_from_saved(self, tensors):
        """Take both copies' buffers from the front of ``tensors``; return the rest."""
        if self._saved_parts is None:
            raise RuntimeError(
                f"{type(self).__name__}.restore_from_saved: nothing was saved (call "
                "prepare_for_saving first)"
            )
        (self._rowwise, self._columnwise), rest = restore_from_saved(
            self._saved_parts, tensors, return_saved_tensors=True
        )
        return rest

    def clear(self) -> None:
        """Release both copies."""
        self._rowwise = self._columnwise = None

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the copies)."""
        return {
            "rowwise": self._rowwise,
            "columnwise": self._columnwise,
            "quantizer": self._quantizer,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={tuple(self._shape)}, dtype={self._dtype}, "
            f"rowwise={type(self._rowwise).__name__ if self._rowwise is not None else None}, "
            f"columnwise="
            f"{type(self._columnwise).__name__ if self._columnwise is not None else None})"
        )


def _moved(part, device: torch.device, non_blocking: bool, pin_memory: bool):
    """A copy of one part on ``device`` (its buffers copied; the original is untouched)."""
    if part is None:
        return None
    if isinstance(part, QuantizedTensor):
        return part._to_device(device, non_blocking=non_blocking, pin_memory=pin_memory)
    if not isinstance(part, QuantizedTensorStorage):
        moved = part.to(device, non_blocking=non_blocking, copy=True)
        return moved.pin_memory() if pin_memory else moved
    tensors, _ = part.prepare_for_saving()
    try:
        twin = copy.copy(part)
        moved = [None if t is None else t.to(device, non_blocking=non_blocking, copy=True)
                 for t in tensors]  # fmt: skip
        if pin_memory:
            moved = [None if t is None else t.pin_memory() for t in moved]
        twin.restore_from_saved(moved)
    finally:
        part.restore_from_saved(tensors)
    return twin


class HybridQuantizedTensor(HybridQuantizedTensorStorage, QuantizedTensor):
    """A :class:`HybridQuantizedTensorStorage` presented as a high-precision ``torch.Tensor``.

    ``detach`` and ``alias`` keep it hybrid (sharing the copies), device moves copy both
    copies' buffers, and every other operation runs in high precision on the dequantized values
    (see :class:`~transformer_engine.pytorch.quantized_tensor.QuantizedTensor`).
    """

    dequantize = QuantizedTensor.dequantize

    def __new__(
        cls, shape, dtype: torch.dtype, *, rowwise=None, columnwise=None, quantizer=None,
        requires_grad: bool = False,
    ):  # fmt: skip
        anchor = rowwise if rowwise is not None else columnwise
        if anchor is None:
            raise ValueError("HybridQuantizedTensor: pass at least one of rowwise, columnwise")
        self = QuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=anchor.device
        )
        self._set_parts(rowwise, columnwise, shape, dtype, quantizer)
        return self

    def __init__(self, *args, **kwargs) -> None:  # state is set in __new__
        pass

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return HybridQuantizedTensorStorage.dequantize(self, dtype=dtype)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None):
        """Overwrite both copies in place with ``tensor`` quantized by this tensor's quantizer."""
        if self._quantizer is None:
            raise RuntimeError(
                "HybridQuantizedTensor.quantize_: this tensor has no quantizer; quantize with "
                "a HybridQuantizer instead"
            )
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _to_device(self, device: torch.device, *, non_blocking: bool, pin_memory: bool):
        return HybridQuantizedTensor(
            self._shape, self.dtype, quantizer=self._quantizer,
            rowwise=_moved(self._rowwise, device, non_blocking, pin_memory),
            columnwise=_moved(self._columnwise, device, non_blocking, pin_memory),
        )  # fmt: skip

    def _quantized_buffers(self) -> list[torch.Tensor | None]:
        buffers = []
        for part in (self._rowwise, self._columnwise):
            if isinstance(part, QuantizedTensorStorage):
                tensors, _ = part.prepare_for_saving()
                part.restore_from_saved(tensors)
                buffers.extend(tensors)
            elif part is not None:
                buffers.append(part)
        return buffers

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            (src,) = args
            return HybridQuantizedTensor(
                src._shape, src.dtype, rowwise=src._rowwise, columnwise=src._columnwise,
                quantizer=src._quantizer,
            )  # fmt: skip
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        values = self._dequantize_plain()
        return (
            f"HybridQuantizedTensor(rowwise={type(self._rowwise).__name__}, "
            f"columnwise={type(self._columnwise).__name__}, dtype={self.dtype}, "
            f"shape={tuple(self.shape)}, device={self.device}, data={values})"
        )

    __str__ = __repr__
