"""``GroupedLinear``: ``num_groups`` independent linear layers applied to consecutive row groups
of one input (the expert GEMMs of a mixture-of-experts layer), as one basic operation.

Calling convention (upstream's): the split sizes are the operation's one *extra input*, an
integer tensor of shape ``(num_groups,)`` whose entries sum to the number of input rows
(product of the input's leading dimensions)::

    op = te.ops.GroupedLinear(4, 64, 48)
    y = op(x, split_sizes)                       # a tensor, or a list of ints (converted)
    y = te.ops.Sequential(norm, op, act)(x, split_sizes)   # extra inputs: tensors only
    y = OperationFuser([op])(x, split_sizes)     # likewise

Group ``i`` takes the next ``split_sizes[i]`` rows through ``weight{i}`` (and ``bias{i}``);
the outputs are concatenated in group order. Empty groups are allowed. The sizes are read on
the host (``tolist()``), so a CUDA tensor costs a synchronization: prefer a CPU tensor. The
split sizes get no gradient.

The GEMMs are those of the functional linear core (``functional/linear.py``), one per group, each with
its own quantizer slots (upstream's layout): forward ``2i`` input and ``2i + 1`` weight,
backward ``i`` grad output. No quantizer covers the whole input or the whole output gradient,
so :meth:`get_input_quantizer` and :meth:`get_grad_output_quantizer` are ``None`` and the
neighbouring operations hand this one plain tensors.

Backward scale update: the whole fuser is one autograd node, and its backward runs every
group's backward GEMMs before the fuser completes the region's backward update (when it holds
it), so (unlike the module, whose groups are separate autograd nodes) no ordering hook is
needed here.
"""

from __future__ import annotations

import contextlib
import math
import operator
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
    run_deferred_wgrads,
)
from ...quantization import FP8GlobalStateManager, QuantizerRole
from ...quantized_tensor import QuantizedTensor
from ...tensor.utils import QUANTIZED_TENSOR_ATTRIBUTES, attach_high_precision_init_val
from ..op import BasicOperation, OperationContext
from ._common import (
    activation_dtype,
    check_params_dtype,
    plain,
    quantize_weight_in_slot,
)

__all__ = ["GroupedLinear"]


def _input_slot(group: int) -> int:
    return 2 * group


def _weight_slot(group: int) -> int:
    return 2 * group + 1


def _grad_output_slot(group: int) -> int:
    return group


