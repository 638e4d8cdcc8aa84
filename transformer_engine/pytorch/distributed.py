"""Activation recompute (``te.checkpoint`` / ``te.distributed.checkpoint``) that keeps
delayed-scaling FP8 state consistent.

A recomputed forward must cast exactly like the original forward, although the scales may
have been updated in between (at the autocast exit). So, inside a checkpointed region:

* the original forward of each FP8 module stashes a copy of its forward scale and amax history
  (a FIFO per module, for regions that call a module several times);
* the recompute swaps the stashed values in, runs, and then puts the up-to-date values back,
  which also discards the amaxes the recompute accumulated (no amax is registered twice);
* the recompute runs under the autocast state captured when the region first ran.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from .quantization import FP8GlobalStateManager

__all__ = [
    "checkpoint",
    "is_fp8_activation_recompute_enabled",
    "in_fp8_activation_recompute_phase",
]

_local = threading.local()


def _phase() -> str | None:
    return getattr(_local, "phase", None)


@contextlib.contextmanager
def _in_phase(phase: str):
    previous = _phase()
    _local.phase = phase
    try:
        yield
    finally:
        _local.phase = previous


def is_fp8_activation_recompute_enabled() -> bool:
    """Inside the original forward of a checkpointed region, with FP8 enabled."""
    return _phase() == "forward" and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """Inside the recompute (during backward) of a checkpointed region."""
    return _phase() == "recompute"


def checkpoint(
    function: Callable,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Callable | None = None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in
    backward with the same FP8 scales as the original forward.

    Parameters
    ----------
    function : callable
    distribute_saved_activations : bool, default False
        Not implemented yet (tensor parallelism); True raises ``NotImplementedError``.
    get_rng_state_tracker : callable, optional
        Not used yet; the CPU and CUDA RNG states are preserved by torch's checkpoint.
    tp_group : ProcessGroup, optional
        Not used (single process).
    use_reentrant : bool, default True
        Passed to ``torch.utils.checkpoint.checkpoint``.
    """
    if distribute_saved_activations:
        raise NotImplementedError(
            "checkpoint: distribute_saved_activations=True needs tensor parallelism, which is "
            "not implemented yet"
        )
    calls = {"count": 0}
    autocast_state = FP8GlobalStateManager.get_autocast_state()

    def run(*inner_args):
        calls["count"] += 1
        if calls["count"] == 1:
            with _in_phase("forward"):
                return function(*inner_args, **kwargs)
        saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.set_autocast_state(autocast_state)
        try:
            with _in_phase("recompute"):
                return function(*inner_args, **kwargs)
        finally:
            FP8GlobalStateManager.set_autocast_state(saved)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant)
