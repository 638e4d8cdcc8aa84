"""Token permutation for mixture-of-experts layers (upstream's ``te.moe_permute`` family).

``moe_permute`` gathers each token's row once for every expert it is routed to, grouped by
expert: expert 0's tokens first, each expert's in token order (a "mask" routing map, ``[tokens,
experts]``, nonzero where routed), or in the order of the flattened ``[tokens, topK]`` choices
(an "index" routing map of expert ids). ``moe_unpermute`` undoes it: each token's row is the sum
of its copies, each weighted by its merging probability when given. Both are compositions of
differentiable PyTorch index operations, so autograd gives their backwards (the permute's is the
unweighted unpermute, and gradients reach the merging probabilities), on any device.

``row_id_map`` (what ``moe_permute`` returns for ``moe_unpermute``): an int64 tensor ``[tokens,
k]`` holding the output row of each (token, routing slot) pair, -1 where the pair is not routed
or was dropped (``k`` is the number of experts for a mask map, topK for an index map). Rows
past ``num_out_tokens`` are dropped (upstream's capacity drop): their tokens lose that copy.
"""

from __future__ import annotations

import torch

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]

_MAP_TYPES = ("mask", "index")


def _check_map_type(name: str, map_type: str) -> None:
    if map_type not in _MAP_TYPES:
        raise ValueError(f"{name}: map_type must be 'mask' or 'index', got {map_type!r}")


def _check_tokens(name: str, inp: torch.Tensor, routing_map: torch.Tensor) -> None:
    if inp.dim() != 2:
        raise ValueError(f"{name}: inp must be [tokens, hidden], got shape {tuple(inp.shape)}")
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
        raise ValueError(
            f"{name}: routing_map must be [tokens, experts or topK] with {inp.shape[0]} tokens, "
            f"got shape {tuple(routing_map.shape)}"
        )
    if routing_map.device != inp.device:
        raise ValueError(f"{name}: routing_map is on {routing_map.device}, inp on {inp.device}")


def _destinations(routing_map: torch.Tensor, map_type: str) -> torch.Tensor:
    """``[tokens, k]``: the output row of each routed pair in the full (undropped) order, -1
    where a pair is not routed."""
    tokens, k = routing_map.shape
    device = routing_map.device
    if map_type == "mask":
        routed = routing_map.bool()
        # Expert-major order: walk the transposed mask, tokens in order within each expert.
        flat = routed.t().reshape(-1)
        rank = torch.cumsum(flat.to(torch.int64), 0) - 1
        dest = torch.where(flat, rank, -1).reshape(k, tokens).t()
    else:
        experts = routing_map.to(torch.int64).reshape(-1)
        # A stable sort by expert id: within an expert, the (token, slot) order.
        order = torch.sort(experts, stable=True).indices
        dest = torch.empty_like(experts)
        dest[order] = torch.arange(experts.numel(), device=device)
        dest = dest.reshape(tokens, k)
    return dest.contiguous()


def _permute(inp, routing_map, num_out_tokens, map_type, name):
    _check_map_type(name, map_type)
    _check_tokens(name, inp, routing_map)
    dest = _destinations(routing_map, map_type)
    if map_type == "mask" and num_out_tokens <= 0:
        raise ValueError(
            f"{name}: a mask routing map needs num_out_tokens > 0 (the number of routed pairs), "
            f"got {num_out_tokens}"
        )
    if map_type == "index" and num_out_tokens <= 0:
        num_out_tokens = routing_map.numel()
    dest = torch.where(dest < num_out_tokens, dest, -1)
    routed = dest >= 0
    token_of = torch.arange(inp.shape[0], device=inp.device)[:, None].expand_as(dest)
    rows, sources = dest[routed], token_of[routed]
    out = inp.new_zeros((num_out_tokens, inp.shape[1]))
    out = out.index_copy(0, rows, inp.index_select(0, sources))
    return out, dest, rows


def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
    """``(out, row_id_map)``: ``inp``'s rows (``[tokens, hidden]``) grouped by expert.

    ``routing_map``: ``[tokens, experts]`` nonzero where routed (``map_type="mask"``; then
    ``num_out_tokens`` > 0 is the output's row count), or ``[tokens, topK]`` expert ids
    (``"index"``; ``num_out_tokens`` <= 0 means tokens x topK). ``max_token_num`` is accepted
    for upstream's signature and unused.
    """
    del max_token_num
    out, dest, _ = _permute(inp, routing_map, int(num_out_tokens), map_type, "moe_permute")
    return out, dest


