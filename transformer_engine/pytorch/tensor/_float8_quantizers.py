"""Per-tensor FP8 quantizers: delayed scaling and current scaling.

Both quantize on the input's device. The delayed-scaling
quantizer holds *views* into its recipe state (``scale`` and row 0 of the amax
history) and max-accumulates every cast's amax into that row in place; the
current-scaling quantizer computes the amax and scale of each tensor it casts
in scratch buffers on the input's device and touches no state.

Public names are re-exported from :mod:`transformer_engine.pytorch.tensor.float8_tensor`. The
quantizers sit above the tensor class they produce
(:mod:`~transformer_engine.pytorch.tensor._float8_tensor_class`) and write into existing tensors
through :func:`~transformer_engine.pytorch.tensor._float8_quantize_into.quantize_into`.
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import torch

from ...common.recipe import DelayedScaling, Float8CurrentScaling
from .. import cpp_extensions as ext
from ..constants import HIGH_PRECISION_DTYPES, DType, TE_DType_To_Torch, to_torch_fp8_dtype
from ..cpp_extensions.cast import (
    column_sum,
    quantize_current_scaling_prevalidated,
    quantize_dbias_prevalidated,
    quantize_prevalidated,
)
from ..cpp_extensions.scaling import current_scale_from, current_scale_prevalidated
from ..device import check_same_device
from ..quantized_tensor import Quantizer, _check_high_precision_dtype
from ._float8_quantize_into import float8_layouts, high_precision_source, quantize_into
from ._float8_tensor_class import Float8Tensor
from .storage.float8_tensor_storage import (
    Float8TensorStorage,
    float8_transposed_shape,
    transpose_bytes,
)

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer"]


def _check_state_tensor(owner: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(
            f"{owner}: {name} must be a one-element float32 tensor (a view into the recipe "
            f"state), got dtype {t.dtype} and shape {tuple(t.shape)}"
        )


def _torch_fp8_dtype(dtype) -> torch.dtype:
    """The torch FP8 dtype of a quantizer's ``dtype`` (a ``DType``): a dict lookup on every
    cast, the ``DType(...)`` conversion (and its error for a bad value) only for other kinds
    of value."""
    try:
        return TE_DType_To_Torch[dtype]
    except (KeyError, TypeError):
        return TE_DType_To_Torch[DType(dtype)]


class _Float8QuantizerBase(Quantizer):
    """What both per-tensor FP8 quantizers share: layouts, wrapping, in-place updates."""

    dtype: DType

    def _layouts(self, device: torch.device, shape) -> tuple[bool, bool]:
        """``(need_data, need_transpose)`` for this quantizer's usages on ``device``."""
        return float8_layouts(
            type(self).__name__, self.rowwise_usage, self.columnwise_usage, device, shape
        )

    def _wrap(
        self,
        *,
        shape,
        dtype,
        data,
        transpose,
        scale_inv,
        requires_grad=False,
        data_fp8=None,
        transpose_fp8=None,
    ):
        """A ``Float8Tensor`` (or ``Float8TensorStorage`` when internal) around the buffers.

        ``data_fp8`` / ``transpose_fp8``: the FP8-typed tensors a cast wrote, which an internal
        storage hands to GEMMs (see ``Float8TensorStorage.float8_gemm_input``)."""
        if self.internal:
            return self._internal_storage(data, transpose, scale_inv, dtype, data_fp8,
                                          transpose_fp8)  # fmt: skip
        return Float8Tensor(
            shape,
            dtype,
            data=data,
            fp8_scale_inv=scale_inv,
            fp8_dtype=self.dtype,
            data_transpose=transpose,
            quantizer=self._result_quantizer(),
            requires_grad=requires_grad,
        )

    def _internal_storage(self, data, transpose, scale_inv, dtype, data_fp8, transpose_fp8):
        """Internal storages are the linear layers' per-call operands: built without
        re-validating what the cast just produced, and holding this quantizer itself (they are
        never re-quantized through it) instead of a copy; a quantizer that reduces amaxes across
        processes still hands out a local copy, as for tensors."""
        if dtype not in HIGH_PRECISION_DTYPES:
            _check_high_precision_dtype(f"{type(self).__name__}.quantize", dtype)
        fp8_dtype = self.dtype
        if not isinstance(fp8_dtype, DType):  # reassigned after construction
            fp8_dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        return Float8TensorStorage._from_cast(
            data=data,
            transpose=transpose,
            scale_inv=scale_inv,
            fp8_dtype=fp8_dtype,
            quantizer=self._result_quantizer()
            if getattr(self, "with_amax_reduction", False)
            else self,
            fake_dtype=dtype,
            data_fp8=data_fp8,
            transpose_fp8=transpose_fp8,
        )

    def _result_quantizer(self) -> Quantizer:
        return self.copy()

    def __getstate__(self) -> dict:
        # process groups do not pickle; a copy is no FSDP2 shard's quantizer (it has no group)
        state = {**self.__dict__, "amax_reduction_group": None}
        state.pop("_fsdp_shard_quantizer", None)
        return state

    def _scale_and_amax(self, src: torch.Tensor, noop_flag=None) -> tuple:
        """``(scale, amax buffer or None)``: the scale to cast ``src`` with and the buffer to
        accumulate its amax into; ``noop_flag`` is the cast's, which may skip the scale's work."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Quantizer API

    def quantize_impl(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None):
        """Quantize ``tensor`` on its own device into a new FP8 tensor (see the class doc)."""
        return self._quantize(tensor, dtype, with_dbias=False)

    def quantize_with_dbias_impl(self, tensor: torch.Tensor):
        """:meth:`quantize_impl` plus ``column_sum(tensor)`` (a linear layer's bias
        gradient from its output gradient), ``(quantized, dbias)``.

        When this quantizer's usages include the transposed copy, the sum is computed in the
        same pass over ``tensor`` (``nvte_quantize_dbias``); otherwise, or for an empty tensor,
        separately. ``tensor`` must be a plain high-precision tensor with at least one dimension.
        """
        if tensor.dim() == 0 or tensor.numel() == 0 or tensor.is_meta:
            return self.quantize_impl(tensor), column_sum(tensor)
        return self._quantize(tensor, None, with_dbias=True)

    def _quantize(self, tensor, dtype, *, with_dbias: bool):
        # Every FP8 linear layer casts through here three times a step: the checks run as
        # comparisons, and their messages are only formatted for a failure.
        src = high_precision_source(tensor)
        src_dtype, shape = src.dtype, src.shape
        fake_dtype = src_dtype if dtype is None else dtype
        if src.is_meta:
            # Deferred initialization: shapes only, no cast and no amax.
            return self.make_empty(shape, dtype=fake_dtype, device=src.device)
        if src_dtype not in HIGH_PRECISION_DTYPES:
            _check_high_precision_dtype(f"{type(self).__name__}.quantize", src_dtype)
        need_data, need_transpose = self._layouts(src.device, shape)
        # The cast kernels write no 0-d transpose; a 0-d tensor's is a copy of its one byte.
        zero_dim = len(shape) == 0
        res, dbias = self._cast(src, need_transpose and not zero_dim, with_dbias)
        out = self._wrap_result(res, shape, fake_dtype, need_data, need_transpose)
        return (out, dbias) if with_dbias else out

    def _wrap_result(self, res, shape, dtype, need_data: bool, need_transpose: bool):
        """A cast's ``QuantizeResult`` as this quantizer's tensor or storage, holding the layouts
        its usages ask for. The cast kernels write no 0-d transpose: a 0-d tensor's transposed
        copy is a copy of its one byte."""
        data = res.data.view(torch.uint8) if need_data else None
        transpose = transpose_fp8 = None
        if need_transpose and len(shape) == 0:
            transpose_fp8 = res.data.clone() if need_data else res.data
            transpose = transpose_fp8.view(torch.uint8)
        elif need_transpose:
            transpose, transpose_fp8 = res.transpose.view(torch.uint8), res.transpose
        if self.internal:  # the per-call operands: straight to the storage
            return self._internal_storage(data, transpose, res.scale_inv, dtype,
                                          res.data if need_data else None, transpose_fp8)  # fmt: skip
        return self._wrap(
            shape=shape,
            dtype=dtype,
            data=data,
            transpose=transpose,
            scale_inv=res.scale_inv,
            data_fp8=res.data if need_data else None,
            transpose_fp8=transpose_fp8,
        )

    def _cast(self, src, with_transpose: bool, with_dbias: bool):
        """The native (or reference) cast of a checked ``src``: ``(QuantizeResult, dbias or
        None)``; the bias gradient comes from the cast's own pass when the transposed copy is
        made too."""
        scale, amax = self._scale_and_amax(src)
        fp8_dtype = _torch_fp8_dtype(self.dtype)
        if with_dbias and with_transpose:
            return quantize_dbias_prevalidated(src, scale, fp8_dtype, amax=amax)
        res = quantize_prevalidated(src, scale, fp8_dtype, amax=amax, with_transpose=with_transpose)
        return res, (column_sum(src) if with_dbias else None)

    #: Whether the scale is fixed before a cast (delayed scaling): a fused producer (an activation
    #: kernel) can write the FP8 bytes in its own pass (:meth:`quantize_produced`).
    scale_precedes_cast = False

    def quantize_produced(self, produce, shape, dtype: torch.dtype, device: torch.device, *,
                          amax_of=None):  # fmt: skip
        """An FP8 tensor (internal storage when ``internal``) of ``shape`` whose bytes
        ``produce(scale, amax, fp8_dtype, with_transpose)`` writes, returning
        ``(QuantizeResult, extra)``; returns ``(tensor, extra)``. Delayed scaling: ``produce``
        gets this quantizer's scale and amax buffer; current scaling needs ``amax_of(amax)``, the
        producer's amax pass writing ``max |values|`` into a one-element float32 buffer, and
        ``produce`` gets the scale from it (reduced across the group first) and no amax."""
        scale, amax = self.cast_scale(device, amax_of)
        need_data, need_transpose = self._layouts(device, shape)
        res, extra = produce(scale, amax, _torch_fp8_dtype(self.dtype), need_transpose)
        out = self._wrap_result(res, torch.Size(shape), dtype, need_data, need_transpose)
        return out, extra

    def cast_scale(self, device: torch.device, amax_of=None):
        """``(scale, amax buffer or None)`` of a cast on ``device``: delayed scaling's state (each
        cast accumulates its amax), or current scaling's scale from ``amax_of`` (as above)."""
        if self.scale_precedes_cast:
            return self._scale_and_amax(None)
        if amax_of is not None and hasattr(self, "_scale_from_amax_pass"):
            return self._scale_from_amax_pass(amax_of, device), None
        raise TypeError(
            f"{type(self).__name__} computes its scale from the values; pass amax_of "
            "(the producer's amax pass) or quantize the produced tensor with quantize()"
        )

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize ``src`` into ``dst``'s buffers in place (see :meth:`Quantizer.update_quantized`).

        ``src`` is moved to ``dst``'s device first (``copy_`` semantics). ``dst``'s
        layouts are coerced to this quantizer's usages. When ``dst`` is a part of a
        larger FP8 tensor that the dispatch made (a dim-0 slice, a partial ``as_strided``),
        it keeps the scale it shares with that tensor (``1 / dst._scale_inv``) so the rest
        stays valid; bytes merely placed in a bigger buffer (``replace_raw_data``) do not.
        """
        return quantize_into(
            type(self).__name__,
            src,
            dst,
            fp8_dtype=self.dtype,
            rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage,
            scale_and_amax=partial(self._scale_and_amax, noop_flag=noop_flag),
            noop_flag=noop_flag,
        )

    def make_empty(
        self,
        shape,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ):
        """Uninitialised FP8 tensor with this quantizer's usages; ``_scale_inv`` is 1.

        ``device=None`` uses the device of the quantizer's state (delayed scaling:
        its ``scale``); the stateless current-scaling quantizer requires ``device``.
        """
        _check_high_precision_dtype(f"{type(self).__name__}.make_empty", dtype)
        device = self._resolve_device(device)
        shape = torch.Size(shape)
        need_data, need_transpose = self._layouts(device, shape)
        kw = {"dtype": torch.uint8, "device": device, "pin_memory": pin_memory}
        data = torch.empty(shape, **kw) if need_data else None
        transpose = torch.empty(float8_transposed_shape(shape), **kw) if need_transpose else None
        scale_inv = torch.ones(1, dtype=torch.float32, device=device)
        return self._wrap(
            shape=shape,
            dtype=dtype,
            data=data,
            transpose=transpose,
            scale_inv=scale_inv,
            requires_grad=requires_grad,
        )

    def _scale_inv_for_data(self, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def create_tensor_from_data(
        self,
        data: torch.Tensor,
        fake_dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
        internal: bool = False,
    ):
        """Wrap existing FP8 bytes (``uint8`` or torch FP8) as a tensor of this quantizer.

        The transposed copy is added when this quantizer's usages need it.
        """
        if not isinstance(data, torch.Tensor) or data.dtype not in (
            torch.uint8,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            raise TypeError(
                "create_tensor_from_data: data must be a torch.uint8 or torch FP8 tensor, got "
                f"{getattr(data, 'dtype', type(data).__name__)}"
            )
        _check_high_precision_dtype("create_tensor_from_data", fake_dtype)
        data = data.view(torch.uint8)
        _, need_transpose = self._layouts(data.device, data.shape)
        transpose = transpose_bytes(data) if need_transpose and not data.is_meta else None
        saved, self.internal = self.internal, internal
        try:
            return self._wrap(
                shape=data.shape,
                dtype=fake_dtype,
                data=data,
                transpose=transpose,
                scale_inv=self._scale_inv_for_data(data.device),
                requires_grad=requires_grad,
            )
        finally:
            self.internal = saved

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Float32, float16 or bfloat16 tensors (and quantized tensors) are quantizable."""
        return super().is_quantizable(inp)


