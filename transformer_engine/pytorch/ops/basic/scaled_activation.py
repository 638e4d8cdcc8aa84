"""``ScaledSwiGLU``: SwiGLU whose output rows are scaled by an extra input, the form a mixture
of experts uses to weight each token's expert output by its router probability.

With the SwiGLU output of shape ``(d_1, ..., d_n)``, the extra input holds one scale per row,
shape ``(d_1, ..., d_{n-1})``: ``y = silu(x1) * x2 * scales[..., None]``. The backward gives
both gradients, the input's through the fused SwiGLU backward kernel of the scaled output
gradient, the scales' as the row sums of ``grad * swiglu(x)`` in float32.
"""

from __future__ import annotations

import torch

from ...functional.activation import activation_backward, activation_forward, activation_spec
from ..op import BasicOperation
from ._common import plain
from .activation import check_glu_interleave_size, glu_from_halves, glu_to_halves

__all__ = ["ScaledSwiGLU"]


class ScaledSwiGLU(BasicOperation):
    """SwiGLU with post-scaling by an extra input (one scale per output row).

    Parameters
    ----------
    glu_interleave_size : int, optional
        The input's halves interleaved in blocks of this many columns, as for
        :class:`~transformer_engine.pytorch.ops.SwiGLU`; ``None``: contiguous halves.
    """

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: int | None = None) -> None:
        super().__init__()
        self.glu_interleave_size = check_glu_interleave_size("ScaledSwiGLU", glu_interleave_size)
        self._spec = activation_spec("swiglu")

    def op_forward(self, *args, **kwargs):
        raise RuntimeError("ScaledSwiGLU runs through fuser_forward (it has an extra input)")

    def op_backward(self, *args, **kwargs):
        raise RuntimeError("ScaledSwiGLU runs through fuser_backward (it has an extra input)")

    def _row_scales(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1]
        if scales.device != x.device:
            raise ValueError(
                f"ScaledSwiGLU: the scales are on {scales.device} but the input is on "
                f"{x.device}; move them to {x.device}"
            )
        if scales.numel() != rows.numel():
            raise ValueError(
                f"ScaledSwiGLU: the scales have shape {tuple(scales.shape)} but the input "
                f"{tuple(x.shape)} has {rows.numel()} rows; pass one scale per row, shape "
                f"{tuple(rows)}"
            )
        return scales.reshape(*rows, 1)

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        (scales,) = basic_op_extra_inputs[0]
        x, scales = (
            glu_to_halves("ScaledSwiGLU", plain(input_), self.glu_interleave_size),
            plain(scales),
        )
        row_scales = self._row_scales(x, scales)
        out = activation_forward(x, self._spec) * row_scales.to(x.dtype)
        ctx = basic_op_ctxs[0]
        if ctx.requires_grad:
            ctx.save_for_backward(x, scales)
        return out, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, scales = ctx.saved_tensors
        grad = plain(grad_output).to(x.dtype)
        row_scales = self._row_scales(x, scales)
        grad_input = glu_from_halves(
            activation_backward(grad * row_scales.to(x.dtype), x, self._spec),
            self.glu_interleave_size,
        )
        swiglu = activation_forward(x, self._spec)  # recomputed: the forward keeps only x
        grad_scales = (grad.float() * swiglu.float()).sum(dim=-1)
        return grad_input, [[]], [(grad_scales.reshape(scales.shape).to(scales.dtype),)]
