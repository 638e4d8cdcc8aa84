"""Context parallelism for ``DotProductAttention``: the sequence split over a process group.

Each of the group's ``cp`` ranks holds two of the sequence's ``2 * cp`` equal chunks of Q, K and
V: chunks ``rank`` and ``2 * cp - 1 - rank`` (the zig-zag split, which gives every rank the same
share of causal work; ``apply_rotary_pos_emb(cp_size=, cp_rank=)`` reads positions the same
way). The attention of a rank's queries is the attention the whole sequence would give those
rows: every rank all-gathers K and V (the gradients are reduce-scattered back in the backward)
and puts the chunks in sequence order; with a causal mask each of its two query chunks then
attends to the keys up to its own end, its diagonal at the bottom-right corner, so each query
row sees exactly the keys it sees in the unsplit sequence, and its softmax is complete in one
call (no partial results to merge).

Packed sequences (``thd``) split each sequence the same way: every padded sequence length
(``cu_seqlens_q_padded``, else ``cu_seqlens_q``: the whole sequences' running sums) must divide
into ``2 * cp`` chunks, and a rank's tokens are each sequence's two chunks in sequence order
(its local running sums are the padded ones divided by ``cp``); positions past a sequence's
length (``cu_seqlens_q``) are padding, with zero output.

Whatever ``cp_comm_type`` names (``p2p``, ``all_gather``, ``a2a``), the communication is that
all-gather: the numbers are the same, each rank keeps the whole sequence's K and V from the
forward to the backward (with ``checkpoint_core_attention`` only its own chunks: the gather
and the attention run again in the backward), and nothing is overlapped; for ``thd`` the chunk
positions are read back to the host once a call. The hierarchical ``a2a+p2p`` form (a list of
two groups, with ``cp_global_ranks``) gathers over each group in turn. ``return_max_logit``
gives the whole sequence's per-head maximum (a MAX all-reduce over the group). FP8 attention
(emulated) runs a rank's two query chunks in one call over the gathered K and V, masked by each
query's position (``sbhd``/``bshd``). Not built:
padding masks given as tensors (``sbhd``/``bshd``), arbitrary masks, biases, ALiBi, a KV cache
and cross attention with context parallelism; each is refused naming itself.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .inputs import to_bhsd
from .problem import AttentionProblem
from .recompute import recompute_in_backward

__all__ = [
    "context_parallel_attention",
    "context_parallel_size_and_rank",
    "gather_sequence",
    "group_size",
    "refuse_under_context_parallelism",
    "thd_partitioned_indices",
]

_MASKS = ("no_mask", "causal", "causal_bottom_right")
_THD_MASKS = ("padding", "padding_causal", "padding_causal_bottom_right")


class _GatherSequence(torch.autograd.Function):
    """All ranks' tensors concatenated along ``dim`` (rank order); the backward sums each
    rank's part of the gradient over the group (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim: int, group, size: int, rank: int):
        ctx.dim, ctx.group, ctx.size, ctx.rank = dim, group, size, rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        chunks = [c.contiguous() for c in grad.chunk(ctx.size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter
            whole = torch.cat(chunks, dim=ctx.dim)
            dist.all_reduce(whole, group=ctx.group)
            mine = whole.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous()
        else:
            mine = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine, None, None, None, None


def group_size(group) -> int:
    """Ranks in ``group``; 1 for ``None`` (no group: one process)."""
    return 1 if group is None else dist.get_world_size(group)


def context_parallel_size_and_rank(cp_group, cp_global_ranks) -> tuple[int, int]:
    """``(size, rank)`` of context parallelism over ``cp_group``: one process group, or the two
    of the hierarchical ``a2a+p2p`` form (a list: the all-to-all group, then the point-to-point
    one), whose whole group ``cp_global_ranks`` lists in context-parallel order."""
    if not isinstance(cp_group, (list, tuple)):
        size = group_size(cp_group)
        return size, (dist.get_rank(cp_group) if size > 1 else 0)
    sizes = [group_size(g) for g in cp_group]
    total = math.prod(sizes)
    if total == 1:
        return 1, 0
    if len(cp_group) != 2:
        raise ValueError(
            f"DotProductAttention: a list of cp groups is the hierarchical a2a+p2p form, two "
            f"groups; got {len(cp_group)}"
        )
    ranks = list(cp_global_ranks or [])
    if len(ranks) != total or dist.get_rank() not in ranks:
        raise ValueError(
            f"DotProductAttention: hierarchical cp groups of sizes {sizes} need cp_global_ranks "
            f"listing the {total} ranks of the whole context-parallel group in its order (this "
            f"rank, {dist.get_rank()}, among them); got {cp_global_ranks}"
        )
    return total, ranks.index(dist.get_rank())


def _groups(dpa) -> list:
    group = dpa.cp_group
    return list(group) if isinstance(group, (list, tuple)) else [group]


def gather_blocks(x: torch.Tensor, dim: int, dpa) -> torch.Tensor:
    """Every context-parallel rank's ``x`` concatenated along ``dim`` in context-parallel rank
    order (differentiable). Hierarchical groups gather over each in turn; which rank each
    gathered block came from is learned once, by gathering the ranks themselves."""
    groups = _groups(dpa)
    if len(groups) == 1:
        return _GatherSequence.apply(x, dim, groups[0], dpa.cp_size, dpa.cp_rank)
    owners = getattr(dpa, "_cp_block_owners", None)
    tag = None
    if owners is None:
        tag = torch.tensor([dpa.cp_rank], dtype=torch.int64, device=x.device)
    for group in groups:
        size, rank = group_size(group), dist.get_rank(group)
        x = _GatherSequence.apply(x, dim, group, size, rank)
        if tag is not None:
            tag = _GatherSequence.apply(tag, 0, group, size, rank)
    if owners is None:
        owners = tag.tolist()
        if sorted(owners) != list(range(dpa.cp_size)):
            raise ValueError(
                f"DotProductAttention: the hierarchical cp groups do not cover the "
                f"context-parallel group once each (gathered ranks {owners}); the a2a and p2p "
                "groups must factor the group that cp_global_ranks lists"
            )
        dpa._cp_block_owners = owners
    n = x.shape[dim] // dpa.cp_size
    where = {owner: i for i, owner in enumerate(owners)}
    return torch.cat([x.narrow(dim, where[r] * n, n) for r in range(dpa.cp_size)], dim=dim)


def _chunk_owner(chunk: int, size: int) -> tuple[int, int]:
    """``(rank, half)`` holding chunk ``chunk`` of ``2 * size``: chunk c < size is rank c's
    first half, chunk c >= size rank ``2 * size - 1 - c``'s second."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


def gather_sequence(x: torch.Tensor, dim: int, dpa) -> torch.Tensor:
    """The whole sequence from each rank's zig-zag pair of chunks of ``x`` along ``dim``, in
    sequence order (differentiable)."""
    size = dpa.cp_size
    gathered = gather_blocks(x, dim, dpa)
    half = x.shape[dim] // 2
    order = []
    for chunk in range(2 * size):
        owner, second = _chunk_owner(chunk, size)
        order.append(gathered.narrow(dim, (2 * owner + second) * half, half))
    return torch.cat(order, dim=dim)


def thd_partitioned_indices(cu_seqlens, total_tokens: int, world_size: int, rank: int):
    """The positions (int32, in order) of the packed tokens ``rank`` holds under context
    parallelism: chunks ``rank`` and ``2 * world_size - 1 - rank`` of each sequence of
    ``cu_seqlens`` (the padded running sums, each length a multiple of ``2 * world_size``),
    ``total_tokens / world_size`` of them (upstream's ``tex.thd_get_partitioned_indices``,
    which Megatron-LM uses to give each rank its share of a packed batch)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"thd_get_partitioned_indices: rank={rank} is not in [0, {world_size})")
    bounds = cu_seqlens.tolist()
    if bounds[-1] != total_tokens:
        raise ValueError(
            f"thd_get_partitioned_indices: cu_seqlens end at {bounds[-1]} but total_tokens is "
            f"{total_tokens}; pass the padded running sums of the whole packed batch"
        )
    starts, lengths = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * world_size):
            raise ValueError(
                f"thd_get_partitioned_indices: a sequence of {end - start} tokens does not split "
                f"into {2 * world_size} equal chunks; pad each to a multiple of {2 * world_size}"
            )
        chunk = (end - start) // (2 * world_size)
        starts += [start + rank * chunk, start + (2 * world_size - 1 - rank) * chunk]
        lengths += [chunk, chunk]
    return _rows(starts, lengths, cu_seqlens.device).to(torch.int32)


