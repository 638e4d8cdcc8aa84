"""``L2Normalization``: scale each vector along the last dimension to unit L2 norm (no
parameters), e.g. the query/key normalization of attention. The arithmetic is
``functional.normalization.l2_normalize`` (float32 at least, output in the input's dtype)."""

from __future__ import annotations

import operator

import torch

from ...functional.normalization import check_eps, l2_normalize, l2_normalize_backward
from ..op import BasicOperation, OperationContext
from ._common import plain

__all__ = ["L2Normalization"]


def _optional_positive_int(name: str, value):
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"L2Normalization: {name} must be an int or None, got {value!r}") from None
    if value <= 0:
        raise ValueError(f"L2Normalization: {name} must be positive, got {value}")
    return value


class L2Normalization(BasicOperation):
    r"""L2 normalization over the last dimension: :math:`y = x / \sqrt{\sum_i x_i^2 + \varepsilon}`.

    Parameters
    ----------
    eps : float, default 1e-6
        Added to the sum of squares for numerical stability.
    seq_length : int, optional
        Sequence length of the inputs. Upstream uses it (with ``micro_batch_size``) to warm up
        its JIT-compiled kernel; there is no JIT warm-up here, so it is checked and kept only.
    micro_batch_size : int, optional
        Micro-batch size of the inputs; see ``seq_length``.
    """

    def __init__(
        self,
        eps: float = 1e-6,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.eps = check_eps("L2Normalization", eps)
        self.seq_length = _optional_positive_int("seq_length", seq_length)
        self.micro_batch_size = _optional_positive_int("micro_batch_size", micro_batch_size)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        x = plain(input_)
        y, rsqrt_norm = l2_normalize(x, self.eps)
        if ctx.requires_grad:
            ctx.save_for_backward(x, rsqrt_norm)
        return y

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        x, rsqrt_norm = ctx.saved_tensors
        return l2_normalize_backward(plain(grad_output), x, rsqrt_norm), []

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
