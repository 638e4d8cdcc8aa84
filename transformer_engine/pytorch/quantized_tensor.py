"""Quantized tensors: the quantizer interface and the generic tensor-subclass behaviour.

A :class:`Quantizer` turns a high-precision tensor into a quantized one. What it produces is
either a :class:`QuantizedTensor` (a ``torch.Tensor`` subclass that presents the nominal
high-precision dtype and shape, used for parameters and for tensors that leave the library) or,
when the quantizer is ``internal``, a lightweight :class:`QuantizedTensorStorage` (a plain
object that holds the same buffers, used inside modules where tensor-subclass overhead is not
wanted).

Aten operations on a :class:`QuantizedTensor` go through ``__torch_dispatch__``. Concrete
formats (``Float8Tensor``) handle the operations they can do on the quantized bytes;
everything else falls back to the rules implemented here:

* ``copy_``: a quantized destination is re-quantized from the source (formats copy the raw
  buffers of a source of their own kind first); a plain one receives the dequantized source.
* ``_to_copy`` without a dtype change moves the buffers to the target device and keeps the
  subclass; with a dtype change it dequantizes (an explicit request for high precision, so no
  warning).
* ``new_empty`` / ``empty_like`` build an empty quantized tensor through the quantizer.
* any other in-place op: dequantize every quantized argument, run the op, and re-quantize into
  each mutated quantized argument (``quantize_``).
* any other op: dequantize and return ordinary tensors, warning once per op name that it ran in
  high precision.
"""

from __future__ import annotations

import abc
import os
import sys
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map, tree_map_only

from .constants import HIGH_PRECISION_DTYPES

__all__ = [
    "Quantizer",
    "QuantizedTensorStorage",
    "QuantizedTensor",
    "prepare_for_saving",
    "restore_from_saved",
    "restore_from_func_ctx",
]

aten = torch.ops.aten

# Op names (``str(func)``) already reported as running in high precision.
_warned_ops: set[str] = set()


def _check_high_precision_dtype(what: str, dtype) -> None:
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what}: dtype={dtype!r} is not a high-precision dtype; use torch.float32, "
            "torch.float16 or torch.bfloat16"
        )


