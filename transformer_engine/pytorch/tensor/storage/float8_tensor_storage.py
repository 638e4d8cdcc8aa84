"""Buffers of a per-tensor-scaled FP8 tensor, without a ``torch.Tensor`` wrapper.

Layout contract (what GEMMs and the integration code read):

``_data``
    ``torch.uint8`` tensor of the logical shape: the row-wise FP8 bytes
    (``view(torch.float8_e4m3fn)`` / ``view(torch.float8_e5m2)`` gives the values
    before scaling). ``None`` when only the column-wise layout is kept.
``_transpose``
    ``torch.uint8`` tensor of shape ``(shape[-1], *shape[:-1])``: the same bytes
    with the last dimension first, for column-wise usage on GPUs without non-TN
    FP8 GEMMs (and on CPU); a 0-d tensor's transpose is a 0-d copy of its one byte
    (upstream's cast writes the same). ``None`` when absent. A stale transpose is never kept:
    it is dropped, so ``_transpose is not None`` means it is valid.
``_transpose_invalid``
    ``True`` exactly when ``_transpose`` is ``None``.
``_scale_inv``
    ``torch.float32`` tensor of shape ``[1]``: ``1 / scale`` used by the cast,
    shared by both layouts. Real value = FP8 value * ``_scale_inv``.
``_fp8_dtype``
    :class:`~transformer_engine.pytorch.constants.DType` (``kFloat8E4M3`` or
    ``kFloat8E5M2``).
``_quantizer``
    The quantizer that produced the tensor (a shallow copy sharing its state), or
    ``None``.
``_dtype``
    Nominal high-precision dtype (what :meth:`dequantize` returns by default).

GEMMs do not read these attributes: they take the FP8 values through
:meth:`Float8TensorStorage.float8_gemm_input`, the operand interface that
:mod:`transformer_engine.pytorch.cpp_extensions.gemm` defines.
"""

from __future__ import annotations

import torch

from ... import cpp_extensions as ext
from ...constants import HIGH_PRECISION_DTYPES, DType, to_torch_fp8_dtype
from ...device import is_non_tn_fp8_gemm_supported
from ...quantized_tensor import QuantizedTensorStorage

__all__ = ["Float8TensorStorage"]


def float8_transposed_shape(shape) -> tuple:
    """Shape of the column-wise bytes of a tensor of ``shape``: ``(last, *leading)``, and ``()``
    for a 0-d tensor (one byte, its own transpose), as upstream allocates it."""
    return () if len(shape) == 0 else ext.transposed_shape(shape)


