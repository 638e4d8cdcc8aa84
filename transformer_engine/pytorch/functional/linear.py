"""The linear core: ``y = x W^T + b`` in FP8 or high precision, as two plain functions.

:func:`linear_forward` computes the output and returns what the backward needs as a
:class:`LinearSaved`; :func:`linear_backward` turns that and the output gradient into the input,
weight and bias gradients. Neither records an autograd graph nor reads global state: the caller
(a module's autograd function, or a ``te.ops`` operation inside the fuser's) says which gradients
are needed, saves the tensors :meth:`LinearSaved.pack` hands it through its own
``save_for_backward``, and owns every decision about scale updates.

FP8 path (per-tensor scaling, Hopper-style TN GEMMs):

* forward: ``x`` is quantized with row-wise usage (and column-wise when the weight needs a
  gradient), ``W`` with row-wise usage (and column-wise when ``x`` needs a gradient), then the
  fprop GEMM ``y = x W^T`` (layout TN);
* backward: ``dy`` is quantized with both usages; dgrad ``dx = dy W`` (NN, uses ``W``'s
  transposed copy) and wgrad ``dW = dy^T x`` (NT, uses both transposed copies).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..cpp_extensions import hp_gemm_cpu
from ..cpp_extensions.gemm import fp8_gemm_prevalidated
from ..device import device_guard
from ..quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    prepare_for_saving,
    restore_from_saved,
)

__all__ = [
    "LinearConfig",
    "LinearSaved",
    "config_from_recipe",
    "linear_forward",
    "linear_backward",
    "check_input_features",
    "check_fp8_gemm_shapes",
    "run_deferred_wgrads",
]


@dataclass
class LinearConfig:
    """Everything the core needs besides the tensors."""

    fp8: bool = False
    input_quantizer: Any = None
    weight_quantizer: Any = None
    grad_output_quantizer: Any = None
    cached_weight: Any = None  # an already-quantized weight to use instead of casting
    cache_weight: Any = None  # callable receiving the quantized weight (is_first_microbatch=True)
    # with cached_weight: cast the weight into it again in place, this device flag as the cast's
    # no-op (make_graphed_callables' one graph for both values of is_first_microbatch)
    recast_flag: Any = None
    activation_dtype: torch.dtype = torch.float32
    fuse_wgrad_accumulation: bool = False
    accumulate_into_main_grad: bool = True
    main_grad_param: Any = None  # the Parameter whose main_grad the fused wgrad writes
    save_original_input: bool = False  # keep x in high precision; quantize it again in backward
    # x is an FP8 tensor a producer (the norm) wrote for this GEMM alone: the forward drops its
    # row-wise bytes after use, as it does with its own cast of x.
    input_produced: bool = False
    wgrad_store: Any = None  # a list: defer the weight-gradient GEMM to the module's backward_dw()
    backward_override: str | None = None  # the recipe's: None, "high_precision", "dequantized"
    fprop_split_accumulator: bool = False
    dgrad_split_accumulator: bool = True
    wgrad_split_accumulator: bool = True


def config_from_recipe(
    recipe, activation_dtype: torch.dtype, quantizers=(None, None, None), **options
) -> LinearConfig:
    """The :class:`LinearConfig` of one GEMM: high precision when ``recipe`` is ``None``, else FP8
    with ``quantizers`` = ``(input, weight, grad_output)`` and the recipe's GEMM settings (split
    accumulators per GEMM, ``backward_override``). ``options`` set the remaining fields."""
    config = LinearConfig(fp8=recipe is not None, activation_dtype=activation_dtype, **options)
    if recipe is None:
        return config
    config.input_quantizer, config.weight_quantizer, config.grad_output_quantizer = quantizers
    if hasattr(recipe, "fp8_gemm_fprop"):
        config.fprop_split_accumulator = recipe.fp8_gemm_fprop.use_split_accumulator
        config.dgrad_split_accumulator = recipe.fp8_gemm_dgrad.use_split_accumulator
        config.wgrad_split_accumulator = recipe.fp8_gemm_wgrad.use_split_accumulator
    config.backward_override = getattr(recipe, "backward_override", None)
    return config


def check_input_features(owner: str, inp: torch.Tensor, size: int, name: str) -> None:
    """Raise unless ``inp``'s last dimension is ``size``, naming the argument ``name`` that set it
    (a 0-d input has no last dimension and is refused too)."""
    if inp.dim() == 0:
        raise ValueError(
            f"{owner}: the input is 0-d; it needs a last dimension of {name}={size} features "
            f"(for one sample, shape ({size},))"
        )
    if inp.shape[-1] != size:
        raise ValueError(
            f"{owner}: the input's last dimension is {inp.shape[-1]} but {name}={size}"
        )


def check_fp8_gemm_shapes(in_features: int, out_features: int) -> None:
    """FP8 GEMMs need the layer's sizes to be multiples of 16 (each is the row length of an
    output of one of the three GEMMs). The token count is free: the weight-gradient GEMM reduces
    over it, and the FP8 GEMM zero-pads a reduction dimension that is not a multiple of 16."""
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if value % 16:
            raise ValueError(
                f"FP8 GEMMs need {name} to be a multiple of 16, got {value}; pad the layer or "
                "run it outside te.autocast"
            )


class LinearSaved:
    """What :func:`linear_backward` needs from one :func:`linear_forward`.

    ``x`` and ``w`` are the saved GEMM operands (``None`` when the gradient that needs them is not
    wanted); ``weight`` is the tensor the forward multiplied by (the placeholder gradient takes its
    shape). Before the caller's ``save_for_backward``, :meth:`pack` takes the tensors out (FP8
    storages split into their buffers, so activation checkpointing and saved-tensor hooks see
    them); :meth:`unpack` puts back what autograd returns. An FP8 weight copy is kept by
    reference instead: it may be a cached workspace that later microbatches reuse.
    """

    __slots__ = (
        "config",
        "x",
        "w",
        "weight",
        "inp_shape",
        "bias_requires_grad",
        "bias_dtype",
        "requantize_x",
        "high_precision_backward",
        "_x_storage",
    )

    def __init__(self, config, x, w, weight, inp_shape, bias, bias_requires_grad) -> None:
        self.config = config
        self.x, self.w, self.weight = x, w, weight
        self.inp_shape = inp_shape
        self.bias_requires_grad = bias_requires_grad
        self.bias_dtype = bias.dtype if bias is not None else None
        self.requantize_x = False  # save_original_input: x is saved in high precision
        self.high_precision_backward = False  # backward_override, or no FP8 at all
        self._x_storage = None

    def pack(self) -> tuple:
        """The tensors to hand to ``save_for_backward`` (they leave this object): first those
        of ``x`` (:meth:`input_tensor_count` of them), then the weight when it is saved as a
        tensor (an FP8 weight copy stays here by reference)."""
        if self.config.fp8 and not (
            self.high_precision_backward and self.config.backward_override == "high_precision"
        ):
            tensors, self._x_storage = prepare_for_saving(self.x)
            self.x = None
            return tuple(tensors)
        tensors = (self.x, self.w)
        self.x = self.w = None
        return tensors

    def input_tensor_count(self, packed: tuple) -> int:
        """How many of the tensors :meth:`pack` returned belong to ``x``."""
        return len(packed) if self._x_storage is not None else 1

    def release_unpacked(self) -> None:
        """Undo :meth:`unpack` once a backward is done with the operands: what it put back
        (``x``, an FP8 storage's buffers and the typed views the GEMMs made of them) would
        otherwise hold the forward's saved input for as long as the graph lives, i.e. into the
        next step's forward while the caller keeps the loss. The buffers stay autograd's: a
        second backward (``retain_graph=True``) unpacks them again. An FP8 weight copy is
        kept (it is not autograd's to give back)."""
        if self._x_storage is not None:
            for storage in self._x_storage:
                if storage is not None:
                    storage.prepare_for_saving()  # hands its buffers out, forgets its views
            self.x = None
        else:
            self.x = self.w = None
        weight = self.weight
        if not isinstance(weight, torch.nn.Parameter):
            # A copy the GEMM saw (cast under torch.autocast, concatenated QKV): only its shape,
            # dtype and device are read again, so a one-element stand-in keeps them.
            stand_in = torch.empty((), dtype=weight.dtype, device=weight.device)
            self.weight = stand_in.expand(weight.shape)

    def unpack(self, saved_tensors) -> None:
        """Put back the tensors :meth:`pack` took out (``ctx.saved_tensors``)."""
        if self._x_storage is not None:
            (self.x,) = restore_from_saved(self._x_storage, saved_tensors)
        else:
            self.x, self.w = saved_tensors


def _quantize(quantizer, tensor, *, rowwise: bool, columnwise: bool, with_dbias: bool = False):
    """``tensor`` in FP8, as internal storage; with ``with_dbias``, ``(FP8, bias gradient)`` from
    ``quantize_with_dbias_impl``."""
    # quantize_impl: no straight-through autograd wrapper, the caller owns the graph; and
    # internal storage (a plain object, not a tensor subclass) is much cheaper on the host.
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    internal, quantizer.internal = quantizer.internal, True
    try:
        if with_dbias:
            return quantizer.quantize_with_dbias_impl(tensor)
        return quantizer.quantize_impl(tensor)
    finally:
        quantizer.internal = internal


def _quantize_grad_output(quantizer, dy, *, rowwise: bool, columnwise: bool, with_dbias: bool):
    """``(dy in FP8, dbias or None)``: with the transposed copy (wgrad) the bias gradient comes
    out of the same pass over ``dy`` (``nvte_quantize_dbias``), saving a read of ``dy``."""
    if with_dbias and columnwise and hasattr(quantizer, "quantize_with_dbias_impl"):
        return _quantize(quantizer, dy, rowwise=rowwise, columnwise=columnwise, with_dbias=True)
    return _quantize(quantizer, dy, rowwise=rowwise, columnwise=columnwise), None


def _quantized_weight(weight, config: LinearConfig, columnwise: bool):
    """The weight as the FP8 GEMM takes it: an FP8 parameter or the cached workspace as it is
    (with the usages this call needs), else a fresh cast (handed to ``cache_weight``)."""
    if config.recast_flag is not None and config.cached_weight is not None:
        quantizer = config.weight_quantizer
        quantizer.set_usage(rowwise=True, columnwise=columnwise)
        quantizer.update_quantized(weight, config.cached_weight, noop_flag=config.recast_flag)
    if isinstance(weight, QuantizedTensor) or config.cached_weight is not None:
        w_q = weight if isinstance(weight, QuantizedTensor) else config.cached_weight
        # A plain tensor (an IdentityQuantizer's cached result) has no usages to set.
        if config.backward_override is None and isinstance(w_q, QuantizedTensorStorage):
            usages = w_q.get_usages()
            missing = not usages["rowwise"] or (columnwise and not usages["columnwise"])
            try:
                w_q.update_usage(rowwise_usage=True, columnwise_usage=columnwise or None)
            except RuntimeError:
                if w_q is weight or not missing:  # an FP8 parameter: nothing to cast again
                    raise
                # A copy cached without the layout this call needs (cast in a no-grad pass,
                # e.g. te.checkpoint's first one) that a block-scaled format cannot rebuild
                # from the other: cast the weight again (the same bytes: the weights have not
                # changed between microbatches) and cache that.
                w_q = None
        if w_q is not None:
            return w_q
    w_q = _quantize(config.weight_quantizer, weight, rowwise=True, columnwise=columnwise)
    if config.cache_weight is not None:
        config.cache_weight(w_q)
    return w_q


def linear_forward(
    weight: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    *,
    needs_dgrad: bool,
    needs_wgrad: bool,
    bias_requires_grad: bool = False,
    forward_gemm=None,
) -> tuple[torch.Tensor, LinearSaved]:
    """``inp @ weight^T + bias`` and what the backward needs.

    ``needs_dgrad`` / ``needs_wgrad`` say which gradients the backward will compute (both
    ``False``: inference, nothing is kept); ``bias_requires_grad`` whether it computes the bias
    gradient too. The output has ``inp``'s leading dimensions.

    ``forward_gemm(gemm, x)``: a tensor-parallel caller's GEMM pipelined with its collective
    (``_ring_gemm.PipelinedForward``), given the GEMM of some rows of the (quantized) input,
    ``gemm(rows, out=None)``; the output is then 2-D with the rows it returns.
    """
    in_features = weight.shape[-1]
    # An FP8 input a producer already quantized (a fused activation) comes as a 2-D storage.
    two_dim = len(inp.shape) == 2
    x = inp if two_dim else inp.reshape(-1, in_features)
    saved = LinearSaved(config, None, None, weight, inp.shape, bias, bias_requires_grad)
    if not config.fp8:
        if forward_gemm is None:
            out = hp_gemm_cpu.linear(x, weight, bias)
        else:
            out = forward_gemm(lambda rows, out=None: hp_gemm_cpu.linear(rows, weight, bias), x)
        saved.high_precision_backward = True
        saved.x = x if needs_wgrad else None
        saved.w = weight if needs_dgrad else None
    elif config.backward_override is not None:
        out = _forward_with_backward_override(
            saved, x, weight, bias, needs_dgrad, needs_wgrad, forward_gemm
        )
    else:
        owns_x_q = not isinstance(x, (QuantizedTensor, QuantizedTensorStorage))
        # save_original_input: backward re-quantizes the saved x (exact for stateless
        # recipes), so the forward needs no column-wise copy.
        keep_x = config.save_original_input and owns_x_q and needs_wgrad
        if not owns_x_q:
            x_q = x
            x_q.update_usage(rowwise_usage=True, columnwise_usage=needs_wgrad or None)
        else:
            x_q = _quantize(
                config.input_quantizer, x, rowwise=True, columnwise=needs_wgrad and not keep_x
            )
        w_q = _quantized_weight(weight, config, columnwise=needs_dgrad)
        if forward_gemm is None:  # (the hot path: no partial, no extra call)
            out = fp8_gemm_prevalidated(
                w_q,
                x_q,
                config.activation_dtype,
                layout="TN",
                bias=bias,
                use_split_accumulator=config.fprop_split_accumulator,
            )
        else:
            out = _fp8_forward_gemm(w_q, x_q, bias, config, forward_gemm)
        # Backward needs only the transposed copies; drop the row-wise input bytes (a plain
        # tensor an IdentityQuantizer returned serves both layouts and has none to drop).
        drops_x = owns_x_q or config.input_produced
        if needs_wgrad and drops_x and not keep_x and isinstance(x_q, QuantizedTensorStorage):
            x_q.update_usage(rowwise_usage=False, columnwise_usage=True)
        # Likewise the weight's row-wise bytes when this call cast it (an FP8 parameter or a
        # cached copy keeps both: later forwards read them).
        fresh_w = not isinstance(weight, QuantizedTensor) and config.cached_weight is None
        if (
            needs_dgrad
            and fresh_w
            and config.cache_weight is None
            and isinstance(w_q, QuantizedTensorStorage)
        ):
            w_q.update_usage(rowwise_usage=False, columnwise_usage=True)
        saved.requantize_x = keep_x
        saved.x = x if keep_x else x_q if needs_wgrad else None
        saved.w = w_q if needs_dgrad else None
    if not two_dim and forward_gemm is None:
        out = out.reshape(*inp.shape[:-1], weight.shape[0])
    return out, saved


def _fp8_forward_gemm(w_q, x_q, bias, config, forward_gemm):
    """The forward GEMM, through ``forward_gemm`` (see :func:`linear_forward`) when given."""
    gemm = functools.partial(
        fp8_gemm_prevalidated, w_q, out_dtype=config.activation_dtype, layout="TN", bias=bias,
        use_split_accumulator=config.fprop_split_accumulator,
    )  # fmt: skip
    return gemm(x_q) if forward_gemm is None else forward_gemm(gemm, x_q)


def _forward_with_backward_override(saved, x, weight, bias, needs_dgrad, needs_wgrad, overlap):
    """FP8 forward GEMM whose backward runs in high precision (``recipe.backward_override``).

    ``"high_precision"`` saves the original operands, ``"dequantized"`` saves the FP8 ones
    (dequantized in backward). Either way no column-wise FP8 copies are made.
    """
    config = saved.config
    x_q = (
        x
        if isinstance(x, (QuantizedTensor, QuantizedTensorStorage))
        else _quantize(config.input_quantizer, x, rowwise=True, columnwise=False)
    )
    w_q = _quantized_weight(weight, config, columnwise=False)
    out = _fp8_forward_gemm(w_q, x_q, bias, config, overlap)
    saved.high_precision_backward = True
    if config.backward_override == "high_precision":
        saved.x = x if needs_wgrad else None
        saved.w = weight if needs_dgrad else None
    else:  # "dequantized"
        saved.x = x_q if needs_wgrad else None
        saved.w = w_q if needs_dgrad else None
    return out


def linear_backward(
    saved: LinearSaved, grad_out, dbias_of_grad: torch.Tensor | None = None, communication=None
):
    """``(dx, dW, dbias)`` from a :func:`linear_forward`'s saved state (already unpacked).

    ``dx`` is computed when the forward was told ``needs_dgrad``, ``dW`` when ``needs_wgrad`` (with
    ``fuse_wgrad_accumulation`` it goes into ``main_grad`` and ``dW`` is ``None`` or Megatron's
    placeholder; with ``wgrad_store`` it is queued for ``backward_dw``), ``dbias`` when
    ``bias_requires_grad``. Runs on the caller's current device.

    ``grad_out`` may also be an FP8 storage of shape ``[tokens, out_features]`` that a fused
    producer (an activation's backward) already quantized with the grad-output quantizer, with
    the usages this backward reads (row-wise for dgrad, column-wise for wgrad); then the bias
    gradient, when needed, comes as ``dbias_of_grad`` (the producer's column sums).

    ``communication``: a tensor-parallel caller's collectives, overlapped with the GEMMs (see
    ``_parallel_backward.ColumnParallelBackward``): ``before_dgrad()`` right before the
    input-gradient GEMM (after the grad-output cast, whose amax reduction must not queue
    behind them), ``dgrad(gemm, grad)`` runs that GEMM (``gemm(rows, out=None)`` of some rows
    of the output gradient; it may pipeline it with a collective),
    ``before_wgrad()`` before ``saved.x`` is read, ``wgrad_operand(grad)`` gives the output
    gradient the weight gradient reads, ``dgrad_ready(dx)`` takes the input gradient (2-D)
    once the weight gradient's input is ready, before its GEMM. The input gradient is then
    left 2-D (the caller's ``communication.input_gradient`` shapes it).
    """
    config = saved.config
    prequantized = isinstance(grad_out, QuantizedTensorStorage) and not isinstance(
        grad_out, torch.Tensor
    )
    # Only whether x is saved matters before the weight gradient: a tensor-parallel caller may
    # still be gathering it (``communication``).
    has_x, saved_w = saved.x is not None, saved.w
    use_fp8 = config.fp8 and not saved.high_precision_backward
    if config.fp8 and saved.high_precision_backward:  # backward_override
        saved_w = _high_precision(saved_w, config.activation_dtype)
    if prequantized:
        if not use_fp8:
            raise TypeError(
                "linear_backward: a pre-quantized output gradient needs the FP8 backward of an "
                "FP8 forward without backward_override"
            )
        if saved.bias_requires_grad and dbias_of_grad is None:
            raise ValueError("linear_backward: pass the bias gradient with a quantized grad_out")
        dy, device = None, grad_out.device
    else:
        out_features = grad_out.shape[-1]
        dy = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, out_features)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        device = dy.device
    dx = dw = dbias = None
    weight = saved.weight
    fuse = config.fuse_wgrad_accumulation and has_x
    if fuse:
        # The GEMM may have seen a cast or concatenated copy: main_grad lives on the module's
        # Parameter.
        weight = config.main_grad_param if config.main_grad_param is not None else weight
        if getattr(weight, "main_grad", None) is None:
            raise RuntimeError(
                "fuse_wgrad_accumulation=True accumulates the weight gradient into "
                "weight.main_grad, but the weight has none; set weight.main_grad to a "
                "float32 tensor of the weight's shape before backward"
            )
    grad_operand = dy
    if prequantized:
        grad_operand, dbias = grad_out, dbias_of_grad
    if use_fp8 and (saved_w is not None or has_x):
        if not prequantized:
            grad_operand, dbias = _quantize_grad_output(
                config.grad_output_quantizer,
                dy,
                rowwise=saved_w is not None,
                columnwise=has_x,
                with_dbias=saved.bias_requires_grad,
            )
        if communication is not None:
            communication.before_dgrad()
        if saved_w is not None and communication is None:  # (the hot path: a direct call)
            dx = fp8_gemm_prevalidated(
                saved_w,
                grad_operand,
                config.activation_dtype,
                layout="NN",
                use_split_accumulator=config.dgrad_split_accumulator,
            )
        elif saved_w is not None:
            gemm = functools.partial(
                fp8_gemm_prevalidated, saved_w, out_dtype=config.activation_dtype,
                layout="NN", use_split_accumulator=config.dgrad_split_accumulator,
            )  # fmt: skip
            dx = communication.dgrad(gemm, grad_operand)
    else:
        if communication is not None:
            communication.before_dgrad()
        if saved_w is not None:
            if communication is None:
                dx = hp_gemm_cpu.matmul(dy, saved_w)
            else:
                dx = communication.dgrad(
                    lambda rows, out=None: hp_gemm_cpu.matmul(rows, saved_w), dy
                )
    saved_x = None
    if has_x:
        if communication is not None:
            communication.before_wgrad()
            grad_operand = communication.wgrad_operand(grad_operand)
        saved_x = _weight_gradient_input(saved, config)
    if communication is not None and dx is not None:
        communication.dgrad_ready(dx)
    if saved.bias_requires_grad:
        dbias = _as_dtype(dy.sum(dim=0) if dbias is None else dbias, saved.bias_dtype)
    if has_x:
        if config.wgrad_store is not None:
            # delay_wgrad_compute: the module's backward_dw() runs this later.
            config.wgrad_store.append(
                _DeferredWgrad(config, saved_x, grad_operand, weight, fuse, use_fp8, device)
            )
        else:
            dw = _weight_gradient(config, saved_x, grad_operand, weight, fuse, use_fp8)
    if dx is not None and communication is None and dx.shape != saved.inp_shape:
        dx = dx.reshape(saved.inp_shape)
    if dw is not None:
        dw = _as_dtype(dw, weight.dtype)
    elif fuse and config.wgrad_store is None:
        dw = _placeholder_wgrad(weight, saved.weight)
    return dx, dw, dbias


def _weight_gradient_input(saved: LinearSaved, config):
    """``saved.x`` as the weight-gradient GEMM reads it: cast to its transposed FP8 copy when
    the forward kept the original input (``save_original_input``), in high precision under
    ``backward_override``."""
    x = saved.x
    if saved.requantize_x:
        x = _quantize(config.input_quantizer, x, rowwise=False, columnwise=True)
    if config.fp8 and saved.high_precision_backward:
        x = _high_precision(x, config.activation_dtype)
    return x


def _high_precision(t, dtype):
    """A saved operand as a plain tensor of ``dtype`` (quantized ones are dequantized)."""
    if t is None:
        return None
    if isinstance(t, QuantizedTensorStorage):
        return t.dequantize(dtype=dtype)
    return _as_dtype(t, dtype)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it is already of that dtype (host time)."""
    return t if t.dtype == dtype else t.to(dtype)


def _weight_gradient(config, saved_x, grad_operand, weight, fuse, fp8):
    """``dW = dy^T x`` (FP8: layout NT on the transposed copies); with ``fuse`` it goes into
    ``weight.main_grad`` (float32) and ``None`` is returned."""
    if fp8:
        if fuse:
            fp8_gemm_prevalidated(
                saved_x,
                grad_operand,
                torch.float32,
                layout="NT",
                out=weight.main_grad,
                accumulate=config.accumulate_into_main_grad,
                use_split_accumulator=config.wgrad_split_accumulator,
            )
            return None
        return fp8_gemm_prevalidated(
            saved_x,
            grad_operand,
            config.activation_dtype,
            layout="NT",
            use_split_accumulator=config.wgrad_split_accumulator,
        )
    if fuse:
        update = grad_operand.t().float() @ saved_x.float()
        if config.accumulate_into_main_grad:
            weight.main_grad.add_(update)
        else:
            weight.main_grad.copy_(update)
        return None
    return hp_gemm_cpu.matmul(grad_operand.t(), saved_x)


def _placeholder_wgrad(param, gemm_weight):
    """What autograd gets for a weight whose gradient went into ``main_grad``.

    Megatron-LM's contract: a weight carrying ``grad_added_to_main_grad`` has it set to True,
    and autograd receives a placeholder gradient (zeros when the weight also carries
    ``zero_out_wgrad=True``, else uninitialized memory) so that gradient hooks on the weight
    still fire; any other weight gets None.
    """
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
    return make(gemm_weight.shape, dtype=gemm_weight.dtype, device=gemm_weight.device)


def run_deferred_wgrads(store: list | None) -> None:
    """``backward_dw()``: run the weight-gradient GEMMs backward queued, oldest first."""
    while store:
        store.pop(0)()


class _DeferredWgrad:
    """A weight-gradient GEMM postponed by ``delay_wgrad_compute`` (run by ``backward_dw``)."""

    def __init__(self, config, saved_x, grad_operand, weight, fuse, fp8, device):
        self.args = (config, saved_x, grad_operand, weight, fuse, fp8)
        self.device = device

    def __call__(self) -> None:
        config = self.args[0]
        target = config.main_grad_param
        # backward_dw() runs outside any backward: make the GEMM's device current.
        with device_guard(self.device):
            dw = _weight_gradient(*self.args)
            if dw is not None:
                dw = dw.to(target.dtype)
                target.grad = dw if target.grad is None else target.grad + dw
            elif hasattr(target, "grad_added_to_main_grad"):
                target.grad_added_to_main_grad = True  # Megatron-LM's flag (see above)
