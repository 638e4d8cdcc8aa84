"""``te.TransformerLayer``: self attention (and for decoders cross attention) followed by an MLP,
with residual connections, as one module; and ``DropPath`` (stochastic depth).

The attention blocks are :class:`MultiheadAttention`, the MLP is ``te.LayerNormMLP``: every
GEMM is a Transformer Engine module, so FP8 recipes apply inside ``te.autocast`` (see
docs/transformer_layer.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention.multi_head_attention import (
    MultiheadAttention,
    check_attention_mask,
    tensor_parallel_size,
)
from .device import construction_device, device_guard
from .module.layernorm import LayerNorm
from .module.layernorm_mlp import LayerNormMLP
from .module.rmsnorm import RMSNorm
from .utils import get_default_init_method

__all__ = ["TransformerLayer", "DropPath"]

LAYER_TYPES = ("encoder", "decoder")
ATTN_MASK_TYPES = (
    "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
    "padding_causal_bottom_right", "arbitrary",
)  # fmt: skip


def normalize_mask_type(owner: str, label: str, mask_type: str) -> str:
    """Upstream's spellings: ``,`` for ``_`` and ``causal_padding`` for ``padding_causal``."""
    if not isinstance(mask_type, str):
        raise ValueError(f"{owner}: {label}={mask_type!r} must be one of {ATTN_MASK_TYPES}")
    normalized = mask_type.replace(",", "_")
    if normalized == "causal_padding":
        normalized = "padding_causal"
    if normalized not in ATTN_MASK_TYPES:
        raise ValueError(f"{owner}: {label}={mask_type!r} must be one of {ATTN_MASK_TYPES}")
    return normalized


