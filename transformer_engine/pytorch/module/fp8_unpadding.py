"""``Fp8Unpadding``: drop the rows ``Fp8Padding`` added (see ``fp8_padding.py``)."""

from __future__ import annotations

import torch

from .fp8_padding import (
    alignment,
    as_rows,
    check_arguments,
    check_splits,
    move_rows,
    padded_sizes,
)

__all__ = ["Fp8Unpadding"]


class Fp8Unpadding(torch.nn.Module):
    """Remove the zero rows that :class:`Fp8Padding` appended to each of ``num_gemms`` groups.

    ``forward(inp, m_splits)`` takes the padded 2-D (or ``(..., features)``) tensor and the
    *original* group sizes, and returns ``(sum(m_splits), features)``; the padding is computed
    with the same ``align_size`` rule as :class:`Fp8Padding`. In backward the gradient gets zero
    rows where the padding was.
    """

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        check_arguments("Fp8Unpadding", num_gemms, align_size)
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits) -> torch.Tensor:
        rows = as_rows("Fp8Unpadding", inp)
        original = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        padded = padded_sizes(
            check_splits("Fp8Unpadding", self.num_gemms, original, sum(original)),
            alignment(self.align_size),
        )
        if sum(padded) != rows.shape[0]:
            raise ValueError(
                f"Fp8Unpadding: the input has {rows.shape[0]} rows, but split sizes {original} "
                f"padded to {padded} make {sum(padded)}; pass the sizes given to Fp8Padding"
            )
        return move_rows(rows, padded, original)
