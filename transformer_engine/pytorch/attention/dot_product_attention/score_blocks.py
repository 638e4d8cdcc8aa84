"""Attention's float32 score products, walked in blocks of queries so that memory stays bounded.

Two computations need the scores that the SDPA kernels do not expose: FP8 attention's emulation
(``fp8_attention.py``: it multiplies FP8 values in float32) and ``return_max_logit`` beside a
kernel's output (:func:`max_logit_in_blocks`). Materializing the score matrix would take
``4 * b * h * sq * skv`` bytes, several times over for autograd (16 GiB per copy at b = 2,
h = 32, s = 8192), where a fused kernel keeps none. Here they walk the queries in blocks holding
at most :data:`SCORE_BLOCK_BYTES` of scores each. For FP8 attention what is kept for backward is
Q, K, V (their FP8 values in float32) and the softmax output's scale, and the backward
recomputes each block's scores and softmax.

The softmax output (slot S) and the score gradient (slot dP) are rounded with one scale each
for the whole tensor, as the fused kernels do: delayed scaling's scale is the recipe state's
(each block's amax accumulates into its amax); current scaling's comes from an amax pass over
every block first, after which the blocks are computed again and rounded with it (twice the
products, which one block that holds everything avoids).

Dropout draws no mask from a generator per block: ``keep(b, h, i, j)`` is a hash of the
element's index and a seed drawn once per call (from the device's generator, inside the dropout
context: the tensor-parallel RNG tracker's state), kept with probability ``1 - p``. So every
block's mask, in the second pass and in the backward, is the same whatever the block size,
without storing a mask or replaying a generator, and the draw is safe in CUDA-graph capture.
"""

from __future__ import annotations

import torch

from ...constants import to_torch_fp8_dtype
from ...cpp_extensions.cast import dequantize, quantize_prevalidated
from .backends import _float_softmax_with_offset, repeat_kv_heads
from .problem import AttentionProblem

__all__ = [
    "SCORE_BLOCK_BYTES",
    "attend_in_blocks",
    "dropout_keep",
    "dropout_seed",
    "max_logit_in_blocks",
]

#: float32 scores per block (bytes); the backward holds about six block-sized tensors at once.
SCORE_BLOCK_BYTES = 128 << 20

