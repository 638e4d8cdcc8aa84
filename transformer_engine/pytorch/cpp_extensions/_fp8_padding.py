"""Zero padding of FP8 GEMM operands.

The GEMMs pad an operand whose extent a kernel does not take (the per-tensor GEMM K to a
multiple of 16, the block-scaled one K to a multiple of 128 and M to a multiple of 4) with zero
rows and columns, which leave the product unchanged: every added term is 0 * 0 = +0.0.
"""

from __future__ import annotations

import torch

__all__ = ["zero_padded_fp8"]


def zero_padded_fp8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (FP8, 2-D) contiguous, in the top-left corner of a zero ``[rows, cols]`` matrix when
    it is smaller. Padded through a uint8 view (torch's pad has no FP8 kernels); a zero byte is
    +0.0 in E4M3 and E5M2."""
    if t.shape == (rows, cols):
        return t.contiguous()
    padding = (0, cols - t.shape[1], 0, rows - t.shape[0])
    return torch.nn.functional.pad(t.view(torch.uint8), padding).view(t.dtype)