class DropPath(torch.nn.Module):
    """Stochastic depth: in training, zero a whole sample's branch with probability
    ``drop_prob`` and scale the kept ones by ``1 / (1 - drop_prob)``; identity in eval.

    Parameters
    ----------
    drop_prob : float, default 0.0
    batch_dim : int, default 0
        The dimension that indexes samples (1 for ``[s, b, h]`` inputs).
    """

    def __init__(self, drop_prob: float = 0.0, batch_dim: int = 0) -> None:
        super().__init__()
        if not 0.0 <= float(drop_prob) < 1.0:
            raise ValueError(f"DropPath: drop_prob={drop_prob!r} must be in [0, 1)")
        self.drop_prob, self.batch_dim = float(drop_prob), batch_dim

    def forward(self, hidden_state: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        """``cu_seqlens`` (packed ``[tokens, h]`` input): one draw per sequence."""
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep_prob = 1.0 - self.drop_prob
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
            keep = torch.rand(lengths.numel(), device=hidden_state.device) < keep_prob
            keep = torch.repeat_interleave(keep, lengths)
            # tokens past the last sequence (padding) are kept: they are ignored anyway
            pad = hidden_state.shape[0] - keep.numel()
            keep = (
                torch.cat([keep, keep.new_ones(pad)]) if pad > 0 else keep[: hidden_state.shape[0]]
            )
            shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        else:
            shape = [1] * hidden_state.dim()
            shape[self.batch_dim] = hidden_state.shape[self.batch_dim]
            keep = torch.rand(shape, device=hidden_state.device) < keep_prob
        return hidden_state * (keep.view(shape).to(hidden_state.dtype) / keep_prob)


class TransformerLayer(torch.nn.Module):
    r"""One transformer layer: attention, (cross attention,) MLP, with residual connections.

    Pre-LN (default): ``x = x + dropout(attn(ln(x)))``, then ``x = x + dropout(mlp(ln(x)))``.
    ``apply_residual_connection_post_layernorm``: the residuals are the norms' outputs instead.
    ``output_layernorm``: no norm before the self attention, one (``layernorm``) at the end.
    ``parallel_attention_mlp``: ``x + dropout(attn(x) + mlp(x))``. Decoders
    (``layer_type="decoder"``) add ``inter_attention`` (cross attention on
    ``encoder_output``) between the two.

    Parameters
    ----------
    hidden_size, ffn_hidden_size, num_attention_heads : int
    num_gqa_groups : int, optional
        Number of K/V heads (grouped-query attention); default ``num_attention_heads``.
    layernorm_epsilon : float, default 1e-5
    hidden_dropout, attention_dropout : float, default 0.1
        Dropout after each block (before the residual add) and on the attention weights.
    init_method, output_layer_init_method : callable, optional
        Initialize the input-side (QKV, FC1) and output-side (attention projection, FC2)
        weights; default N(0, 0.023) for both.
    layer_number : int, optional
        Position of the layer (> 0); keys its KV cache.
    kv_channels : int, optional
        Head size; default ``hidden_size // num_attention_heads``.
    self_attn_mask_type : str, default "causal"
    window_size, bottom_right_diagonal : optional
        Sliding window of the self attention.
    enc_dec_attn_mask_type : str, default "no_mask"
    enc_dec_bottom_right_diagonal, enc_dec_window_size : optional
        The same for the decoder's cross attention.
    params_dtype : torch.dtype, optional
    get_rng_state_tracker : callable, optional
    fuse_wgrad_accumulation : bool, default False
        Requires ``fuse_qkv_params=True`` (``ValueError`` otherwise).
    seq_length, micro_batch_size : int, optional
    apply_residual_connection_post_layernorm : bool, default False
    output_layernorm : bool, default False
    parallel_attention_mlp : bool, default False
        Encoder only; excludes the two options above.
    layer_type : {"encoder", "decoder"}, default "encoder"
    drop_path_rate : float, default 0.0
        Stochastic depth of the attention and MLP branches (``drop_path``).
    tp_group, tp_size : optional
        Tensor parallelism over ``tp_size`` ranks (the group's size when a group is given;
        without one, call :meth:`set_tensor_parallel_group` before the forward), handed to
        every child: heads and K/V groups are divided by ``tp_size`` and so is
        ``ffn_hidden_size``. ``tp_size > 1`` needs ``set_parallel_mode=True``.
    sequence_parallel : bool, default False
        With ``tp_size > 1``: the layer's input and output are split along the sequence
        dimension (dim 0 of sbhd; ``seq_length``, when given, is checked against it); norms,
        dropout and residual adds run on the local part, the column-parallel GEMMs gather it
        and the row-parallel ones reduce-scatter their outputs back.
    set_parallel_mode : bool, default False
        Makes the attention's QKV projection and FC1 column-parallel, its ``proj`` and FC2
        row-parallel; without tensor parallelism it changes nothing.
    fuse_qkv_params, rotary_pos_interleaved, zero_centered_gamma, qkv_weight_interleaved,
    bias, normalization, qk_norm_type, qk_norm_eps, qk_norm_before_rope, softmax_type
        As :class:`MultiheadAttention` (``bias`` and ``normalization`` also for the MLP).
    activation : str, default "gelu"
        gelu, geglu, glu, qgelu, qgeglu, relu, reglu, srelu, sreglu, silu, swiglu or
        clamped_swiglu (the gated ones double FC1's output).
    activation_params : dict, optional
        ``clamped_swiglu``'s ``limit``, ``alpha`` and ``glu_linear_offset``.
    device : str or torch.device, default "cuda"
        ``"meta"`` defers initialization to :meth:`reset_parameters`.
    attn_input_format : {"sbhd", "bshd", "thd"}, default "sbhd"
        ``[s, b, hidden]``, ``[b, s, hidden]`` or packed ``[tokens, hidden]``.
    name : str, optional

    ``ub_tp_comm_overlap=True`` (the ``ub_*`` options act only with it, after
    ``initialize_ub``) hands the ``ub_*`` flags to the attention and MLP blocks.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: bool | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        tp_group=None,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        get_rng_state_tracker: Callable | None = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: dict | None = None,
        normalization: str = "LayerNorm",
        device="cuda",
        attn_input_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        owner = "TransformerLayer"
        # Every ub_* option only acts together with ub_tp_comm_overlap (upstream ANDs them).
        on = bool(ub_tp_comm_overlap)
        ub = dict(
            ub_overlap_ag=on and ub_overlap_ag, ub_overlap_rs=on and ub_overlap_rs,
            ub_overlap_rs_dgrad=on and ub_overlap_rs_dgrad, ub_bulk_dgrad=on and ub_bulk_dgrad,
            ub_bulk_wgrad=on and ub_bulk_wgrad,
        )  # fmt: skip
        tp_size = tensor_parallel_size(owner, tp_group, tp_size)
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"{owner}: layer_type={layer_type!r} must be one of {LAYER_TYPES}")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(
                f"{owner}: fuse_wgrad_accumulation=True requires fuse_qkv_params=True; pass "
                "fuse_qkv_params=True"
            )
        if parallel_attention_mlp:
            if layer_type != "encoder":
                raise ValueError(
                    f"{owner}: parallel_attention_mlp=True needs layer_type='encoder', got "
                    f"{layer_type!r}"
                )
            if apply_residual_connection_post_layernorm or output_layernorm:
                raise ValueError(
                    f"{owner}: parallel_attention_mlp=True cannot be combined with "
                    "apply_residual_connection_post_layernorm or output_layernorm"
                )
        for label, p in (("hidden_dropout", hidden_dropout), ("drop_path_rate", drop_path_rate)):
            if not 0.0 <= float(p) < 1.0:
                raise ValueError(f"{owner}: {label}={p!r} must be in [0, 1)")
        self.self_attn_mask_type = normalize_mask_type(
            owner, "self_attn_mask_type", self_attn_mask_type
        )
        self.enc_dec_attn_mask_type = normalize_mask_type(
            owner, "enc_dec_attn_mask_type", enc_dec_attn_mask_type
        )

        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.layer_number, self.layer_type = layer_number, layer_type
        self.window_size, self.bottom_right_diagonal = window_size, bottom_right_diagonal
        self.enc_dec_window_size = enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.hidden_dropout = float(hidden_dropout)
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.output_layernorm = output_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.attn_input_format, self.name = attn_input_format, name
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.set_parallel_mode, self.seq_length = set_parallel_mode, seq_length
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.get_rng_state_tracker = get_rng_state_tracker
        params_dtype = params_dtype or torch.get_default_dtype()
        device = construction_device(owner, device)  # pinned once: every child agrees
        init_method = init_method or get_default_init_method()
        output_layer_init_method = output_layer_init_method or get_default_init_method()

        def child_name(suffix: str) -> str | None:
            return None if name is None else f"{name}.{suffix}"

        attention = dict(
            hidden_size=hidden_size, num_attention_heads=num_attention_heads,
            kv_channels=kv_channels, attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon, init_method=init_method,
            output_layer_init_method=output_layer_init_method, layer_number=layer_number,
            tp_group=tp_group, tp_size=tp_size, num_gqa_groups=num_gqa_groups,
            sequence_parallel=self.sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            get_rng_state_tracker=get_rng_state_tracker, params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
            zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved,
            rotary_pos_interleaved=rotary_pos_interleaved, bias=bias,
            normalization=normalization, device=device, qkv_format=attn_input_format,
            qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps,
            qk_norm_before_rope=qk_norm_before_rope, seq_length=seq_length,
            micro_batch_size=micro_batch_size, softmax_type=softmax_type, **ub,
        )  # fmt: skip
        self.self_attention = MultiheadAttention(
            **attention, input_layernorm=not output_layernorm, attention_type="self",
            attn_mask_type=self.self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            return_bias=not parallel_attention_mlp, name=child_name("self_attention"),
        )  # fmt: skip
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                **attention, input_layernorm=True, attention_type="cross",
                attn_mask_type=self.enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal, return_bias=True,
                name=child_name("inter_attention"),
            )  # fmt: skip
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, tp_group=tp_group,
            tp_size=tp_size, sequence_parallel=self.sequence_parallel,
            set_parallel_mode=set_parallel_mode,
            get_rng_state_tracker=get_rng_state_tracker, init_method=init_method,
            output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=not parallel_attention_mlp, params_dtype=params_dtype,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            zero_centered_gamma=zero_centered_gamma, activation=activation,
            activation_params=activation_params, normalization=normalization, device=device,
            name=child_name("layernorm_mlp"), **ub,
        )  # fmt: skip
        batch_dim = 1 if attn_input_format == "sbhd" else 0
        self.drop_path = DropPath(drop_path_rate, batch_dim) if drop_path_rate > 0.0 else None
        if output_layernorm:
            norm_class = RMSNorm if normalization == "RMSNorm" else LayerNorm
            self.layernorm = norm_class(
                hidden_size, eps=layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                device=device, dtype=params_dtype,
            )  # fmt: skip

    # -- parameters and groups -----------------------------------------------------------------
    def reset_parameters(self, defer_init: bool = False) -> None:
        """Materialize (from ``device="meta"``) and initialize every child's parameters."""
        if defer_init:
            return
        for child in self.children():
            if hasattr(child, "reset_parameters"):
                child.reset_parameters()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel group on every child (needed before the forward when built
        with ``tp_size > 1`` and no ``tp_group``)."""
        self.tp_group = tp_group
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)
            elif hasattr(child, "tp_group"):
                child.tp_group = tp_group

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Hand the context-parallel group to every attention block."""
        for child in self.children():
            if isinstance(child, MultiheadAttention):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def reset_fp8_meta_tensors(self) -> None:
        """Scales back to 1 and amax histories to 0 in every FP8 module of the layer."""
        with torch.no_grad():
            for module in self.modules():
                meta = getattr(module, "fp8_meta", None)
                if module is self or not isinstance(meta, dict):
                    continue
                for key in ("scaling_fwd", "scaling_bwd"):
                    state = meta.get(key)
                    delayed = state.delayed_scaling_state() if state is not None else None
                    if delayed is not None:
                        delayed.scale.fill_(1.0)
                        delayed.amax_history.zero_()

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        encoder_output: torch.Tensor | None = None,
        enc_dec_attn_mask=None,
        enc_dec_attn_mask_type: str | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        enc_dec_bottom_right_diagonal: bool | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb=None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: bool | None = None,
    ) -> torch.Tensor:
        """The layer on ``hidden_states`` (``attn_input_format``); returns the same shape.

        Self attention sees ``cu_seqlens_q`` / ``max_seqlen_q`` for both queries and keys; the
        ``*_kv`` arguments reach only a decoder's cross attention (with ``encoder_output``,
        ``enc_dec_attn_mask`` and ``enc_dec_attn_mask_type``). Under ``torch.autocast`` the
        input is cast to the autocast dtype first.
        """
        owner = type(self).__name__
        self_attn_mask_type = normalize_mask_type(
            owner, "self_attn_mask_type", self_attn_mask_type or self.self_attn_mask_type
        )
        enc_dec_attn_mask_type = normalize_mask_type(
            owner, "enc_dec_attn_mask_type", enc_dec_attn_mask_type or self.enc_dec_attn_mask_type
        )
        check_attention_mask(owner, attention_mask, self_attn_mask_type)
        if self.layer_type == "decoder":
            check_attention_mask(owner, enc_dec_attn_mask, enc_dec_attn_mask_type)
            if encoder_output is None:
                raise ValueError(f"{owner}: layer_type='decoder' needs encoder_output")
        if window_size is None:
            window_size = self.window_size
        if enc_dec_window_size is None:
            enc_dec_window_size = self.enc_dec_window_size
        if self.sequence_parallel and self.seq_length is not None:
            local = self.seq_length // self.tp_size
            if hidden_states.shape[0] != local:
                raise ValueError(
                    f"{owner}: under sequence parallelism hidden_states must hold this rank's "
                    f"seq_length // tp_size = {self.seq_length} // {self.tp_size} = {local} "
                    f"positions along dim 0, got shape {tuple(hidden_states.shape)}"
                )
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))

        with device_guard(hidden_states.device):
            shared = dict(
                is_first_microbatch=is_first_microbatch,
                checkpoint_core_attention=checkpoint_core_attention,
                inference_params=inference_params, core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs,
            )  # fmt: skip
            attention_outputs = self.self_attention(
                hidden_states, attention_mask=attention_mask, attn_mask_type=self_attn_mask_type,
                window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                rotary_pos_emb=rotary_pos_emb, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded,
                cu_seqlens_kv_padded=cu_seqlens_q_padded, max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_q, **shared,
            )  # fmt: skip
            drop_cu = cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q
            if self.attn_input_format != "thd":
                drop_cu = None
            if self.parallel_attention_mlp:
                attention_output = attention_outputs  # bias already added (no return_bias)
            else:
                if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
                    out, out_bias, residual = attention_outputs
                else:
                    (out, out_bias), residual = attention_outputs, hidden_states
                hidden_states = self._bias_dropout_add(out, out_bias, residual, drop_cu, True)

            if self.layer_type == "decoder":
                cross_outputs = self.inter_attention(
                    hidden_states, attention_mask=enc_dec_attn_mask,
                    attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                    bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                    encoder_output=encoder_output, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                    cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q,
                    max_seqlen_kv=max_seqlen_kv, **shared,
                )  # fmt: skip
                if self.apply_residual_connection_post_layernorm:
                    out, out_bias, residual = cross_outputs
                else:
                    (out, out_bias), residual = cross_outputs, hidden_states
                hidden_states = self._bias_dropout_add(out, out_bias, residual, drop_cu, False)

            mlp_outputs = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
            if self.parallel_attention_mlp:
                output = self._bias_dropout_add(
                    attention_output, mlp_outputs, hidden_states, drop_cu, True
                )
            else:
                if self.apply_residual_connection_post_layernorm:
                    out, out_bias, residual = mlp_outputs
                else:
                    (out, out_bias), residual = mlp_outputs, hidden_states
                output = self._bias_dropout_add(out, out_bias, residual, drop_cu, True)
            if self.output_layernorm:
                output = self.layernorm(output)
        return output

    def _bias_dropout_add(self, out, bias, residual, cu_seqlens, drop_path: bool):
        """``residual + drop_path(dropout(out + bias))`` (drop path on self attention and MLP
        branches only, as upstream)."""
        # A layer without biases hands back None or, as upstream's modules do, an empty tensor.
        if bias is not None and bias.numel() != 0:
            out = out + bias
        if self.hidden_dropout > 0.0:
            out = F.dropout(out, p=self.hidden_dropout, training=self.training)
        if drop_path and self.drop_path is not None:
            out = self.drop_path(out, cu_seqlens)
        return residual + out
