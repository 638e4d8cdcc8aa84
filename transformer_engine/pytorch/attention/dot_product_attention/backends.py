"""The attention backends: an explicit (unfused) implementation, and PyTorch's
``scaled_dot_product_attention`` kernels pinned one at a time.

* :class:`UnfusedDotProductAttention`: ``Q K^T``, scale, bias, mask, softmax (with the softmax
  type's offset), dropout, ``P V``, in float32 whatever the input dtype. It handles every
  option, is the CPU path, and is what the fused kernels are tested against.
* :class:`FlashAttention`: SDPA's FLASH_ATTENTION kernel (causal flag or no mask only).
* :class:`FusedAttention`: SDPA's CUDNN_ATTENTION or EFFICIENT_ATTENTION kernel, whichever
  the caller passes (the automatic choice passes the memory-efficient one only, see
  ``utils.CUDNN_NOT_AUTOMATIC``); the memory-efficient one also takes materialized masks, additive biases and (through an extra
  key column, below) the off-by-one and learnable softmax offsets.

None of them has parameters. Which one runs is decided by ``utils.get_attention_backend``;
:func:`sdpa_supports` asks PyTorch whether a kernel accepts the actual tensors of a call.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from .problem import AttentionProblem, causal_keep

__all__ = [
    "UnfusedDotProductAttention",
    "FlashAttention",
    "FusedAttention",
    "SDPBackend",
    "sdpa_supports",
    "sdpa_inputs",
]

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch: no SDPA backends, unfused only
    SDPBackend, sdpa_kernel = None, None
_CAUSAL_BIAS: list = []


def causal_bias_api():
    """``(CausalBias, causal_lower_right)`` from ``torch.nn.attention.bias``, or ``(None, None)``
    on a torch without them (bottom-right causal masks are then materialized). Imported on first
    use: that module imports torch._dynamo, which would add over a second to importing this
    package."""
    if not _CAUSAL_BIAS:
        try:
            from torch.nn.attention.bias import CausalBias, causal_lower_right
        except ImportError:  # pragma: no cover
            CausalBias, causal_lower_right = None, None
        _CAUSAL_BIAS.extend((CausalBias, causal_lower_right))
    return _CAUSAL_BIAS[0], _CAUSAL_BIAS[1]


def _amax_or_neg_inf(scores: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """``scores.amax(dim)``, with ``-inf`` (the max of nothing) where a reduced dim is empty:
    zero-length sequences must not make ``amax`` raise."""
    if scores.numel() > 0:
        return scores.amax(dim=dim, keepdim=keepdim)
    reduced = {d % scores.dim() for d in ((dim,) if isinstance(dim, int) else dim)}
    shape = [
        1 if d in reduced else n for d, n in enumerate(scores.shape) if keepdim or d not in reduced
    ]
    return scores.new_full(shape, float("-inf"))


def _float_softmax_with_offset(scores: torch.Tensor, offset: torch.Tensor | None, *,
                               with_sink: bool = False):  # fmt: skip
    """``exp(s_j) / (exp(offset) + sum_j exp(s_j))`` over the last dim (offset ``None``: the
    vanilla softmax). Rows whose scores are all ``-inf`` give zeros, never NaN; so do rows
    without any key (a zero-length key sequence), where ``amax`` has nothing to reduce.
    ``with_sink``: also the offset's own share ``exp(offset) / (...)`` per row (zeros without
    an offset), ``(probs, sink)``."""
    row_max = _amax_or_neg_inf(scores, dim=-1, keepdim=True)
    if offset is not None:
        row_max = torch.maximum(row_max, offset)
    # Softmax does not depend on the shift: a constant for autograd, and 0 for empty rows.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    exps = torch.exp(scores - shift)
    denominator = exps.sum(dim=-1, keepdim=True)
    if offset is not None:
        denominator = denominator + torch.exp(offset - shift)
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    if not with_sink:
        return exps / denominator
    sink = torch.zeros_like(denominator) if offset is None else torch.exp(offset - shift)
    return exps / denominator, sink / denominator


def repeat_kv_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``t`` ``[b, hkv, s, d]`` with each head repeated ``groups`` times (grouped-query attention)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


class UnfusedDotProductAttention(torch.nn.Module):
    """Attention written out in PyTorch operations, computed in float32 (the CPU path).

    ``forward(problem, dropout_p, dropout_ctx, fp8=None)`` returns ``(out [b, hq, sq, dv] in the
    input dtype, max_logit [hq] float32 or None)``. With ``fp8`` (an
    ``fp8_attention.Fp8Attention``) the call is FP8 attention's emulation instead, whose
    products run in query blocks (``score_blocks.py``).
    """

    def forward(
        self,
        problem: AttentionProblem,
        dropout_p: float = 0.0,
        dropout_ctx=contextlib.nullcontext,
        fp8=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fp8 is not None:
            return fp8.attend(problem, dropout_p, dropout_ctx), None
        q, k, v = problem.q, problem.k, problem.v
        groups = q.shape[1] // k.shape[1]
        k32 = repeat_kv_heads(k.float(), groups)
        v32 = repeat_kv_heads(v.float(), groups)
        scores = torch.matmul(q.float(), k32.transpose(-2, -1)) * problem.scale
        if problem.bias is not None:
            scores = scores + problem.bias.float()
        keep = problem.keep
        if keep is None and problem.implicit_causal:
            keep = causal_keep(q.shape[2], k.shape[2], q.device, problem.implicit_causal)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        max_logit = None
        if problem.return_max_logit:
            with torch.no_grad():
                max_logit = _amax_or_neg_inf(scores, dim=(0, 2, 3)).float()
        probs = _float_softmax_with_offset(scores, softmax_offset(problem, scores.device))
        if dropout_p > 0.0:
            with dropout_ctx():
                probs = F.dropout(probs, p=dropout_p, training=True)
        return torch.matmul(probs, v32).to(q.dtype), max_logit


def softmax_offset(problem: AttentionProblem, device) -> torch.Tensor | None:
    """The softmax offset ``[1, hq, 1, 1]`` float32 of the off-by-one (zeros) and learnable
    softmax types; ``None`` for vanilla."""
    if problem.softmax_type == "vanilla":
        return None
    heads = problem.q.shape[1]
    if problem.softmax_offset is None:  # off-by-one: exp(0) in the denominator
        return torch.zeros(1, heads, 1, 1, device=device)
    return problem.softmax_offset.float().view(1, heads, 1, 1)


# -- PyTorch's SDPA kernels ---------------------------------------------------------------------
def sdpa_inputs(problem: AttentionProblem, repeat_kv: bool, flash: bool = False):
    """``(q, k, v, attn_mask, is_causal, enable_gqa)`` for ``F.scaled_dot_product_attention``.

    A top-left causal mask is SDPA's ``is_causal``; a bottom-right one is
    ``causal_lower_right`` for the flash kernel (which aligns causal masks to the bottom-right
    corner itself) and a mask tensor for the others. Rows without any key attend to every key
    instead (their output is zeroed afterwards by the caller), so no kernel sees a row of
    ``-inf`` only. A softmax offset becomes one more key: a zero key and a zero value whose
    score is the offset itself.
    """
    q, k, v = problem.q, problem.k, problem.v
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    sink = problem.softmax_type != "vanilla"
    keep = problem.keep
    if keep is not None and problem.row_valid is not None:
        keep = keep | ~problem.row_valid
    corner = problem.implicit_causal
    plain = not sink and problem.bias is None
    is_causal, lower_right = corner == "top_left" and plain, None
    causal_lower_right = causal_bias_api()[1] if corner == "bottom_right" and flash else None
    if corner == "bottom_right" and plain and flash and causal_lower_right is not None:
        lower_right = causal_lower_right(sq, skv)
        repeat_kv = True  # its flash call bypasses SDPA's GQA handling: equal heads only
    elif corner is not None and not is_causal:
        keep = causal_keep(sq, skv, q.device, corner)
    if lower_right is not None:
        attn_mask = lower_right
    elif plain:
        attn_mask = keep
    else:
        if problem.bias is not None:
            attn_mask = problem.bias.to(q.dtype)
        else:
            attn_mask = q.new_zeros(1, 1, sq, skv)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
        if sink:
            batch = attn_mask.shape[0]
            attn_mask = attn_mask.expand(batch, hq, sq, skv)
            if problem.softmax_offset is None:
                column = q.new_zeros(1, 1, 1, 1).expand(batch, hq, sq, 1)
            else:
                offset = problem.softmax_offset.to(q.dtype).view(1, hq, 1, 1)
                column = offset.expand(batch, hq, sq, 1)
            attn_mask = torch.cat([attn_mask, column], dim=-1)
            k = torch.cat([k, k.new_zeros(b, hkv, 1, k.shape[3])], dim=2)
            v = torch.cat([v, v.new_zeros(b, hkv, 1, v.shape[3])], dim=2)
    enable_gqa = hq != hkv
    if enable_gqa and repeat_kv:
        k, v = repeat_kv_heads(k, hq // hkv), repeat_kv_heads(v, hq // hkv)
        enable_gqa = False
    return q, k, v, attn_mask, is_causal, enable_gqa


_FLAG_NAMES = ("flash", "mem_efficient", "math", "cudnn")
_KERNEL_FLAGS = {  # the one process-wide SDPA flag each kernel needs on (the others off)
    "FLASH_ATTENTION": (True, False, False, False),
    "EFFICIENT_ATTENTION": (False, True, False, False),
    "MATH": (False, False, True, False),
    "CUDNN_ATTENTION": (False, False, False, True),
}
_cuda_backends = torch.backends.cuda
_FLAG_ACCESSORS = tuple(
    (
        getattr(_cuda_backends, f"{n}_sdp_enabled", None),
        getattr(_cuda_backends, f"enable_{n}_sdp", None),
    )
    for n in _FLAG_NAMES
)
_HAVE_FLAGS = all(a is not None for pair in _FLAG_ACCESSORS for a in pair)


class _PinnedKernel:
    """``with _PinnedKernel(backend):`` lets SDPA run ``backend`` only, flipping just the
    process-wide flags that differ and restoring them on exit. Same effect as
    ``torch.nn.attention.sdpa_kernel``, for a fraction of its host time (it runs every call)."""

    __slots__ = ("wanted", "flipped")

    def __init__(self, backend) -> None:
        self.wanted = _KERNEL_FLAGS[backend.name]
        self.flipped = ()

    def __enter__(self) -> None:
        flipped = []
        for (enabled, enable), want in zip(_FLAG_ACCESSORS, self.wanted):
            if enabled() != want:
                enable(want)
                flipped.append((enable, not want))
        self.flipped = flipped

    def __exit__(self, exc_type, exc, tb) -> None:
        for enable, previous in self.flipped:
            enable(previous)


def _pinned(backend):
    if _HAVE_FLAGS and backend.name in _KERNEL_FLAGS:
        return _PinnedKernel(backend)
    return sdpa_kernel(backend)  # a kernel without a public flag (or an older torch)


def _run_sdpa(problem: AttentionProblem, backend, dropout_p, dropout_ctx, repeat_kv):
    flash = backend.name == "FLASH_ATTENTION"
    # Only the flash kernel takes enable_gqa: with a GQA problem the memory-efficient kernel,
    # pinned alone, raised "Invalid backend" on an H200 (torch 2.11), so K/V heads are repeated
    # for every other kernel.
    q, k, v, attn_mask, is_causal, enable_gqa = sdpa_inputs(problem, repeat_kv or not flash, flash)
    kwargs = {"enable_gqa": True} if enable_gqa else {}  # older torch lacks the keyword
    with _pinned(backend), dropout_ctx():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=problem.scale, **kwargs,
        )  # fmt: skip
    if problem.row_valid is not None:
        out = out.masked_fill(~problem.row_valid, 0)
    return out


class FlashAttention(torch.nn.Module):
    """PyTorch's flash-attention SDPA kernel (no mask or a top-left causal flag, no bias)."""

    sdp_backend = None if SDPBackend is None else SDPBackend.FLASH_ATTENTION

    def forward(self, problem, dropout_p=0.0, dropout_ctx=contextlib.nullcontext, *,
                repeat_kv=False):  # fmt: skip
        return _run_sdpa(problem, self.sdp_backend, dropout_p, dropout_ctx, repeat_kv)