def refuse_under_context_parallelism(what: str) -> None:
    """``NotImplementedError``: ``what`` is not built with context parallelism."""
    raise NotImplementedError(
        f"DotProductAttention: {what} with context parallelism (a cp_group of more than one "
        "rank) is not built here"
    )


def context_parallel_attention(dpa, q, k, v, fmt, mask_type, window, options: tuple):
    """``dpa``'s attention of this rank's zig-zag query chunks over the whole sequence.

    ``options``: the call's remaining arguments, ``(core_attention_bias_type, alibi_slopes,
    checkpoint_core_attention, (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
    cu_seqlens_kv_padded), fp8)`` (a KV cache was refused before it was written; ``fp8``: the
    call's ``Fp8Attention`` or ``None``)."""
    bias_type, alibi_slopes, checkpoint, cu_seqlens, fp8 = options
    if mask_type not in (_THD_MASKS if fmt == "thd" else _MASKS):
        refuse_under_context_parallelism(f"attn_mask_type={mask_type!r} (qkv_format={fmt!r})")
    if bias_type != "no_bias" or alibi_slopes is not None:
        refuse_under_context_parallelism(f"core_attention_bias_type={bias_type!r} / ALiBi")
    if "causal" not in mask_type and window not in (None, (-1, -1)):
        refuse_under_context_parallelism(f"window_size={window} without a causal mask")
    if fmt != "thd":
        seq_dim = 0 if fmt == "sbhd" else 1
        local = q.shape[seq_dim]
        if k.shape[seq_dim] != local or v.shape[seq_dim] != local:
            refuse_under_context_parallelism(f"keys of another length than the queries ({k.shape[seq_dim]} against "
                    f"{local}: cross attention)")  # fmt: skip
        if local % 2:
            raise ValueError(
                f"DotProductAttention: with context parallelism each rank holds two equal "
                f"chunks of the sequence, so its length ({local}) must be even"
            )

    if fp8 is not None:  # keeps its operands, as without context parallelism
        if fmt == "thd":
            refuse_under_context_parallelism("FP8 attention (fp8_dpa) with qkv_format='thd'")
        return _fp8_attention(dpa, fp8, q, k, v, fmt, mask_type, window)

    def run(q, k, v):
        if fmt == "thd":
            return _finish(dpa, _thd_attention(dpa, q, k, v, mask_type, window, cu_seqlens), 0)
        return _finish(dpa, _dense_attention(dpa, q, k, v, fmt, mask_type, window), seq_dim)

    if checkpoint and torch.is_grad_enabled():
        # Keep only this rank's chunks: the backward gathers and attends again.
        return recompute_in_backward(run, q, k, v, tracker=dpa._dropout()[1])
    return run(q, k, v)


