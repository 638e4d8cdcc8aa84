"""``te.GroupedLinear``: ``num_gemms`` independent linear layers applied to consecutive row
groups of one input (the expert GEMMs of a mixture-of-experts layer).

Group ``i`` takes the next ``m_splits[i]`` rows of the input through ``weight{i}``/``bias{i}``
with its own quantizer slots (forward ``3i`` input, ``3i + 1`` weight; backward ``2i`` grad
output); the outputs are concatenated in group order.

Backward scale update: the groups' backward GEMMs are independent autograd nodes, and autograd
does not order them. The first FP8 module of an autocast region must update the backward
scales *after* every grad output of the region was quantized, so here no single group may
claim the region's first-module flag. The module reads the flag itself and, when it is the
first module, hooks the end of every group's backward node; the last group to finish runs
the update (once per backward pass; the countdown re-arms for a retained graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._tensor_parallel import divide
from ..device import construction_device, device_guard
from ..functional.linear import check_input_features
from ..quantization import BackwardScaleUpdate, claim_backward_update
from ..quantized_tensor import QuantizedTensor
from ._gemm_setup import gemm_weight, make_linear_config
from ._linear_function import linear
from ._linear_parameters import check_features, check_single_process_arguments
from ._outputs import returned_bias
from ._quantizer_roles import gemm_quantizer_roles
from ._tensor_parallel_setup import (
    check_tensor_parallel_ready,
    configure_tensor_parallel,
    mark_partitioned,
    mark_sequence_parallel,
    reduce_split_amaxes,
)
from .base import TransformerEngineBaseModule, default_init_method

__all__ = ["GroupedLinear"]


class _BackwardUpdateAfterAll:
    """Completes the region's backward scale update when the last of ``count`` autograd nodes
    (one per group GEMM; their order is autograd's) finished."""

    def __init__(self, count: int, update: BackwardScaleUpdate, device: torch.device) -> None:
        self.count, self.left, self.update, self.device = count, count, update, device

    def __call__(self, grad_inputs, grad_outputs) -> None:
        self.left -= 1
        if self.left == 0:
            self.left = self.count  # re-armed for a backward through a retained graph
            with device_guard(self.device):
                self.update.complete()


class _GradientInto(torch.autograd.Function):
    """Identity in forward; backward copies the gradient into a caller's buffer and hands that
    buffer on (``GroupedLinear(..., dgrad_out=...)``)."""

    @staticmethod
    def forward(ctx, tensor, buffer):  # noqa: D102
        ctx.buffer = buffer
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.buffer.copy_(grad), None


def _check_preallocated(inp, out_features: int, out, dgrad_out) -> None:
    """``out`` / ``dgrad_out`` must fit the call; checked before any state changes."""
    if out is not None:
        shape = (*inp.shape[:-1], out_features)
        dtype = (
            torch.get_autocast_dtype(inp.device.type)
            if torch.is_autocast_enabled(inp.device.type)
            else inp.dtype
        )
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
            raise ValueError(
                f"GroupedLinear: out has shape {tuple(getattr(out, 'shape', ()))}; this call "
                f"produces {shape}"
            )
        if out.dtype != dtype or out.device != inp.device:
            raise ValueError(
                f"GroupedLinear: out is {out.dtype} on {out.device}; this call produces {dtype} "
                f"on {inp.device}"
            )
        if out.requires_grad and out.is_leaf and torch.is_grad_enabled():
            raise ValueError(
                "GroupedLinear: out requires grad; pass a buffer that does not (the result is "
                "copied into it and stays in the autograd graph)"
            )
    if dgrad_out is not None:
        if (
            not isinstance(dgrad_out, torch.Tensor)
            or dgrad_out.shape != inp.shape
            or dgrad_out.dtype != inp.dtype
            or dgrad_out.device != inp.device
        ):
            raise ValueError(
                f"GroupedLinear: dgrad_out must be a {inp.dtype} tensor of shape "
                f"{tuple(inp.shape)} on {inp.device} (the input's), got "
                f"{getattr(dgrad_out, 'dtype', type(dgrad_out).__name__)} "
                f"{tuple(getattr(dgrad_out, 'shape', ()))} on {getattr(dgrad_out, 'device', None)}"
            )


class GroupedLinear(TransformerEngineBaseModule):
    """``num_gemms`` linear layers, each applied to its own group of input rows.

    Parameters
    ----------
    num_gemms : int
        Number of groups (and of weights ``weight0 .. weight{num_gemms-1}``).
    in_features, out_features : int
        Sizes of every group's layer.
    bias : bool, default True
        ``bias0 .. bias{num_gemms-1}``.
    return_bias : bool, default False
        Return ``(out, [bias0, ...])`` with the biases *not* added.
    params_dtype : torch.dtype, optional
        Default ``torch.get_default_dtype()``.
    device : str or torch.device, default "cuda"
        ``"cuda"`` is the current CUDA device; ``"meta"`` defers initialization.
    init_method : callable, optional
        Initializes each weight in place; default N(0, 0.023).
    fuse_wgrad_accumulation : bool, default False
        Accumulate each weight gradient into ``weight{i}.main_grad`` (float32).
    delay_wgrad_compute : bool, default False
        Backward leaves the weight-gradient GEMMs to :meth:`backward_dw`.
    save_original_input : bool, default False
        Keep the input in high precision for backward and quantize it again there (less
        memory when the FP8 transpose is larger than the input is worth keeping); only for
        stateless recipes (current scaling), refused under ``DelayedScaling``.
    name : str, optional
    tp_group, tp_size, parallel_mode, sequence_parallel
        Tensor parallelism as upstream has it for GroupedLinear (docs/modules.md, "Tensor
        parallelism"): ``parallel_mode="column"`` keeps ``out_features / tp_size`` rows of every
        weight on each rank, ``"row"`` keeps ``in_features / tp_size`` columns;
        ``in_features`` / ``out_features`` then hold the local sizes. The module runs no
        collective on the activations: the caller (a mixture-of-experts token dispatcher)
        gathers the tokens and reduces the row-parallel outputs, so ``sequence_parallel`` is
        only recorded. ``bias=True`` with ``tp_size > 1`` is refused (as upstream). Under
        current scaling the operands split over the ranks (a row-parallel input, a
        column-parallel output gradient) get their amax reduced over ``tp_group``.
    get_rng_state_tracker, rng_tracker_name
        Each weight is initialized inside ``get_rng_state_tracker().fork(rng_tracker_name)``.

    Comm-overlap and grouped-parameter arguments are accepted for compatibility; values other
    than the defaults raise ``NotImplementedError`` naming the argument.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
        init_method: Callable | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device="cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: str | None = None,
        use_grouped_tensor: bool | None = None,
    ) -> None:
        super().__init__(name=name)
        configure_tensor_parallel(
            self, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        check_single_process_arguments(
            "GroupedLinear", ub_overlap_rs=ub_overlap_rs, ub_overlap_ag=ub_overlap_ag,
            single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_bias,
            use_grouped_tensor=use_grouped_tensor,
        )  # fmt: skip
        check_features(num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        if bias and self.tp_size > 1:
            raise ValueError(
                f"GroupedLinear: bias=True with tp_size={self.tp_size} is not supported (as "
                "upstream): the tensor-parallel communication happens outside this module, so "
                "it cannot add a bias once; pass bias=False and add the bias after the reduction"
            )
        if self.parallel_mode == "column":
            out_features = divide(out_features, self.tp_size, "out_features")
        elif self.parallel_mode == "row":
            in_features = divide(in_features, self.tp_size, "in_features")
        # FP8 parameters are quantized during construction: the state needs every GEMM's slots.
        self._num_gemms = num_gemms
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self._init_wgrad_store(delay_wgrad_compute)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        params_dtype = params_dtype or torch.get_default_dtype()
        device = construction_device(type(self).__name__, device)
        init_method = init_method or default_init_method

        for i in range(num_gemms):
            w = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(w), init_fn=init_method, fp8_meta_index=3 * i + 1
            )
        for i in range(num_gemms):
            if bias:
                b = torch.empty(out_features, dtype=params_dtype, device=device)
                self.register_parameter(f"bias{i}", torch.nn.Parameter(b), init_fn=None)
            else:
                # No bias: an empty tensor, as upstream (no Parameter, not in the state dict).
                setattr(self, f"bias{i}", torch.empty(0, dtype=params_dtype, device=device))
        for i in range(num_gemms):  # upstream's partition attributes
            mark_partitioned(self, f"weight{i}", 1 if self.parallel_mode == "row" else 0)
            if bias and self.parallel_mode == "column":
                mark_partitioned(self, f"bias{i}", 0)
            elif bias and self.parallel_mode == "row":
                mark_sequence_parallel(self, f"bias{i}", self.sequence_parallel)
        self.reset_parameters(defer_init=device.type == "meta")

    # -- forward -------------------------------------------------------------------------------
    def _split_sizes(self, m_splits, rows: int) -> list[int]:
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dim() != 1 or m_splits.is_floating_point() or m_splits.is_complex():
                raise ValueError(
                    f"GroupedLinear: m_splits must be a 1-D integer tensor, got dtype "
                    f"{m_splits.dtype} and shape {tuple(m_splits.shape)}"
                )
            sizes = [int(m) for m in m_splits.tolist()]
        else:
            sizes = list(m_splits)
            for m in sizes:
                if isinstance(m, bool) or not isinstance(m, int):
                    raise ValueError(f"GroupedLinear: m_splits must hold ints, got {m_splits!r}")
        if len(sizes) != self.num_gemms:
            raise ValueError(
                f"GroupedLinear: m_splits has {len(sizes)} entries but num_gemms={self.num_gemms}"
            )
        if any(m < 0 for m in sizes):
            raise ValueError(f"GroupedLinear: m_splits must be non-negative, got {sizes}")
        if sum(sizes) != rows:
            raise ValueError(
                f"GroupedLinear: m_splits {sizes} sum to {sum(sizes)} but the input has {rows} "
                "rows (product of its leading dimensions)"
            )
        return sizes

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list:
        """Per GEMM: forward ``[input, weight, None]``, backward ``[grad_output, None]``
        (``None``: a boundary slot), for a ``CustomRecipe`` factory."""
        names = [self.name or ""] * (num_quantizers // (3 if fwd else 2))
        return gemm_quantizer_roles("grouped_linear", names, fwd=fwd, num_quantizers=num_quantizers)

    def forward(
        self,
        inp: torch.Tensor,
        m_splits,
        is_first_microbatch: bool | None = None,
        out: torch.Tensor | None = None,
        dgrad_out: torch.Tensor | None = None,
    ):
        """Apply group ``i``'s layer to the next ``m_splits[i]`` rows of ``inp``.

        ``m_splits`` is a list of ints or an integer tensor of shape ``(num_gemms,)``; it must
        sum to the number of input rows. Returns ``out`` (shape ``inp.shape[:-1] +
        (out_features,)``) or, with ``return_bias``, ``(out, [bias0, ...])``.

        ``out``: a preallocated output (that shape, the activation dtype, ``inp``'s device, not
        requiring grad) that receives the result and is returned; gradients flow through it.
        ``dgrad_out``: a preallocated buffer (``inp``'s shape, dtype and device) that receives
        the gradient with respect to ``inp`` in backward, and is what autograd hands on.
        Both are filled by a copy (the grouped GEMMs still write their own outputs).
        """
        if isinstance(inp, QuantizedTensor):
            raise TypeError("GroupedLinear: a quantized input is not supported; pass a tensor")
        check_input_features("GroupedLinear", inp, self.in_features, "in_features")
        sizes = self._split_sizes(m_splits, inp.numel() // self.in_features)
        _check_preallocated(inp, self.out_features, out, dgrad_out)
        if dgrad_out is not None and inp.requires_grad and torch.is_grad_enabled():
            inp = _GradientInto.apply(inp, dgrad_out)
        with self.prepare_forward_ctx(inp, num_gemms=self.num_gemms) as inp:
            check_tensor_parallel_ready(self, gathers_input=False)
            dtype, fp8 = self.activation_dtype, self.fp8
            if inp.dtype != dtype:
                inp = inp.to(dtype)
            groups = inp.reshape(-1, self.in_features).split(sizes, dim=0)
            weights = [
                gemm_weight("GroupedLinear", getattr(self, f"weight{i}"), dtype, fp8)
                for i in range(self.num_gemms)
            ]
            biases = [
                getattr(self, f"bias{i}").to(dtype) if self.use_bias else None
                for i in range(self.num_gemms)
            ]
            configs = [
                make_linear_config(
                    self,
                    weights[i],
                    is_first_microbatch,
                    input_slot=3 * i,
                    weight_slot=3 * i + 1,
                    grad_output_slot=2 * i,
                    workspace_key=f"weight{i}",
                    in_features=self.in_features,
                    out_features=self.out_features,
                    main_grad_param=getattr(self, f"weight{i}"),
                )  # fmt: skip
                for i in range(self.num_gemms)
            ]
            for config in configs:
                config.wgrad_store = self.wgrad_store
                reduce_split_amaxes(
                    self, config, input_split=self.parallel_mode == "row",
                    grad_output_split=self.parallel_mode == "column",
                )  # fmt: skip
            if self.save_original_input and fp8:
                self._check_save_original_input()
                for config in configs:
                    config.save_original_input = True
            # only a module whose backward runs may complete the region's update (a frozen
            # first module leaves it to the next)
            runs_backward = inp.requires_grad or any(p.requires_grad for p in self.parameters())
            claims = fp8 and torch.is_grad_enabled() and runs_backward
            update = claim_backward_update() if claims else None
            outs = [
                linear(weights[i], x, None if self.return_bias else biases[i], configs[i])
                for i, x in enumerate(groups)
            ]
            if update is not None:
                nodes = [o.grad_fn for o in outs if o.grad_fn is not None]
                if nodes:
                    hook = _BackwardUpdateAfterAll(len(nodes), update, inp.device)
                    for node in nodes:
                        node.register_hook(hook)
            result = torch.cat(outs, dim=0).reshape(*inp.shape[:-1], self.out_features)
            if out is not None:
                result = out.copy_(result)
        if self.return_bias:
            return result, [returned_bias(self, b) for b in biases]
        return result
