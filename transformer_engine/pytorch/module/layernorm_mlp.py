"""``te.LayerNormMLP``: norm -> FC1 -> activation -> FC2, with FP8 GEMMs inside
``te.autocast``.

Quantizer slots (``num_gemms=2``: 6 forward, 4 backward): FC1 uses forward slots 0 (input) and
1 (weight) and backward slot 0 (GRAD_OUTPUT1); FC2 uses forward slots 3 and 4 and backward slot
2 (GRAD_OUTPUT2). The output slots 2 and 5 and the grad-input slots 1 and 3 stay unused.

FC1's backward runs after FC2's, so FC1's GEMM is the one that completes the autocast region's
backward scale update (when this module holds it), once both grad outputs were quantized.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from .._tensor_parallel import (
    copy_to_tensor_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
)
from ..device import construction_device
from ..functional.activation import get_activation, get_activation_spec
from ..functional.linear import check_input_features
from ._fused_norm import (
    apply_norm,
    apply_norm_fp8,
    check_normalization,
    register_norm_parameters,
)
from ._gemm_setup import claim_module_backward_update, gemm_weight, make_linear_config
from ._linear_function import linear
from ._linear_parameters import check_features, check_single_process_arguments
from ._mlp_function import fc1_activation_fc2
from ._outputs import reshape_output, returned_bias
from ._quantizer_roles import gemm_quantizer_roles
from ._tensor_parallel_setup import (
    check_tensor_parallel_ready,
    configure_comm_overlap,
    configure_tensor_parallel,
    mark_partitioned,
    mark_sequence_parallel,
    reduce_split_amaxes,
)
from .base import (
    TransformerEngineBaseModule,
    default_init_method,
)

__all__ = ["LayerNormMLP"]

GEMM1_INPUT, GEMM1_WEIGHT = 0, 1
GEMM2_INPUT, GEMM2_WEIGHT = 3, 4
GRAD_OUTPUT1, GRAD_OUTPUT2 = 0, 2


class LayerNormMLP(TransformerEngineBaseModule):
    """Normalization followed by a two-layer MLP, in FP8 inside ``te.autocast``.

    Parameters
    ----------
    hidden_size : int
        Input and output size.
    ffn_hidden_size : int
        Size of the activation between FC1 and FC2 (FC1 produces twice as much for the gated
        activations).
    eps : float, default 1e-5
    bias : bool, default True
        ``fc1_bias`` and ``fc2_bias``.
    normalization : {"LayerNorm", "RMSNorm"}, default "LayerNorm"
    activation : str, default "gelu"
        One of gelu, geglu, glu, qgelu, qgeglu, relu, reglu, srelu, sreglu, silu, swiglu,
        clamped_swiglu.
    activation_params : dict, optional
        ``clamped_swiglu`` only: ``limit`` (7.0), ``alpha`` (1.702), ``glu_linear_offset`` (1.0).
    init_method, output_layer_init_method : callable, optional
        Initialize ``fc1_weight`` and ``fc2_weight`` in place; default N(0, 0.023).
    return_bias : bool, default False
        Return ``fc2_bias`` *not* added, for a later fused add.
    return_layernorm_output : bool, default False
        Also return the norm's output.
    params_dtype : torch.dtype, optional
        Default ``torch.get_default_dtype()``.
    zero_centered_gamma : bool, default False
        ``layer_norm_weight`` starts at 0 and the norm scales by ``1 + layer_norm_weight``.
    device : str or torch.device, default "cuda"
        ``"cuda"`` is the current CUDA device; ``"meta"`` defers initialization.
    fuse_wgrad_accumulation : bool, default False
        Accumulate weight gradients into ``fc1_weight.main_grad`` / ``fc2_weight.main_grad``.
    checkpoint : bool, default False
        Selective recompute: FC1 and the activation keep no activations and are recomputed in
        backward (FC2 is not rerun), with the FP8 scales of the original forward.
    delay_wgrad_compute : bool, default False
        Backward leaves both weight-gradient GEMMs to :meth:`backward_dw`.
    name : str, optional
    tp_group, tp_size, set_parallel_mode, sequence_parallel
        Tensor parallelism (docs/modules.md): ``ffn_hidden_size`` is always divided by
        ``tp_size`` (as upstream); with ``set_parallel_mode=True`` FC1 is column-parallel and
        FC2 row-parallel (FC2's output all-reduced, or reduce-scattered along dim 0 under
        ``sequence_parallel``, where the norm runs on this rank's tokens and its output is
        all-gathered for FC1). Without ``set_parallel_mode`` no communication runs.
    get_rng_state_tracker
        The weights are initialized inside ``get_rng_state_tracker().fork()``.

    Comm-overlap arguments (``ub_*``, ``symmetric_ar_type``) are accepted for compatibility;
    values other than the defaults raise ``NotImplementedError`` naming the argument.
    ``seq_length`` and ``micro_batch_size`` only size comm-overlap buffers and are ignored.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Callable | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: dict | None = None,
        output_layer_init_method: Callable | None = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_overlap_ag: bool = False,
        name: str | None = None,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__(name=name)
        # FP8 parameters are quantized during construction: the state needs both GEMMs' slots.
        self._num_gemms = 2
        check_normalization("LayerNormMLP", normalization)
        self.activation_fn, self.is_glu = get_activation(
            "LayerNormMLP", activation, activation_params
        )
        self._activation_spec = get_activation_spec("LayerNormMLP", activation, activation_params)
        self._fused_activation_fn = self.activation_fn  # replaced by a user: no fused node
        configure_tensor_parallel(
            self, tp_group=tp_group, tp_size=tp_size,
            parallel_mode="column" if set_parallel_mode else None,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        check_single_process_arguments("LayerNormMLP", symmetric_ar_type=symmetric_ar_type)
        # upstream's fixed layer names: FC1 "fc1", FC2 "fc2"
        configure_comm_overlap(
            self, "mlp" if set_parallel_mode else None, "fc1", ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )  # fmt: skip
        check_features(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        ffn_hidden_size = divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size")
        if not float(eps) >= 0:
            raise ValueError(f"eps={eps!r} must be non-negative")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.fc1_out_features = 2 * ffn_hidden_size if self.is_glu else ffn_hidden_size
        self.eps, self.normalization = float(eps), normalization
        self.activation, self.activation_params = activation, activation_params
        self.zero_centered_gamma = zero_centered_gamma
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self._init_wgrad_store(delay_wgrad_compute)
        self.set_parallel_mode, self.checkpoint = set_parallel_mode, checkpoint
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.get_rng_state_tracker = get_rng_state_tracker
        params_dtype = params_dtype or torch.get_default_dtype()
        device = construction_device(type(self).__name__, device)

        register_norm_parameters(
            self, normalization, hidden_size, zero_centered_gamma, params_dtype, device
        )
        for layer, (rows, cols), init_fn, index in (
            ("fc1", (self.fc1_out_features, hidden_size), init_method, GEMM1_WEIGHT),
            ("fc2", (hidden_size, ffn_hidden_size), output_layer_init_method, GEMM2_WEIGHT),
        ):
            w = torch.empty(rows, cols, dtype=params_dtype, device=device)
            self.register_parameter(
                f"{layer}_weight", torch.nn.Parameter(w),
                init_fn=init_fn or default_init_method, fp8_meta_index=index,
            )  # fmt: skip
            if bias:
                b = torch.empty(rows, dtype=params_dtype, device=device)
                self.register_parameter(f"{layer}_bias", torch.nn.Parameter(b), init_fn=None)
            else:
                # No bias: an empty tensor, as upstream (no Parameter, not in the state dict).
                setattr(self, f"{layer}_bias", torch.empty(0, dtype=params_dtype, device=device))
        mark_partitioned(self, "fc1_weight", 0)
        mark_partitioned(self, "fc1_bias", 0)
        mark_partitioned(self, "fc2_weight", 1)
        for name in ("layer_norm_weight", "layer_norm_bias", "fc2_bias"):
            mark_sequence_parallel(self, name, self.sequence_parallel)
        self.reset_parameters(defer_init=device.type == "meta")

    # -- forward -------------------------------------------------------------------------------
    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list:
        """Per GEMM: forward ``[input, weight, None]``, backward ``[grad_output, None]``
        (``None``: a boundary slot), for a ``CustomRecipe`` factory."""
        names = [
            f"{self.name}.fc1" if self.name else "fc1",
            f"{self.name}.fc2" if self.name else "fc2",
        ]
        return gemm_quantizer_roles("linear", names, fwd=fwd, num_quantizers=num_quantizers)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """Norm, FC1, activation, FC2.

        Returns ``out``, ``(out, fc2_bias)`` with ``return_bias``, ``(out, ln_out)`` with
        ``return_layernorm_output``, or ``(out, fc2_bias, ln_out)`` with both.
        """
        check_input_features("LayerNormMLP", inp, self.hidden_size, "hidden_size")
        with self.prepare_forward_ctx(inp, num_gemms=2) as inp:
            check_tensor_parallel_ready(self)
            dtype, fp8 = self.activation_dtype, self.fp8
            if inp.dtype != dtype:
                inp = inp.to(dtype)
            parallel = self.set_parallel_mode and self.tp_size > 1
            # FC1's node (the fused body's, or FC1's own with a replaced activation) all-gathers
            # the norm output itself (in FP8 where the recipe allows); the recomputing path
            # (checkpoint=True) gathers it before FC1.
            body_gathers = (
                parallel
                and self.sequence_parallel
                and not (self.checkpoint and torch.is_grad_enabled())
            )
            # The fused body without parallelism takes FC1's FP8 input written by the norm
            # kernel itself (no high-precision copy of the norm's output).
            fuse_norm = (
                fp8
                and not parallel
                and not self.return_layernorm_output
                and self.activation_fn is self._fused_activation_fn
                and not (self.checkpoint and torch.is_grad_enabled())
            )
            ln_out = None if fuse_norm else apply_norm(self, inp)
            gemm_in = inp if fuse_norm else ln_out
            in_grad_group = None  # FC1's node all-reduces its input gradient over it
            if parallel and not body_gathers:  # FC1 is column-parallel: its input is whole
                if self.sequence_parallel:
                    gemm_in = gather_from_sequence_parallel_region(ln_out, self.tp_group)
                elif self.checkpoint and torch.is_grad_enabled():
                    gemm_in = copy_to_tensor_parallel_region(ln_out, self.tp_group)
                else:
                    in_grad_group = self.tp_group
            fc1_weight = gemm_weight("LayerNormMLP", self.fc1_weight, dtype, fp8)
            fc2_weight = gemm_weight("LayerNormMLP", self.fc2_weight, dtype, fp8)
            fc1_bias = self.fc1_bias.to(dtype) if self.use_bias else None
            fc2_bias = self.fc2_bias.to(dtype) if self.use_bias else None
            # Both configs before any GEMM: shape errors surface before work is done.
            fc1_config = make_linear_config(
                self, fc1_weight, is_first_microbatch,
                input_slot=GEMM1_INPUT, weight_slot=GEMM1_WEIGHT, grad_output_slot=GRAD_OUTPUT1,
                workspace_key="fc1_weight", in_features=self.hidden_size,
                out_features=self.fc1_out_features,
                main_grad_param=self.fc1_weight,
            )  # fmt: skip
            fc2_config = make_linear_config(
                self, fc2_weight, is_first_microbatch,
                input_slot=GEMM2_INPUT, weight_slot=GEMM2_WEIGHT, grad_output_slot=GRAD_OUTPUT2,
                workspace_key="fc2_weight", in_features=self.ffn_hidden_size,
                out_features=self.hidden_size,
                main_grad_param=self.fc2_weight,
            )  # fmt: skip
            fc1_config.wgrad_store = fc2_config.wgrad_store = self.wgrad_store
            # FC1's backward runs after FC2's: it completes the region's backward update (the
            # fused body's node holds every parameter; otherwise FC1's own node does).
            fused_body = self.activation_fn is self._fused_activation_fn and not (
                self.checkpoint and torch.is_grad_enabled()
            )
            # (lazily: the input usually requires grad, and the parameters are not walked)
            completing = (
                itertools.chain((inp,), self.parameters())
                if fused_body
                else (gemm_in, fc1_weight, fc1_bias)
            )
            update = claim_module_backward_update(fc1_config, completing)
            reduce_split_amaxes(self, fc1_config, input_split=False, grad_output_split=parallel)
            reduce_split_amaxes(self, fc2_config, input_split=parallel, grad_output_split=False)
            # Row-parallel FC2: its bias is added after the reduction, so it counts once.
            gemm_bias = None if (self.return_bias or parallel) else fc2_bias
            if fuse_norm:
                needs_wgrad = torch.is_grad_enabled() and fc1_weight.requires_grad
                ln_fp8 = apply_norm_fp8(self, inp, fc1_config, columnwise=needs_wgrad)
                gemm_in = apply_norm(self, inp) if ln_fp8 is None else ln_fp8
            # Under sequence parallelism FC2's node reduce-scatters its output and all-gathers
            # (in FP8 where the recipe allows) the output gradient.
            rs_group = self.tp_group if parallel and self.sequence_parallel else None
            if self.checkpoint and torch.is_grad_enabled():
                act_out = self._fc1_and_activation_recomputed(
                    gemm_in, fc1_weight, fc1_bias, fc1_config, update
                )
                out = linear(fc2_weight, act_out, gemm_bias, fc2_config, None, None, rs_group,
                             overlap=self.comm_overlap)  # fmt: skip
            elif self.activation_fn is self._fused_activation_fn:
                # One node for FC1, the activation and FC2: the fused activation writes FC2's
                # FP8 input, and its backward FC1's FP8 output gradient.
                out = fc1_activation_fc2(
                    gemm_in, fc1_weight, fc1_bias, fc2_weight, gemm_bias,
                    self._activation_spec, fc1_config, fc2_config, update,
                    self.tp_group if body_gathers else None, rs_group, in_grad_group,
                    self.comm_overlap,
                )  # fmt: skip
                if fuse_norm:
                    out = reshape_output(out, (*inp.shape[:-1], out.shape[-1]))
            else:  # activation_fn replaced by the user: call it
                act_out = self.activation_fn(
                    linear(fc1_weight, gemm_in, fc1_bias, fc1_config, update,
                           self.tp_group if body_gathers else None,
                           input_gradient_group=in_grad_group, overlap=self.comm_overlap)
                )  # fmt: skip
                out = linear(fc2_weight, act_out, gemm_bias, fc2_config, None, None, rs_group,
                             overlap=self.comm_overlap)  # fmt: skip
            if parallel:
                if not self.sequence_parallel:
                    out = reduce_from_tensor_parallel_region(out, self.tp_group)
                if fc2_bias is not None and not self.return_bias:
                    out = out + fc2_bias
        outputs = (out,)
        if self.return_bias:
            outputs += (returned_bias(self, fc2_bias),)
        if self.return_layernorm_output:
            if self.return_layernorm_output_gathered and self.sequence_parallel:
                ln_out = gather_from_sequence_parallel_region(ln_out, self.tp_group)
            outputs += (ln_out,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _fc1_and_activation_recomputed(self, ln_out, fc1_weight, fc1_bias, fc1_config, update):
        """``checkpoint=True``: FC1 and the activation keep none of their activations; backward
        recomputes them (FC2 is not rerun: its backward needs only its saved FP8 input).

        The recompute casts exactly like the original forward: with delayed scaling, the forward
        scales and amax history of that forward are swapped in for the recompute and the current
        ones put back afterwards, which also drops the amaxes the recompute accumulated (no amax
        is counted twice).
        """
        state = self._delayed_forward_state()
        snapshot = None if state is None else state.snapshot()
        runs = {"count": 0}

        def fc1_and_activation(x):
            runs["count"] += 1
            if runs["count"] == 1 or snapshot is None:
                return self.activation_fn(linear(fc1_weight, x, fc1_bias, fc1_config, update))
            current = state.snapshot()
            state.restore(snapshot)
            try:
                return self.activation_fn(linear(fc1_weight, x, fc1_bias, fc1_config, update))
            finally:
                state.restore(current)

        return torch.utils.checkpoint.checkpoint(fc1_and_activation, ln_out, use_reentrant=False)