class _QuantizeFunc(torch.autograd.Function):
    """Quantize in forward; pass the gradient through unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, tensor, quantizer, dtype):  # noqa: D102
        ctx.input_dtype = tensor.dtype
        return quantizer.quantize_impl(tensor, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        if isinstance(grad, torch.Tensor) and grad.dtype != ctx.input_dtype:
            grad = grad.to(ctx.input_dtype)
        return grad, None, None


class Quantizer(abc.ABC):
    """Builder of quantized tensors from high-precision tensors.

    Parameters
    ----------
    rowwise : bool
        Produce the row-wise layout (the operand as it is, "TN" orientation).
    columnwise : bool
        Produce the column-wise layout (the transposed operand). On GPUs without non-TN FP8
        GEMMs (Hopper, Ada, sm_120) and on CPU this is a physically transposed copy.

    Attributes
    ----------
    rowwise_usage, columnwise_usage : bool
        The usages the next quantization produces.
    internal : bool
        When True, :meth:`quantize` returns a lightweight ``*TensorStorage`` object instead of
        a ``torch.Tensor`` subclass (no autograd, no dispatch).
    optimize_for_gemm : bool
        Reserved for GEMM-only layouts; unused by per-tensor FP8.
    """

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False
        self.optimize_for_gemm = False

    # ------------------------------------------------------------------ quantization

    def quantize(self, tensor: torch.Tensor, *, out=None, dtype: torch.dtype | None = None):
        """Quantize ``tensor``.

        Parameters
        ----------
        tensor : torch.Tensor
            High-precision input (a quantized input is dequantized first).
        out : QuantizedTensorStorage, optional
            Existing quantized tensor to overwrite in place (see :meth:`update_quantized`).
        dtype : torch.dtype, optional
            Nominal dtype of the result (what it dequantizes to); defaults to ``tensor.dtype``.

        Returns
        -------
        QuantizedTensor or QuantizedTensorStorage
            ``out`` when given, else a new one: when this quantizer is not ``internal`` and
            grad mode is on, the output of a straight-through autograd function (the gradient
            passes unchanged).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.quantize: expected a torch.Tensor, got "
                f"{type(tensor).__name__}"
            )
        if dtype is not None:
            _check_high_precision_dtype(f"{type(self).__name__}.quantize", dtype)
        if out is not None:
            return self.update_quantized(tensor, out)
        if not self.internal and torch.is_grad_enabled():
            return _QuantizeFunc.apply(tensor, self, dtype)
        return self.quantize_impl(tensor, dtype=dtype)

    def __call__(self, tensor: torch.Tensor, *, out=None, dtype: torch.dtype | None = None):
        """Same as :meth:`quantize`."""
        return self.quantize(tensor, out=out, dtype=dtype)

    def multi_quantize(self, list_of_tensors) -> list:
        """:meth:`quantize` of each tensor (upstream's API; no fused multi-tensor cast)."""
        return [self.quantize(tensor) for tensor in list_of_tensors]

    @abc.abstractmethod
    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Quantize ``tensor`` into a new quantized tensor (no autograd).

        Parameters
        ----------
        tensor : torch.Tensor
            High-precision input.
        dtype : torch.dtype, optional
            Nominal dtype of the result; defaults to ``tensor.dtype``.
        """

    @abc.abstractmethod
    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into the existing quantized tensor ``dst`` in place and return ``dst``.

        Parameters
        ----------
        src : torch.Tensor
            High-precision values of ``dst``'s shape.
        dst : QuantizedTensorStorage
            Destination; its buffers are overwritten.
        noop_flag : torch.Tensor, optional
            One-element float32 tensor; when it holds 1.0 nothing is written.
        """

    def make_empty(
        self,
        shape,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ):
        """Allocate an uninitialised quantized tensor with this quantizer's usages.

        Parameters
        ----------
        shape : sequence of int
            Logical shape.
        dtype : torch.dtype
            Nominal high-precision dtype.
        device : torch.device or str, optional
            Where to allocate. ``None`` uses the device of the quantizer's own state
            (its ``scale``) when it has one; a stateless quantizer requires it.
        requires_grad : bool
            Autograd flag of the result.
        pin_memory : bool
            Pin the (CPU) buffers.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement make_empty")

    def _resolve_device(self, device, what: str = "make_empty") -> torch.device:
        """``device`` as a ``torch.device``; ``None`` falls back to the quantizer's state device."""
        if device is not None:
            return torch.device(device)
        state = self._state_device()
        if state is None:
            raise ValueError(
                f"{type(self).__name__}.{what}: device=None, and this quantizer holds no state "
                "tensors whose device could be used; pass device=... explicitly (the library "
                "never falls back to the current CUDA device)"
            )
        return state

    def _state_device(self) -> torch.device | None:
        """Device of the quantizer's state tensors, ``None`` for a stateless quantizer."""
        return None

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Record statistics of ``tensor`` without quantizing it (no-op by default)."""
        return None

    # ------------------------------------------------------------------ usages and copies

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Set which layouts the next quantization produces (``None`` leaves a flag as is)."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def get_usages(self) -> dict[str, bool]:
        """``{"rowwise": ..., "columnwise": ...}``."""
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def copy(self) -> Quantizer:
        """Shallow copy: usage flags are independent, state tensors are shared."""
        # copy.copy's result (a new object given __getstate__'s dict) without its __reduce_ex__
        # round trip: block-scaled casts hand every result a copy.
        new = type(self).__new__(type(self))
        state = self.__getstate__()
        setstate = getattr(new, "__setstate__", None)
        setstate(state) if setstate is not None else new.__dict__.update(state or {})
        return new

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether :meth:`quantize` accepts ``inp``: a float32, float16 or bfloat16 tensor."""
        if isinstance(inp, QuantizedTensor):
            return True
        return isinstance(inp, torch.Tensor) and inp.dtype in HIGH_PRECISION_DTYPES

    def supports_only_rowwise_all_gather(self) -> bool:
        """Whether all-gathers of this format must gather row-wise data only."""
        return False

    def is_requantization_safe(self) -> bool:
        """Whether dequantizing and quantizing again reproduces the same bytes."""
        return False

    def _get_compatible_recipe(self):
        """The recipe class whose tensors this quantizer produces (``None`` if none)."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rowwise_usage={self.rowwise_usage}, "
            f"columnwise_usage={self.columnwise_usage}, internal={self.internal})"
        )


class QuantizedTensorStorage:
    """Marker base of quantized buffers, with or without a ``torch.Tensor`` wrapper.

    Subclasses hold the quantized buffers and a ``_quantizer`` and implement :meth:`dequantize`,
    :meth:`update_usage`, :meth:`get_usages`, :meth:`prepare_for_saving` and
    :meth:`restore_from_saved`.
    """

    _quantizer: Quantizer | None = None

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values as a plain tensor."""
        raise NotImplementedError

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None):
        """Create the layouts that are required and delete those that are not."""
        raise NotImplementedError

    def get_usages(self) -> dict[str, bool]:
        """Which layouts are present."""
        raise NotImplementedError

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensorStorage]:
        """Detach the buffers for ``ctx.save_for_backward``; returns ``(tensors, self)``."""
        raise NotImplementedError

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Re-attach buffers saved by :meth:`prepare_for_saving`; returns the unused rest."""
        raise NotImplementedError


def prepare_for_saving(*tensors) -> tuple[list[torch.Tensor | None], list[Any]]:
    """Split tensors and quantized storages into plain tensors for ``save_for_backward``.

    Returns ``(tensor_list, objects)``: ``objects[i]`` is ``None`` for a plain tensor (its
    tensor is in ``tensor_list``) or the emptied storage to pass to :func:`restore_from_saved`.
    """
    tensor_list: list[torch.Tensor | None] = []
    objects: list[Any] = []
    for t in tensors:
        if isinstance(t, QuantizedTensorStorage) and not isinstance(t, torch.Tensor):
            saved, obj = t.prepare_for_saving()
            tensor_list.extend(saved)
            objects.append(obj)
        else:
            tensor_list.append(t)
            objects.append(None)
    return tensor_list, objects


def restore_from_saved(objects: list[Any], saved_tensors, return_saved_tensors: bool = False):
    """Inverse of :func:`prepare_for_saving`: the original tensors and storages, in order.

    Each storage takes its buffers from the front of ``saved_tensors``. With
    ``return_saved_tensors=True`` the result is ``(restored, leftover)``, ``leftover`` being the
    saved tensors no object consumed (for callers that saved more after them).
    """
    saved = list(saved_tensors)
    out = []
    for obj in objects:
        if obj is None:
            if not saved:
                raise ValueError(
                    "restore_from_saved: more objects than saved tensors; pass the objects and "
                    "tensors of one prepare_for_saving call"
                )
            out.append(saved.pop(0))
        else:
            saved = obj.restore_from_saved(saved)
            out.append(obj)
    return (out, saved) if return_saved_tensors else out


def restore_from_func_ctx(ctx, return_saved_tensors: bool = False):
    """:func:`restore_from_saved` for an autograd function's ``ctx``.

    Forward stores ``tensors, ctx.tensor_objects = prepare_for_saving(...)`` and calls
    ``ctx.save_for_backward(*tensors)``; backward calls this. ``ctx.tensor_objects`` is
    cleared afterwards so the storages are not kept alive by the graph.
    """
    try:
        objects = ctx.tensor_objects
    except AttributeError:
        raise AttributeError(
            "restore_from_func_ctx: ctx has no tensor_objects; in forward, set "
            "ctx.tensor_objects to the objects prepare_for_saving returned"
        ) from None
    result = restore_from_saved(objects, ctx.saved_tensors, return_saved_tensors)
    ctx.tensor_objects = None
    return result


def _mutated_arguments(func, args, kwargs) -> list[Any]:
    """Values of the arguments that ``func``'s schema marks as written (``Tensor(a!)``)."""
    values = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args):
            values.append(args[i])
        elif arg.name in kwargs:
            values.append(kwargs[arg.name])
    return values


