"""``BasicLinear``: ``y = x W^T`` (no bias) on the functional linear core the modules share.

The forward and backward GEMMs (FP8 inside ``te.autocast``, high precision outside) are those
of ``functional/linear.py``; this operation only chooses the quantizers and dtypes, tells the
core which gradients the fuser needs, and keeps the core's saved state in its context.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from ..._sharded_parameters import (
    copy_whole_value_into_shard,
    empty_fp8_weight_on_meta,
    is_sharded_parameter,
    local_part,
    rebind_weight_quantizer,
)
from ...device import construction_device, materialization_device
from ...functional.linear import (
    check_fp8_gemm_shapes,
    check_input_features,
    config_from_recipe,
    linear_backward,
    linear_forward,
)
from ...quantization import FP8GlobalStateManager, QuantizerRole
from ...quantized_tensor import QuantizedTensor, QuantizedTensorStorage
from ...tensor.utils import QUANTIZED_TENSOR_ATTRIBUTES, attach_high_precision_init_val
from ..op import BasicOperation, OperationContext
from ._common import (
    activation_dtype,
    check_params_dtype,
    plain,
    quantize_weight_in_slot,
)
from ._linear_parallelism import LinearParallelism

__all__ = ["BasicLinear", "fusible_linear", "is_produced_input", "EVERY_PLACEMENT"]

# For fusions that run the linear's own forward and backward (its collectives included) and do
# their extra arithmetic outside its GEMMs: any tensor-parallel placement.
EVERY_PLACEMENT = ("column", "column+sp", "row", "row+sp")

# quantizer slots (upstream's layout): forward [input, weight], backward [grad_output]
_INPUT, _WEIGHT, _GRAD_OUTPUT = 0, 1, 0


class BasicLinear(BasicOperation):
    """Linear transform ``y = x W^T`` without bias.

    Parameters
    ----------
    in_features, out_features : int
    device : torch.device or str, optional
        Default: the current CUDA device when CUDA is available, else the CPU. ``"meta"``
        defers initialization to ``reset_parameters()`` or the first forward, which
        materializes onto the input's device.
    dtype : torch.dtype, optional
        Parameter dtype (float32, float16 or bfloat16); default ``torch.get_default_dtype()``.
    rng_state_tracker_function : callable, optional
        Returns an RNG tracker whose ``fork()`` the initialization runs in.
    accumulate_into_main_grad : bool, default False
        Accumulate the weight gradient into ``weight.main_grad`` (float32) instead of returning
        it.

    tensor_parallel_mode : {None, "column", "row"}, default None
        Split the weight over ``tensor_parallel_group``: ``"column"`` holds ``out_features / tp``
        output features (the input gradient is all-reduced), ``"row"`` holds
        ``in_features / tp`` input features (the output is all-reduced; add a bias after it).
        ``in_features`` and ``out_features`` are the whole layer's; ``local_in_features`` and
        ``local_out_features`` this rank's. Needs ``torch.distributed`` initialized.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
        Default: the world group.
    sequence_parallel : bool, default False
        With a mode and more than one rank: the input (column) or output (row) is split along
        dimension 0, all-gathered before a column GEMM (in FP8 under a per-tensor FP8 recipe)
        and reduce-scattered after a row GEMM, as ``te.Linear`` does.
    userbuffers_options : dict, optional
        ``{"comm_name": name}`` (``"qkv"``, ``"proj"``, ``"fc1"``, ``"fc2"``; after
        ``initialize_ub``): under sequence parallelism the GEMMs run chunk by chunk with their
        gathers and reduce-scatters, as the modules' ``ub_*`` flags do.

    Notes
    -----
    The weight starts like ``torch.nn.Linear``'s (Kaiming-uniform with ``a = sqrt(5)``). Under
    ``te.quantized_model_init`` it is an FP8 parameter quantized on its own device with this
    operation's weight quantizer. FP8 needs ``in_features`` and ``out_features`` to be
    multiples of 16; the token count is free.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group=None,
        sequence_parallel: bool = False,
        rng_state_tracker_function=None,
        accumulate_into_main_grad: bool = False,
        userbuffers_options=None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BasicLinear: {name}={value!r} must be a positive int")
        par = LinearParallelism(
            "BasicLinear", in_features, out_features, tensor_parallel_mode,
            tensor_parallel_group, sequence_parallel, userbuffers_options,
        )  # fmt: skip
        self._parallelism = par
        self.in_features = in_features
        self.out_features = out_features
        self.local_in_features = par.local_in_features
        self.local_out_features = par.local_out_features
        self.tensor_parallel_mode = tensor_parallel_mode
        self.tensor_parallel_group = tensor_parallel_group
        self.tensor_parallel_size = par.size
        self.sequence_parallel = par.sequence_parallel
        self._rng_state_tracker_function = rng_state_tracker_function
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self._with_quantized_weight = FP8GlobalStateManager.with_fp8_parameters()
        self._quantized_weight_recipe = (
            FP8GlobalStateManager.get_fp8_recipe() if self._with_quantized_weight else None
        )
        self._preserve_high_precision_init_val = (
            self._with_quantized_weight and FP8GlobalStateManager.with_high_precision_init_val()
        )
        dtype = check_params_dtype("BasicLinear", dtype)
        device = construction_device("BasicLinear", device)
        weight = torch.empty(
            par.local_out_features, par.local_in_features, dtype=dtype, device=device
        )
        if device.type == "meta" and self._with_quantized_weight:
            # per-tensor FP8 weights are Float8Tensors on meta already (FSDP2 sharding on meta)
            empty = empty_fp8_weight_on_meta(weight, self._quantized_weight_recipe)
            weight = weight if empty is None else empty
        self.weight = torch.nn.Parameter(weight)
        par.mark_weight(self.weight)
        if device.type != "meta":
            self.reset_parameters()

    # -- quantizers ------------------------------------------------------------------------------
    def num_quantizers(self, mode: str) -> int:
        return 2 if mode == "forward" else 1

    def get_quantizer_roles(self, mode: str) -> list | None:
        if mode == "forward":
            return [QuantizerRole("linear", "input"), QuantizerRole("linear", "weight")]
        return [QuantizerRole("linear", "grad_output")]

    def _on_recipe_state_change(self) -> None:
        quantizer = self.get_quantizer("forward", _WEIGHT)
        if quantizer is None:
            return
        self._parallelism.reduce_split_amaxes(
            self.get_quantizer("forward", _INPUT), self.get_quantizer("backward", _GRAD_OUTPUT)
        )
        # An FP8 weight re-quantizes (optimizer updates) with the op's current weight quantizer.
        weight = self.weight
        quantizer = quantizer.copy()
        quantizer.set_usage(rowwise=True, columnwise=True)
        rebind_weight_quantizer(weight, quantizer)  # FSDP2's shard or whole weight too

    def reset_recipe_state(self, *, recipe, device=None) -> None:  # noqa: D102
        weight_recipe = self._quantized_weight_recipe
        if (
            recipe is not None
            and isinstance(self.weight, QuantizedTensor)
            and type(recipe) is not type(weight_recipe)
        ):
            raise ValueError(
                f"BasicLinear: the FP8 weight was quantized for {type(weight_recipe).__name__} "
                f"(te.quantized_model_init) but te.autocast uses {type(recipe).__name__}; use "
                "the same recipe class for both"
            )
        super().reset_recipe_state(recipe=recipe, device=device)

    # -- parameters ------------------------------------------------------------------------------
    def _rng_context(self):
        if self._rng_state_tracker_function is None:
            return contextlib.nullcontext()
        return self._rng_state_tracker_function().fork()

    def reset_parameters(self, device=None) -> None:
        """(Re)initialize the weight (Kaiming-uniform, ``a = sqrt(5)``).

        Parameters
        ----------
        device : torch.device or str, optional
            Where a meta weight is materialized (default: the current CUDA device, else the
            CPU; the fuser passes the input's device). A weight that already has storage (e.g.
            after ``module.to_empty(device=...)``) is re-initialized in place, on its device,
            so optimizers holding it keep training it.

        Under ``te.quantized_model_init`` the weight becomes (or is re-quantized as) an FP8
        parameter, quantized on its device with this operation's weight quantizer, whose
        recipe state is made there first.
        """
        old = self.weight
        target = old.device if not old.is_meta else materialization_device(device)
        values = torch.empty(old.shape, dtype=old.dtype, device=target)
        with torch.no_grad(), self._rng_context():
            torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5))
        sharded = is_sharded_parameter(old)  # an FSDP2 shard: written in place, the whole value
        high_precision = None
        if self._with_quantized_weight:
            if self._preserve_high_precision_init_val:
                high_precision = (local_part(values, old) if sharded else values).cpu().clone()
            values = quantize_weight_in_slot(
                self, _WEIGHT, values, None if sharded else old, target
            )
        if sharded:
            copy_whole_value_into_shard(old, values)
        elif old.is_meta or isinstance(values, QuantizedTensor) is not isinstance(
            old, QuantizedTensor
        ):
            new = torch.nn.Parameter(values, requires_grad=old.requires_grad)
            for attr, value in vars(old).items():  # not a (meta) FP8 tensor's buffers
                if attr not in QUANTIZED_TENSOR_ATTRIBUTES and not isinstance(value, torch.Tensor):
                    setattr(new, attr, value)
            self.weight = new
        elif values is not old:
            with torch.no_grad():
                old.copy_(values)
        if high_precision is not None:
            attach_high_precision_init_val(self.weight, high_precision)

    # -- forward and backward --------------------------------------------------------------------
    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        return self.linear_forward(ctx, input_)

    def linear_forward(
        self, ctx: OperationContext, input_: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ W^T (+ bias)`` through the linear core; fills ``ctx`` for
        :meth:`op_backward`. A ``bias`` (used by fusions) gets no gradient here: its own
        operation computes that.

        ``input_`` may also be an FP8 storage (``Float8TensorStorage``) that a fused producer
        (``ForwardActivationCast``, ``ForwardNormCast``) wrote for this operation with its
        input quantizer, under FP8 only. The producer hands it over: after the GEMM its
        row-wise bytes are dropped when only the weight gradient reads it, as the core does
        with the inputs it casts itself."""
        produced = is_produced_input(input_)
        if produced:
            input_ = _check_produced_input(input_, self.local_in_features)
        else:
            label = "local in_features" if self._parallelism.active else "in_features"
            check_input_features("BasicLinear", input_, self.local_in_features, label)
        input_shape = input_.shape
        weight = self.weight
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        if produced and not fp8:
            raise RuntimeError(
                "BasicLinear: an FP8 input written by a fused producer reached it outside "
                "te.autocast; producers write FP8 only under an FP8 recipe"
            )
        dtype = activation_dtype(input_, weight)
        ctx.input_dtype = input_._dtype if produced else input_.dtype
        ctx.weight_dtype = weight.dtype
        if produced:
            # the core takes a producer's FP8 input as a 2-D storage
            input_ = input_ if len(input_shape) == 2 else input_.view((-1, input_shape[-1]))
        elif isinstance(input_, QuantizedTensor) and not fp8:
            input_ = input_.dequantize()
        if not produced and not isinstance(input_, QuantizedTensor) and input_.dtype != dtype:
            input_ = input_.to(dtype)

        gemm_weight = weight
        if isinstance(weight, QuantizedTensor) and not fp8:
            warnings.warn(
                "BasicLinear: an FP8 weight used outside te.autocast is dequantized", stacklevel=4
            )
            gemm_weight = weight.dequantize(dtype=dtype)
        elif not isinstance(weight, QuantizedTensor) and weight.dtype != dtype:
            gemm_weight = weight.to(dtype)

        needs_wgrad = ctx.requires_grad and weight.requires_grad
        quantizers = (None, None, None)
        recipe = None
        if fp8:
            check_fp8_gemm_shapes(self.local_in_features, self.local_out_features)
            quantizers = (
                self.get_quantizer("forward", _INPUT),
                self.get_quantizer("forward", _WEIGHT),
                self.get_quantizer("backward", _GRAD_OUTPUT),
            )
            recipe = self._fp8_metas["forward"]["recipe"]
        config = config_from_recipe(
            recipe,
            dtype,
            quantizers,
            fuse_wgrad_accumulation=self._accumulate_into_main_grad,
            main_grad_param=weight,
        )
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        par = self._parallelism
        if par.active and bias is not None and par.mode == "row":
            raise ValueError(
                "BasicLinear: a bias inside a row-parallel GEMM would be summed over the ranks; "
                "add it after the reduction (te.ops.Linear does)"
            )
        par.check_fp8(config, recipe)
        with torch.no_grad():
            gathered = par.gemm_input(input_, config, input_shape)
            full, leading, shard, forward_gemm, _ = gathered
            out, saved = linear_forward(
                gemm_weight,
                full,
                bias,
                config,
                needs_dgrad=ctx.input_requires_grad,
                # an FP8 shard is gathered again in backward for the weight gradient
                needs_wgrad=needs_wgrad and shard is None,
                forward_gemm=forward_gemm,
            )
            if produced and leading is None and forward_gemm is None and len(input_shape) != 2:
                out = out.reshape(*input_shape[:-1], out.shape[-1])
            out = par.finish_forward(ctx, saved, input_, input_shape, gathered, needs_wgrad, out)
        if produced and leading is None:
            if needs_wgrad:
                input_.update_usage(rowwise_usage=False, columnwise_usage=True)
            saved.inp_shape = input_shape  # the input gradient takes the producer's shape
        if ctx.requires_grad:
            ctx.save_for_backward(*saved.pack())
            ctx.linear_saved = saved
        return out

    def saved_state(self, ctx: OperationContext):
        """The forward's ``LinearSaved`` with its tensors back in place (unpacked once)."""
        saved = ctx.linear_saved
        if not getattr(ctx, "linear_unpacked", False):
            saved.unpack(ctx.saved_tensors)
            ctx.linear_unpacked = True
        return saved

    def release_saved(self, ctx: OperationContext) -> None:  # noqa: D102
        if getattr(ctx, "linear_unpacked", False):
            ctx.linear_saved.release_unpacked()
            ctx.linear_unpacked = False  # a second backward unpacks again

    def grad_output_layouts(self, ctx: OperationContext) -> tuple[bool, bool] | None:
        """``(rowwise, columnwise)``: the layouts of the FP8 output gradient this backward's
        GEMMs read (row-wise for dgrad, transposed for wgrad), or ``None`` when it takes no
        FP8 gradient (high precision, ``backward_override``, or neither GEMM runs). A fused
        producer (``BackwardActivationCast``) writes exactly these."""
        saved = self.saved_state(ctx)
        if not saved.config.fp8 or saved.high_precision_backward:
            return None
        if saved.w is None and saved.x is None:
            return None
        return saved.w is not None, saved.x is not None

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        """Also takes, as ``grad_output``, an FP8 storage a fused producer wrote with the
        forward's grad-output quantizer in :meth:`grad_output_layouts`, shaped
        ``[tokens, out_features]``."""
        grad_input, grad_weight, _ = self._backward(ctx, grad_output, None)
        return grad_input, [grad_weight]

    def backward_with_bias(self, ctx: OperationContext, grad_output: torch.Tensor, bias_ctx):
        """:meth:`op_backward` of a plain ``grad_output``, plus the gradient of the ``Bias``
        after this linear (its context ``bias_ctx``; ``None`` where it needs none), computed
        as ``te.Linear`` computes its own: in the pass that casts ``grad_output`` to FP8 when
        that pass writes the transposed copy, else as a sum. ``(grad_input, [grad_weight],
        grad_bias)``."""
        grad_input, grad_weight, grad_bias = self._backward(ctx, grad_output, bias_ctx)
        return grad_input, [grad_weight], grad_bias

    def _backward(self, ctx: OperationContext, grad_output, bias_ctx):
        saved = self.saved_state(ctx)
        # Set on every call (the forward asks for no bias gradient): a second backward of the
        # graph (retain_graph=True) runs the same way.
        saved.bias_requires_grad = bias_ctx is not None and bias_ctx.bias_requires_grad
        if saved.bias_requires_grad:
            saved.bias_dtype = bias_ctx.bias_dtype
        if not is_produced_input(grad_output):
            grad_output = plain(grad_output)
            if grad_output.dtype != saved.config.activation_dtype:
                grad_output = grad_output.to(saved.config.activation_dtype)
        par = self._parallelism
        grad_output, communication = par.backward_inputs(ctx, saved, grad_output)
        grad_input, grad_weight, grad_bias = linear_backward(
            saved, grad_output, None, communication
        )
        grad_input = par.input_gradient(ctx, grad_input, communication)
        if grad_input is not None and grad_input.dtype != ctx.input_dtype:
            grad_input = grad_input.to(ctx.input_dtype)
        if grad_weight is not None and grad_weight.dtype != ctx.weight_dtype:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_input, grad_weight, grad_bias


def fusible_linear(op, allow: tuple[str, ...] = ()) -> bool:
    """Whether ``op`` is a ``BasicLinear`` a fusion may take: any without tensor parallelism;
    with it, only the placements in ``allow`` (``"column"``, ``"column+sp"``, ``"row"``,
    ``"row+sp"``), those where the fusion leaves the operation's collectives as they are (a
    produced FP8 input cannot be all-gathered, a bias inside a row GEMM would be summed over
    the ranks, ...)."""
    return type(op) is BasicLinear and op._parallelism.placement in (None, *allow)


def is_produced_input(tensor) -> bool:
    """Whether ``tensor`` is an FP8 storage (no ``torch.Tensor`` wrapper): what fused producers
    hand a ``BasicLinear``; user tensors are plain or ``Float8Tensor``s."""
    return isinstance(tensor, QuantizedTensorStorage) and not isinstance(tensor, torch.Tensor)


def _check_produced_input(storage, in_features: int):
    shape = storage.shape
    if len(shape) == 0 or shape[-1] != in_features:
        raise ValueError(
            f"BasicLinear: the FP8 input a fused producer wrote has shape {tuple(shape)}; its "
            f"last dimension must be in_features={in_features}"
        )
    return storage
