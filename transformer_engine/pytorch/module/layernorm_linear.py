"""``te.LayerNormLinear``: a LayerNorm or RMSNorm followed by ``y = x W^T + b``, with an FP8
GEMM inside ``te.autocast``.

The norm runs in high precision (float32 inside, output in the activation dtype); its output
is quantized by the GEMM like ``Linear``'s input, with the same quantizer slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .._tensor_parallel import divide, gather_from_sequence_parallel_region
from ..device import construction_device
from ..functional.linear import check_input_features
from ._fused_norm import (
    apply_norm,
    apply_norm_fp8,
    check_normalization,
    register_norm_parameters,
)
from ._gemm_setup import (
    InputGradientCast,
    claim_module_backward_update,
    gemm_weight,
    make_linear_config,
    quantize_output,
)
from ._linear_parameters import (
    check_features,
    check_single_process_arguments,
    linear_bias,
    linear_weight,
    register_linear_parameters,
)
from ._outputs import reshape_output, returned_bias
from ._quantizer_roles import gemm_quantizer_roles
from ._tensor_parallel_setup import (
    check_tensor_parallel_ready,
    configure_comm_overlap,
    configure_tensor_parallel,
    local_parameters_split,
    mark_partitioned,
    mark_sequence_parallel,
    parallel_gemm,
    reduce_split_amaxes,
)
from .base import TransformerEngineBaseModule, default_init_method

__all__ = ["LayerNormLinear"]

# Forward / backward quantizer slots of the GEMM (upstream's FP8FwdTensorIdx layout).
GEMM1_INPUT, GEMM1_WEIGHT, GEMM1_OUTPUT = 0, 1, 2
GRAD_OUTPUT1, GRAD_INPUT1 = 0, 1


class LayerNormLinear(TransformerEngineBaseModule):
    """Normalization followed by a linear layer, in FP8 inside ``te.autocast``.

    Parameters
    ----------
    in_features, out_features : int
    eps : float, default 1e-5
        Added to the variance (mean square for RMSNorm) in the norm.
    bias : bool, default True
    normalization : {"LayerNorm", "RMSNorm"}, default "LayerNorm"
    return_bias : bool, default False
        Return the bias *not* added, for a later fused add.
    return_layernorm_output : bool, default False
        Also return the norm's output (``(out, ln_out)`` or ``(out, bias, ln_out)``).
    return_layernorm_output_gathered : bool, default False
        Under sequence parallelism, return the norm's output gathered over the tensor-parallel
        ranks instead of this rank's slice.
    params_dtype : torch.dtype, optional
        Default ``torch.get_default_dtype()``.
    zero_centered_gamma : bool, default False
        ``layer_norm_weight`` starts at 0 and the norm scales by ``1 + layer_norm_weight``.
    device : str or torch.device, default "cuda"
        ``"cuda"`` is the current CUDA device; ``"meta"`` defers initialization.
    init_method : callable, optional
        Initializes the linear weight in place; default N(0, 0.023).
    parameters_split : tuple of str or dict, optional
        Register the linear weight (and bias) as several parameters ``<name>_weight``.
    fuse_wgrad_accumulation : bool, default False
        Accumulate the weight gradient into ``weight.main_grad`` (float32).
    name : str, optional
    tp_group, tp_size, parallel_mode, sequence_parallel
        Tensor parallelism, as ``Linear``'s (docs/modules.md), with ``parallel_mode`` None or
        ``"column"`` (``"row"`` raises ``NotImplementedError``, as upstream). Under sequence
        parallelism the norm runs on this rank's slice of the tokens and its output is
        all-gathered for the GEMM; the norm's parameters carry ``sequence_parallel=True``.
    get_rng_state_tracker
        The weight is initialized inside ``get_rng_state_tracker().fork()``.

    Comm-overlap arguments (``ub_*``, ``symmetric_ar_type``) are accepted for compatibility;
    values other than the defaults raise ``NotImplementedError`` naming the argument.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        init_method: Callable | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        configure_tensor_parallel(
            self, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        if parallel_mode == "row":
            raise NotImplementedError(
                "LayerNormLinear: parallel_mode='row' is not supported (as upstream): a "
                "row-parallel GEMM needs its input split along the features, which a norm over "
                "the whole hidden size cannot produce; use LayerNorm followed by a row-parallel "
                "Linear"
            )
        check_normalization("LayerNormLinear", normalization)
        check_single_process_arguments("LayerNormLinear", symmetric_ar_type=symmetric_ar_type)
        configure_comm_overlap(
            self, self.parallel_mode, ub_name, ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )  # fmt: skip
        check_features(in_features=in_features, out_features=out_features)
        if self.parallel_mode == "column":
            out_features = divide(out_features, self.tp_size, "out_features")
            parameters_split = local_parameters_split(
                "LayerNormLinear", parameters_split, self.tp_size
            )
        if not float(eps) >= 0:
            raise ValueError(f"eps={eps!r} must be non-negative")
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self._init_wgrad_store(delay_wgrad_compute, parameters_split)
        self.get_rng_state_tracker = get_rng_state_tracker
        params_dtype = params_dtype or torch.get_default_dtype()
        device = construction_device(type(self).__name__, device)
        register_norm_parameters(
            self, normalization, in_features, zero_centered_gamma, params_dtype, device
        )
        register_linear_parameters(
            self, in_features=in_features, out_features=out_features,
            parameters_split=parameters_split, bias=bias, params_dtype=params_dtype,
            device=device, init_method=init_method or default_init_method,
            fp8_meta_index=GEMM1_WEIGHT,
        )  # fmt: skip
        for prefix in (f"{n}_" if n else "" for n in self.sizes):
            mark_partitioned(self, f"{prefix}weight", 0)
            if bias and self.parallel_mode == "column":
                mark_partitioned(self, f"{prefix}bias", 0)
        for name in ("layer_norm_weight", "layer_norm_bias"):
            mark_sequence_parallel(self, name, self.sequence_parallel)
        self.reset_parameters(defer_init=device.type == "meta")

    # -- forward -------------------------------------------------------------------------------
    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list:
        """Per GEMM: forward ``[input, weight, None]``, backward ``[grad_output, None]``
        (``None``: a boundary slot), for a ``CustomRecipe`` factory."""
        names = [self.name or ""]
        return gemm_quantizer_roles("linear", names, fwd=fwd, num_quantizers=num_quantizers)

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool | None = False,
        fp8_grad: bool | None = False,
    ):
        """Norm, then GEMM.

        Returns ``out``, ``(out, bias)`` with ``return_bias``, ``(out, ln_out)`` with
        ``return_layernorm_output``, or ``(out, bias, ln_out)`` with both.
        """
        check_input_features("LayerNormLinear", inp, self.in_features, "in_features")
        with self.prepare_forward_ctx(inp, num_gemms=1) as inp:
            check_tensor_parallel_ready(self)
            dtype, fp8 = self.activation_dtype, self.fp8
            grad_cast = None
            if fp8 and fp8_grad:
                grad_cast = InputGradientCast(self.quantizers["scaling_bwd"][GRAD_INPUT1])
                inp = grad_cast.wrap(inp)
            if inp.dtype != dtype:
                inp = inp.to(dtype)
            weight = gemm_weight("LayerNormLinear", linear_weight(self), dtype, fp8)
            bias = linear_bias(self)
            gemm_bias = None if (bias is None or self.return_bias) else bias.to(dtype)
            config = make_linear_config(
                self, weight, is_first_microbatch,
                input_slot=GEMM1_INPUT, weight_slot=GEMM1_WEIGHT, grad_output_slot=GRAD_OUTPUT1,
                workspace_key="weight", in_features=self.in_features,
                out_features=self.out_features,
                main_grad_param=self.weight if "" in self.sizes else None,
            )  # fmt: skip
            config.wgrad_store = self.wgrad_store
            reduce_split_amaxes(
                self, config, input_split=False, grad_output_split=self.parallel_mode == "column"
            )
            needs_wgrad = torch.is_grad_enabled() and weight.requires_grad
            ln_fp8 = None
            if fp8 and self.tp_size == 1 and not self.return_layernorm_output:
                # The norm kernel writes the GEMM's FP8 input itself (no high-precision copy).
                ln_fp8 = apply_norm_fp8(self, inp, config, columnwise=needs_wgrad)
            ln_out = apply_norm(self, inp) if ln_fp8 is None else ln_fp8
            # lazily: the input usually requires grad, and the parameters are not walked
            completing = itertools.chain((inp,), self.parameters())
            update = claim_module_backward_update(config, completing)
            if grad_cast is not None:
                update = grad_cast.take_update(update)
            out = parallel_gemm(self, weight, ln_out, gemm_bias, config, update)
            if ln_fp8 is not None:
                out = reshape_output(out, (*inp.shape[:-1], out.shape[-1]))
            if fp8 and fp8_output:
                out = quantize_output(self.quantizers["scaling_fwd"][GEMM1_OUTPUT], out)
        outputs = (out,)
        if self.return_bias:
            outputs += (returned_bias(self, bias, dtype),)
        if self.return_layernorm_output:
            if self.return_layernorm_output_gathered and self.sequence_parallel:
                ln_out = gather_from_sequence_parallel_region(ln_out, self.tp_group)
            outputs += (ln_out,)
        return outputs[0] if len(outputs) == 1 else outputs
