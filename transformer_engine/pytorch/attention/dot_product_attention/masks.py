"""What an attention call may see: boolean keep-masks and additive biases over the score matrix.

Conventions (docs/attention.md):

* User-facing masks are bool with ``True`` = masked (upstream's convention); the masks built
  here are *keep* masks, ``True`` = the query may attend to the key (SDPA's convention), shaped
  ``[B, 1 or H, sq, skv]`` with ``B`` the batch size or 1.
* Query ``i`` of sequence ``b`` sees key ``j`` where ``j - i - offset`` lies in the window
  ``[-left, right]`` (a negative bound is unbounded). ``offset`` is 0 for a top-left diagonal
  and ``skv_b - sq_b`` (the sequences' actual lengths) for a bottom-right one; causal masks are
  the window ``(left, 0)``.
* Padding masks are per sequence ``[b, s]`` (True = padded); lengths are the unmasked counts.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "keep_mask",
    "rows_with_keys",
    "alibi_slopes",
    "alibi_bias",
    "lengths_from_padding",
    "padding_from_lengths",
]


def lengths_from_padding(padding: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths (int32 ``[b]``) of a ``[b, s]`` padding mask (True = padded)."""
    return (~padding).sum(dim=-1, dtype=torch.int32)


def padding_from_lengths(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[b, max_len]`` padding mask (True = padded) of sequences of ``lengths`` tokens."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) >= lengths.unsqueeze(1)


def _diagonal_offset(bottom_right, sq, skv, lengths_q, lengths_kv, device):
    """``offset`` of the module docstring, as an int or a ``[B, 1, 1, 1]`` tensor."""
    if not bottom_right:
        return 0
    if lengths_q is None and lengths_kv is None:
        return skv - sq
    lq = lengths_q if lengths_q is not None else torch.full((1,), sq, device=device)
    lkv = lengths_kv if lengths_kv is not None else torch.full((1,), skv, device=device)
    return (lkv.long() - lq.long()).view(-1, 1, 1, 1)


def _relative_positions(sq, skv, offset, device) -> torch.Tensor:
    """``j - i - offset`` for every (query i, key j): ``[1 or B, 1, sq, skv]``, int64."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    return j - i - offset


def keep_mask(
    *,
    sq: int,
    skv: int,
    device: torch.device,
    window: tuple[int, int],
    bottom_right: bool,
    q_padding: torch.Tensor | None = None,
    kv_padding: torch.Tensor | None = None,
    lengths_q: torch.Tensor | None = None,
    lengths_kv: torch.Tensor | None = None,
    arbitrary: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The keep-mask of one call, or ``None`` when every query sees every key.

    ``window`` is ``(left, right)`` after :func:`utils.check_set_window_size` (causal types
    arrive as ``(left, 0)``). ``lengths_*`` (int ``[b]``) place a bottom-right diagonal per
    sequence; ``arbitrary`` is a user mask (True = masked) broadcastable to
    ``[b, h, sq, skv]``.
    """
    keep = None
    left, right = window
    if left >= 0 or right >= 0:
        offset = _diagonal_offset(bottom_right, sq, skv, lengths_q, lengths_kv, device)
        rel = _relative_positions(sq, skv, offset, device)
        if right >= 0:
            keep = rel <= right
        if left >= 0:
            keep = (rel >= -left) if keep is None else keep & (rel >= -left)
    if q_padding is not None:
        rows = ~q_padding.view(q_padding.shape[0], 1, sq, 1)
        keep = rows if keep is None else keep & rows
    if kv_padding is not None:
        cols = ~kv_padding.view(kv_padding.shape[0], 1, 1, skv)
        keep = cols if keep is None else keep & cols
    if arbitrary is not None:
        keep = ~arbitrary if keep is None else keep & ~arbitrary
    if keep is not None and keep.dim() < 4:  # an arbitrary mask of fewer dims broadcasts
        keep = keep.view((1,) * (4 - keep.dim()) + tuple(keep.shape))
    return keep


def rows_with_keys(keep: torch.Tensor) -> torch.Tensor:
    """``[B, 1 or H, sq, 1]``: whether each query row may attend to at least one key.

    Rows without any key (padded queries, windows that miss every key) produce zeros.
    """
    if keep.shape[-1] == 1:
        return keep
    return keep.any(dim=-1, keepdim=True)


def alibi_slopes(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """The ALiBi paper's head slopes (float32 ``[num_heads]``): a geometric sequence starting
    at ``2**(-8/n)`` for the largest power of two ``n <= num_heads``, completed for other head
    counts by the odd-indexed slopes of ``2n`` heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    powers = torch.arange(1, closest + 1, dtype=torch.float64)
    slopes = (2.0 ** (-8.0 / closest)) ** powers
    if closest < num_heads:
        extra = torch.arange(1, 2 * (num_heads - closest) + 1, 2, dtype=torch.float64)
        slopes = torch.cat([slopes, (2.0 ** (-4.0 / closest)) ** extra])
    return slopes.to(device=device, dtype=torch.float32)


def alibi_bias(
    slopes: torch.Tensor,
    *,
    sq: int,
    skv: int,
    bottom_right: bool,
    lengths_q: torch.Tensor | None = None,
    lengths_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ALiBi bias ``-slope * |j - i - offset|`` (float32 ``[1 or B, H, sq, skv]``).

    ``slopes`` is ``[h]`` or ``[b, h]``; ``offset`` as in the module docstring, so the key on
    a query's diagonal gets 0 and keys further away are penalized linearly.
    """
    device = slopes.device
    offset = _diagonal_offset(bottom_right, sq, skv, lengths_q, lengths_kv, device)
    distance = _relative_positions(sq, skv, offset, device).abs().to(torch.float32)
    if slopes.dim() == 1:
        slopes = slopes.view(1, -1, 1, 1)
    else:
        slopes = slopes.view(slopes.shape[0], slopes.shape[1], 1, 1)
    return -slopes.to(torch.float32) * distance
