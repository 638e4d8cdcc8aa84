"""``Fp8Unpadding``: drop the rows ``Fp8Padding`` added (see ``fp8_padding.py``)."""

from __future__ import annotations

import torch

from .fp8_padding import alignment, check_splits, move_rows, padded_sizes

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
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms <= 0:
            raise ValueError(f"Fp8Unpadding: num_gemms={num_gemms!r} must be a positive int")
        if align_size is not None and (
            isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0
        ):
            raise ValueError(f"Fp8Unpadding: align_size={align_size!r} must be a positive int")
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits) -> torch.Tensor:
        if inp.dim() == 0:
            raise ValueError("Fp8Unpadding: the input needs at least one dimension (features)")
        rows = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
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
