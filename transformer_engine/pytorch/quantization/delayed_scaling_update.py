"""The unfused, per-module delayed-scaling update in PyTorch (upstream's Python path).

The registry runs the fused kernel for string algorithms; this path is used when a recipe
supplies callables (``amax_compute_algo`` or
``scaling_factor_compute_algo``), which the fused kernel cannot run. Unlike the fused kernel,
this path rolls the history even when the new amax is zero; that is upstream's behaviour for
this path and is kept on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..reference import FLOAT32_MAX

__all__ = [
    "_update_amax_history",
    "_default_get_amax_and_update_history",
    "_default_sf_compute",
    "_compute_amax_and_update_history",
    "_compute_scaling_factor",
    "_amax_and_scale_update",
    "split_and_copy",
]


def _update_amax_history(amax_history: torch.Tensor) -> torch.Tensor:
    """Roll by -1 along the history (newest last) and zero row 0, in place."""
    if amax_history.shape[0] > 1:
        amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].fill_(0.0)
    return amax_history


def _default_get_amax_and_update_history(
    amax_history: torch.Tensor, amax_compute_algo: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The amax a scale is computed from (before rolling), then the rolled history."""
    if amax_compute_algo == "max":
        amax = torch.max(amax_history, dim=0).values
    else:  # "most_recent"
        amax = amax_history[0].clone()
    return amax, _update_amax_history(amax_history)


def _default_sf_compute(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int
) -> torch.Tensor:
    """``(fp8_max / amax) / 2**margin``; keep the old scale for non-positive or non-finite
    amaxes; +Inf becomes FLT_MAX. Writes into ``scale`` and returns it."""
    sf = (fp8_max / amax) / (2**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, FLOAT32_MAX), sf)
    scale.copy_(sf)
    return scale


def _compute_amax_and_update_history(
    amax_history: torch.Tensor, amax_compute_algo: str | Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    if callable(amax_compute_algo):
        amax = amax_compute_algo(amax_history)
        return amax, _update_amax_history(amax_history)
    return _default_get_amax_and_update_history(amax_history, amax_compute_algo)


def _compute_scaling_factor(amax, scale, fp8_max, recipe) -> torch.Tensor:
    if recipe.scaling_factor_compute_algo is None:
        return _default_sf_compute(amax, scale, fp8_max, recipe.margin)
    return recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)


def _amax_and_scale_update(
    amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe
) -> None:
    """One module's update on the device its tensors live on."""
    amax, amax_history = _compute_amax_and_update_history(amax_history, recipe.amax_compute_algo)
    new_scale = _compute_scaling_factor(amax, scale, fp8_max, recipe)
    if new_scale is not scale:
        scale.copy_(new_scale)


def split_and_copy(
    buffer: torch.Tensor, outputs: list[torch.Tensor], chunk_sizes: list[int]
) -> None:
    """Copy consecutive chunks of ``buffer`` into ``outputs`` (each on its own device)."""
    for chunk, out in zip(torch.split(buffer, chunk_sizes), outputs):
        out.copy_(chunk)
