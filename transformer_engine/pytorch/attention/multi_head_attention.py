"""``te.MultiheadAttention``: QKV projection (optionally behind a LayerNorm/RMSNorm), rotary
embeddings, QK normalization, ``DotProductAttention`` and the output projection.

The projections are ``te.LayerNormLinear`` / ``te.Linear``, so FP8 recipes apply to them inside
``te.autocast``; the attention core runs in high precision (see docs/transformer_layer.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._tensor_parallel import get_distributed_world_size
from ..device import construction_device, device_guard
from ..module._fused_norm import check_normalization
from ..module._outputs import returned_bias
from ..module.layernorm import LayerNorm
from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear
from ..module.rmsnorm import RMSNorm
from ..ops.basic.l2_normalization import L2Normalization
from .dot_product_attention.dot_product_attention import DotProductAttention
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention"]

QKV_FORMATS = ("sbhd", "bshd", "thd")
ATTENTION_TYPES = ("self", "cross")
QK_NORM_TYPES = (None, "L2Normalization", "RMSNorm", "LayerNorm")
# Mask types whose attention_mask is a boolean tensor (True = masked out).
MASK_TENSOR_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right", "arbitrary")


def positive_int(owner: str, label: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}: {label}={value!r} must be a positive int")
    return value


def tensor_parallel_size(owner: str, tp_group, tp_size) -> int:
    """The group's size when a group is given (upstream's rule), else ``tp_size`` checked."""
    if tp_group is not None:
        return get_distributed_world_size(tp_group)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size={tp_size!r} must be a positive int")
    return tp_size


def check_heads_divisible(owner: str, heads: int, groups: int, tp_size: int) -> None:
    """Every rank holds whole heads and whole K/V groups."""
    for label, count in (("num_attention_heads", heads), ("num_gqa_groups", groups)):
        if count % tp_size:
            raise ValueError(
                f"{owner}: {label}={count} is not divisible by tp_size={tp_size}; tensor "
                "parallelism splits the heads and K/V groups evenly over the ranks"
            )


def check_attention_mask(owner: str, attention_mask, attn_mask_type: str) -> None:
    """Padding and arbitrary masks are boolean (True = masked); anything else is a TypeError."""
    if attention_mask is None or attn_mask_type not in MASK_TENSOR_TYPES:
        return
    masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,)
    for mask in masks:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(
                f"{owner}: attention_mask for attn_mask_type={attn_mask_type!r} must be a "
                f"torch.bool tensor (True = masked out), got {got}; convert it with mask.bool()"
            )


class MultiheadAttention(torch.nn.Module):
    r"""Multi-head (self or cross) attention with projections in FP8 inside ``te.autocast``.

    Self attention projects ``hidden_states`` to Q, K and V with one GEMM (``layernorm_qkv``
    with ``input_layernorm``, else ``qkv``); cross attention projects ``hidden_states`` to Q
    (``layernorm_query`` / ``query_layer``) and ``encoder_output`` to K and V (``key_value``).
    ``core_attention`` (:class:`DotProductAttention`) computes
    :math:`\mathrm{softmax}(QK^T/\sqrt{d} + \mathrm{mask})V` per head and ``proj`` maps the
    heads back to ``hidden_size``.

    Parameters
    ----------
    hidden_size : int
    num_attention_heads : int
    kv_channels : int, optional
        Head size ``d``; default ``hidden_size // num_attention_heads``.
    attention_dropout : float, default 0.1
    layernorm_epsilon : float, default 1e-5
    init_method, output_layer_init_method : callable, optional
        Initialize the QKV and the output projection weights; default N(0, 0.023).
    layer_number : int, optional
        Position of the layer (> 0); keys the layer's KV cache in ``inference_params``.
    attn_mask_type : str, default "causal"
        no_mask, padding, causal, padding_causal, causal_bottom_right,
        padding_causal_bottom_right or arbitrary; ``forward`` may override it.
    window_size, bottom_right_diagonal : optional
        Sliding window ``(left, right)`` and its diagonal, as ``DotProductAttention``.
    num_gqa_groups : int, optional
        Number of K/V heads ``g`` (grouped-query attention); default ``num_attention_heads``.
        Must divide ``num_attention_heads``.
    fuse_wgrad_accumulation : bool, default False
        Accumulate weight gradients into ``main_grad``; requires ``fuse_qkv_params=True``.
    params_dtype : torch.dtype, optional
    return_bias : bool, default False
        Return ``proj``'s bias *not* added, for a later fused bias-dropout-add.
    return_layernorm_output : bool, default False
        With ``input_layernorm``, also return the input norm's output (ignored without it).
    input_layernorm : bool, default False
        Normalize the input in front of the Q (and for self attention K, V) projection.
    attention_type : {"self", "cross"}, default "self"
    tp_group, tp_size : optional
        Tensor parallelism over ``tp_size`` ranks (the group's size when a group is given;
        without one, call :meth:`set_tensor_parallel_group` before the forward). Heads and
        K/V groups are divided by ``tp_size`` (``ValueError`` when they do not divide) and
        ``tp_size > 1`` needs ``set_parallel_mode=True``.
    sequence_parallel : bool, default False
        With ``tp_size > 1``: ``hidden_states`` and the output are split along the sequence
        dimension (dim 0 of sbhd, packed thd); the QKV projection all-gathers its input and
        ``proj`` reduce-scatters its output.
    set_parallel_mode : bool, default False
        Makes the QKV projection column- and ``proj`` row-parallel over the tensor-parallel
        group; without tensor parallelism it changes nothing.
    fuse_qkv_params : bool, default False
        ``False``: the QKV weight is held as ``query_weight`` / ``key_weight`` /
        ``value_weight`` (and ``*_bias``); ``True``: as one ``weight`` / ``bias``.
    zero_centered_gamma : bool, default False
    qkv_weight_interleaved : bool, default True
        With ``fuse_qkv_params=True``: the fused weight's rows are grouped per K/V group as
        ``[q heads of the group, k, v]``; otherwise (and always without ``fuse_qkv_params``) all
        Q rows come first, then K, then V.
    rotary_pos_interleaved : bool, default False
        Rotate even/odd channel pairs instead of halves in ``apply_rotary_pos_emb``.
    bias : bool, default True
    normalization : {"LayerNorm", "RMSNorm"}, default "LayerNorm"
    device : str or torch.device, default "cuda"
        ``"meta"`` defers initialization to :meth:`reset_parameters`.
    qkv_format : {"sbhd", "bshd", "thd"}, default "sbhd"
        Layout of ``hidden_states``: ``[s, b, hidden]``, ``[b, s, hidden]`` or packed
        ``[tokens, hidden]`` (with ``cu_seqlens_q`` / ``cu_seqlens_kv``).
    name : str, optional
    qk_norm_type : {None, "L2Normalization", "RMSNorm", "LayerNorm"}, default None
        Normalize Q and K over the head dimension (``q_norm`` / ``k_norm``).
    qk_norm_eps : float, default 1e-6
    qk_norm_before_rope : bool, default False
        Apply the QK norm before the rotary embedding instead of after it.
    seq_length, micro_batch_size : int, optional
        Passed to ``L2Normalization``.
    softmax_type : str, default "vanilla"
        Passed to ``DotProductAttention``.

    The ``ub_*`` flags (after ``initialize_ub``, under sequence parallelism) go to the QKV
    projection (``ub_name="qkv"``: ``ub_overlap_ag``, ``ub_overlap_rs_dgrad``, ``ub_bulk_*``)
    and the output projection (``"proj"``: ``ub_overlap_ag``, ``ub_overlap_rs``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        tp_group=None,
        tp_size: int = 1,
        num_gqa_groups: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Callable | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device="cuda",
        qkv_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        owner = "MultiheadAttention"
        tp_size = tensor_parallel_size(owner, tp_group, tp_size)
        positive_int(owner, "hidden_size", hidden_size)
        heads = positive_int(owner, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % heads:
                raise ValueError(
                    f"{owner}: hidden_size={hidden_size} is not divisible by num_attention_heads="
                    f"{heads}; pass kv_channels (the head size) explicitly"
                )
            kv_channels = hidden_size // heads
        head_dim = positive_int(owner, "kv_channels", kv_channels)
        groups = heads if num_gqa_groups is None else num_gqa_groups
        positive_int(owner, "num_gqa_groups", groups)
        if heads % groups:
            raise ValueError(
                f"{owner}: num_gqa_groups={groups} must divide num_attention_heads={heads}"
            )
        if layer_number is not None and (not isinstance(layer_number, int) or layer_number <= 0):
            raise ValueError(f"{owner}: layer_number={layer_number!r} must be a positive int")
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"{owner}: attention_type={attention_type!r} must be 'self' or 'cross'"
            )
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"{owner}: qkv_format={qkv_format!r} must be one of {QKV_FORMATS}")
        if qk_norm_type not in QK_NORM_TYPES:
            raise ValueError(
                f"{owner}: qk_norm_type={qk_norm_type!r} is not supported; use one of "
                f"{QK_NORM_TYPES}"
            )
        check_normalization(owner, normalization)
        check_heads_divisible(owner, heads, groups, tp_size)
        if tp_size > 1 and not set_parallel_mode:
            raise ValueError(
                f"{owner}: tp_size={tp_size} needs set_parallel_mode=True: the heads are split "
                "over the ranks, so the QKV projection must be column- and proj row-parallel"
            )
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(
                f"{owner}: fuse_wgrad_accumulation=True requires fuse_qkv_params=True (the "
                "separate query/key/value weights have no single main_grad to accumulate into)"
            )

        self.hidden_size, self.num_attention_heads = hidden_size, heads
        self.hidden_size_per_attention_head = self.kv_channels = head_dim
        self.num_gqa_groups = groups
        self.num_attention_heads_per_partition = heads // tp_size
        self.num_gqa_groups_per_partition = groups // tp_size
        # Full widths (the projections' constructor sizes; column parallelism divides them).
        self.hidden_size_q, self.hidden_size_kv = heads * head_dim, groups * head_dim
        self.layer_number = layer_number
        self.attn_mask_type, self.window_size = attn_mask_type, window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.attention_type, self.qkv_format = attention_type, qkv_format
        self.input_layernorm = input_layernorm
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.fuse_qkv_params = fuse_qkv_params
        # The interleaved layout only exists for the fused weight (upstream's rule).
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved = rotary_pos_interleaved
        self.qk_norm_type, self.qk_norm_before_rope = qk_norm_type, qk_norm_before_rope
        self.set_parallel_mode, self.name = set_parallel_mode, name
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.get_rng_state_tracker = get_rng_state_tracker
        params_dtype = params_dtype or torch.get_default_dtype()
        device = construction_device(owner, device)  # pinned once: every child agrees

        def child_name(suffix: str) -> str | None:
            return None if name is None else f"{name}.{suffix}"

        common = dict(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            get_rng_state_tracker=get_rng_state_tracker,
            bias=bias, params_dtype=params_dtype, device=device, tp_group=tp_group,
            tp_size=tp_size, sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
        norm = dict(
            eps=layernorm_epsilon, normalization=normalization,
            zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output,
        )  # fmt: skip
        column = "column" if set_parallel_mode else None
        qkv_ub = dict(
            ub_overlap_ag=ub_overlap_ag, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad, ub_name="qkv",
        )  # fmt: skip
        if attention_type == "self":
            split = None
            if not fuse_qkv_params:
                split = {"query": self.hidden_size_q, "key": self.hidden_size_kv}
                split["value"] = self.hidden_size_kv
            qkv_args = (hidden_size, self.hidden_size_q + 2 * self.hidden_size_kv)
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    *qkv_args, init_method=init_method, parallel_mode=column,
                    parameters_split=split, name=child_name("layernorm_linear_qkv"),
                    **norm, **common, **qkv_ub,
                )  # fmt: skip
            else:
                self.qkv = Linear(
                    *qkv_args, init_method=init_method, parallel_mode=column,
                    parameters_split=split, name=child_name("linear_qkv"), **common, **qkv_ub,
                )  # fmt: skip
        else:
            q_split = None if fuse_qkv_params else ("query",)
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, self.hidden_size_q, init_method=init_method,
                    parallel_mode=column, parameters_split=q_split,
                    name=child_name("layernorm_linear_q"), **norm, **common, **qkv_ub,
                )  # fmt: skip
            else:
                self.query_layer = Linear(
                    hidden_size, self.hidden_size_q, init_method=init_method,
                    parallel_mode=column, parameters_split=q_split,
                    name=child_name("linear_q"), **common, **qkv_ub,
                )  # fmt: skip
            self.key_value = Linear(
                hidden_size, 2 * self.hidden_size_kv, init_method=init_method,
                parallel_mode=column, parameters_split=None if fuse_qkv_params else ("key", "value"),
                name=child_name("linear_kv"), **common,
            )  # fmt: skip

        self.q_norm, self.k_norm = self._qk_norms(
            qk_norm_type, qk_norm_eps, params_dtype, device, seq_length, micro_batch_size
        )
        self.core_attention = DotProductAttention(
            heads, head_dim, num_gqa_groups=groups, attention_dropout=attention_dropout,
            tp_size=tp_size, tp_group=tp_group, sequence_parallel=self.sequence_parallel,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, get_rng_state_tracker=get_rng_state_tracker,
            layer_number=layer_number, attention_type=attention_type,
            softmax_type=softmax_type, name=child_name("core_attention"), device=device,
        )  # fmt: skip
        self.proj = Linear(
            self.hidden_size_q, hidden_size, init_method=output_layer_init_method,
            return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None,
            name=child_name("proj"), ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
            ub_name="proj", **common,
        )  # fmt: skip

    def _qk_norms(self, qk_norm_type, eps, dtype, device, seq_length, micro_batch_size):
        """``(q_norm, k_norm)`` over the head dimension (L2, parameter-free: one for both)."""
        if qk_norm_type is None:
            return None, None
        if qk_norm_type == "L2Normalization":
            l2 = L2Normalization(eps=eps, seq_length=seq_length, micro_batch_size=micro_batch_size)
            return l2, l2
        norm_class = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
        d = self.hidden_size_per_attention_head
        return tuple(norm_class(d, eps=eps, device=device, dtype=dtype) for _ in range(2))

    # -- parameters ----------------------------------------------------------------------------
    def reset_parameters(self, defer_init: bool = False) -> None:
        """Materialize (from ``device="meta"``) and initialize every child's parameters, each
        onto the device its own rules pick (see docs/transformer_layer.md)."""
        if defer_init:
            return
        for child in self.children():
            if hasattr(child, "reset_parameters"):
                child.reset_parameters()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel group here and on every child (needed before the forward
        when built with ``tp_size > 1`` and no ``tp_group``; each projection checks the
        group's size against ``tp_size`` at its forward)."""
        self.tp_group = tp_group
        for module in self.modules():
            if module is not self and hasattr(module, "set_tensor_parallel_group"):
                module.set_tensor_parallel_group(tp_group)
            elif module is not self and hasattr(module, "tp_group"):
                module.tp_group = tp_group

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Hand the context-parallel group to ``core_attention`` (RoPE reads its chunks too)."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                       cp_comm_type)  # fmt: skip

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_output: torch.Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
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
    ):
        """Attention over ``hidden_states`` (shape per ``qkv_format``; cross attention: keys and
        values from ``encoder_output``).

        ``rotary_pos_emb`` is one frequency tensor for Q and K or a ``(q_freqs, k_freqs)``
        tuple (``RotaryPositionEmbedding``'s output). Returns the output (the input's shape),
        then ``proj``'s bias with ``return_bias`` and the input norm's output with
        ``return_layernorm_output``; a tuple only when there is more than one.
        """
        owner = type(self).__name__
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"{owner}: hidden_states must be a tensor, got {type(hidden_states)}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{owner}: hidden_states has {hidden_states.shape[-1]} features in its last "
                f"dimension (shape {tuple(hidden_states.shape)}), expected hidden_size="
                f"{self.hidden_size}"
            )
        # A wrong rank used to surface as the shape of an internal per-head view of Q/K/V.
        rank, layout = (2, "[tokens, hidden]") if self.qkv_format == "thd" else (3, "")
        layout = layout or f"[{', '.join(self.qkv_format[:2])}, hidden]"
        for label, t in (("hidden_states", hidden_states), ("encoder_output", encoder_output)):
            if isinstance(t, torch.Tensor) and t.dim() != rank:
                raise ValueError(
                    f"{owner}: {label} has shape {tuple(t.shape)} but qkv_format="
                    f"{self.qkv_format!r} needs {rank} dimensions {layout}"
                )
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        if window_size is None:
            window_size = self.window_size
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        check_attention_mask(owner, attention_mask, attn_mask_type.replace(",", "_"))
        if self.attention_type == "cross" and encoder_output is None:
            raise ValueError(f"{owner}: attention_type='cross' needs encoder_output")
        if inference_params is not None and self.qkv_format == "thd" and rotary_pos_emb is not None:
            # thd decoding itself works (it was refused as a whole); RoPE is refused as upstream
            raise NotImplementedError(
                f"{owner}: rotary_pos_emb with inference_params and qkv_format='thd' is not "
                "supported; use sbhd or bshd inputs for KV-cache decoding with RoPE"
            )

        with device_guard(hidden_states.device):
            layernorm_output = None
            if self.attention_type == "self":
                query, key, value, layernorm_output = self._self_qkv(
                    hidden_states, is_first_microbatch
                )
            else:
                query, key, value, layernorm_output = self._cross_qkv(
                    hidden_states, encoder_output, is_first_microbatch
                )

            # The KV cache appends each step's self-attention keys; cross-attention keys come
            # whole from encoder_output on every call, so they neither enter nor read it.
            kv_cache = inference_params if self.attention_type == "self" else None
            layer = self.layer_number or 1
            if kv_cache is not None and layer not in kv_cache.cache_manager.cache:
                kv_cache.allocate_memory(layer)

            if self.q_norm is not None and self.qk_norm_before_rope:
                query, key = self.q_norm(query), self.k_norm(key)
            if rotary_pos_emb is not None:
                # pad_between_seqs=None is "inferred": the core attention places sequences by
                # the padded cu_seqlens, so RoPE must too (None used to mean the unpadded ones,
                # shifting every sequence after a gap). Equal cu_seqlens give equal results.
                padded = pad_between_seqs is None or bool(pad_between_seqs)
                rope_cu_q, rope_cu_kv = (
                    padded_cu if padded and padded_cu is not None else cu
                    for cu, padded_cu in ((cu_seqlens_q, cu_seqlens_q_padded),
                                          (cu_seqlens_kv, cu_seqlens_kv_padded))
                )  # fmt: skip
                query, key = self._rotary(
                    query, key, rotary_pos_emb, inference_params, pad_between_seqs, rope_cu_q,
                    rope_cu_kv,
                )  # fmt: skip
            if self.q_norm is not None and not self.qk_norm_before_rope:
                query, key = self.q_norm(query), self.k_norm(key)

            context = self.core_attention(
                query, key, value, attention_mask=attention_mask, qkv_format=self.qkv_format,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                attn_mask_type=attn_mask_type, window_size=window_size,
                bottom_right_diagonal=bottom_right_diagonal,
                checkpoint_core_attention=checkpoint_core_attention,
                core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                fast_zero_fill=fast_zero_fill, inference_params=kv_cache,
                pad_between_seqs=pad_between_seqs,
            )  # fmt: skip
            projection = self.proj(context, is_first_microbatch=is_first_microbatch)

        if self.return_bias:  # proj's bias: a copy where this module is an FSDP2 unit
            projection = (projection[0], returned_bias(self, projection[1]))
        outputs = projection if self.return_bias else (projection,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs += (layernorm_output,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _heads(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """``[..., count * d]`` -> ``[..., count, d]`` (a view)."""
        return t.view(*t.shape[:-1], count, self.hidden_size_per_attention_head)

    def _self_qkv(self, hidden_states, is_first_microbatch):
        """Q ``[..., h, d]``, K and V ``[..., g, d]`` (views into one projection output)."""
        layernorm_output = None
        if self.input_layernorm:
            mixed = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            if self.return_layernorm_output:
                mixed, layernorm_output = mixed
        else:
            mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
        # This rank's heads and groups: the column-parallel projection produced only those.
        heads, groups = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition
        per_group, d = heads // groups, self.hidden_size_per_attention_head
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            # Rows grouped per K/V group: [q_0 .. q_{per_group-1}, k, v] for each group.
            grouped = mixed.view(*lead, groups, per_group + 2, d)
            query, key, value = grouped.split((per_group, 1, 1), dim=-2)
            query = query.reshape(*lead, heads, d)
            key, value = key.squeeze(-2), value.squeeze(-2)
        else:
            # All Q rows, then all K rows, then all V rows.
            query, key, value = mixed.split((heads * d, groups * d, groups * d), dim=-1)
            query = self._heads(query, heads)
            key, value = self._heads(key, groups), self._heads(value, groups)
        return query, key, value, layernorm_output

    def _cross_qkv(self, hidden_states, encoder_output, is_first_microbatch):
        """Q from ``hidden_states``; K and V from ``encoder_output``."""
        layernorm_output = None
        if self.input_layernorm:
            query = self.layernorm_query(hidden_states, is_first_microbatch=is_first_microbatch)
            if self.return_layernorm_output:
                query, layernorm_output = query
        else:
            query = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
        mixed = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
        groups, d = self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            # Per group: [k, v].
            key, value = mixed.view(*lead, groups, 2 * d).split((d, d), dim=-1)
        else:
            # All K rows, then all V rows.
            key, value = mixed.view(*lead, 2 * groups, d).split((groups, groups), dim=-2)
        heads = self.num_attention_heads_per_partition
        return self._heads(query, heads), key, value, layernorm_output

    def _rotary(self, query, key, rotary_pos_emb, inference_params, pad_between_seqs, cu_q, cu_kv):
        """Q and K rotated by their frequencies (``[s, 1, 1, rot_dim]``, fp32)."""
        if isinstance(rotary_pos_emb, (tuple, list)):
            if len(rotary_pos_emb) != 2:
                raise ValueError(
                    f"{type(self).__name__}: rotary_pos_emb must be a tensor or a (q_freqs, "
                    f"k_freqs) pair, got a sequence of {len(rotary_pos_emb)}"
                )
            q_freqs, k_freqs = rotary_pos_emb
        else:
            q_freqs = k_freqs = rotary_pos_emb
        start_positions = None
        if inference_params is not None:
            # Decoding: the new tokens sit after the ones already cached for each sequence.
            start_positions = inference_params.get_seqlens_pre_step()
            # The batch may hold rows past the live sequences (InferenceParams.step ignores
            # them); their RoPE offsets were missing, so apply_rotary_pos_emb refused the call.
            extra = query.shape[0 if self.qkv_format == "bshd" else 1] - start_positions.numel()
            if extra > 0:
                start_positions = torch.nn.functional.pad(start_positions, (0, extra))
        cp = self.core_attention  # positions of its context-parallel chunks
        rotate = dict(
            tensor_format=self.qkv_format, start_positions=start_positions, fused=True,
            interleaved=self.rotary_pos_interleaved, cp_size=cp.cp_size, cp_rank=cp.cp_rank,
        )  # fmt: skip
        query = apply_rotary_pos_emb(query, q_freqs, cu_seqlens=cu_q, **rotate)
        key = apply_rotary_pos_emb(key, k_freqs, cu_seqlens=cu_kv, **rotate)
        return query, key