def _dense_attention(dpa, q, k, v, fmt, mask_type, window):
    """``sbhd`` / ``bshd``: the results of this rank's query parts, in order."""
    seq_dim = 0 if fmt == "sbhd" else 1
    local = q.shape[seq_dim]
    size, rank = dpa.cp_size, dpa.cp_rank
    k_all = gather_sequence(k, seq_dim, dpa)
    v_all = gather_sequence(v, seq_dim, dpa)
    layout = f"{fmt}_{fmt}_{fmt}"

    def attend(q_part, keys, mask, bottom_right):
        return dpa._attend(
            q_part, k_all.narrow(seq_dim, 0, keys), v_all.narrow(seq_dim, 0, keys), fmt, fmt,
            layout, None, mask, window, bottom_right, None, None, None, None, None, None,
            False, "no_bias", None, None, False, False,
        )  # fmt: skip

    if mask_type == "no_mask":
        return [attend(q, k_all.shape[seq_dim], "no_mask", False)]
    half = local // 2
    return [
        attend(q.narrow(seq_dim, 0, half), (rank + 1) * half, "causal_bottom_right", True),
        attend(q.narrow(seq_dim, half, half), (2 * size - rank) * half, "causal_bottom_right",
               True),
    ]  # fmt: skip


def _fp8_attention(dpa, fp8, q, k, v, fmt, mask_type, window):
    """FP8 attention (emulated, ``fp8_attention.py``) of this rank's two query chunks over the
    gathered sequence in one call, each query row masked by its position in the whole
    sequence: one QKV, S and dP scale per rank, as one kernel call would take."""
    seq_dim = 0 if fmt == "sbhd" else 1
    k_all, v_all = gather_sequence(k, seq_dim, dpa), gather_sequence(v, seq_dim, dpa)
    mask = {}
    if mask_type != "no_mask":
        half, size, rank = q.shape[seq_dim] // 2, dpa.cp_size, dpa.cp_rank
        firsts = (rank * half, (2 * size - 1 - rank) * half)
        positions = torch.cat([torch.arange(f, f + half, device=q.device) for f in firsts])
        mask = {"positions": positions, "window_left": -1 if window is None else window[0]}
    problem = AttentionProblem(
        to_bhsd(q, fmt), to_bhsd(k_all, fmt), to_bhsd(v_all, fmt), scale=dpa.softmax_scale,
        softmax_type=dpa.softmax_type, softmax_offset=dpa._softmax_offset(q.device),
    )  # fmt: skip
    dropout, tracker = dpa._dropout()
    out = fp8.attend(problem, dropout, contextlib.nullcontext if tracker is None else tracker.fork,
                     **mask)  # fmt: skip
    out = dpa._output(out, fmt, None)
    return fp8.fp8_result(out) if fp8.fp8_output else out


