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

Whatever ``cp_comm_type`` names (``p2p``, ``all_gather``, ``a2a``), the communication is that
all-gather: the numbers are the same, each rank holds the whole sequence's K and V for the
layer's duration, and nothing is overlapped. ``return_max_logit`` gives the whole sequence's
per-head maximum (a MAX all-reduce over the group). Not built: the hierarchical ``a2a+p2p`` groups,
packed (``thd``) sequences, padding or arbitrary masks, biases, ALiBi, a KV cache and cross
attention with context parallelism; each is refused naming itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["context_parallel_attention", "gather_sequence"]

_MASKS = ("no_mask", "causal", "causal_bottom_right")


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


def gather_sequence(x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    """The whole sequence from each rank's zig-zag pair of chunks of ``x`` along ``dim``, in
    sequence order (differentiable)."""
    gathered = _GatherSequence.apply(x, dim, group, size, rank)
    half = x.shape[dim] // 2
    order = []
    for chunk in range(2 * size):
        # chunk c < size is rank c's first half; chunk c >= size is rank 2*size-1-c's second
        owner, second = (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)
        order.append(gathered.narrow(dim, (2 * owner + second) * half, half))
    return torch.cat(order, dim=dim)


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"DotProductAttention: {what} with context parallelism (a cp_group of more than one "
        "rank) is not built here"
    )


def context_parallel_attention(dpa, q, k, v, fmt, mask_type, window, options: dict):
    """``dpa``'s attention of this rank's zig-zag query chunks over the whole sequence.

    ``options``: the call's remaining arguments (``attention_mask``, ``cu_seqlens_q``,
    ``cu_seqlens_kv``, ``core_attention_bias_type``, ``core_attention_bias``,
    ``alibi_slopes``, ``inference_params``, ``checkpoint_core_attention``)."""
    if fmt not in ("sbhd", "bshd"):
        _refuse(f"qkv_format={fmt!r} (packed sequences)")
    if mask_type not in _MASKS:
        _refuse(f"attn_mask_type={mask_type!r}")
    if options["inference_params"] is not None:
        _refuse("a KV cache (inference_params)")
    if options["core_attention_bias_type"] != "no_bias" or options["alibi_slopes"] is not None:
        _refuse(f"core_attention_bias_type={options['core_attention_bias_type']!r} / ALiBi")
    if mask_type == "no_mask" and window not in (None, (-1, -1)):
        _refuse(f"window_size={window} without a causal mask")
    seq_dim = 0 if fmt == "sbhd" else 1
    local = q.shape[seq_dim]
    if k.shape[seq_dim] != local or v.shape[seq_dim] != local:
        _refuse(
            f"keys of another length than the queries ({k.shape[seq_dim]} against {local}: "
            "cross attention)"
        )
    if local % 2:
        raise ValueError(
            f"DotProductAttention: with context parallelism each rank holds two equal chunks "
            f"of the sequence, so its length ({local}) must be even"
        )
    group, size, rank = dpa.cp_group, dpa.cp_size, dpa.cp_rank
    k_all = gather_sequence(k, seq_dim, group, size, rank)
    v_all = gather_sequence(v, seq_dim, group, size, rank)
    layout = f"{fmt}_{fmt}_{fmt}"
    checkpoint = options["checkpoint_core_attention"]

    def attend(q_part, keys, mask, bottom_right):
        return dpa._attend(
            q_part, k_all.narrow(seq_dim, 0, keys), v_all.narrow(seq_dim, 0, keys), fmt, fmt,
            layout, None, mask, window, bottom_right, None, None, None, None, None, None,
            checkpoint, "no_bias", None, None, False, False,
        )  # fmt: skip

    if mask_type == "no_mask":
        results = [attend(q, k_all.shape[seq_dim], "no_mask", False)]
    else:
        half = local // 2
        results = [
            attend(q.narrow(seq_dim, 0, half), (rank + 1) * half, "causal_bottom_right", True),
            attend(q.narrow(seq_dim, half, half), (2 * size - rank) * half,
                   "causal_bottom_right", True),
        ]  # fmt: skip
    if not dpa.return_max_logit:
        return torch.cat(results, dim=seq_dim)
    # The whole sequence's per-head maximum: this rank's rows, then the group's.
    top = torch.stack([max_logit for _, max_logit in results]).amax(dim=0)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([out for out, _ in results], dim=seq_dim), top