class GroupedLinear(BasicOperation):
    """``num_groups`` linear layers ``y_i = x_i W_i^T (+ b_i)``, group ``i`` applied to its own
    consecutive rows of the input.

    Parameters
    ----------
    num_groups : int
        Number of groups (and of weights ``weight0 .. weight{num_groups-1}``).
    in_features, out_features : int
        Sizes of every group's layer.
    bias : bool, default True
        Biases ``bias0 .. bias{num_groups-1}`` (initialized to zero); without them the
        attributes are ``None``.
    device : torch.device or str, optional
        Default: the current CUDA device when CUDA is available, else the CPU. ``"meta"``
        defers initialization to ``reset_parameters()`` or the first forward, which
        materializes onto the input's device.
    dtype : torch.dtype, optional
        Parameter dtype (float32, float16 or bfloat16); default ``torch.get_default_dtype()``.
    rng_state_tracker_function : callable, optional
        Returns an RNG tracker whose ``fork()`` the weight initialization runs in.
    accumulate_into_main_grad : bool, default False
        Accumulate each weight gradient into ``weight{i}.main_grad`` (float32) instead of
        returning it.

    delay_wgrad_compute : bool, default False
        Backward computes the input and bias gradients only; the weight-gradient GEMMs wait
        for :meth:`backward_dw` (into ``.grad``, or ``main_grad`` with
        ``accumulate_into_main_grad``), giving the same gradients.

    ``single_grouped_weight``, ``single_grouped_bias`` and ``scale_bias`` (experimental
    upstream) are accepted for compatibility; ``True`` raises ``NotImplementedError``.

    Notes
    -----
    Extra input: the split sizes (see the module docstring for the calling convention).
    Weights start like ``torch.nn.Linear``'s (Kaiming-uniform with ``a = sqrt(5)``), drawn in
    group order. Under ``te.quantized_model_init`` they are FP8 parameters, each quantized on
    its own device with its group's weight quantizer. FP8 needs ``in_features`` and
    ``out_features`` to be multiples of 16; the groups' row counts are free.
    """

    num_extra_inputs = 1

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        rng_state_tracker_function=None,
        accumulate_into_main_grad: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        scale_bias: bool = False,
    ) -> None:
        super().__init__()
        self.wgrad_store: list | None = [] if delay_wgrad_compute else None
        for name, value in (
            ("single_grouped_weight", single_grouped_weight),
            ("single_grouped_bias", single_grouped_bias),
            ("scale_bias", scale_bias),
        ):
            if value:
                raise NotImplementedError(f"GroupedLinear: {name}=True is not implemented yet")
        for name, value in (
            ("num_groups", num_groups),
            ("in_features", in_features),
            ("out_features", out_features),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GroupedLinear: {name}={value!r} must be a positive int")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bool(bias)
        self._rng_state_tracker_function = rng_state_tracker_function
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self._with_quantized_weight = FP8GlobalStateManager.with_fp8_parameters()
        self._quantized_weight_recipe = (
            FP8GlobalStateManager.get_fp8_recipe() if self._with_quantized_weight else None
        )
        self._preserve_high_precision_init_val = (
            self._with_quantized_weight and FP8GlobalStateManager.with_high_precision_init_val()
        )
        dtype = check_params_dtype("GroupedLinear", dtype)
        device = construction_device("GroupedLinear", device)
        # weights first, then biases: the order of parameters() and of the gradients
        for i in range(num_groups):
            weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
            if device.type == "meta" and self._with_quantized_weight:
                # per-tensor FP8 weights are Float8Tensors on meta already (FSDP2 on meta)
                empty = empty_fp8_weight_on_meta(weight, self._quantized_weight_recipe)
                weight = weight if empty is None else empty
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))
        for i in range(num_groups):
            b = None
            if self.use_bias:
                b = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
            self.register_parameter(f"bias{i}", b)
        if device.type != "meta":
            self.reset_parameters()

    def need_backward_dw(self) -> bool:
        """Whether weight gradients wait for :meth:`backward_dw` (``delay_wgrad_compute``)."""
        return self.wgrad_store is not None

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs that backward deferred, in order."""
        run_deferred_wgrads(self.wgrad_store)

    def weights(self) -> list[torch.nn.Parameter]:
        """The current ``weight0 .. weight{num_groups-1}`` (read now, never cached)."""
        return [getattr(self, f"weight{i}") for i in range(self.num_groups)]

    def biases(self) -> list[torch.nn.Parameter | None]:
        """The current ``bias0 ..`` (``None`` entries without biases)."""
        return [getattr(self, f"bias{i}") for i in range(self.num_groups)]

    # -- quantizers ------------------------------------------------------------------------------
    def num_quantizers(self, mode: str) -> int:
        return 2 * self.num_groups if mode == "forward" else self.num_groups

    def get_quantizer_roles(self, mode: str) -> list | None:
        if mode == "forward":
            roles = [QuantizerRole("grouped_linear", t) for t in ("input", "weight")]
            return roles * self.num_groups
        return [QuantizerRole("grouped_linear", "grad_output")] * self.num_groups

    def get_input_quantizer(self):
        # Each group quantizes its own rows with its own scale: a producer must not quantize
        # the whole input with group 0's quantizer.
        return None

    def get_grad_output_quantizer(self):
        return None

    def _on_recipe_state_change(self) -> None:
        # FP8 weights re-quantize (optimizer updates) with their group's current quantizer.
        for i, weight in enumerate(self.weights()):
            quantizer = self.get_quantizer("forward", _weight_slot(i))
            if quantizer is not None:
                quantizer = quantizer.copy()
                quantizer.set_usage(rowwise=True, columnwise=True)
                rebind_weight_quantizer(weight, quantizer)  # FSDP2's shard or whole weight too

    def reset_recipe_state(self, *, recipe, device=None) -> None:  # noqa: D102
        weight_recipe = self._quantized_weight_recipe
        if (
            recipe is not None
            and any(isinstance(w, QuantizedTensor) for w in self.weights())
            and type(recipe) is not type(weight_recipe)
        ):
            raise ValueError(
                f"GroupedLinear: the FP8 weights were quantized for "
                f"{type(weight_recipe).__name__} (te.quantized_model_init) but te.autocast uses "
                f"{type(recipe).__name__}; use the same recipe class for both"
            )
        super().reset_recipe_state(recipe=recipe, device=device)

    # -- parameters ------------------------------------------------------------------------------
    def _rng_context(self):
        if self._rng_state_tracker_function is None:
            return contextlib.nullcontext()
        return self._rng_state_tracker_function().fork()

    def reset_parameters(self, device=None) -> None:
        """(Re)initialize the weights (Kaiming-uniform, ``a = sqrt(5)``, in group order) and
        zero the biases.

        Parameters
        ----------
        device : torch.device or str, optional
            Where meta parameters are materialized (default: the current CUDA device, else the
            CPU; the fuser passes the input's device). Parameters that already have storage
            (e.g. after ``module.to_empty(device=...)``) are re-initialized in place, on their
            device, so optimizers holding them keep training them.

        Under ``te.quantized_model_init`` the weights become (or are re-quantized as) FP8
        parameters, each quantized on its device with its group's weight quantizer, whose
        recipe state is made there first.
        """
        for i in range(self.num_groups):
            self._reset_weight(i, device)
        for i in range(self.num_groups):
            self._reset_bias(i, device)

    def _reset_weight(self, group: int, device) -> None:
        name = f"weight{group}"
        old = getattr(self, name)
        target = old.device if not old.is_meta else materialization_device(device)
        values = torch.empty(old.shape, dtype=old.dtype, device=target)
        with torch.no_grad(), self._rng_context():
            torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5))
        sharded = is_sharded_parameter(old)  # an FSDP2 shard: written in place, the whole value
        high_precision = None
        if self._with_quantized_weight:
            if self._preserve_high_precision_init_val:
                high_precision = (local_part(values, old) if sharded else values).cpu().clone()
            slot = _weight_slot(group)
            values = quantize_weight_in_slot(self, slot, values, None if sharded else old, target)
        if sharded:
            copy_whole_value_into_shard(old, values)
        elif old.is_meta or isinstance(values, QuantizedTensor) is not isinstance(
            old, QuantizedTensor
        ):
            setattr(self, name, _replacement(old, values))
        elif values is not old:
            with torch.no_grad():
                old.copy_(values)
        if high_precision is not None:
            attach_high_precision_init_val(getattr(self, name), high_precision)

    def _reset_bias(self, group: int, device) -> None:
        name = f"bias{group}"
        old = getattr(self, name)
        if old is None:
            return
        if old.is_meta:
            values = torch.zeros(old.shape, dtype=old.dtype, device=materialization_device(device))
            setattr(self, name, _replacement(old, values))
        else:
            with torch.no_grad():
                old.zero_()

    # -- split sizes -----------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, split_sizes, **kwargs):
        """``op(input, split_sizes)``: ``split_sizes`` is an integer tensor of shape
        ``(num_groups,)`` or a list of ints (made a CPU int64 tensor here)."""
        if not isinstance(split_sizes, torch.Tensor):
            split_sizes = torch.tensor(self._check_split_list(split_sizes), dtype=torch.int64)
        return super().forward(input, split_sizes, **kwargs)

    def _check_split_list(self, split_sizes) -> list[int]:
        try:
            sizes = list(split_sizes)
        except TypeError:
            raise ValueError(
                f"GroupedLinear: the split sizes must be a 1-D integer tensor or a list of ints, "
                f"got {type(split_sizes).__name__}"
            ) from None
        ints = []
        for m in sizes:
            # any integer (operator.index): NumPy integers (iterating an array, e.g. of
            # np.bincount) and 0-d integer tensors were refused as "must be ints"
            try:
                if isinstance(m, bool):
                    raise TypeError
                ints.append(operator.index(m))
            except TypeError:
                raise ValueError(
                    f"GroupedLinear: the split sizes must be integers, got {sizes!r}; pass a "
                    "list of ints or an integer tensor"
                ) from None
        return ints

    def _split_sizes(self, split_sizes, rows: int) -> list[int]:
        if not isinstance(split_sizes, torch.Tensor):
            raise TypeError(
                f"GroupedLinear: the split sizes (its extra input) must be a 1-D integer "
                f"tensor, got {type(split_sizes).__name__}"
            )
        if (
            split_sizes.dim() != 1
            or split_sizes.is_floating_point()
            or split_sizes.is_complex()
            or split_sizes.dtype == torch.bool
        ):
            raise ValueError(
                f"GroupedLinear: the split sizes must be a 1-D integer tensor, got dtype "
                f"{split_sizes.dtype} and shape {tuple(split_sizes.shape)}"
            )
        sizes = [int(m) for m in split_sizes.tolist()]
        if len(sizes) != self.num_groups:
            raise ValueError(
                f"GroupedLinear: the split sizes have {len(sizes)} entries but "
                f"num_groups={self.num_groups}"
            )
        if any(m < 0 for m in sizes):
            raise ValueError(f"GroupedLinear: the split sizes must be non-negative, got {sizes}")
        if sum(sizes) != rows:
            raise ValueError(
                f"GroupedLinear: the split sizes {sizes} sum to {sum(sizes)} but the input has "
                f"{rows} rows (product of its leading dimensions)"
            )
        return sizes

    # -- forward and backward --------------------------------------------------------------------
    def op_forward(self, *args, **kwargs):
        raise RuntimeError("GroupedLinear runs through fuser_forward (it has an extra input)")

    def op_backward(self, *args, **kwargs):
        raise RuntimeError("GroupedLinear runs through fuser_backward (it has an extra input)")

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        ctx: OperationContext = basic_op_ctxs[0]
        (split_sizes,) = basic_op_extra_inputs[0]
        x = plain(input_)  # groups have their own scales: a quantized input is dequantized
        check_input_features("GroupedLinear", x, self.in_features, "in_features")
        sizes = self._split_sizes(split_sizes, x.numel() // self.in_features)
        weights, biases = self.weights(), self.biases()
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        dtype = activation_dtype(x, weights[0])
        ctx.input_dtype = x.dtype
        ctx.input_shape = x.shape
        ctx.sizes = sizes
        ctx.param_dtypes = (
            [w.dtype for w in weights],
            [None if b is None else b.dtype for b in biases],
        )
        if x.dtype != dtype:
            x = x.to(dtype)
        rows = x.reshape(-1, self.in_features)

        recipe = self._fp8_metas["forward"]["recipe"] if fp8 else None
        if fp8:
            check_fp8_gemm_shapes(self.in_features, self.out_features)
        outputs, states, to_save, counts = [], [], [], []
        for i, (group_rows, weight, bias) in enumerate(zip(rows.split(sizes), weights, biases)):
            needs_wgrad = ctx.requires_grad and weight.requires_grad
            quantizers = (None, None, None)
            if fp8:
                quantizers = (
                    self.get_quantizer("forward", _input_slot(i)),
                    self.get_quantizer("forward", _weight_slot(i)),
                    self.get_quantizer("backward", _grad_output_slot(i)),
                )
            config = config_from_recipe(
                recipe,
                dtype,
                quantizers,
                fuse_wgrad_accumulation=self._accumulate_into_main_grad,
                main_grad_param=weight,
                wgrad_store=self.wgrad_store,
            )
            with torch.no_grad():
                out, saved = linear_forward(
                    _gemm_weight(weight, dtype, fp8),
                    group_rows,
                    _gemm_bias(bias, dtype),
                    config,
                    needs_dgrad=ctx.input_requires_grad,
                    needs_wgrad=needs_wgrad,
                    bias_requires_grad=bias is not None and bias.requires_grad,
                )
            outputs.append(out)
            if ctx.requires_grad:
                tensors = saved.pack()
                counts.append(len(tensors))
                to_save.extend(tensors)
            states.append(saved)
        if ctx.requires_grad:
            ctx.save_for_backward(*to_save)
            ctx.group_states = states
            ctx.saved_counts = counts
            # a group whose weight is frozen, when the input needs no gradient, has no GEMM in
            # backward (only its bias gradient, if any)
            ctx.needs_gemm = [ctx.input_requires_grad or w.requires_grad for w in weights]
        output = torch.cat(outputs, dim=0)
        return output.reshape(*ctx.input_shape[:-1], self.out_features), [()]

    def release_saved(self, ctx: OperationContext) -> None:  # noqa: D102
        # the deferred weight gradients (backward_dw) still read the saved inputs
        if self.wgrad_store is None and getattr(ctx, "group_states", None):
            for state in ctx.group_states:
                state.release_unpacked()

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx: OperationContext = basic_op_ctxs[0]
        # a copy: the loop below lets go of each group's state when it is done, and a second
        # backward through this forward (retain_graph=True) unpacks them again from ctx
        states = list(ctx.group_states)
        saved_tensors, start = ctx.saved_tensors, 0
        for state, count in zip(states, ctx.saved_counts):
            state.unpack(saved_tensors[start : start + count])
            start += count
        dtype = states[0].config.activation_dtype
        dy = plain(grad_output)
        if dy.dtype != dtype:
            dy = dy.to(dtype)
        dy = dy.reshape(-1, self.out_features)

        weight_dtypes, bias_dtypes = ctx.param_dtypes
        grad_inputs, grad_weights, grad_biases = [], [], []
        for i, group_dy in enumerate(dy.split(ctx.sizes)):
            if ctx.needs_gemm[i]:
                dx, dw, dbias = linear_backward(states[i], group_dy)
            else:
                dw = dx = None
                dbias = group_dy.sum(dim=0) if states[i].bias_requires_grad else None
            states[i] = None  # free the group's saved operands as soon as it is done
            grad_inputs.append(dx)
            grad_weights.append(None if dw is None else dw.to(weight_dtypes[i]))
            grad_biases.append(None if dbias is None else dbias.to(bias_dtypes[i]))

        grad_input = None
        if ctx.input_requires_grad:
            grad_input = torch.cat([g.reshape(-1, self.in_features) for g in grad_inputs])
            grad_input = grad_input.reshape(ctx.input_shape).to(ctx.input_dtype)
        grads = {f"weight{i}": g for i, g in enumerate(grad_weights)}
        grads.update({f"bias{i}": g for i, g in enumerate(grad_biases)})
        grad_params = [grads[name] for name, _ in self.named_parameters(recurse=False)]
        return grad_input, [grad_params], [(None,)]


def _gemm_weight(weight, dtype: torch.dtype, fp8: bool):
    """The weight as the GEMM takes it: cast to the compute dtype (an FP8 weight outside
    ``te.autocast`` dequantized)."""
    if isinstance(weight, QuantizedTensor):
        if fp8:
            return weight
        warnings.warn(
            "GroupedLinear: an FP8 weight used outside te.autocast is dequantized", stacklevel=6
        )
        return weight.dequantize(dtype=dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _gemm_bias(bias, dtype: torch.dtype):
    """The bias in the compute dtype."""
    if bias is None or bias.dtype == dtype:
        return bias
    return bias.to(dtype)


def _replacement(old: torch.nn.Parameter, values) -> torch.nn.Parameter:
    """A new ``Parameter`` holding ``values`` with ``old``'s flag and plain attributes."""
    new = torch.nn.Parameter(values, requires_grad=old.requires_grad)
    for attr, value in vars(old).items():  # not a (meta) FP8 tensor's buffers
        if attr not in QUANTIZED_TENSOR_ATTRIBUTES and not isinstance(value, torch.Tensor):
            setattr(new, attr, value)
    return new
