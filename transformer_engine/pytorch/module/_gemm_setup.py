"""How the linear-family modules set up one GEMM: its ``LinearConfig`` (quantizer slots, weight
workspace, main_grad), the weight as the GEMM sees it, the claim on the backward scale update,
and the FP8 output / FP8 input-gradient options.

``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and ``GroupedLinear`` all run their GEMMs
through the functional linear core; what differs between them is only which quantizer slots
and which weight workspace each GEMM uses, and which GEMM's backward runs last (the one that
completes the region's backward scale update). Those differences are the keyword arguments of
:func:`make_linear_config`.
"""

from __future__ import annotations

import warnings

import torch

from ..functional.linear import LinearConfig, check_fp8_gemm_shapes, config_from_recipe
from ..quantization import BackwardScaleUpdate, FP8GlobalStateManager, claim_backward_update
from ..quantized_tensor import QuantizedTensor

__all__ = [
    "make_linear_config",
    "claim_module_backward_update",
    "gemm_weight",
    "quantize_output",
    "InputGradientCast",
]


def make_linear_config(
    module,
    weight: torch.Tensor,
    is_first_microbatch: bool | None,
    *,
    input_slot: int,
    weight_slot: int,
    grad_output_slot: int,
    workspace_key: str,
    in_features: int,
    out_features: int,
    main_grad_param: torch.Tensor | None = None,
) -> LinearConfig:
    """The ``LinearConfig`` of one GEMM of ``module`` in the current forward.

    Parameters
    ----------
    module : TransformerEngineBaseModule
        Inside ``prepare_forward_ctx``: its ``fp8``, ``activation_dtype``, quantizers and
        recipe are read, and its weight workspace is used for ``is_first_microbatch``.
    weight : torch.Tensor
        The weight the GEMM will use (a ``QuantizedTensor`` for FP8 parameters).
    is_first_microbatch : bool or None
        ``None``: quantize the weight every call. ``True``: quantize and cache it under
        ``workspace_key``. ``False``: reuse the cached copy. Also selects whether the weight
        gradient accumulates into ``main_grad`` (it does unless ``True``, or unless the weight
        carries ``overwrite_main_grad=True``).
    input_slot, weight_slot : int
        Forward quantizer slots of the GEMM's input and weight.
    grad_output_slot : int
        Backward quantizer slot of the GEMM's output gradient.
    workspace_key : str
        Key of the cached quantized weight (one per weight of the module).
    in_features, out_features : int
        The GEMM's reduction and output sizes (checked to be multiples of 16 in FP8).
    main_grad_param : torch.nn.Parameter, optional
        The parameter whose ``main_grad`` a fused weight-gradient GEMM writes.

    Raises
    ------
    ValueError
        In FP8, ``in_features`` or ``out_features`` not a multiple of 16 (see
        ``check_fp8_gemm_shapes``; the token count is free).
    """
    fp8 = module.fp8
    grad_param = main_grad_param if main_grad_param is not None else weight
    # Megatron's overwrite_main_grad: the wgrad GEMM writes main_grad instead of adding.
    overwrite = getattr(grad_param, "overwrite_main_grad", False)
    state = FP8GlobalStateManager.quantization_state
    in_graph = state.cached_weights_in_graph
    if in_graph is not None and module.fuse_wgrad_accumulation and not overwrite:
        in_graph.append(grad_param)  # the graph accumulates; a first microbatch zeroes first
    options = dict(
        fuse_wgrad_accumulation=module.fuse_wgrad_accumulation,
        accumulate_into_main_grad=not is_first_microbatch and not overwrite,
        main_grad_param=main_grad_param,
    )
    if not fp8:
        return config_from_recipe(None, module.activation_dtype, **options)
    check_fp8_gemm_shapes(in_features, out_features)
    fwd, bwd = module.quantizers["scaling_fwd"], module.quantizers["scaling_bwd"]
    config = config_from_recipe(
        module.fp8_meta["recipe"],
        module.activation_dtype,
        (fwd[input_slot], fwd[weight_slot], bwd[grad_output_slot]),
        **options,
    )
    if not isinstance(weight, QuantizedTensor):
        config.cached_weight, config.cache_weight, config.recast_flag = _cached_weight(
            module, workspace_key, is_first_microbatch, state.recast_flag_in_graph
        )
    return config


