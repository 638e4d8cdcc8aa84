"""A column-parallel GEMM's input under sequence parallelism, from the forward to the backward.

The forward all-gathers the input over the tensor-parallel group (``sequence_parallel_gemm_input``
of :mod:`._tensor_parallel`, in FP8 where the recipe allows) and runs the GEMM on the whole
sequence; what the weight gradient needs is kept as this rank's shard only (the FP8 shard the
gather handed out, or the high-precision input itself) and gathered again in the backward. The
modules' linear node and ``te.ops.BasicLinear`` both go through :func:`keep_local_shard` and
:func:`restore_gathered_input`, so they keep and gather the same things.

:func:`check_sequence_parallel_scaling` is the rule that lets every rank cast the gathered input
with one scale under delayed scaling; :func:`reduce_amaxes_over` the one that does it under
current scaling, for that input and for any operand split along its features.
"""

from __future__ import annotations

import torch

from ._tensor_parallel import gather_along_first_dim, group_contains, regather_fp8_shard
from .quantization import FP8GlobalStateManager

__all__ = [
    "keep_local_shard",
    "mark_kept_shard",
    "restore_gathered_input",
    "check_sequence_parallel_scaling",
    "reduce_amaxes_over",
]

# What a backward gathers again (``keep_local_shard``'s result)
_FP8_SHARD = "fp8"
_HIGH_PRECISION_SHARD = "high_precision"


def keep_local_shard(saved, inp: torch.Tensor, full, shard, needs_wgrad: bool) -> str | None:
    """After the linear core's forward on the gathered input ``full``: point ``saved.x`` (what
    the weight gradient reads) at this rank's shard instead of the gathered input, and say what
    the backward must gather again (``None``: nothing; the saved input is not the gathered one).

    ``shard``: the FP8 shard ``sequence_parallel_gemm_input`` handed out (``None`` when it
    gathered in high precision); ``inp``: this rank's input as it came in. The core was asked
    for no transposed copy of ``full`` when ``shard`` is set (the backward builds it from the
    gathered shard)."""
    if shard is not None and needs_wgrad:
        saved.x = shard
        return _FP8_SHARD
    x = saved.x
    if type(x) is torch.Tensor and full is not inp and x.data_ptr() == full.data_ptr():
        # the core kept the gathered high-precision input as it is: keep the local rows
        saved.x = inp.reshape(-1, inp.shape[-1])
        return _HIGH_PRECISION_SHARD
    return None


def mark_kept_shard(saved, shard, needs_wgrad: bool) -> str | None:
    """:func:`keep_local_shard` for a GEMM that read this rank's rows itself, chunk by chunk
    with the others' (``_ring_gemm.all_gather_gemm``): the FP8 ``shard`` it read is kept when the
    weight gradient needs it; a high-precision ``saved.x`` already is the local rows."""
    if shard is not None and needs_wgrad:
        saved.x = shard
        return _FP8_SHARD
    return _HIGH_PRECISION_SHARD if type(saved.x) is torch.Tensor else None


def restore_gathered_input(saved, kept: str | None, group):
    """In the backward, before the weight gradient: issue the all-gather over ``group`` of
    ``saved.x`` as :func:`keep_local_shard` left it (``kept``), asynchronously (``saved.x``
    keeps the shard meanwhile), and return a function that waits for it and sets ``saved.x``
    to the gathered input (``None`` when there is nothing to gather)."""
    if kept == _FP8_SHARD:
        finish = regather_fp8_shard(saved.x, group, async_op=True)
    elif kept == _HIGH_PRECISION_SHARD:
        gathered, handle = gather_along_first_dim(saved.x, group, async_op=True)

        def finish():
            if handle is not None:
                handle.wait()
            return gathered
    else:
        return None

    def set_gathered():
        saved.x = finish()

    return set_gathered


def check_sequence_parallel_scaling(owner: str, recipe, tp_group) -> None:
    """Under delayed scaling, a sequence-parallel GEMM casts the gathered input with the scale
    of its amax history, so every rank must hold the same history: the amaxes must be reduced
    (``recipe.reduce_amax=True``) over a group that contains the tensor-parallel group.
    ``RuntimeError`` naming ``owner`` and the fix otherwise; other recipes pass."""
    if recipe is None or not recipe.delayed():
        return
    if not recipe.reduce_amax:
        raise RuntimeError(
            f"{owner}: sequence_parallel=True under DelayedScaling needs "
            "recipe.reduce_amax=True, so that every tensor-parallel rank casts with the "
            "same scale"
        )
    if not group_contains(FP8GlobalStateManager.get_fp8_group(), tp_group):
        raise RuntimeError(
            f"{owner}: sequence_parallel=True under DelayedScaling needs the autocast's "
            "amax_reduction_group to contain the tensor-parallel group (normally the "
            "data x tensor parallel group); pass te.autocast(..., "
            "amax_reduction_group=...) accordingly"
        )


def reduce_amaxes_over(quantizers, group) -> None:
    """Current scaling: each of ``quantizers`` (those of operands split over the
    tensor-parallel ranks) all-reduces (MAX) its amax over ``group`` before computing its
    scale, so every rank casts with the whole tensor's scale; other quantizers are left as
    they are."""
    for quantizer in quantizers:
        if hasattr(quantizer, "with_amax_reduction"):
            quantizer.with_amax_reduction = True
            quantizer.amax_reduction_group = group
