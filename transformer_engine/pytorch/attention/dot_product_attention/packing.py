"""Layouts of attention inputs: packed ``qkv_layer``/``kv_layer`` tensors, and the ``thd``
format (variable-length sequences packed along one token dimension) unpacked to a padded batch.

Every backend runs on padded ``[b, h, s, d]`` batches; a ``thd`` tensor is gathered into one
(``thd_to_padded``) and the output gathered back (``padded_to_thd``), both without host syncs
once the padded length is known. Sequence ``b`` starts at token ``cu_seqlens_padded[b]`` and
has ``cu_seqlens[b+1] - cu_seqlens[b]`` tokens; tokens between sequences (``pad_between_seqs``)
get zeros in the output.
"""

from __future__ import annotations

import torch

__all__ = ["ThdLayout", "thd_layout", "thd_to_padded", "padded_to_thd", "split_packed"]


class ThdLayout:
    """Where the tokens of a ``thd`` tensor go in a padded ``[b, max_len, ...]`` batch."""

    __slots__ = ("lengths", "max_len", "gather_index", "token_batch", "token_pos", "token_valid")

    def __init__(self, lengths, max_len, gather_index, token_batch, token_pos, token_valid):
        self.lengths = lengths  # int32 [b]: tokens of each sequence
        self.max_len = max_len  # the padded length
        self.gather_index = gather_index  # int64 [b * max_len]: source token of each slot
        self.token_batch = token_batch  # int64 [t]: sequence of each token
        self.token_pos = token_pos  # int64 [t]: position of each token in its sequence
        self.token_valid = token_valid  # bool [t, 1, 1]: token belongs to a sequence


def thd_layout(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_len: int,
    total_tokens: int,
) -> ThdLayout:
    """The :class:`ThdLayout` of ``total_tokens`` tokens holding ``len(cu_seqlens) - 1``
    sequences; ``cu_seqlens_padded`` (default ``cu_seqlens``) gives where each one starts."""
    starts_all = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    batch = lengths.shape[0]
    device = cu_seqlens.device
    slots = torch.arange(max_len, device=device)
    last = max(total_tokens - 1, 0)
    gather_index = (starts_all[:-1].unsqueeze(1) + slots.unsqueeze(0)).clamp_(0, last)
    tokens = torch.arange(total_tokens, device=device)
    token_batch = torch.searchsorted(starts_all[1:].contiguous(), tokens, right=True)
    token_batch = token_batch.clamp_(max=batch - 1)
    token_pos = tokens - starts_all[token_batch]
    token_valid = (token_pos >= 0) & (token_pos < lengths.long()[token_batch])
    token_pos = token_pos.clamp_(0, max_len - 1)
    return ThdLayout(
        lengths, max_len, gather_index.reshape(-1), token_batch, token_pos,
        token_valid.view(total_tokens, 1, 1),
    )  # fmt: skip


def thd_to_padded(x: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
    """``[t, h, d]`` -> ``[b, max_len, h, d]`` (slots past a sequence's end hold other tokens'
    values; the masks built from ``layout.lengths`` keep them out of the result)."""
    batch = layout.lengths.shape[0]
    if x.shape[0] == 0:
        # No tokens (every sequence is empty): every slot is masked, but index_select needs a
        # row to read; one zero row serves, and x stays in the autograd graph.
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return x.index_select(0, layout.gather_index).view(batch, layout.max_len, *x.shape[1:])


def padded_to_thd(y: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
    """``[b, max_len, h, d]`` -> ``[t, h, d]``; tokens outside every sequence get zeros."""
    out = y[layout.token_batch, layout.token_pos]
    return out.masked_fill(~layout.token_valid, 0)


def split_packed(
    layer: torch.Tensor, count: int, interleave_dim: int, name: str, expected_dims: int
) -> tuple[torch.Tensor, ...]:
    """Views of the ``count`` tensors packed in ``layer`` along ``interleave_dim``.

    ``qkv_layer`` packs 3 (``[..., 3, h, d]`` for ``interleave_dim=-3``, ``[..., h, 3, d]``
    for -2), ``kv_layer`` packs 2; the layout is declared by the caller, never guessed.
    """
    if interleave_dim not in (-3, -2):
        raise ValueError(f"qkv_interleave_dim={interleave_dim} must be -3 or -2")
    if layer.dim() != expected_dims:
        raise ValueError(
            f"DotProductAttention: {name} has shape {tuple(layer.shape)} but the format needs "
            f"{expected_dims} dimensions ([..., {count}, h, d] or [..., h, {count}, d])"
        )
    if layer.shape[interleave_dim] != count:
        raise ValueError(
            f"DotProductAttention: {name} has shape {tuple(layer.shape)}; dimension "
            f"{interleave_dim} (qkv_interleave_dim) must be {count}"
        )
    return layer.unbind(dim=interleave_dim)
