"""``te.DotProductAttention``: scaled dot-product attention over PyTorch's SDPA kernels or an
explicit float32 implementation, with upstream's formats, masks, windows, biases, softmax
types and KV cache (docs/attention.md)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

from ...device import (
    DevicePlacementError,
    construction_device,
    enter_device,
    exit_device,
    materialization_device,
)
from ...module.base import TransformerEngineBaseModule
from .backends import FlashAttention, FusedAttention, UnfusedDotProductAttention
from .context_parallel import (
    context_parallel_attention,
    context_parallel_size_and_rank,
    group_size,
    refuse_under_context_parallelism,
)
from .fp8_attention import fp8_attention_roles, setup_fp8_attention
from .inputs import (
    QKV_FORMATS,
    build_problem,
    check_qkv,
    check_thd_arguments,
    normalize_mask_type,
    resolve_packed_inputs,
    side_lengths,
    thd_inputs,
    to_bhsd,
)
from .packing import padded_to_thd
from .problem import AttentionProblem
from .recompute import recompute_in_backward
from .score_blocks import max_logit_in_blocks
from .utils import AttentionParams, backend_env, check_set_window_size, get_attention_backend

__all__ = ["DotProductAttention", "_attention_backends"]

# The backend chosen for each AttentionParams seen so far (``"choices"``), and upstream's keys
# for the latest choice. Setting ``backend_selection_requires_update`` to True forgets them all.
_attention_backends = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
    "choices": {},
}
_MAX_CACHED_CHOICES = 256
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _choose_backend(params: AttentionParams, problem: AttentionProblem):
    cache = _attention_backends
    if cache["backend_selection_requires_update"]:
        cache["choices"].clear()
        cache["backend_selection_requires_update"] = False
    choice = cache["choices"].get(params)
    if choice is None:
        choice = get_attention_backend(params, problem)
        if len(cache["choices"]) >= _MAX_CACHED_CHOICES:
            cache["choices"].clear()
        cache["choices"][params] = choice
        cache["attention_params"] = params
        for key in ("use_flash_attention", "flash_attention_backend", "use_fused_attention",
                    "fused_attention_backend", "use_unfused_attention"):  # fmt: skip
            cache[key] = getattr(choice, key)
    return choice


class DotProductAttention(TransformerEngineBaseModule):
    """Scaled dot-product attention ``softmax(Q K^T * scale + bias, masked) V``.

    Parameters
    ----------
    num_attention_heads : int
    kv_channels : int or (int, int)
        Head dim of Q/K, or ``(dk, dv)`` when V's head dim differs.
    num_gqa_groups : int, optional
        Number of K/V heads (grouped-query attention; 1 is multi-query); default
        ``num_attention_heads``. Must divide it.
    attention_dropout : float, default 0.0
        Dropout on the attention probabilities, in training mode only.
    qkv_format : {"sbhd", "bshd", "thd"}, default "sbhd"
        ``[s, b, h, d]``, ``[b, s, h, d]`` or packed variable-length sequences ``[t, h, d]``
        with ``cu_seqlens_q/kv``.
    attn_mask_type : str, default "causal"
        ``no_mask``, ``causal``, ``causal_bottom_right``, ``padding``, ``padding_causal``,
        ``padding_causal_bottom_right`` or ``arbitrary`` (``","`` is read as ``"_"``,
        ``causal_padding`` as ``padding_causal``).
    window_size : (int, int), optional
        Sliding window ``(left, right)``; -1 is unbounded (rules: ``check_set_window_size``).
    bottom_right_diagonal : bool, optional
        Align the window (and ALiBi) with the bottom-right corner of the score matrix. Forced
        False for ``causal``/``padding_causal``, True for ``*_bottom_right``, default True
        otherwise.
    sequence_parallel, tp_size, tp_group
        Tensor parallelism: ``num_attention_heads`` and ``num_gqa_groups`` are the full counts
        and must both be divisible by ``tp_size`` (the group's size when a group is given);
        each rank's inputs hold its ``heads // tp_size`` query and ``groups // tp_size`` K/V
        heads. ``sequence_parallel`` only stops the dropout from forking the RNG tracker.
    get_rng_state_tracker : callable, optional
        Returns a tracker whose ``fork()`` runs the attention dropout (unless
        ``sequence_parallel``); without it dropout uses the default generator.
    layer_number : int, optional
        This layer's index in the KV cache (default 1).
    attention_type : {"self", "cross"}, default "self"
    cp_group, cp_global_ranks, cp_stream, cp_comm_type
        Context parallelism: the sequence split over ``cp_group`` in zig-zag chunks (see
        ``set_context_parallel_group``); ``cp_global_ranks`` and ``cp_stream`` are accepted.
    softmax_scale : float, optional
        Default ``1 / sqrt(dk)``.
    softmax_type : {"vanilla", "off-by-one", "learnable"}, default "vanilla"
        ``off-by-one`` adds 1 to the softmax denominator, ``learnable`` adds ``exp(a_h)`` with
        the per-head parameter ``softmax_offset`` (zeros at initialization).
    return_max_logit : bool, default False
        ``forward`` also returns the per-head maximum of the masked, scaled scores.
    name : str, optional
    device : str or torch.device, optional
        Where ``softmax_offset`` is built (this implementation's addition; upstream always
        uses the current CUDA device). Default: the current CUDA device, else the CPU, or
        ``meta`` inside ``with torch.device("meta")``; ``"meta"`` defers to
        ``reset_parameters()``.

    Backends: PyTorch SDPA's flash or memory-efficient kernels on CUDA when the call allows
    them (its cuDNN kernel is not chosen automatically: a wrong dq was measured on torch
    2.11), else an explicit float32 implementation (always on CPU); see docs/attention.md for
    how they are chosen and ``NVTE_*_ATTN`` to exclude them.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
        name: str | None = None,
        device=None,
    ) -> None:
        super().__init__(name=name)
        if tp_group is not None:
            tp_size = group_size(tp_group)
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"DotProductAttention: tp_size={tp_size!r} must be a positive int")
        # The core has no collectives: each rank attends over its own heads (the projections
        # around it split them); the group only matters to set_tensor_parallel_group callers.
        self.tp_group, self.tp_size, self.sequence_parallel = tp_group, tp_size, sequence_parallel
        if isinstance(kv_channels, int):
            kv_channels = (kv_channels, kv_channels)
        dk, dv = (int(c) for c in kv_channels)
        if num_attention_heads <= 0 or dk <= 0 or dv <= 0:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} and kv_channels={kv_channels} must "
                "be positive"
            )
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if groups <= 0 or num_attention_heads % groups != 0:
            raise ValueError(
                f"num_gqa_groups={num_gqa_groups} must be positive and divide "
                f"num_attention_heads={num_attention_heads}"
            )
        for label, count in (
            ("num_attention_heads", num_attention_heads),
            ("num_gqa_groups", groups),
        ):
            if count % tp_size:
                raise ValueError(
                    f"DotProductAttention: {label}={count} is not divisible by tp_size={tp_size}; "
                    "tensor parallelism gives every rank the same number of heads and groups"
                )
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type={attention_type!r} must be 'self' or 'cross'")
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(
                f"softmax_type={softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}"
            )
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={attention_dropout} must be in [0, 1)")
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = dk, dv
        self.kv_channels = (dk, dv)
        self.num_gqa_groups = groups
        # Full counts are the constructor's; each rank sees heads // tp_size query heads and
        # groups // tp_size K/V heads.
        self.num_attention_heads_per_partition = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = groups // tp_size
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = normalize_mask_type(attn_mask_type)
        self.window_size = check_set_window_size(self.attn_mask_type, window_size)
        # None: each call's mask type picks its own default window (no coercion warnings)
        self._constructor_window = None if window_size is None else tuple(window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type = attention_type
        self.softmax_scale = dk**-0.5 if softmax_scale is None else float(softmax_scale)
        self.softmax_type = softmax_type
        self.return_max_logit = return_max_logit
        # upstream reads the variable once, here; torch's deterministic mode is read per call
        self.deterministic = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.flash_attention = FlashAttention()
        self.fused_attention = FusedAttention()
        self.unfused_attention = UnfusedDotProductAttention()
        self._mask_settings_cache: dict = {}
        if device is None and torch.get_default_device().type == "meta":
            device = "meta"
        device = construction_device(type(self).__name__, device)
        if softmax_type == "learnable":
            offset = torch.empty(
                self.num_attention_heads_per_partition, dtype=torch.float32, device=device
            )
            self.register_parameter(
                "softmax_offset", torch.nn.Parameter(offset), init_fn=torch.nn.init.zeros_
            )
            self.reset_parameters(defer_init=device.type == "meta")
        elif softmax_type == "off-by-one":  # upstream's attribute: the offset, fixed at 0
            heads = self.num_attention_heads_per_partition
            zeros = torch.zeros(heads, dtype=torch.float32, device=device)
            self.register_buffer("softmax_offset", zeros, persistent=False)
        else:
            self.softmax_offset = None

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialize the parameters (``softmax_offset`` when learnable); the off-by-one
        offset buffer is zeroed, and built on the materialization device if it is on meta."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init or self.softmax_type != "off-by-one":
            return
        offset = self.softmax_offset
        if offset.device.type == "meta":
            self.softmax_offset = torch.zeros(
                offset.shape, dtype=torch.float32, device=materialization_device()
            )
        else:
            offset.zero_()

    # -- configuration -------------------------------------------------------------------------
    def set_context_parallel_group(
        self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"
    ) -> None:
        """Context parallelism over ``cp_group`` (one group, or the a2a and p2p groups of the
        hierarchical form with ``cp_global_ranks``): each rank holds the zig-zag chunks
        ``rank`` and ``2 * cp - 1 - rank`` of the sequence (``context_parallel.py``; every
        ``cp_comm_type`` runs as an all-gather of K and V)."""
        types = cp_comm_type if isinstance(cp_comm_type, (list, tuple)) else [cp_comm_type]
        if any(t not in CP_COMM_TYPES for t in types):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is not one of {CP_COMM_TYPES}")
        size, rank = context_parallel_size_and_rank(cp_group, cp_global_ranks)
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type
        self.cp_size, self.cp_rank, self._cp_block_owners = size, rank, None

    def _mask_settings(self, attn_mask_type, window_size, bottom_right_diagonal):
        """``(mask_type, window, bottom_right)`` of one call, cached per distinct arguments."""
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self._constructor_window if window_size is None else tuple(window_size)
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        key = (attn_mask_type, window_size, bottom_right_diagonal)
        settings = self._mask_settings_cache.get(key)
        if settings is None:
            mask_type = normalize_mask_type(attn_mask_type)
            window = check_set_window_size(mask_type, window_size)
            if mask_type in ("causal", "padding_causal"):
                bottom_right = False
            elif mask_type.endswith("bottom_right"):
                bottom_right = True
            else:
                bottom_right = True if bottom_right_diagonal is None else bottom_right_diagonal
            settings = self._mask_settings_cache[key] = (mask_type, window, bottom_right)
        return settings

    def _dropout(self):
        """``(p, tracker)``: this call's attention dropout (0 in eval mode) and the RNG tracker
        it draws under (``None`` without dropout or tracker)."""
        p = self.attention_dropout if self.training else 0.0
        if p == 0.0 or self.get_rng_state_tracker is None or self.sequence_parallel:
            return p, None
        return p, self.get_rng_state_tracker()

    def parameters_device(self) -> torch.device | None:
        """The parameters' device, else (no parameters) the last FP8 call's inputs' device:
        where the FP8 attention slots' recipe state lives."""
        device = super().parameters_device()
        return device if device is not None else self.__dict__.get("_fp8_device")

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list:
        """The FP8 attention slots' roles (``module_type="dpa"``), for a ``CustomRecipe``."""
        return fp8_attention_roles(self.name or "", fwd=fwd, num_quantizers=num_quantizers)

    def _softmax_offset(self, device: torch.device):
        if self.softmax_type != "learnable":
            return None
        offset = self.softmax_offset
        if offset.device != device:
            raise DevicePlacementError(
                f"DotProductAttention: softmax_offset is on {offset.device} but the inputs are "
                f"on {device}; move the module to {device} (call reset_parameters() first if it "
                "was built on meta)"
            )
        return offset

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        query_layer: torch.Tensor | None = None,
        key_layer: torch.Tensor | None = None,
        value_layer: torch.Tensor | None = None,
        attention_mask=None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool = False,
        bf16_backward: bool = False,
        num_splits: int | None = 1,
        score_mod=None,
        score_mod_bprop=None,
        score_mod_tensors=None,
        score_mod_bprop_tensors=None,
        qkv_layer: torch.Tensor | None = None,
        kv_layer: torch.Tensor | None = None,
        qkv_interleave_dim: int = -3,
    ):
        """Attention over ``query_layer``, ``key_layer``, ``value_layer`` (or the packed
        ``qkv_layer`` / ``kv_layer``).

        Returns ``[sq, b, h*dv]`` (sbhd), ``[b, sq, h*dv]`` (bshd) or ``[t, h*dv]`` (thd), in
        the query's format, and with ``return_max_logit`` also the float32 ``[h]`` maximum of
        the masked, scaled and biased scores. ``attention_mask`` is bool, True = masked:
        ``[b, 1, 1, s]`` padding for self attention, a ``(q_mask, kv_mask)`` tuple for cross
        attention, or anything broadcastable to ``[b, h, sq, skv]`` for ``arbitrary``.
        ``fast_zero_fill`` and ``pad_between_seqs`` are accepted (padded positions always get
        zeros; padding between ``thd`` sequences follows from ``cu_seqlens_*_padded``);
        ``fp8_output`` (return a ``Float8Tensor``) and ``bf16_backward`` (a high-precision
        backward) apply to FP8 attention (the recipe's ``fp8_dpa`` / ``fp8_mha``, emulated:
        ``fp8_attention.py``).
        """
        if num_splits not in (None, 1):
            raise NotImplementedError(
                f"DotProductAttention: num_splits={num_splits} needs FlashAttention 3, which "
                "is not a backend here; use num_splits=1"
            )
        if score_mod is not None or score_mod_bprop is not None:
            raise NotImplementedError(
                "DotProductAttention: score_mod / score_mod_bprop (cuDNN flex attention) are "
                "not supported"
            )
        fmt = self.qkv_format if qkv_format is None else qkv_format
        if fmt not in QKV_FORMATS:
            raise ValueError(f"qkv_format={fmt!r} is not one of {', '.join(QKV_FORMATS)}")
        q, k, v, packed_layout = resolve_packed_inputs(
            query_layer, key_layer, value_layer, qkv_layer, kv_layer, qkv_interleave_dim, fmt
        )
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        mask_type, window, bottom_right = self._mask_settings(
            attn_mask_type, window_size, bottom_right_diagonal
        )
        fp8 = setup_fp8_attention(self, q.device, fp8_output=fp8_output, grad=grad,
                                  bf16_backward=bf16_backward, kv_cache=inference_params is not None)  # fmt: skip
        enter_device(q.device)
        try:  # (from here on a failure hands FP8 attention's claims back: fp8.abandon)
            q_format = kv_format = fmt
            if inference_params is not None:
                k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_kv, q_format, mask_type = (
                    self._kv_cache_step(inference_params, k, v, fmt, mask_type)
                )
                kv_format, attention_mask = "bshd", None
                if q_format == "thd" and max_seqlen_q is None:  # known without a host sync
                    max_seqlen_q = getattr(inference_params, "max_ctx_len", None)
                cu_seqlens_q_padded = cu_seqlens_kv_padded = None
                # padding_causal became its bottom-right form; the other padding types keep
                # their own diagonal (bottom-right unless the caller said otherwise), so a
                # decoded query's window and ALiBi distances count back from the cache's end
                bottom_right = bottom_right or mask_type.endswith("bottom_right")
            check_qkv(q, k, v, q_format, kv_format, self.num_attention_heads_per_partition,
                      self.num_gqa_groups_per_partition, *self.kv_channels)  # fmt: skip
            layout = packed_layout or f"{q_format}_{kv_format}_{kv_format}"
            if fp8 is not None:
                self._recompute_swap_in()
            if self.cp_size > 1:
                cu = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
                options = (core_attention_bias_type, alibi_slopes, checkpoint_core_attention, cu,
                           fp8)  # fmt: skip
                out = context_parallel_attention(self, q, k, v, fmt, mask_type, window, options)
            else:
                out = self._attend(
                    q, k, v, q_format, kv_format, layout, attention_mask, mask_type, window,
                    bottom_right, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                    cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, checkpoint_core_attention,
                    core_attention_bias_type, core_attention_bias, alibi_slopes,
                    inference_params is not None, bool(pad_between_seqs), fp8,
                )  # fmt: skip
            if fp8 is not None:
                self._register_fp8_state()
            return out
        except BaseException:
            if fp8 is not None:
                fp8.abandon()
            raise
        finally:
            if fp8 is not None:
                self._recompute_swap_out()
            exit_device()

    def _kv_cache_step(self, inference_params, k, v, fmt, mask_type):
        """Write this step's K/V into the cache; attention then reads the whole (bshd) cache
        with a bottom-right causal diagonal per sequence."""
        if self.cp_size > 1:  # refused before the cache is written
            refuse_under_context_parallelism("a KV cache (inference_params)")
        if "padding" not in mask_type:
            raise ValueError(
                f"DotProductAttention: KV caching needs a padding mask type, got "
                f"attn_mask_type={mask_type!r}; use 'padding_causal' (or 'padding')"
            )
        if mask_type == "padding_causal":
            mask_type = "padding_causal_bottom_right"
        cache_dtype = getattr(inference_params, "dtype", None)
        if cache_dtype is not None and cache_dtype != k.dtype:
            # Named here: the cache casts the new K/V to its dtype, and check_qkv then reported
            # dtypes the caller never passed ("query/key/value dtypes differ").
            raise TypeError(
                f"DotProductAttention: the KV cache holds {cache_dtype} (InferenceParams "
                f"dtype) but the inputs are {k.dtype}; build InferenceParams with "
                f"dtype={k.dtype}"
            )
        self.attention_type = "cross"  # queries and keys differ in length from now on
        k_cache, v_cache, cu_q, cu_kv, _, out_format = inference_params.step(
            self.layer_number, k, v, fmt
        )
        if getattr(inference_params, "is_paged", False):
            # pages gathered into [max_batch_size, max_sequence_length, h, d] (a copy)
            k_cache, v_cache = inference_params.convert_paged_to_nonpaged(self.layer_number)
        q_format = out_format.split("_2")[0]
        return k_cache, v_cache, cu_q, cu_kv, None, q_format, mask_type

    def _attend(
        self, q, k, v, q_format, kv_format, layout, attention_mask, mask_type, window,
        bottom_right, cu_q, cu_kv, cu_q_padded, cu_kv_padded, max_seqlen_q, max_seqlen_kv,
        checkpoint_core_attention, bias_type, bias, alibi_slopes, kv_cache, pad_between_seqs,
        fp8=None,
    ):  # fmt: skip
        if q_format == "thd" or kv_format == "thd":
            check_thd_arguments(mask_type, q_format, kv_format, cu_q, cu_kv)
        batch = cu_q.shape[0] - 1 if q_format == "thd" else q.shape[1 if q_format == "sbhd" else 0]
        if kv_cache and kv_format == "bshd" and k.shape[0] > batch:
            k, v = k[:batch], v[:batch]  # the cache holds more sequences than this step runs
        padding = mask_type.startswith("padding")
        q_mask = kv_mask = arbitrary = None
        if mask_type == "arbitrary":
            if attention_mask is None:
                raise ValueError(
                    "DotProductAttention: attn_mask_type='arbitrary' needs attention_mask"
                )
            arbitrary = attention_mask
        elif padding and attention_mask is not None and q_format != "thd":
            q_mask, kv_mask = self._padding_masks(attention_mask)
        q_side = side_lengths(
            "q", q, q_format, cu_q, cu_q_padded, max_seqlen_q, q_mask, batch, padding
        )
        kv_side = side_lengths("kv", k, kv_format, cu_kv, cu_kv_padded, max_seqlen_kv, kv_mask,
                               batch, padding)  # fmt: skip
        qb = thd_inputs(q, q_side) if q_format == "thd" else to_bhsd(q, q_format)
        kb = thd_inputs(k, kv_side) if kv_format == "thd" else to_bhsd(k, kv_format)
        vb = thd_inputs(v, kv_side) if kv_format == "thd" else to_bhsd(v, kv_format)
        if kb.shape[0] != qb.shape[0]:
            raise ValueError(
                f"DotProductAttention: batch sizes differ (queries {qb.shape[0]}, keys/values "
                f"{kb.shape[0]})"
                + (
                    "; cu_seqlens_q and cu_seqlens_kv must both have batch + 1 entries"
                    if "thd" in (q_format, kv_format)
                    else ""
                )  # fmt: skip
            )
        problem = build_problem(
            qb, kb, vb, q_side=q_side, kv_side=kv_side, mask_type=mask_type, window=window,
            bottom_right=bottom_right, arbitrary_mask=arbitrary, bias_type=bias_type, bias=bias,
            alibi_slopes_=alibi_slopes, scale=self.softmax_scale, softmax_type=self.softmax_type,
            softmax_offset=self._softmax_offset(q.device),
            return_max_logit=self.return_max_logit,
        )  # fmt: skip
        dropout_p, tracker = self._dropout()
        params = self._params(problem, layout, mask_type, window, bottom_right, bias_type, bias,
                              alibi_slopes, kv_cache, pad_between_seqs, dropout_p)  # fmt: skip
        choice = _choose_backend(params, problem)
        dropout_ctx = contextlib.nullcontext if tracker is None else tracker.fork

        def attend(q_, k_, v_):
            problem.q, problem.k, problem.v = q_, k_, v_
            if fp8 is not None or not (choice.use_flash_attention or choice.use_fused_attention):
                # (FP8 attention is emulated in the unfused backend: fp8_attention.py)
                return self.unfused_attention(problem, dropout_p, dropout_ctx, fp8=fp8)
            if choice.use_flash_attention:
                kernel, run = choice.flash_attention_backend, self.flash_attention
                out = run(problem, dropout_p, dropout_ctx, repeat_kv=kernel.repeat_kv)
            else:
                kernel = choice.fused_attention_backend
                out = self.fused_attention(problem, dropout_p, dropout_ctx,
                                           sdp_backend=kernel.sdp_backend,
                                           repeat_kv=kernel.repeat_kv)  # fmt: skip
            # The kernels return no scores: the maximum logit comes from a pass of its own.
            return (out, max_logit_in_blocks(problem)) if problem.return_max_logit else out

        # FP8 attention keeps its operands (a recompute would round with updated scales)
        if checkpoint_core_attention and torch.is_grad_enabled() and fp8 is None:
            result = recompute_in_backward(attend, qb, kb, vb, tracker=tracker)
        else:
            result = attend(qb, kb, vb)
        out, max_logit = result if isinstance(result, tuple) else (result, None)
        out = self._output(out, q_format, q_side)
        if fp8 is not None and fp8.fp8_output:
            out = fp8.fp8_result(out)
        if self.return_max_logit:
            return out, max_logit
        return out

    def _padding_masks(self, attention_mask):
        if isinstance(attention_mask, (tuple, list)):
            if len(attention_mask) != 2:
                raise ValueError(
                    "DotProductAttention: a padding attention_mask tuple is (q_mask, kv_mask)"
                )
            return attention_mask[0], attention_mask[1]
        return attention_mask, attention_mask

    @staticmethod
    def _output(out: torch.Tensor, q_format: str, q_side) -> torch.Tensor:
        """``[b, h, sq, dv]`` -> the query's format with heads and head dim merged."""
        b, h, sq, dv = out.shape
        if q_format == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(sq, b, h * dv)
        if q_format == "bshd":
            return out.transpose(1, 2).reshape(b, sq, h * dv)
        packed = padded_to_thd(out.transpose(1, 2), q_side.layout)
        return packed.reshape(packed.shape[0], h * dv)

    def _params(self, problem, layout, mask_type, window, bottom_right, bias_type, bias,
                alibi_slopes, kv_cache, pad_between_seqs, dropout_p) -> AttentionParams:  # fmt: skip
        q, k, v = problem.q, problem.k, problem.v
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        deterministic = self.deterministic or torch.are_deterministic_algorithms_enabled()
        bias_shape = None
        if bias is not None and bias_type in ("pre_scale_bias", "post_scale_bias"):
            bias_shape = "".join("1" if n == 1 else c for n, c in zip(bias.shape, "bhss"))
        return AttentionParams(
            type(q), q.dtype, layout, q.shape[0], q.shape[1], k.shape[1], q.shape[2],
            k.shape[2], q.shape[3], v.shape[3], mask_type, window,
            None if alibi_slopes is None else tuple(alibi_slopes.shape), bias_type, bias_shape,
            bool(bias is not None and bias.requires_grad), pad_between_seqs, dropout_p, False,
            self.cp_comm_type if isinstance(self.cp_comm_type, str) else "a2a+p2p",
            deterministic, self.training, False, self.softmax_type, self.return_max_logit,
            False, 1, q.device, bottom_right, kv_cache, grad, backend_env(),
        )  # fmt: skip
