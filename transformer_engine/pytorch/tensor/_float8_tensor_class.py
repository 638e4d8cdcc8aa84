"""The ``Float8Tensor`` class: a per-tensor-scaled FP8 tensor that behaves like a high-precision tensor.

Its public home is :mod:`transformer_engine.pytorch.tensor.float8_tensor`, next to the
quantizers that produce it; the class lives here, below the quantizers, so that they can
import it.

The tensor presents its nominal dtype (float32, float16 or bfloat16), shape and
device; its values are FP8 bytes times ``_scale_inv`` (the buffer layout is
described in :mod:`transformer_engine.pytorch.tensor.storage.float8_tensor_storage`).
Aten operations it can do on the bytes (views, transposes, slices, copies,
device moves) keep it a ``Float8Tensor``; the table lives in
:mod:`transformer_engine.pytorch.tensor._float8_dispatch`. Other operations run
in high precision (see :class:`~transformer_engine.pytorch.quantized_tensor.QuantizedTensor`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..constants import HIGH_PRECISION_DTYPES, DType, to_torch_fp8_dtype
from ..quantized_tensor import QuantizedTensor
from ._float8_dispatch import FLOAT8_HANDLERS
from ._float8_fsdp import fsdp_post_all_gather, fsdp_pre_all_gather
from ._float8_quantize_into import check_data_value, quantize_into
from ._quantized_setitem import is_dim0_view_key, quantized_setitem
from .storage.float8_tensor_storage import Float8TensorStorage, check_float8_buffers

__all__ = ["Float8Tensor", "_make_float8_tensor_in_reduce_ex"]


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """FP8 tensor with per-tensor scaling, presented as a high-precision ``torch.Tensor``.

    Parameters
    ----------
    shape : sequence of int
        Logical shape.
    dtype : torch.dtype
        Nominal dtype: float32, float16 or bfloat16.
    data : torch.Tensor or None
        Row-wise FP8 bytes (``uint8`` or torch FP8) of ``shape``.
    fp8_scale_inv : torch.Tensor
        One-element float32 ``1 / scale``; on another device than the bytes (upstream's tests
        pass a CPU tensor with CUDA bytes) it is copied to the bytes' device.
    fp8_dtype : DType or torch.dtype
        FP8 format of the bytes.
    data_transpose : torch.Tensor, optional
        Column-wise bytes of shape ``(shape[-1], *shape[:-1])`` (``()`` for a 0-d tensor).
    quantizer : Quantizer, optional
        Used to re-quantize in place (``copy_``, in-place ops, ``quantize_``).
    requires_grad : bool
        Autograd flag.
    device : torch.device or str, optional
        Must match the buffers' device when given (default: the buffers' device).
    stride : sequence of int, optional
        Must be the contiguous strides of ``shape`` when given.
    fake_dtype : torch.dtype, optional
        Alias of ``dtype`` (must equal it when given).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    # The storage mixin defines these for plain storages; a tensor keeps torch's.
    size = torch.Tensor.size
    shape = torch.Tensor.shape
    device = torch.Tensor.device
    view = torch.Tensor.view

    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        *,
        data: torch.Tensor | None,
        fp8_scale_inv: torch.Tensor,
        fp8_dtype,
        data_transpose: torch.Tensor | None = None,
        quantizer=None,
        requires_grad: bool = False,
        device: torch.device | str | None = None,
        stride=None,
        fake_dtype: torch.dtype | None = None,
    ):
        if fake_dtype is not None and fake_dtype != dtype:
            raise ValueError(f"Float8Tensor: fake_dtype={fake_dtype} must equal dtype={dtype}")
        shape = torch.Size(shape)
        if stride is not None and tuple(stride) != _contiguous_strides(shape):
            raise ValueError(
                f"Float8Tensor: stride={tuple(stride)} is not contiguous for shape "
                f"{tuple(shape)}; FP8 tensors are always contiguous (omit stride)"
            )
        buffer = next(t for t in (data, data_transpose, fp8_scale_inv) if t is not None)
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"Float8Tensor: FP8 buffers must be tensors, got {type(buffer)}")
        if device is not None:
            wanted = torch.device(device)
            if wanted.type != buffer.device.type or wanted.index not in (None, buffer.device.index):
                raise ValueError(
                    f"Float8Tensor: device={wanted} but the FP8 buffers are on {buffer.device}; "
                    "move the buffers or omit device"
                )
        check_float8_buffers("Float8Tensor", data, data_transpose, fp8_scale_inv, shape)
        self = QuantizedTensor.__new__(
            cls, shape, dtype, requires_grad=requires_grad, device=buffer.device
        )
        self._set_float8_buffers(
            data=data,
            fp8_scale_inv=fp8_scale_inv,
            fp8_dtype=fp8_dtype,
            data_transpose=data_transpose,
            quantizer=quantizer,
            fake_dtype=dtype,
            shape=shape,
        )
        return self

    def __init__(self, *args, **kwargs) -> None:
        # Everything happens in __new__; this keeps the storage __init__ from running again.
        pass

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def make_like(
        cls,
        tensor: Float8Tensor,
        *,
        shape=None,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        data: torch.Tensor | None = None,
        data_transpose: torch.Tensor | None = None,
    ) -> Float8Tensor:
        """New ``Float8Tensor`` sharing ``tensor``'s buffers, with the given overrides.

        Passing ``data`` replaces the row-wise bytes and drops the old transpose
        unless ``data_transpose`` is passed too. The scale is shared, and so is the mark of
        a part of a larger tensor (``_shares_scale_with_base``).
        """
        meta = tensor.get_metadata()
        meta.pop("fake_dtype")
        if data is not None:
            meta["data"] = data
            meta["data_transpose"] = data_transpose
        elif data_transpose is not None:
            meta["data_transpose"] = data_transpose
        if shape is None:
            shape = meta["data"].shape if meta["data"] is not None else tensor.shape
        out = cls(shape, dtype or tensor.dtype, requires_grad=requires_grad, **meta)
        if getattr(tensor, "_shares_scale_with_base", False):
            out._shares_scale_with_base = True
        return out

    def to_dtype(self, dtype: torch.dtype) -> Float8Tensor:
        """Same FP8 buffers with another nominal dtype."""
        return Float8Tensor.make_like(self, dtype=dtype, requires_grad=self.requires_grad)

    # ------------------------------------------------------------------ values

    # autograd-aware (the storage's dequantize, first in the MRO, is the plain one)
    dequantize = QuantizedTensor.dequantize

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: torch.Tensor | None = None):
        """Re-quantize ``tensor`` into this tensor's buffers in place; returns ``self``.

        Uses the tensor's own quantizer. A tensor without one (e.g. loaded from a
        checkpoint) keeps its current scale (``1 / _scale_inv``).
        """
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != tuple(self.shape):
            tensor = tensor.expand(self.shape)
        if self._quantizer is not None:
            self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
            return self
        # What a delayed-scaling quantizer holding this scale would do; the amax of the cast
        # is not wanted by anyone, so none is computed.
        scale = torch.reciprocal(self._scale_inv.detach().reshape(1)).reshape(())
        quantize_into(
            "Float8Tensor",
            tensor,
            self,
            fp8_dtype=DType.cast(to_torch_fp8_dtype(self._fp8_dtype)),
            rowwise=self._data is not None,
            columnwise=self._transpose is not None,
            scale_and_amax=lambda src: (scale, None),
            noop_flag=noop_flag,
        )
        return self

    def _reset_caches(self) -> None:
        """Rebuild the transposed copy from the row-wise bytes after they were edited."""
        if self._data is not None and self._transpose is not None:
            self._create_transpose()

    def remove_caches(self) -> None:
        """Drop the transposed copy (when row-wise bytes exist)."""
        if self._data is not None:
            self._transpose = None
            self._transpose_invalid = True
            # Its cached FP8 view would keep the dropped bytes alive.
            self.__dict__.pop("_transpose_fp8_view", None)

    def float8_gemm_input(
        self, columnwise: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(values, scale_inv)`` for a GEMM, as
        :meth:`Float8TensorStorage.float8_gemm_input <transformer_engine.pytorch.tensor.storage.float8_tensor_storage.Float8TensorStorage.float8_gemm_input>`
        describes, except that the typed view is made afresh on every call: a tensor keeps its
        ``__dict__`` free of extra tensors, which pickling, ``deepcopy`` and ``.data`` would
        carry along.
        """
        buffer = self._transpose if columnwise else self._data
        if buffer is None:
            return None, self._scale_inv
        return buffer.view(to_torch_fp8_dtype(self._fp8_dtype)), self._scale_inv

    # ------------------------------------------------------------------ FSDP2

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """FSDP2 hook: this shard's row-wise FP8 bytes are what the all-gather sends (see
        :mod:`~transformer_engine.pytorch.tensor._float8_fsdp`)."""
        return fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the whole parameter as a ``Float8Tensor`` around the gathered bytes."""
        return fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)

    def _quantized_buffers(self) -> list[torch.Tensor | None]:
        return [self._data, self._transpose, self._scale_inv]

    def _to_device(self, device: torch.device, *, non_blocking: bool, pin_memory: bool):
        if self._scale_inv.is_meta and device.type != "meta":
            raise ValueError(
                f"Float8Tensor on meta holds no data and cannot be copied to {device}; create "
                f"it there instead (torch.empty_like(t, device={str(device)!r}), "
                "module.to_empty(...)) and initialize it"
            )

        def move(t):
            if t is None:
                return None
            t = t.to(device, non_blocking=non_blocking, copy=True)
            return t.pin_memory() if pin_memory else t

        return Float8Tensor(
            self.shape,
            self.dtype,
            data=move(self._data),
            fp8_scale_inv=move(self._scale_inv),
            fp8_dtype=self._fp8_dtype,
            data_transpose=move(self._transpose),
            quantizer=self._quantizer,
        )

    # ------------------------------------------------------------------ Python protocol

    @property
    def data(self) -> torch.Tensor:
        """Detached alias (``Float8Tensor``) sharing the FP8 buffers."""
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # A Float8Tensor takes over the other's buffers (and its device and shape, as
        # torch's setter does); a plain tensor is quantized in place with our quantizer.
        if isinstance(value, Float8Tensor):
            torch._C.TensorBase.data.__set__(self, value)
            self._set_float8_buffers(
                shape=value.shape, **{**value.get_metadata(), "fake_dtype": value.dtype}
            )
            self._shares_scale_with_base = value._shares_scale_with_base
            return
        check_data_value("Float8Tensor", value, self.shape)
        with torch.no_grad():
            self.quantize_(value)
        if value.dtype != self.dtype and value.dtype in HIGH_PRECISION_DTYPES:
            # e.g. module.half(): the values stay FP8, the nominal dtype follows.
            torch._C.TensorBase.data.__set__(self, self.to_dtype(value.dtype))
            self._dtype = value.dtype

    def __repr__(self, *, tensor_contents=None) -> str:
        if self.is_meta:
            values = "<meta: no data>"
            scale_inv = "<meta>"
        else:
            with torch.no_grad():
                values = repr(self._dequantize_plain())
            scale_inv = f"{float(self._scale_inv.reshape(())):.6g}"
        return (
            f"Float8Tensor(fp8_dtype={DType.cast(self._fp8_dtype).name}, scale_inv={scale_inv}, "
            f"dtype={self.dtype}, shape={tuple(self.shape)}, device={self.device}, "
            f"data={values})"
        )

    __str__ = __repr__

    def __setitem__(self, key, value) -> None:
        # Only dim-0 rows and slices of the row-wise bytes are views of them; any other index
        # gives a copy, and a write into it must be re-quantized into this tensor.
        writes_through = self._data is not None and is_dim0_view_key(key)
        quantized_setitem(self, key, value, writes_through=writes_through)

    def __reduce_ex__(self, protocol):
        # A parameter pickles as torch's Parameter rebuild around a detached copy, and a tensor
        # that requires grad says so: both came back plain tensors without requires_grad, so
        # an FP8 parameter of a pickled module (torch.save(model)) silently trained no more.
        if isinstance(self, torch.nn.Parameter):
            rebuild = torch._utils._rebuild_parameter
            return (rebuild, (self.detach(), self.requires_grad, OrderedDict()))
        args = (
            self._data,
            int(self._fp8_dtype),
            self._scale_inv,
            self.dtype,
            tuple(self.shape),
            self._transpose,
        )
        return (_make_float8_tensor_in_reduce_ex, args + ((True,) if self.requires_grad else ()))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = FLOAT8_HANDLERS.get(func)
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return QuantizedTensor.__torch_dispatch__.__func__(cls, func, types, args, kwargs)


def _make_float8_tensor_in_reduce_ex(
    data: torch.Tensor | None,
    fp8_dtype: int,
    fp8_scale_inv: torch.Tensor,
    dtype: torch.dtype,
    shape,
    data_transpose: torch.Tensor | None = None,
    requires_grad: bool = False,
) -> Float8Tensor:
    """Rebuild a pickled :class:`Float8Tensor` (no quantizer: it keeps its scale on re-quantize)."""
    return Float8Tensor(
        shape,
        dtype,
        data=data,
        fp8_scale_inv=fp8_scale_inv,
        fp8_dtype=DType(int(fp8_dtype)),
        data_transpose=data_transpose,
        requires_grad=requires_grad,
    )


# Pickles name a function by its module and name, and checkpoints have always named this one
# transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex: that public
# module re-exports it, and this keeps the name checkpoints carry (and torch.load's allow-list
# below matches) unchanged.
_make_float8_tensor_in_reduce_ex.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"

# Lets torch.load(..., weights_only=True) rebuild Float8Tensors: the reconstructor only
# wraps tensors it is given.
torch.serialization.add_safe_globals([_make_float8_tensor_in_reduce_ex])