class FusedAttention(torch.nn.Module):
    """PyTorch's cuDNN or memory-efficient SDPA kernel, chosen per call (``sdp_backend``)."""

    def forward(self, problem, dropout_p=0.0, dropout_ctx=contextlib.nullcontext, *,
                sdp_backend=None, repeat_kv=False):  # fmt: skip
        return _run_sdpa(problem, sdp_backend, dropout_p, dropout_ctx, repeat_kv)


_CAN_USE = {
    "FLASH_ATTENTION": "can_use_flash_attention",
    "EFFICIENT_ATTENTION": "can_use_efficient_attention",
    "CUDNN_ATTENTION": "can_use_cudnn_attention",
}


def _sdpa_params(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa):
    params_type = torch.backends.cuda.SDPAParams
    try:
        return params_type(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    except TypeError:  # torch < 2.5: no enable_gqa
        return params_type(q, k, v, attn_mask, dropout_p, is_causal)


def _ask_pytorch(backend, problem, dropout_p, repeat_kv) -> tuple[bool, str]:
    check = getattr(torch.backends.cuda, _CAN_USE[backend.name], None)
    if check is None or not hasattr(torch.backends.cuda, "SDPAParams"):
        return True, ""  # this torch cannot say; the static filters decided
    flash = backend.name == "FLASH_ATTENTION"
    q, k, v, attn_mask, is_causal, enable_gqa = sdpa_inputs(problem, repeat_kv, flash)
    causal_bias_type = causal_bias_api()[0] if flash else None
    if causal_bias_type is not None and isinstance(attn_mask, causal_bias_type):
        attn_mask = None  # what CausalBias itself asks before its flash call
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA turns a bool mask into an additive one before choosing; probe what it sees
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    params = _sdpa_params(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if check(params, False):
        return True, ""
    with warnings.catch_warnings(record=True) as caught:  # the reasons come as warnings
        warnings.simplefilter("always")
        check(params, True)
    return False, "; ".join(str(w.message) for w in caught) or "refused by PyTorch"


def sdpa_supports(backend, problem: AttentionProblem, dropout_p: float):
    """``(ok, repeat_kv, reason)``: whether PyTorch's SDPA ``backend`` accepts this call's
    tensors, first with grouped-query attention passed natively (``enable_gqa``), then with
    K/V repeated to the query heads."""
    ok, reason = _ask_pytorch(backend, problem, dropout_p, repeat_kv=False)
    if ok or problem.q.shape[1] == problem.k.shape[1]:
        return ok, False, reason
    ok_repeated, reason_repeated = _ask_pytorch(backend, problem, dropout_p, repeat_kv=True)
    return ok_repeated, ok_repeated, reason if ok_repeated else reason_repeated
