"""``AttentionProblem``: one attention call, resolved and backend-neutral.

``DotProductAttention.forward`` turns its arguments (formats, packed inputs, mask types,
windows, biases, the KV cache) into one of these; every backend computes

    out = softmax_with_offset(Q K^T * scale + bias, masked where keep is False) @ V

from it. Queries, keys and values are ``[b, h, s, d]`` views of the caller's tensors.
"""

from __future__ import annotations

import torch

__all__ = ["AttentionProblem", "causal_keep"]


class AttentionProblem:
    """Inputs of one attention computation (see the module docstring).

    Attributes
    ----------
    q, k, v : torch.Tensor
        ``[b, hq, sq, dk]``, ``[b, hkv, skv, dk]``, ``[b, hkv, skv, dv]``; ``hq`` is a
        multiple of ``hkv`` (grouped-query attention shares each K/V head among
        ``hq // hkv`` query heads).
    keep : torch.Tensor or None
        Bool ``[B, 1 or hq, sq, skv]`` (True = may attend), ``None`` for no materialized mask.
    implicit_causal : {None, "top_left", "bottom_right"}
        A causal mask over the whole ``sq x skv`` matrix that is not materialized (``keep`` is
        ``None`` then): key ``j`` visible from query ``i`` when ``j <= i`` (top-left) or
        ``j <= i + skv - sq`` (bottom-right, only with ``sq <= skv`` so that every query sees
        a key). The kernels apply it themselves.
    bias : torch.Tensor or None
        Float32 additive bias after scaling (pre-scale biases arrive multiplied by the scale),
        broadcastable to ``[b, hq, sq, skv]``; ALiBi is one.
    row_valid : torch.Tensor or None
        Bool ``[B, 1 or hq, sq, 1]``: rows with at least one key; other rows output zeros.
    scale : float
    softmax_type : str
        ``"vanilla"``, ``"off-by-one"`` or ``"learnable"``: the denominator gets an extra
        ``exp(offset_h)`` term (offset 0 for off-by-one).
    softmax_offset : torch.Tensor or None
        ``[hq]`` offsets of ``"learnable"`` (a parameter), ``None`` otherwise.
    return_max_logit : bool
        Also return the per-head maximum of the masked, scaled and biased scores.
    """

    __slots__ = (
        "q", "k", "v", "keep", "implicit_causal", "bias", "row_valid", "scale",
        "softmax_type", "softmax_offset", "return_max_logit",
    )  # fmt: skip

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        implicit_causal: str | None = None,
        bias: torch.Tensor | None = None,
        row_valid: torch.Tensor | None = None,
        scale: float = 1.0,
        softmax_type: str = "vanilla",
        softmax_offset: torch.Tensor | None = None,
        return_max_logit: bool = False,
    ) -> None:
        self.q, self.k, self.v = q, k, v
        self.keep, self.implicit_causal = keep, implicit_causal
        self.bias, self.row_valid, self.scale = bias, row_valid, scale
        self.softmax_type, self.softmax_offset = softmax_type, softmax_offset
        self.return_max_logit = return_max_logit

    @property
    def needs_scores(self) -> bool:
        """Whether a kernel must see more than Q, K, V and a causal flag: a mask, a bias or a
        softmax offset."""
        return self.keep is not None or self.bias is not None or self.softmax_type != "vanilla"


def causal_keep(sq: int, skv: int, device: torch.device, corner: str = "top_left") -> torch.Tensor:
    """The causal keep-mask ``[1, 1, sq, skv]``: ``j <= i`` (``corner="top_left"``) or
    ``j <= i + skv - sq`` (``"bottom_right"``)."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    return j <= i + (skv - sq if corner == "bottom_right" else 0)