class Float8Quantizer(_Float8QuantizerBase):
    """Delayed-scaling FP8 quantizer: casts with a scale kept in recipe state.

    Parameters
    ----------
    scale : torch.Tensor
        One-element float32 tensor (0-d or ``[1]``), normally a view into the recipe
        state's scale vector. Never copied: scale updates are seen by the next cast.
    amax : torch.Tensor
        One-element float32 tensor, normally a view into row 0 of the amax history.
        Every cast max-accumulates ``max|x|`` into it in place.
    fp8_dtype : DType or torch.dtype
        ``DType.kFloat8E4M3`` / ``kFloat8E5M2`` (or the torch equivalents).
    rowwise, columnwise : bool
        Usages (see :class:`~transformer_engine.pytorch.quantized_tensor.Quantizer`).

    Notes
    -----
    The cast runs on the input's device; a ``scale`` or ``amax`` on another device
    is refused with a ``ValueError`` naming both devices. The output's
    ``_scale_inv`` is ``1 / scale`` as computed by the cast.
    """

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        owner = type(self).__name__
        _check_state_tensor(owner, "scale", scale)
        _check_state_tensor(owner, "amax", amax)
        check_same_device(owner, "scale", scale, amax=amax)
        dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.scale = scale
        self.amax = amax
        self.dtype = dtype

    scale_precedes_cast = True

    # An FSDP2 shard's quantizer (tensor._float8_fsdp) all-reduces (MAX) over this group the
    # amax each in-place re-quantization accumulates: the history sees the whole parameter.
    amax_reduction_group = None

    def _scale_and_amax(self, src, noop_flag=None):
        return self.scale, self.amax

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag=None):  # noqa: D102
        out = super().update_quantized(src, dst, noop_flag=noop_flag)
        if (group := self.amax_reduction_group) is not None:
            torch.distributed.all_reduce(self.amax, torch.distributed.ReduceOp.MAX, group)
        return out

    def _reduce_amax_across(self, group) -> None:
        self.amax_reduction_group = group

    def _state_device(self) -> torch.device:
        return self.scale.device

    def _scale_inv_for_data(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.ones(1, dtype=torch.float32, device=device)
        if self.scale.device != device:
            raise ValueError(
                f"create_tensor_from_data: data is on {device} but the quantizer's scale is on "
                f"{self.scale.device}; move the data (or the recipe state) to one device"
            )
        return torch.reciprocal(self.scale.detach().reshape(1))

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Overwrite ``amax`` with ``max|tensor|`` (no cast); ``tensor`` must share its device."""
        ext.compute_amax(high_precision_source(tensor), out=self.amax)

    def supports_only_rowwise_all_gather(self) -> bool:
        """Delayed-scaling tensors are all-gathered row-wise only."""
        return True

    def _get_compatible_recipe(self):
        return DelayedScaling

    def __repr__(self) -> str:
        scale = "meta" if self.scale.is_meta else f"{float(self.scale.reshape(())):.6g}"
        return (
            f"Float8Quantizer(fp8_dtype={self.dtype.name}, scale={scale}, "
            f"device={self.scale.device}, rowwise_usage={self.rowwise_usage}, "
            f"columnwise_usage={self.columnwise_usage}, internal={self.internal})"
        )


class Float8CurrentScalingQuantizer(_Float8QuantizerBase):
    """Current-scaling FP8 quantizer: each cast computes its own amax and scale.

    Per call, on the input's device: ``amax = max|x|``; when ``with_amax_reduction``,
    ``torch.distributed.all_reduce(amax, op=MAX, group=amax_reduction_group)``;
    ``scale = fp8_max / max(amax, amax_epsilon)`` (1 for a zero, infinite or NaN
    amax; FLT_MAX instead of +inf; rounded down to a power of 2 when
    ``force_pow_2_scales``); then the cast with that scale. No amax is accumulated
    anywhere.

    Parameters
    ----------
    fp8_dtype : DType or torch.dtype
        FP8 format.
    device : optional
        Accepted for compatibility and ignored: the input's device is used.
    rowwise, columnwise : bool
        Usages.
    use_existing_amax : bool
        Deprecated and ignored.
    with_amax_reduction : bool
        All-reduce (MAX) the amax over ``amax_reduction_group`` before computing the scale.
    amax_reduction_group : torch.distributed.ProcessGroup, optional
        Group of the reduction (``None``: the default group). Dropped when pickling.
    force_pow_2_scales : bool
        Round scales down to powers of 2.
    amax_epsilon : float
        Lower bound on the amax used for the scale (finite, >= 0).
    scale, amax : optional
        Deprecated and ignored.
    """

    def __init__(
        self,
        fp8_dtype,
        device=None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        use_existing_amax: bool = False,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        force_pow_2_scales: bool = False,
        amax_epsilon: float = 0.0,
        scale=None,
        amax=None,
    ) -> None:
        owner = type(self).__name__
        dtype = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        try:
            epsilon = float(amax_epsilon)
        except (TypeError, ValueError):
            raise TypeError(f"{owner}: amax_epsilon={amax_epsilon!r} must be a number") from None
        if not math.isfinite(epsilon) or epsilon < 0:
            raise ValueError(f"{owner}: amax_epsilon={amax_epsilon!r} must be finite and >= 0")
        deprecated = {"use_existing_amax": use_existing_amax, "scale": scale, "amax": amax}
        for name, value in deprecated.items():
            if value is not None and value is not False:
                warnings.warn(
                    f"{owner}: {name} is deprecated and ignored (current scaling computes the "
                    "amax and scale of every tensor it casts)",
                    DeprecationWarning,
                    stacklevel=2,
                )
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = dtype
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = epsilon

    def _cast(self, src, with_transpose: bool, with_dbias: bool):
        if self.with_amax_reduction:  # the all-reduce runs between the amax and the scale
            return super()._cast(src, with_transpose, with_dbias)
        res, dbias = quantize_current_scaling_prevalidated(
            src,
            _torch_fp8_dtype(self.dtype),
            epsilon=self.amax_epsilon,
            force_pow_2_scales=self.force_pow_2_scales,
            with_transpose=with_transpose,
            with_dbias=with_dbias and with_transpose,
        )
        if with_dbias and dbias is None:
            dbias = column_sum(src)
        return res, dbias

    def _scale_and_amax(self, src, noop_flag=None):
        # noop_flag (a CUDA graph's cached weight): the amax pass is skipped with the cast
        scale = current_scale_prevalidated(
            src, _torch_fp8_dtype(self.dtype), epsilon=self.amax_epsilon,
            force_pow_2_scales=self.force_pow_2_scales, reduce_amax=self._amax_reduction(),
            noop_flag=noop_flag,
        )  # fmt: skip
        return scale, None

    def _scale_from_amax_pass(self, amax_of, device: torch.device) -> torch.Tensor:
        """The scale of values whose amax ``amax_of(buffer)`` writes (see quantize_produced)."""
        return current_scale_from(
            amax_of, device, _torch_fp8_dtype(self.dtype), epsilon=self.amax_epsilon,
            force_pow_2_scales=self.force_pow_2_scales, reduce_amax=self._amax_reduction(),
        )  # fmt: skip

    def _amax_reduction(self):
        """The all-reduce (MAX over the group) of an amax buffer, or None without reduction."""
        if not self.with_amax_reduction:
            return None

        def reduce_amax(amax):
            torch.distributed.all_reduce(
                amax, op=torch.distributed.ReduceOp.MAX, group=self.amax_reduction_group
            )

        return reduce_amax

    def _reduce_amax_across(self, group) -> None:
        self.with_amax_reduction, self.amax_reduction_group = True, group

    def _result_quantizer(self) -> Quantizer:
        # A produced tensor re-quantizes locally: the reduction belongs to the producing call.
        q = self.copy()
        q.with_amax_reduction = False
        q.amax_reduction_group = None
        return q

    def _scale_inv_for_data(self, device: torch.device) -> torch.Tensor:
        return torch.ones(1, dtype=torch.float32, device=device)

    def is_requantization_safe(self) -> bool:
        """Current scaling is deterministic: re-quantizing reproduces the bytes."""
        return True

    def _get_compatible_recipe(self):
        return Float8CurrentScaling

    # A value quantizer, as upstream's: it holds no state between casts, so two with the same
    # settings cast alike and compare equal (and hash alike); the process group by identity.
    def _value_key(self) -> tuple:
        return (
            self.dtype,
            self.rowwise_usage,
            self.columnwise_usage,
            self.internal,
            self.optimize_for_gemm,
            self.with_amax_reduction,
            self.force_pow_2_scales,
            self.amax_epsilon,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return (
            self._value_key() == other._value_key()
            and self.amax_reduction_group is other.amax_reduction_group
        )

    def __hash__(self) -> int:
        return hash((type(self), self._value_key(), id(self.amax_reduction_group)))

    def __repr__(self) -> str:
        return (
            f"Float8CurrentScalingQuantizer(fp8_dtype={self.dtype.name}, "
            f"force_pow_2_scales={self.force_pow_2_scales}, amax_epsilon={self.amax_epsilon}, "
            f"with_amax_reduction={self.with_amax_reduction}, "
            f"rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
            f"internal={self.internal})"
        )