def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """``(out, permuted_probs, row_id_map)`` for a mask ``routing_map``: :func:`moe_permute`,
    and each output row's probability ``probs[token, expert]`` (differentiable)."""
    out, dest, rows = _permute(
        inp, routing_map, int(num_out_tokens), "mask", "moe_permute_with_probs"
    )
    if tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(
            f"moe_permute_with_probs: probs has shape {tuple(probs.shape)}, the routing map "
            f"{tuple(routing_map.shape)}"
        )
    routed = dest >= 0
    permuted_probs = probs.new_zeros(out.shape[0]).index_copy(0, rows, probs[routed])
    return out, permuted_probs, dest


def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
                  probs=None, pad_offsets=None):  # fmt: skip
    """Each token's row: the sum of its permuted copies (``inp``'s rows that ``row_id_map``
    names), each times ``merging_probs[token, slot]`` when given; ``[tokens, hidden]``, or
    ``restore_shape``. ``probs`` is the deprecated name of ``merging_probs``. ``pad_offsets``:
    the one :func:`moe_permute_and_pad_with_probs` returned (its padded layout)."""
    _check_map_type("moe_unpermute", map_type)
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("moe_unpermute: pass merging_probs or its old name probs, not both")
        merging_probs = probs
    dest = row_id_map
    if pad_offsets is not None:
        dest = torch.where(dest >= 0, dest + pad_offsets[_expert_of(dest)], -1)
    tokens = dest.shape[0]
    routed = dest >= 0
    token_of = torch.arange(tokens, device=inp.device)[:, None].expand_as(dest)
    copies = inp.index_select(0, dest[routed])
    if merging_probs is not None:
        if tuple(merging_probs.shape) != tuple(dest.shape):
            raise ValueError(
                f"moe_unpermute: merging_probs has shape {tuple(merging_probs.shape)}, the "
                f"routing {tuple(dest.shape)}"
            )
        copies = copies * merging_probs[routed].to(copies.dtype)[:, None]
    out = inp.new_zeros((tokens, inp.shape[1])).index_add(0, token_of[routed], copies)
    if restore_shape is not None:
        out = out.reshape(restore_shape)
    return out


def _expert_of(dest: torch.Tensor) -> torch.Tensor:
    """The expert (column) of every entry of a mask row map ``[tokens, experts]``."""
    return torch.arange(dest.shape[1], device=dest.device)[None, :].expand_as(dest)


def moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size):
    """:func:`moe_permute_with_probs` with each expert's rows padded with zero rows to a
    multiple of ``align_size``: ``(out, permuted_probs, row_id_map, pad_offsets,
    target_tokens_per_expert)``. ``pad_offsets`` (``[experts]``: the padding rows before each
    expert's block) goes to :func:`moe_unpermute`; ``None`` when no expert needed padding."""
    if int(align_size) <= 0:
        raise ValueError(
            f"moe_permute_and_pad_with_probs: align_size must be > 0, got {align_size}"
        )
    counts = torch.as_tensor(tokens_per_expert, device=inp.device).to(torch.int64)
    if counts.numel() != routing_map.shape[1]:
        raise ValueError(
            f"moe_permute_and_pad_with_probs: {counts.numel()} tokens_per_expert entries for "
            f"{routing_map.shape[1]} experts"
        )
    align = int(align_size)
    target = (counts + align - 1) // align * align
    padding = target - counts
    pad_offsets = torch.cumsum(padding, 0) - padding
    routed_total = int(counts.sum())
    out, permuted_probs, dest = moe_permute_with_probs(inp, probs, routing_map, routed_total)
    if int(padding.sum()) == 0:
        return out, permuted_probs, dest, None, target
    # Each expert's block moves down by the padding before it.
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=inp.device), counts)
    rows = torch.arange(routed_total, device=inp.device) + pad_offsets[expert_of_row]
    total = int(target.sum())
    padded = out.new_zeros((total, out.shape[1])).index_copy(0, rows, out)
    padded_probs = permuted_probs.new_zeros(total).index_copy(0, rows, permuted_probs)
    return padded, padded_probs, dest, pad_offsets, target


def _chunk_order(split_sizes, sorted_index, device):
    sizes = torch.as_tensor(split_sizes, device=device).to(torch.int64)
    order = torch.as_tensor(sorted_index, device=device).to(torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    rows = [torch.arange(int(starts[i]), int(starts[i] + sizes[i]), device=device) for i in order]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=device)


def moe_sort_chunks_by_index(inp, split_sizes, sorted_index):
    """``inp``'s rows cut into chunks of ``split_sizes`` rows, in the order ``sorted_index``
    lists them (only the tensor is returned, as upstream's)."""
    return inp.index_select(0, _chunk_order(split_sizes, sorted_index, inp.device))


def moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index):
    """:func:`moe_sort_chunks_by_index` of ``inp`` and of ``probs`` alike: ``(out, probs)``."""
    rows = _chunk_order(split_sizes, sorted_index, inp.device)
    return inp.index_select(0, rows), probs.index_select(0, rows)