def _cached_weight(module, key: str, is_first_microbatch: bool | None, graph_flag) -> tuple:
    """``(cached, store, recast_flag)`` of a weight workspace (``module._fp8_workspaces``): the
    quantized weight to reuse (``None`` when there is none), a callable that stores a new one
    (``None`` without ``is_first_microbatch``), and ``graph_flag`` where one is given (while
    ``make_graphed_callables`` captures one graph for both values of ``is_first_microbatch``:
    ``graph_state.cast_cached_weights_in_graph``): the graph's flag under which it casts the
    weight into the workspace again (1.0: it stays)."""
    workspaces = module._fp8_workspaces
    if is_first_microbatch is None:
        workspaces.pop(key, None)
        return None, None, None
    store = lambda value: workspaces.__setitem__(key, value)  # noqa: E731
    cached = workspaces.get(key)
    if cached is not None and cached.device != module.parameters_device():
        del workspaces[key]  # stale: the weights moved since it was cached
        cached = None
    if cached is not None:
        if graph_flag is not None and graph_flag.device == cached.device:
            return cached, store, graph_flag
        if is_first_microbatch is False:
            return cached, store, None  # store: a cast again when it lacks a needed layout
    return None, store, None


def claim_module_backward_update(config: LinearConfig, tensors=()) -> BackwardScaleUpdate | None:
    """The region's backward scale update, if this module is the region's first FP8 module.

    Call it once per forward, for the GEMM whose backward runs last (FC1 in ``LayerNormMLP``),
    with ``tensors`` the inputs and parameters of the autograd node that will complete it. With
    a backward override nothing is quantized in backward, so there is nothing to update; and a
    node none of whose tensors requires grad never runs its backward (a frozen first layer
    under a trainable one): either way the first-module claim stays for a later module, which
    completes the update instead.
    """
    if (
        config.fp8
        and torch.is_grad_enabled()
        and config.backward_override is None
        and any(t is not None and t.requires_grad for t in tensors)
    ):
        return claim_backward_update()
    return None


def quantize_output(quantizer, out: torch.Tensor):
    """``fp8_output=True``: the GEMM's output as a ``Float8Tensor`` (the forward state's output
    slot). It stays in the autograd graph: the gradient passes through unchanged, in high
    precision (straight-through), so a model can train through an FP8 output."""
    return quantizer.quantize(out)


class _QuantizeGradient(torch.autograd.Function):
    """Identity in forward; in backward the gradient is handed on as a quantized tensor."""

    @staticmethod
    def forward(ctx, tensor, quantizer):  # noqa: D102
        ctx.quantizer = quantizer
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        quantizer = ctx.quantizer
        quantizer.set_usage(rowwise=True, columnwise=False)
        return quantizer.quantize_impl(grad), None


class _UpdateAtBackwardEnd:
    """A backward scale update that, completed by the GEMM's backward, runs at the end of that
    backward pass instead (autograd's queued callback): after every cast of the pass, the
    grad-input cast included, and also when the pass does not compute the input's gradient."""

    __slots__ = ("update",)

    def __init__(self, update: BackwardScaleUpdate) -> None:
        self.update = update

    def complete(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.update.complete)


class InputGradientCast:
    """``fp8_grad=True``: the module hands the gradient of its input back as a ``Float8Tensor``
    (nominal dtype the input's) cast by ``quantizer``, the backward state's grad-input slot.

    :meth:`wrap` puts the cast on the input (it runs after the module's own backward, for
    ``LayerNormLinear`` after the normalization's); :meth:`take_update` defers the region's
    backward scale update, if the module claimed it, to the end of the backward pass, so under
    delayed scaling the cast's amax counts in this step's update, as the other slots' do."""

    def __init__(self, quantizer) -> None:
        self.quantizer = quantizer
        self._wrapped = False

    def wrap(self, inp: torch.Tensor) -> torch.Tensor:
        if not inp.requires_grad or not torch.is_grad_enabled():
            return inp
        self._wrapped = True
        return _QuantizeGradient.apply(inp, self.quantizer)

    def take_update(self, update: BackwardScaleUpdate | None):
        """What the GEMM's backward completes in place of ``update``."""
        if not self._wrapped or update is None:
            return update
        return _UpdateAtBackwardEnd(update)


def gemm_weight(owner: str, weight: torch.Tensor, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    """The weight as a GEMM uses it.

    FP8 parameters are used as they are inside ``te.autocast`` and dequantized (with a warning)
    outside it; high-precision weights are cast to the activation dtype when they differ (under
    ``torch.autocast``).
    """
    if isinstance(weight, QuantizedTensor):
        if fp8:
            return weight
        warnings.warn(
            f"{owner}: FP8 weights used outside te.autocast are dequantized", stacklevel=3
        )
        return weight.dequantize(dtype=dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)
