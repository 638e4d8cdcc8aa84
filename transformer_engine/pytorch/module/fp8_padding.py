"""``Fp8Padding``: pad each group of rows up to the FP8 alignment before a ``GroupedLinear``.

A mixture-of-experts layer routes arbitrary token counts to its experts; ``Fp8Padding`` appends
zero rows to each group up to the recipe's alignment (``get_align_size_for_quantization``: 16
for the per-tensor and Float8BlockScaling recipes, 32 for MXFP8, 128 for NVFP4), and
``Fp8Unpadding`` (``fp8_unpadding.py``) drops them from the output again. Both are plain row
copies on the input's device, differentiable (the padding rows get no gradient).

No GEMM here needs the padding: ``GroupedLinear`` takes groups of any row count under every
recipe (the per-tensor FP8 GEMM zero-pads its reduction dimension, which in the weight-gradient
GEMM is the group's rows; the block-scaled GEMMs are emulated for shapes their native kernels do
not take). The modules pad as upstream's do, whose grouped FP8 GEMMs need aligned groups, so code
written for upstream runs unchanged and sees the same padded sizes.
"""

from __future__ import annotations

import torch

from ..quantization import (
    FP8GlobalStateManager,
    get_align_size_for_quantization,
    get_default_recipe,
)

__all__ = ["Fp8Padding"]


def check_splits(owner: str, num_gemms: int, m_splits, rows: int) -> list[int]:
    """``m_splits`` as a list of ``num_gemms`` non-negative ints summing to ``rows``."""
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    sizes = list(m_splits)
    if len(sizes) != num_gemms:
        raise ValueError(f"{owner}: got {len(sizes)} split sizes for num_gemms={num_gemms}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{owner}: split sizes must be non-negative ints, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{owner}: the split sizes {sizes} sum to {sum(sizes)}, not {rows} rows")
    return sizes


def check_arguments(owner: str, num_gemms, align_size) -> None:
    """Constructor checks shared by ``Fp8Padding`` and ``Fp8Unpadding``."""
    if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms <= 0:
        raise ValueError(f"{owner}: num_gemms={num_gemms!r} must be a positive int")
    if align_size is not None and (
        isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0
    ):
        raise ValueError(f"{owner}: align_size={align_size!r} must be a positive int")


def as_rows(owner: str, inp: torch.Tensor) -> torch.Tensor:
    """``inp`` as ``(rows, features)`` (the leading dimensions flattened; 2-D kept as is)."""
    if inp.dim() == 0:
        raise ValueError(f"{owner}: the input needs at least one dimension (features)")
    return inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])


def alignment(align_size: int | None) -> int:
    """``align_size``, or the alignment of the recipe in effect (of the default one outside
    ``te.autocast``)."""
    if align_size is not None:
        return align_size
    if FP8GlobalStateManager.is_fp8_enabled():
        return get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
    return get_align_size_for_quantization(get_default_recipe())


def padded_sizes(sizes: list[int], align: int) -> list[int]:
    return [(size + align - 1) // align * align for size in sizes]


class _MoveRows(torch.autograd.Function):
    """Copy row groups from one layout (``src_sizes``) into zeros of another (``dst_sizes``);
    group ``i`` keeps its first ``min`` rows. Backward is the same move the other way."""

    @staticmethod
    def forward(ctx, x, src_sizes, dst_sizes):  # noqa: D102
        ctx.sizes = (src_sizes, dst_sizes)
        return _move(x, src_sizes, dst_sizes)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        src_sizes, dst_sizes = ctx.sizes
        return _move(grad, dst_sizes, src_sizes), None, None


def _move(x: torch.Tensor, src_sizes: list[int], dst_sizes: list[int]) -> torch.Tensor:
    out = x.new_zeros((sum(dst_sizes), *x.shape[1:]))
    src = dst = 0
    for s, d in zip(src_sizes, dst_sizes):
        n = min(s, d)
        if n:
            out.narrow(0, dst, n).copy_(x.narrow(0, src, n))
        src, dst = src + s, dst + d
    return out


def move_rows(x: torch.Tensor, src_sizes: list[int], dst_sizes: list[int]) -> torch.Tensor:
    if src_sizes == dst_sizes:
        return x
    return _MoveRows.apply(x, src_sizes, dst_sizes)


class Fp8Padding(torch.nn.Module):
    """Pad each of ``num_gemms`` row groups with zero rows up to a multiple of ``align_size``.

    Parameters
    ----------
    num_gemms : int
        Number of groups.
    align_size : int, optional
        Row alignment; default: the alignment of the recipe in effect at each call (16 for the
        per-tensor FP8 recipes).

    ``forward(inp, m_splits)`` takes ``inp`` of shape ``(..., features)`` (rows are the product
    of the leading dimensions) and the group sizes (ints or a 1-D tensor), and returns
    ``(out, padded_m_splits)`` with ``out`` of shape ``(sum(padded_m_splits), features)``. When
    every group is already aligned, ``out`` is ``inp`` viewed as 2-D (no copy).
    """

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        check_arguments("Fp8Padding", num_gemms, align_size)
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits) -> tuple[torch.Tensor, list[int]]:
        rows = as_rows("Fp8Padding", inp)
        sizes = check_splits("Fp8Padding", self.num_gemms, m_splits, rows.shape[0])
        padded = padded_sizes(sizes, alignment(self.align_size))
        return move_rows(rows, sizes, padded), padded
