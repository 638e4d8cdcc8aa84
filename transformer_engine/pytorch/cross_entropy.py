"""``parallel_cross_entropy``: cross entropy over logits whose vocabulary may be split across a
tensor-parallel group (upstream's ``transformer_engine.pytorch.cross_entropy``).

Each rank holds the logits of ``V_local`` consecutive vocabulary entries (rank r: entries
``r * V_local`` to ``(r + 1) * V_local - 1``, equal shares). Per token, in float32::

    lse  = max + log(sum_j exp(x_j - max))       (max and the sum all-reduced over the group)
    loss = lse - x_target                          (x_target from the rank that holds it)
    loss = (1 - s) * loss + s * (lse - mean_j x_j) (label smoothing s; the mean over all V)

which is ``torch.nn.functional.cross_entropy(..., label_smoothing=s)`` of the whole vocabulary;
a token whose target is ``ignore_idx`` has loss 0 and gradient 0. The gradient with respect to
the logits, ``softmax(x) - (1 - s) * onehot(target) - s / V``, is computed in the forward and
kept in the logits' dtype (no float32 copy of the logits is kept for the backward); the backward
multiplies it by the loss gradient. Nothing reads a value back to the host, so the call can be
captured in a CUDA graph (``is_cg_capturable`` is accepted for upstream's signature and changes
nothing here).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["parallel_cross_entropy"]

# Rows of logits worked on at once: bounds the float32 temporaries to a slice of the logits.
_ROWS_PER_CHUNK = 2048


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, reduce_loss, group, ignore_idx):
        vocab_local = logits.shape[-1]
        rows = logits.numel() // vocab_local if vocab_local else 0
        x = logits.detach().reshape(rows, vocab_local)
        t = target.reshape(rows).to(torch.int64)
        world = dist.get_world_size(group) if group is not None else 1
        start = (dist.get_rank(group) if group is not None else 0) * vocab_local
        vocab = vocab_local * world
        s = float(label_smoothing)

        row_max = x.amax(dim=-1).float()
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        sum_exp = torch.empty(rows, dtype=torch.float32, device=x.device)
        sum_x = torch.empty_like(sum_exp) if s else None
        for lo in range(0, rows, _ROWS_PER_CHUNK):
            hi = min(rows, lo + _ROWS_PER_CHUNK)
            chunk = x[lo:hi].float()
            sum_exp[lo:hi] = torch.exp(chunk - row_max[lo:hi, None]).sum(dim=-1)
            if sum_x is not None:
                sum_x[lo:hi] = chunk.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        if sum_x is not None:
            _all_reduce(sum_x, dist.ReduceOp.SUM, group)

        kept = t != ignore_idx
        here = kept & (t >= start) & (t < start + vocab_local)
        column = torch.where(here, t - start, 0)
        target_logit = torch.where(here, x.gather(1, column[:, None])[:, 0].float(), 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        lse = row_max + torch.log(sum_exp)
        loss = lse - target_logit
        if sum_x is not None:
            loss = (1.0 - s) * loss + s * (lse - sum_x / vocab)
        loss = torch.where(kept, loss, 0.0)

        # d loss / d x, kept in the logits' dtype; ignored rows stay zero. Not made when no
        # gradient is wanted (evaluation).
        grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        for lo in range(0, rows if grad is not None else 0, _ROWS_PER_CHUNK):
            hi = min(rows, lo + _ROWS_PER_CHUNK)
            g = torch.exp(x[lo:hi].float() - row_max[lo:hi, None]) / sum_exp[lo:hi, None]
            if s:
                g -= s / vocab
            g[torch.arange(hi - lo, device=x.device), column[lo:hi]] -= torch.where(
                here[lo:hi], 1.0 - s, 0.0
            )
            g *= kept[lo:hi, None]
            grad[lo:hi] = g

        ctx.reduce_loss = bool(reduce_loss)
        ctx.logits_shape = logits.shape
        if reduce_loss:
            count = kept.sum().clamp_min(1).to(torch.float32)
            ctx.save_for_backward(grad, count)
            return loss.sum() / count
        ctx.save_for_backward(grad)
        return loss.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.reduce_loss:
            grad, count = ctx.saved_tensors
            scale = (grad_loss.float() / count).reshape(1, 1)
        else:
            (grad,) = ctx.saved_tensors
            scale = grad_loss.float().reshape(-1, 1)
        grad_logits = (grad.float() * scale).to(grad.dtype).reshape(ctx.logits_shape)
        return grad_logits, None, None, None, None, None


def parallel_cross_entropy(
    inp: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group=None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of ``inp``'s logits against ``target`` (module docstring).

    Parameters
    ----------
    inp : torch.Tensor
        Logits, ``(B, SQ, V)`` or ``(SQ, B, V)`` (any leading shape), float32, bfloat16 or
        float16; ``V`` is this rank's share of the vocabulary when ``dist_process_group`` is
        given.
    target : torch.Tensor
        Integer class indices into the whole vocabulary, shaped like ``inp`` without its last
        dimension.
    label_smoothing : float, default 0.0
    reduce_loss : bool, default False
        Return the mean loss over the tokens whose target is not ``ignore_idx`` (their count
        clamped to at least 1) instead of the per-token losses.
    dist_process_group : torch.distributed.ProcessGroup, optional
        The group the vocabulary is split over; ``None``: ``inp`` holds all of it.
    ignore_idx : int, default -100
    is_cg_capturable : bool, default False
        Accepted (the call is always capturable here).
    _input : torch.Tensor, optional
        Deprecated name of ``inp`` (``FutureWarning``).

    Returns
    -------
    torch.Tensor
        float32: per-token losses shaped like ``target``, or a 0-d mean with ``reduce_loss``.
    """
    del is_cg_capturable
    if _input is not None:
        warnings.warn(
            "parallel_cross_entropy(_input=...) is deprecated; pass the logits as inp",
            FutureWarning,
            stacklevel=2,
        )
        if inp is not None:
            raise ValueError("parallel_cross_entropy: pass the logits as inp or _input, not both")
        inp = _input
    if not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("parallel_cross_entropy: inp (the logits) and target must be tensors")
    if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"parallel_cross_entropy: logits must be float32, bfloat16 or float16, got {inp.dtype}"
        )
    if inp.dim() < 1 or tuple(target.shape) != tuple(inp.shape[:-1]):
        raise ValueError(
            f"parallel_cross_entropy: target has shape {tuple(target.shape)}; it must be the "
            f"logits' shape {tuple(inp.shape)} without the vocabulary dimension"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(
            f"parallel_cross_entropy: target must hold integer class indices, got {target.dtype}"
        )
    if target.device != inp.device:
        raise ValueError(
            f"parallel_cross_entropy: target is on {target.device}, the logits on {inp.device}"
        )
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(
            f"parallel_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]"
        )
    return _CrossEntropy.apply(
        inp, target, float(label_smoothing), bool(reduce_loss), dist_process_group, int(ignore_idx)
    )