def _finish(dpa, results, dim: int):
    """The query parts' outputs joined along ``dim``; with ``return_max_logit`` also the whole
    sequence's per-head maximum (this rank's parts', then the group's)."""
    if not dpa.return_max_logit:
        return torch.cat(results, dim=dim)
    top = torch.stack([max_logit for _, max_logit in results]).amax(dim=0)
    for group in _groups(dpa):
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([out for out, _ in results], dim=dim), top


def _cumsum(lengths, device) -> torch.Tensor:
    sums = [0]
    for n in lengths:
        sums.append(sums[-1] + n)
    return torch.tensor(sums, dtype=torch.int32, device=device)


def _rows(starts, lengths, device) -> torch.Tensor:
    """int64 ``[start_0, start_0 + n_0) + [start_1, ...) + ...``, built on ``device`` (no
    per-token host loop: a packed batch may hold many thousands of tokens)."""
    total = sum(lengths)
    n = torch.tensor(lengths, dtype=torch.int64, device=device)
    shift = torch.tensor(starts, dtype=torch.int64, device=device) - (torch.cumsum(n, 0) - n)
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, n, output_size=total)


def _thd_attention(dpa, q, k, v, mask_type, window, cu_seqlens):
    """``thd``: the local tokens' attention, as a list of results for :func:`_finish` (one
    part, or the two chunks' in the local order already; see the module docstring)."""
    cu_q, cu_kv, cu_q_padded, cu_kv_padded = cu_seqlens
    if cu_q is None or cu_kv is None:
        raise ValueError(
            "DotProductAttention: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv"
        )
    same = cu_kv.shape == cu_q.shape and bool(torch.equal(cu_kv, cu_q))
    if cu_kv_padded is not None or cu_q_padded is not None:
        same = same and cu_kv_padded is not None and cu_q_padded is not None
        same = same and bool(torch.equal(cu_kv_padded, cu_q_padded))
    if not same:
        refuse_under_context_parallelism(
            "different cu_seqlens for queries and keys (cross attention)"
        )
    size, rank = dpa.cp_size, dpa.cp_rank
    padded = (cu_q if cu_q_padded is None else cu_q_padded).tolist()  # one host read a call
    actual = (cu_q[1:] - cu_q[:-1]).tolist()
    lengths = [b - a for a, b in zip(padded[:-1], padded[1:])]
    if any(n % (2 * size) for n in lengths):
        raise ValueError(
            f"DotProductAttention: with context parallelism over {size} ranks every padded "
            f"sequence length must be a multiple of {2 * size} (two chunks a rank); got "
            f"{lengths} (pad the sequences and pass cu_seqlens_q_padded)"
        )
    local_total, device = padded[-1] // size, q.device
    if q.shape[0] != local_total:
        raise ValueError(
            f"DotProductAttention: this rank holds {q.shape[0]} tokens, but cu_seqlens "
            f"(padded total {padded[-1]}) over {size} ranks give {local_total}"
        )
    chunk = [n // (2 * size) for n in lengths]
    local_start = [p // size for p in padded[:-1]]
    # The whole padded sequences from every rank's chunks.
    order = []
    for i, c_len in enumerate(chunk):
        for c in range(2 * size):
            owner, second = _chunk_owner(c, size)
            order.append((owner * local_total + local_start[i] + second * c_len, c_len))
    whole = _rows([o for o, _ in order], [n for _, n in order], device)
    k_all = gather_blocks(k, 0, dpa).index_select(0, whole)
    v_all = gather_blocks(v, 0, dpa).index_select(0, whole)

    def attend(q_part, q_valid, q_rows, keys, mask):
        """``q_part`` (``q_rows`` rows a sequence, the first ``q_valid`` real) against the first
        ``keys`` positions of each whole sequence."""
        k_index = _rows(padded[:-1], keys, device)
        k_part, v_part = k_all.index_select(0, k_index), v_all.index_select(0, k_index)
        k_valid = [min(a, n) for a, n in zip(actual, keys)]
        return dpa._attend(
            q_part, k_part, v_part, "thd", "thd", "thd_thd_thd", None, mask, window, True,
            _cumsum(q_valid, device), _cumsum(k_valid, device), _cumsum(q_rows, device),
            _cumsum(keys, device), max(q_rows, default=1), max(keys, default=1), False,
            "no_bias", None, None, False, True,
        )  # fmt: skip

    def valid(c):  # real queries of chunk c of each sequence
        return [max(0, min(a - c * n, n)) for a, n in zip(actual, chunk)]

    if "causal" not in mask_type:
        both = [x + y for x, y in zip(valid(rank), valid(2 * size - 1 - rank))]
        return [attend(q, both, [2 * n for n in chunk], lengths, "padding")]
    parts, index = [], []
    for second, c in ((0, rank), (1, 2 * size - 1 - rank)):
        rows = _rows([s + second * n for s, n in zip(local_start, chunk)], chunk, device)
        keys = [(c + 1) * n for n in chunk]
        part = attend(q.index_select(0, rows), valid(c), chunk, keys,
                      "padding_causal_bottom_right")  # fmt: skip
        parts.append(part)
        index.append(rows)
    # back to the local order: the two chunks of each sequence were taken apart
    inverse = torch.empty(local_total, dtype=torch.int64, device=device)
    inverse[torch.cat(index)] = torch.arange(local_total, device=device)
    if dpa.return_max_logit:
        out = torch.cat([o for o, _ in parts]).index_select(0, inverse)
        return [(out, torch.stack([m for _, m in parts]).amax(dim=0))]
    return [torch.cat(parts).index_select(0, inverse)]
