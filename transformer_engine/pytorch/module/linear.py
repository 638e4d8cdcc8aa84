"""``te.Linear``: ``y = x W^T + b`` with FP8 GEMMs inside ``te.autocast``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._tensor_parallel import divide
from ..device import construction_device
from ..functional.linear import check_input_features
from ._gemm_setup import (
    InputGradientCast,
    claim_module_backward_update,
    gemm_weight,
    make_linear_config,
    quantize_output,
)
from ._linear_function import linear
from ._linear_parameters import (
    check_features,
    check_single_process_arguments,
    linear_bias,
    linear_weight,
    register_linear_parameters,
)
from ._outputs import returned_bias
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

__all__ = ["Linear"]

# Forward / backward quantizer slots of the first GEMM (upstream's FP8FwdTensorIdx layout).
GEMM1_INPUT, GEMM1_WEIGHT, GEMM1_OUTPUT = 0, 1, 2
GRAD_OUTPUT1, GRAD_INPUT1 = 0, 1


class Linear(TransformerEngineBaseModule):
    """Linear layer ``y = x W^T + b``, in FP8 inside ``te.autocast``.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool, default True
    return_bias : bool, default False
        Return ``(out, bias)`` with the bias *not* added (for a later fused add).
    params_dtype : torch.dtype, optional
        Default ``torch.get_default_dtype()``.
    device : str or torch.device, default "cuda"
        ``"cuda"`` is the current CUDA device; ``"meta"`` defers initialization.
    init_method : callable, optional
        Initializes the weight in place; default N(0, 0.023).
    parameters_split : tuple of str or dict, optional
        Register the weight (and bias) as several parameters ``<name>_weight``.
    fuse_wgrad_accumulation : bool, default False
        Accumulate the weight gradient into ``weight.main_grad`` (float32).
    delay_wgrad_compute : bool, default False
        Backward leaves the weight-gradient GEMM to :meth:`backward_dw`.
    save_original_input : bool, default False
        Keep the input in high precision for backward and quantize it again there (stateless
        recipes only; refused under ``DelayedScaling``).
    name : str, optional
    tp_group, tp_size, parallel_mode, sequence_parallel
        Tensor parallelism (docs/modules.md, "Tensor parallelism"): ``parallel_mode="column"``
        keeps ``out_features / tp_size`` rows of the weight (and of the bias) on each rank,
        ``"row"`` keeps ``in_features / tp_size`` columns (the bias is whole);
        ``in_features`` / ``out_features`` then hold the local sizes. ``tp_size`` comes from
        ``tp_group`` when one is given; without one, call :meth:`set_tensor_parallel_group`
        before the forward. ``sequence_parallel`` (only with ``tp_size > 1``): the input of a
        column-parallel layer and the output of a row-parallel one are split along dimension 0.
    get_rng_state_tracker, rng_tracker_name
        The weight is initialized inside ``get_rng_state_tracker().fork(rng_tracker_name)``.

    ``forward(inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False)``: in FP8,
    ``fp8_output`` returns the output as a differentiable ``Float8Tensor`` and ``fp8_grad``
    hands the input's gradient back as a ``Float8Tensor`` (see docs/modules.md).

    Comm-overlap arguments (``ub_*``, ``symmetric_ar_type``) are accepted for compatibility;
    values other than the defaults raise ``NotImplementedError`` naming the argument.
    """

    def __init__(
        self,
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
        parameters_split=None,
        device="cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        save_original_input: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        configure_tensor_parallel(
            self, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        check_single_process_arguments("Linear", symmetric_ar_type=symmetric_ar_type)
        configure_comm_overlap(
            self, self.parallel_mode, ub_name, ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )  # fmt: skip
        check_features(in_features=in_features, out_features=out_features)
        if self.parallel_mode == "column":
            out_features = divide(out_features, self.tp_size, "out_features")
            parameters_split = local_parameters_split("Linear", parameters_split, self.tp_size)
        elif self.parallel_mode == "row":
            in_features = divide(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self._init_wgrad_store(delay_wgrad_compute, parameters_split)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        device = construction_device(type(self).__name__, device)
        register_linear_parameters(
            self, in_features=in_features, out_features=out_features,
            parameters_split=parameters_split, bias=bias,
            params_dtype=params_dtype or torch.get_default_dtype(), device=device,
            init_method=init_method or default_init_method, fp8_meta_index=GEMM1_WEIGHT,
        )  # fmt: skip
        self._mark_parallel_parameters()
        self.reset_parameters(defer_init=device.type == "meta")

    def _mark_parallel_parameters(self) -> None:
        """Upstream's attributes: every weight is partitioned along dim 0 (column, None) or 1
        (row); a column-parallel bias along dim 0; a row-parallel bias carries
        ``sequence_parallel`` (its gradient is a partial sum under sequence parallelism)."""
        prefixes = [f"{n}_" if n else "" for n in self.sizes]
        for prefix in prefixes:
            mark_partitioned(self, f"{prefix}weight", 1 if self.parallel_mode == "row" else 0)
            if not self.use_bias:
                continue
            if self.parallel_mode == "column":
                mark_partitioned(self, f"{prefix}bias", 0)
            elif self.parallel_mode == "row":
                mark_sequence_parallel(self, f"{prefix}bias", self.sequence_parallel)

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
        check_input_features("Linear", inp, self.in_features, "in_features")
        with self.prepare_forward_ctx(inp, num_gemms=1) as inp:
            check_tensor_parallel_ready(self)
            bias = linear_bias(self)
            dtype = self.activation_dtype
            fp8 = self.fp8
            weight = gemm_weight("Linear", linear_weight(self), dtype, fp8)
            grad_cast = None
            if fp8 and fp8_grad:
                grad_cast = InputGradientCast(self.quantizers["scaling_bwd"][GRAD_INPUT1])
                inp = grad_cast.wrap(inp)
            if inp.dtype != dtype:
                inp = inp.to(dtype)
            gemm_bias = None if (bias is None or self.return_bias) else bias.to(dtype)
            config = make_linear_config(
                self, weight, is_first_microbatch,
                input_slot=GEMM1_INPUT, weight_slot=GEMM1_WEIGHT, grad_output_slot=GRAD_OUTPUT1,
                workspace_key="weight", in_features=self.in_features,
                out_features=self.out_features,
                main_grad_param=self.weight if "" in self.sizes else None,
            )  # fmt: skip
            config.wgrad_store = self.wgrad_store
            if self.save_original_input and fp8:
                self._check_save_original_input()
                config.save_original_input = True
            reduce_split_amaxes(
                self, config, input_split=self.parallel_mode == "row",
                grad_output_split=self.parallel_mode == "column",
            )  # fmt: skip
            update = claim_module_backward_update(config, (inp, weight, gemm_bias))
            if grad_cast is not None:
                update = grad_cast.take_update(update)
            out = parallel_gemm(self, weight, inp, gemm_bias, config, update, gemm=linear)
            if fp8 and fp8_output:
                out = quantize_output(self.quantizers["scaling_fwd"][GEMM1_OUTPUT], out)
        if self.return_bias:
            return out, returned_bias(self, bias, dtype)
        return out