def _as_uint8(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(
            f"{name} has dtype {t.dtype}; FP8 bytes must be torch.uint8 (or a torch FP8 dtype)"
        )
    return t


def transpose_bytes(data: torch.Tensor) -> torch.Tensor:
    """Transposing copy ``(…, last) -> (last, …)`` of FP8 bytes (``uint8``), on their own device.

    The rows of the copy are the columns of ``data`` viewed as ``[rows, last]``: the layout
    the quantize kernels write for column-wise usage. A 0-d tensor's transpose is a copy.
    """
    if data.dim() == 0:
        return data.clone()
    if data.numel() == 0:
        # reshape(-1, 0) cannot infer the row count when the last dim is 0
        return data.movedim(-1, 0).contiguous()
    cols = data.shape[-1]
    return data.reshape(-1, cols).t().contiguous().reshape(cols, *data.shape[:-1])


def untranspose_bytes(transpose: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`transpose_bytes`: ``(last, …) -> (…, last)``."""
    if transpose.dim() == 0:
        return transpose.clone()
    return transpose.movedim(0, -1).contiguous()


def _logical_shape_of_transpose(transpose: torch.Tensor) -> torch.Size:
    if transpose.dim() == 0:
        return torch.Size(())
    return torch.Size((*transpose.shape[1:], transpose.shape[0]))


def check_float8_buffers(
    owner: str,
    data: torch.Tensor | None,
    transpose: torch.Tensor | None,
    scale_inv: torch.Tensor,
    shape=None,
) -> torch.Size:
    """Validate FP8 buffers against each other (and ``shape``); returns the logical shape."""
    if data is None and transpose is None:
        raise ValueError(f"{owner}: data and data_transpose are both None; pass at least one")
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        raise TypeError(
            f"{owner}: fp8_scale_inv must be a float32 tensor, got "
            f"{getattr(scale_inv, 'dtype', type(scale_inv).__name__)}"
        )
    if scale_inv.numel() != 1:
        raise ValueError(
            f"{owner}: fp8_scale_inv must hold one element, got shape {tuple(scale_inv.shape)}"
        )
    if data is not None:
        logical = data.shape
    else:
        logical = _logical_shape_of_transpose(transpose)
    if shape is not None and tuple(shape) != tuple(logical):
        raise ValueError(
            f"{owner}: shape={tuple(shape)} but the FP8 buffers describe shape {tuple(logical)}"
        )
    if transpose is not None:
        expected = float8_transposed_shape(logical)
        if tuple(transpose.shape) != tuple(expected):
            raise ValueError(
                f"{owner}: data_transpose has shape {tuple(transpose.shape)}; for shape "
                f"{tuple(logical)} it must be {tuple(expected)}"
            )
    # fp8_scale_inv may be elsewhere: the constructors move it to the bytes' device (upstream's
    # constructor accepts it), see ``scale_inv_on_device``.
    if data is not None and transpose is not None and data.device != transpose.device:
        raise ValueError(
            f"{owner}: data is on {data.device} but data_transpose is on {transpose.device}; "
            "move them to one device"
        )
    return torch.Size(logical)


def scale_inv_on_device(
    scale_inv: torch.Tensor, data: torch.Tensor | None, transpose: torch.Tensor | None
) -> torch.Tensor:
    """``scale_inv`` on the device of the FP8 bytes: itself when it is there already, else a copy.

    Upstream's constructors accept a ``fp8_scale_inv`` on another device than the bytes (its
    tests build CUDA tensors with a CPU ``torch.full([1], s)``); kernels here read the scale
    on the bytes' device, so the value is copied there once, at construction.
    """
    anchor = data if data is not None else transpose
    if anchor is None or scale_inv.device == anchor.device:
        return scale_inv
    if scale_inv.is_meta:
        raise ValueError(
            f"fp8_scale_inv is a meta tensor (no value) but the FP8 bytes are on {anchor.device}; "
            f"pass a scale_inv with a value (e.g. torch.ones(1, device='{anchor.device}'))"
        )
    return scale_inv.to(anchor.device)


class Float8TensorStorage(QuantizedTensorStorage):
    """Per-tensor-scaled FP8 buffers (row-wise bytes, transposed bytes, ``scale_inv``).

    Parameters
    ----------
    data : torch.Tensor or None
        Row-wise FP8 bytes (``uint8`` or a torch FP8 dtype) of the logical shape.
    fp8_scale_inv : torch.Tensor
        One-element float32 ``1 / scale``; kept as is on the bytes' device, copied there from
        any other device.
    fp8_dtype : DType or torch.dtype
        FP8 format of the bytes.
    data_transpose : torch.Tensor, optional
        Column-wise bytes of shape ``(shape[-1], *shape[:-1])``.
    quantizer : Quantizer, optional
        Quantizer used to re-quantize in place.
    fake_dtype : torch.dtype
        Nominal high-precision dtype.
    """

    # ``(uint8 buffer, the same bytes typed as torch FP8)`` for each layout, or None: the views
    # :meth:`float8_gemm_input` hands to GEMMs, kept so a storage read by several GEMMs is
    # viewed once. Valid only while the buffer is the very object recorded next to the view.
    _data_fp8_view: tuple[torch.Tensor, torch.Tensor] | None = None
    _transpose_fp8_view: tuple[torch.Tensor, torch.Tensor] | None = None
    # True for what the tensor dispatch makes of part of a larger FP8 tensor (a dim-0 slice, a
    # partial ``as_strided``) or of a copy of its bytes, sharing that tensor's ``_scale_inv``:
    # re-quantizing it keeps the shared scale, so the rest stays valid. Bytes that merely live
    # in a bigger buffer (``replace_raw_data``) are a whole tensor with a scale of its own.
    _shares_scale_with_base: bool = False

    def __init__(
        self,
        *,
        data: torch.Tensor | None,
        fp8_scale_inv: torch.Tensor,
        fp8_dtype,
        data_transpose: torch.Tensor | None = None,
        quantizer=None,
        fake_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._set_float8_buffers(
            data=data,
            fp8_scale_inv=fp8_scale_inv,
            fp8_dtype=fp8_dtype,
            data_transpose=data_transpose,
            quantizer=quantizer,
            fake_dtype=fake_dtype,
        )

    @classmethod
    def _from_cast(
        cls,
        *,
        data,
        transpose,
        scale_inv,
        fp8_dtype: DType,
        quantizer,
        fake_dtype,
        data_fp8=None,
        transpose_fp8=None,
    ):
        """A storage around buffers a quantizer's cast just produced (uint8 views of the right
        shapes, one device, a float32 ``[1]`` scale_inv): the checks of ``__init__`` are skipped,
        which matters on the linear layers' per-call path. ``data_fp8`` / ``transpose_fp8`` are
        the FP8-typed tensors the cast wrote (``data`` / ``transpose`` are their uint8 views):
        GEMMs get them without another view."""
        self = cls.__new__(cls)
        self._data = data
        self._transpose = transpose
        if data_fp8 is not None:
            self._data_fp8_view = (data, data_fp8)
        if transpose_fp8 is not None:
            self._transpose_fp8_view = (transpose, transpose_fp8)
        self._transpose_invalid = transpose is None
        self._scale_inv = scale_inv
        self._fp8_dtype = fp8_dtype
        self._quantizer = quantizer
        self._dtype = fake_dtype
        return self

    def _set_float8_buffers(
        self,
        *,
        data,
        fp8_scale_inv,
        fp8_dtype,
        data_transpose=None,
        quantizer=None,
        fake_dtype=torch.float32,
        shape=None,
    ) -> None:
        owner = type(self).__name__
        data = _as_uint8("data", data)
        data_transpose = _as_uint8("data_transpose", data_transpose)
        fp8 = DType.cast(to_torch_fp8_dtype(fp8_dtype))
        if fake_dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"{owner}: nominal dtype {fake_dtype!r} is not supported; use torch.float32, "
                "torch.float16 or torch.bfloat16"
            )
        check_float8_buffers(owner, data, data_transpose, fp8_scale_inv, shape)
        self._data = data
        self._transpose = data_transpose
        self._transpose_invalid = data_transpose is None
        self._scale_inv = scale_inv_on_device(fp8_scale_inv, data, data_transpose)
        self._fp8_dtype = fp8
        self._quantizer = quantizer
        self._dtype = fake_dtype

    def _replace_buffers(self, *, data, transpose, fp8_dtype: DType) -> None:
        """Take new (or rewritten) FP8 bytes in ``fp8_dtype`` after an in-place quantization."""
        if fp8_dtype != self._fp8_dtype:
            # Same buffers, other format: the typed views no longer describe them.
            self._forget_fp8_views()
        self._data = data
        self._transpose = transpose
        self._transpose_invalid = transpose is None
        self._fp8_dtype = fp8_dtype

    def _forget_fp8_views(self) -> None:
        # Instance attributes only where they were set: a Float8Tensor never sets them.
        self.__dict__.pop("_data_fp8_view", None)
        self.__dict__.pop("_transpose_fp8_view", None)

    def __getstate__(self) -> dict:
        # Pickles leave out the typed FP8 views: torch cannot unpickle two dtypes of one
        # storage ("'UntypedStorage' has no attribute 'dtype'" in pickle.loads), and
        # float8_gemm_input makes them again from the loaded bytes.
        state = dict(self.__dict__)
        state.pop("_data_fp8_view", None)
        state.pop("_transpose_fp8_view", None)
        return state

    # ------------------------------------------------------------------ geometry

    def size(self, *args, **kwargs):
        """Logical shape (``torch.Size``), or one dimension of it."""
        if self._data is not None:
            shape = self._data.shape
        elif self._transpose is not None:
            shape = _logical_shape_of_transpose(self._transpose)
        else:
            raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")
        return shape[args[0]] if args else shape[kwargs["dim"]] if "dim" in kwargs else shape

    @property
    def shape(self) -> torch.Size:
        """Logical shape."""
        return self.size()

    @property
    def device(self) -> torch.device:
        """Device of the FP8 buffers."""
        for t in (self._data, self._transpose, self._scale_inv):
            if t is not None:
                return t.device
        raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")

    # ------------------------------------------------------------------ values

    def _dequantize_plain(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._dtype if dtype is None else dtype
        fp8 = to_torch_fp8_dtype(self._fp8_dtype)
        if self.device.type == "meta":
            # Meta tensors carry shapes only; propagate the shape.
            return torch.empty(self.size(), dtype=dtype, device="meta")
        if self._data is not None:
            return ext.dequantize(self._data.view(fp8), self._scale_inv, dtype)
        if self._transpose is not None:
            values = ext.dequantize(self._transpose.view(fp8), self._scale_inv, dtype)
            return values if values.dim() == 0 else values.movedim(0, -1).contiguous()
        raise RuntimeError(f"{type(self).__name__} holds no buffers (cleared or saved)")

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values as a plain tensor: FP8 value * ``_scale_inv``, in ``dtype``.

        Parameters
        ----------
        dtype : torch.dtype, optional
            float32, float16 or bfloat16; defaults to the nominal dtype.
        """
        return self._dequantize_plain(dtype)

    # ------------------------------------------------------------------ GEMM operand

    def float8_gemm_input(
        self, columnwise: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The FP8 values and scale a GEMM reads, as plain torch tensors: ``(values, scale_inv)``.

        This is the FP8 operand interface of
        :func:`transformer_engine.pytorch.cpp_extensions.general_gemm`.

        Parameters
        ----------
        columnwise : bool
            ``False``: the row-wise values, in the logical shape. ``True``: the transposed
            copy, of shape ``(shape[-1], *shape[:-1])``.

        Returns
        -------
        values : torch.Tensor or None
            The requested layout typed as its torch FP8 dtype (``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2``; a view of the bytes, no copy), or ``None`` when this
            storage does not hold that layout.
        scale_inv : torch.Tensor
            One-element float32 ``1 / scale``: real value = FP8 value * ``scale_inv``.

        The typed view is kept next to the buffer it was made from (a quantizer's cast hands
        over the FP8 tensor it wrote), so a storage read by several GEMMs costs no view per
        GEMM; a replaced buffer is noticed by identity and viewed again.
        """
        if columnwise:
            buffer, cached = self._transpose, self._transpose_fp8_view
        else:
            buffer, cached = self._data, self._data_fp8_view
        if buffer is None:
            return None, self._scale_inv
        if cached is None or cached[0] is not buffer:
            cached = (buffer, buffer.view(to_torch_fp8_dtype(self._fp8_dtype)))
            if columnwise:
                self._transpose_fp8_view = cached
            else:
                self._data_fp8_view = cached
        return cached[1], self._scale_inv

    # ------------------------------------------------------------------ usages

    def get_usages(self) -> dict[str, bool]:
        """``{"rowwise": ..., "columnwise": ...}`` for the layouts present now."""
        rowwise = self._data is not None
        columnwise = self._transpose is not None
        if rowwise and is_non_tn_fp8_gemm_supported(self._data.device):
            columnwise = True
        return {"rowwise": rowwise, "columnwise": columnwise}

    def _create_transpose(self) -> None:
        if self._data is None:
            raise RuntimeError(
                f"{type(self).__name__}: cannot create the transposed copy, there is no "
                "row-wise data; quantize again with rowwise usage"
            )
        self._transpose = transpose_bytes(self._data)
        self._transpose_invalid = False

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Create the layouts that are required and delete those that are not.

        Parameters
        ----------
        rowwise_usage, columnwise_usage : bool, optional
            ``True``: the layout must be present afterwards; ``False``: drop it;
            ``None``: keep the current state.

        Raises
        ------
        RuntimeError
            Row-wise data is requested but only the transpose exists: FP8 data is
            never regenerated from the transpose; quantize again instead.
        ValueError
            The result would hold no layout at all.
        """
        owner = type(self).__name__
        # The usages present now (get_usages, inlined: the linear layers call this per GEMM
        # operand), with the device's layout rule asked once.
        data = self._data
        non_tn = data is not None and is_non_tn_fp8_gemm_supported(data.device)
        rowwise = data is not None if rowwise_usage is None else bool(rowwise_usage)
        if columnwise_usage is None:
            columnwise = self._transpose is not None or non_tn
        else:
            columnwise = bool(columnwise_usage)
        if not rowwise and not columnwise:
            raise ValueError(
                f"{owner}.update_usage: rowwise_usage and columnwise_usage would both be False, "
                "leaving no data; keep at least one (or call clear())"
            )
        if data is None:
            non_tn = is_non_tn_fp8_gemm_supported(self.device)
        need_data = rowwise or (columnwise and non_tn)
        need_transpose = columnwise and not non_tn
        if need_data and self._data is None:
            raise RuntimeError(
                f"{owner}.update_usage: row-wise data was requested but only the transposed copy "
                "exists, and FP8 data is not regenerated from the transpose; quantize the "
                "high-precision tensor again with rowwise usage"
            )
        if need_transpose and self._transpose is None:
            self._create_transpose()
        if not need_data:
            self._data = None
            # A dropped layout's view would keep its bytes alive (e.g. an input's row-wise
            # bytes, saved for backward only through its transposed copy).
            self.__dict__.pop("_data_fp8_view", None)
        if not need_transpose:
            self._transpose = None
            self._transpose_invalid = True
            self.__dict__.pop("_transpose_fp8_view", None)

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """``(_data, _transpose)``, or one of them when the other is not requested."""
        if rowwise_data and columnwise_data:
            return self._data, self._transpose
        if rowwise_data:
            return self._data
        if columnwise_data:
            return self._transpose
        raise ValueError("get_data_tensors: request rowwise_data and/or columnwise_data")

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the buffers)."""
        return {
            "data": self._data,
            "fp8_scale_inv": self._scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": self._transpose,
            "quantizer": self._quantizer,
            "fake_dtype": self._dtype,
        }

    # ------------------------------------------------------------------ saving, copying

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], Float8TensorStorage]:
        """Hand the buffers out as ``[_data, _transpose, _scale_inv]`` and drop them here."""
        tensors = [self._data, self._transpose, self._scale_inv]
        # The typed views share the buffers' memory: kept here they would hold the bytes past
        # a release of the saved tensors (and out of sight of saved-tensor hooks).
        self._forget_fp8_views()
        self._data = None
        self._transpose = None
        self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take ``[_data, _transpose, _scale_inv]`` from the front of ``tensors``; return the rest."""
        if len(tensors) < 3:
            raise ValueError(
                f"{type(self).__name__}.restore_from_saved: expected at least 3 tensors "
                f"([_data, _transpose, _scale_inv]), got {len(tensors)}"
            )
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        self._transpose_invalid = self._transpose is None
        return list(tensors[3:])

    def copy_from_storage(self, src: Float8TensorStorage) -> None:
        """Copy ``src``'s FP8 bytes and ``scale_inv`` into this object's buffers (same shape)."""
        if not isinstance(src, Float8TensorStorage):
            raise TypeError(
                f"copy_from_storage: src must be a Float8TensorStorage, got {type(src).__name__}"
            )
        if tuple(src.size()) != tuple(self.size()):
            raise ValueError(
                f"copy_from_storage: shapes differ ({tuple(src.size())} into {tuple(self.size())})"
            )
        data = transpose = None
        if self._data is not None:
            data = src._data if src._data is not None else untranspose_bytes(src._transpose)
        if self._transpose is not None:
            transpose = src._transpose if src._transpose is not None else transpose_bytes(src._data)
        if data is not None:
            self._data.copy_(data)
        if transpose is not None:
            self._transpose.copy_(transpose)
        self._scale_inv.copy_(src._scale_inv.reshape(self._scale_inv.shape))
        if src._fp8_dtype != self._fp8_dtype:
            self._forget_fp8_views()
        self._fp8_dtype = src._fp8_dtype

    def clear(self) -> None:
        """Release the FP8 bytes (``_scale_inv`` and the quantizer are kept)."""
        self._data = None
        self._transpose = None
        self._transpose_invalid = True
        self._forget_fp8_views()

    def view(self, shape) -> Float8TensorStorage:
        """Storage sharing the bytes with a new logical shape (transpose kept if still valid)."""
        if self._data is None:
            raise RuntimeError(
                f"{type(self).__name__}.view: only the transposed copy exists; a view needs "
                "row-wise data"
            )
        data = self._data.view(shape)
        transpose = None
        if (
            self._transpose is not None
            and data.dim() > 0
            and data.shape[-1] == self._data.shape[-1]
        ):
            transpose = self._transpose.view(ext.transposed_shape(data.shape))
        out = Float8TensorStorage(
            data=data,
            fp8_scale_inv=self._scale_inv,
            fp8_dtype=self._fp8_dtype,
            data_transpose=transpose,
            quantizer=self._quantizer,
            fake_dtype=self._dtype,
        )
        out._shares_scale_with_base = self._shares_scale_with_base
        return out

    def __repr__(self) -> str:
        scale_inv = (
            "None"
            if self._scale_inv is None or self._scale_inv.is_meta
            else f"{float(self._scale_inv.reshape(())):.6g}"
        )
        try:
            shape = tuple(self.size())
        except RuntimeError:
            shape = "cleared"
        return (
            f"{type(self).__name__}(shape={shape}, fp8_dtype={self._fp8_dtype.name}, "
            f"scale_inv={scale_inv}, dtype={self._dtype}, "
            f"usages={self.get_usages() if shape != 'cleared' else None})"
        )