_LOW32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)`` without leaving int64's range (the
    constant in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _LOW32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds; every input bit reaches every output
    bit) of int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(seed: torch.Tensor, shape, rows, p: float) -> torch.Tensor:
    """Bool ``[b, h, rows, skv]``: the dropout mask of ``rows`` (a slice, or an int64 tensor of
    row indices) of a ``[b, h, sq, skv]`` score matrix, True (kept) where the hash of the
    element's flat index and ``seed`` (two int64 values in ``[0, 2**32)``) is at or above
    ``p * 2**32``."""
    b, h, sq, skv = shape
    device = seed.device
    heads = torch.arange(b * h, device=device, dtype=torch.int64).view(b, h, 1, 1)
    if isinstance(rows, slice):
        rows = torch.arange(rows.start, rows.stop, device=device, dtype=torch.int64)
    i = rows.view(1, 1, -1, 1)
    j = torch.arange(skv, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    index = (heads * sq + i) * skv + j
    x = _mix32((index & _LOW32) ^ seed[0])
    x = _mix32(x ^ (index >> 32) ^ seed[1])
    return x >= min(int(p * 2**32), 2**32)


def dropout_seed(device: torch.device, dropout_ctx) -> torch.Tensor:
    """A call's dropout seed: two int64 values in ``[0, 2**32)`` drawn from ``device``'s
    generator inside ``dropout_ctx`` (a tensor-parallel RNG tracker's fork, or nothing)."""
    with dropout_ctx():
        return torch.randint(0, 2**32, (2,), device=device, dtype=torch.int64)


class _Plan:
    """One call's query blocks and what every block reads besides Q and K.

    ``positions`` (int64 ``[sq]``, or ``None``): the query rows' positions among the keys
    (context parallelism's chunks of one sequence), which make the mask causal by position,
    key ``j`` visible from row ``i`` when ``positions[i] - window_left <= j <= positions[i]``
    (``window_left < 0``: no lower bound), and number the rows of the dropout's index as in
    the whole ``skv x skv`` matrix."""

    def __init__(self, problem: AttentionProblem, q, k, *, dropout_p=0.0, seed=None,
                 s_quantizer=None, dp_quantizer=None, positions=None, window_left=-1):  # fmt: skip
        b, h, sq, _ = q.shape
        skv = k.shape[2]
        self.shape = (b, h, sq, skv)
        self.positions, self.window_left = positions, window_left
        self.keep, self.implicit_causal = problem.keep, problem.implicit_causal
        self.scale = problem.scale
        self.dropout_p, self.seed = dropout_p, seed
        self.s_quantizer, self.dp_quantizer = s_quantizer, dp_quantizer
        rows = max(1, SCORE_BLOCK_BYTES // (4 * max(b * h * skv, 1)))
        self.blocks = [slice(r, min(r + rows, sq)) for r in range(0, sq, rows)]

    def scores(self, q, k, bias, rows: slice):
        """The masked (``-inf``), scaled and biased float32 scores of ``rows``."""
        scores = torch.matmul(q[:, :, rows], k.transpose(-2, -1)) * self.scale
        if bias is not None:
            scores = scores + (bias[:, :, rows] if _has_rows(bias, self.shape[2]) else bias)
        keep = self._keep(rows, scores.device)
        return scores if keep is None else scores.masked_fill(~keep, float("-inf"))

    def probabilities(self, q, k, bias, offset, rows: slice):
        """``(p, sink, p after dropout)`` of ``rows``: the softmax of their scores, the
        offset's share per row, and ``p`` with dropout applied."""
        p, sink = _float_softmax_with_offset(self.scores(q, k, bias, rows), offset, with_sink=True)
        return p, sink, self._dropped(p, rows)

    def _keep(self, rows: slice, device):
        if self.positions is not None:
            at = self.positions[rows].view(1, 1, -1, 1)
            j = torch.arange(self.shape[3], device=device).view(1, 1, 1, -1)
            return (j <= at) & (j >= at - self.window_left) if self.window_left >= 0 else j <= at
        if self.keep is not None:
            return self.keep[:, :, rows] if self.keep.shape[2] != 1 else self.keep
        if self.implicit_causal is None:
            return None
        _, _, sq, skv = self.shape
        shift = skv - sq if self.implicit_causal == "bottom_right" else 0
        i = torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1)
        return torch.arange(skv, device=device).view(1, 1, 1, skv) <= i + shift

    def _dropped(self, x, rows: slice):
        """``x`` (probabilities of ``rows``, or their gradient) through the dropout: the kept
        entries scaled by ``1 / (1 - p)``."""
        if self.dropout_p == 0.0:
            return x
        shape, ids = self.shape, rows
        if self.positions is not None:  # the rows of the whole skv x skv matrix
            shape, ids = (*shape[:2], shape[3], shape[3]), self.positions[rows]
        keep = dropout_keep(self.seed, shape, ids, self.dropout_p)
        return x * keep * (1.0 / (1.0 - self.dropout_p))


def _bias4(problem: AttentionProblem):
    """The problem's bias as a 4-D view (``None`` without one)."""
    bias = problem.bias
    if bias is not None and bias.dim() < 4:
        bias = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return bias


def _has_rows(bias: torch.Tensor, sq: int) -> bool:
    return bias.shape[2] == sq and sq != 1


def _block_scale(quantizer, device, blocks, values_of):
    """``(scale, amax buffer or None)`` rounding every block's ``values_of(rows)`` with one
    scale: the quantizer's (delayed scaling), or one from an amax pass over all blocks."""

    def amax_of(buffer):
        buffer.zero_()
        for rows in blocks:
            values = values_of(rows)
            if values.numel():
                torch.maximum(buffer, values.abs().amax().reshape(1), out=buffer)

    return quantizer.cast_scale(device, amax_of)


def _rounded(x, quantizer, scale, amax):
    """float32 FP8 values of ``x`` with ``scale`` (its amax accumulated into ``amax``)."""
    fp8_dtype = to_torch_fp8_dtype(quantizer.dtype)
    res = quantize_prevalidated(x, scale, fp8_dtype, amax=amax, with_transpose=False)
    return dequantize(res.data, res.scale_inv)


class _Memo:
    """The last block's values, reused when one block holds everything (no second pass)."""

    def __init__(self, single: bool, compute):
        self.single, self.compute, self.value = single, compute, None

    def __call__(self, rows):
        if not self.single:
            return self.compute(rows)
        if self.value is None:
            self.value = self.compute(rows)
        return self.value


class _ScoreBlocks(torch.autograd.Function):
    """``softmax(Q K^T * scale + bias, masked) @ V`` with the S rounding (forward) and the dP
    rounding (backward), block by block (see the module docstring). Q, K, V: ``[b, h, s, d]``
    float32 (K and V heads repeated to Q's)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, offset, plan: _Plan):  # noqa: D102
        b, h, sq, _ = plan.shape
        out = q.new_empty(b, h, sq, v.shape[-1])
        dropped = _Memo(
            len(plan.blocks) == 1, lambda r: plan.probabilities(q, k, bias, offset, r)[2]
        )
        quantizer = plan.s_quantizer
        scale, amax = _block_scale(quantizer, q.device, plan.blocks, dropped)
        for rows in plan.blocks:
            out[:, :, rows] = torch.matmul(_rounded(dropped(rows), quantizer, scale, amax), v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, bias, offset, scale.clone())
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k, v, bias, offset, s_scale = ctx.saved_tensors
        plan = ctx.plan
        need_bias, need_offset = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dbias = torch.zeros_like(bias) if need_bias else None
        doffset = torch.zeros_like(offset) if need_offset else None

        def grads(rows):
            p, sink, p_dropped = plan.probabilities(q, k, bias, offset, rows)
            g = plan._dropped(torch.matmul(dout[:, :, rows], v.transpose(-2, -1)), rows)
            row_sum = (g * p).sum(-1, keepdim=True)
            return p_dropped, p * (g - row_sum), sink * row_sum

        block = _Memo(len(plan.blocks) == 1, grads)
        quantizer = plan.dp_quantizer
        if quantizer is not None:
            scale, amax = _block_scale(quantizer, q.device, plan.blocks, lambda r: block(r)[1])
        for rows in plan.blocks:
            p_dropped, ds, sink_share = block(rows)
            p8 = _rounded(p_dropped, plan.s_quantizer, s_scale, None)  # (not in the amax pass)
            dv += torch.matmul(p8.transpose(-2, -1), dout[:, :, rows])
            if need_bias:
                _add_bias_grad(dbias, ds, rows, plan.shape[2])
            if need_offset:
                doffset -= sink_share.sum(dim=(0, 2, 3), keepdim=True)
            if quantizer is not None:
                ds = _rounded(ds, quantizer, scale, amax)
            dq[:, :, rows] = torch.matmul(ds, k) * plan.scale
            dk += torch.matmul(ds.transpose(-2, -1), q[:, :, rows]) * plan.scale
        return dq, dk, dv, dbias, doffset, None


def _add_bias_grad(dbias: torch.Tensor, ds: torch.Tensor, rows: slice, sq: int) -> None:
    """Add ``ds`` (the unrounded score gradient of ``rows``) to the bias gradient, summed over
    the dimensions the bias broadcasts."""
    target = dbias[:, :, rows] if _has_rows(dbias, sq) else dbias
    summed = [d for d in range(4) if target.shape[d] == 1 and ds.shape[d] != 1]
    target += ds.sum(dim=summed, keepdim=True) if summed else ds


def attend_in_blocks(problem: AttentionProblem, q, k, v, offset, *, dropout_p, dropout_ctx,
                     s_quantizer, dp_quantizer, positions=None, window_left=-1):  # fmt: skip
    """FP8 attention's ``P V`` (float32 ``[b, h, sq, dv]``) from float32 FP8 values of Q, K, V
    (K and V heads repeated to Q's): the softmax output rounded by ``s_quantizer``, and in
    backward the score gradient by ``dp_quantizer`` (``None``: kept in float32).
    ``positions`` / ``window_left``: a causal mask by query position (see ``_Plan``)."""
    seed = dropout_seed(q.device, dropout_ctx) if dropout_p > 0.0 else None
    plan = _Plan(problem, q, k, dropout_p=dropout_p, seed=seed, s_quantizer=s_quantizer,
                 dp_quantizer=dp_quantizer, positions=positions, window_left=window_left)  # fmt: skip
    s_quantizer.set_usage(rowwise=True, columnwise=False)
    if dp_quantizer is not None:
        dp_quantizer.set_usage(rowwise=True, columnwise=False)
    return _ScoreBlocks.apply(q, k, v, _bias4(problem), offset, plan)


def max_logit_in_blocks(problem: AttentionProblem) -> torch.Tensor:
    """The float32 ``[hq]`` maximum per head of the masked, scaled and biased scores (float32
    products; ``-inf`` for a head without any), computed block by block without autograd: what
    ``return_max_logit`` returns beside the output of a kernel that does not return scores."""
    with torch.no_grad():
        q, k = problem.q.float(), problem.k.float()
        k = repeat_kv_heads(k, q.shape[1] // k.shape[1])
        plan, bias = _Plan(problem, q, k), _bias4(problem)
        top = torch.full((q.shape[1],), float("-inf"), device=q.device)
        for rows in plan.blocks:
            scores = plan.scores(q, k, bias, rows)
            if scores.numel():
                top = torch.maximum(top, scores.amax(dim=(0, 2, 3)))
        return top