class _DequantizeFunc(torch.autograd.Function):
    """Dequantize in forward; pass the gradient through unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, tensor, dtype):  # noqa: D102
        ctx.input_dtype = tensor.dtype
        return tensor._dequantize_plain(dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        if grad.dtype != ctx.input_dtype:
            grad = grad.to(ctx.input_dtype)
        return grad, None


class QuantizedTensor(torch.Tensor):
    """Base of quantized ``torch.Tensor`` subclasses (wrapper subclasses, no real storage).

    The wrapper presents the nominal high-precision dtype, shape and device; the
    quantized buffers are attributes. ``__torch_function__`` is disabled: every
    operation reaches :meth:`__torch_dispatch__` as an aten op.

    Subclasses implement :meth:`dequantize` (with ``dtype=``), :meth:`quantize_`,
    ``_dequantize_plain`` (dequantize without autograd) and ``_to_device``.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        *,
        requires_grad: bool = False,
        device: torch.device | str | None = None,
        stride=None,
    ):
        if device is None:
            raise ValueError(f"{cls.__name__}: pass device=...; a quantized tensor has no default")
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tuple(shape),
            strides=stride,
            dtype=dtype,
            layout=torch.strided,
            device=torch.device(device),
            requires_grad=requires_grad,
        )

    # Subclass hooks ------------------------------------------------------------------

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision values (``dtype`` defaults to the nominal one).

        Autograd-aware: the gradient passes through to this tensor unchanged. Subclasses whose
        storage base also defines ``dequantize`` (plain, no autograd) re-bind this one
        (``dequantize = QuantizedTensor.dequantize``), since the storage comes first in their MRO.
        """
        if torch.is_grad_enabled() and self.requires_grad:
            return _DequantizeFunc.apply(self, dtype)
        return self._dequantize_plain(dtype)

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None):
        """Overwrite the quantized values in place with ``tensor`` quantized."""
        raise NotImplementedError

    def _to_device(self, device: torch.device, *, non_blocking: bool, pin_memory: bool):
        raise NotImplementedError

    def __deepcopy__(self, memo):
        # Deep copies of the bytes; the quantizer is shared (modules re-bind their copies').
        with torch.no_grad():
            out = self._to_device(self.device, non_blocking=False, pin_memory=False)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        else:
            out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out

    # Conversions (Python methods: they bypass dispatch) --------------------------------

    def float(self) -> torch.Tensor:
        """Dequantize to float32 (autograd-aware)."""
        return self.dequantize(dtype=torch.float32)

    def half(self) -> torch.Tensor:
        """Dequantize to float16 (autograd-aware)."""
        return self.dequantize(dtype=torch.float16)

    def bfloat16(self) -> torch.Tensor:
        """Dequantize to bfloat16 (autograd-aware)."""
        return self.dequantize(dtype=torch.bfloat16)

    # Generic dispatch ------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            return _copy(args[0], args[1], **kwargs)
        if func is aten._to_copy.default:
            return _to_copy(args[0], **kwargs)
        if func in (aten.new_empty.default, aten.empty_like.default):
            handled = _new_empty(func, args, kwargs)
            if handled is not NotImplemented:
                return handled
        if func is aten.is_pinned.default:
            return all(t.is_pinned() for t in args[0]._quantized_buffers() if t is not None)
        if func._schema.is_mutable:
            return _inplace_fallback(func, args, kwargs)
        return _high_precision_fallback(func, args, kwargs)

    def _quantized_buffers(self) -> list[torch.Tensor | None]:
        return []


def _dequantize_any(t):
    return t._dequantize_plain() if isinstance(t, QuantizedTensor) else t


def _copy(dst, src, non_blocking: bool = False):
    if isinstance(dst, QuantizedTensor):
        if isinstance(src, QuantizedTensor):
            src = src._dequantize_plain()
        dst.quantize_(src)
        return dst
    dst.copy_(_dequantize_any(src), non_blocking=non_blocking)
    return dst


def _to_copy(
    tensor,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    if layout not in (None, torch.strided):
        raise ValueError(f"{type(tensor).__name__}: layout={layout} is not supported; use strided")
    target = torch.device(device) if device is not None else tensor.device
    if dtype is None or dtype == tensor.dtype:
        return tensor._to_device(target, non_blocking=non_blocking, pin_memory=bool(pin_memory))
    # An explicit request for another dtype: dequantize (no warning) on the own device.
    hp = dtype if dtype in HIGH_PRECISION_DTYPES else torch.float32
    out = tensor._dequantize_plain(hp)
    out = out.to(dtype=dtype, device=target, non_blocking=non_blocking)
    return out.pin_memory() if pin_memory else out


def _new_empty(func, args, kwargs):
    tensor = args[0]
    quantizer = getattr(tensor, "_quantizer", None)
    if quantizer is None:
        return NotImplemented
    if func is aten.new_empty.default:
        shape = args[1]
    else:
        shape = tensor.shape
    dtype = kwargs.get("dtype") or tensor.dtype
    if dtype not in HIGH_PRECISION_DTYPES:
        return NotImplemented
    device = kwargs.get("device") or tensor.device
    return quantizer.make_empty(
        shape, dtype=dtype, device=device, pin_memory=bool(kwargs.get("pin_memory"))
    )


def _inplace_fallback(func, args, kwargs):
    """Dequantize, run the in-place op, re-quantize into the mutated quantized arguments."""
    plain_of: dict[int, tuple[QuantizedTensor, torch.Tensor]] = {}

    def unwrap(t):
        # One plain tensor per quantized object, so `x.add_(x)` keeps its aliasing.
        if id(t) not in plain_of:
            plain_of[id(t)] = (t, t._dequantize_plain())
        return plain_of[id(t)][1]

    plain_args, plain_kwargs = tree_map_only(QuantizedTensor, unwrap, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)

    def flat(values):
        for v in values:
            if isinstance(v, (list, tuple)):
                yield from flat(v)
            else:
                yield v

    for value in flat(_mutated_arguments(func, args, kwargs)):
        if isinstance(value, QuantizedTensor):
            value.quantize_(plain_of[id(value)][1])
    original_of = {id(plain): orig for orig, plain in plain_of.values()}
    return tree_map(lambda v: original_of.get(id(v), v), out)


_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # transformer_engine
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def _caller_stacklevel() -> int:
    """``stacklevel`` that points a warning at the first frame outside this library and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _high_precision_fallback(func, args, kwargs):
    """Dequantize all quantized arguments and run ``func`` on plain tensors."""
    name = str(func)
    if name not in _warned_ops:
        _warned_ops.add(name)
        warnings.warn(
            f"{name} has no quantized implementation: it ran in high precision on dequantized "
            "values and returned plain tensors (reported once per op)",
            stacklevel=_caller_stacklevel(),
        )
    plain_args, plain_kwargs = tree_map_only(QuantizedTensor, _dequantize_any, (args, kwargs))
    return func(*plain_args, **plain_kwargs)
