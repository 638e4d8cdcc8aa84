"""``checkpoint_core_attention``: attention whose activations (the probabilities, the dropout
mask) are recomputed in backward instead of kept.

The recompute must draw the same dropout mask as the forward. torch's checkpoint restores the
default CPU and CUDA generators; the states of a user's RNG tracker (``get_rng_state_tracker``,
whose ``fork()`` swaps its own state in around the dropout) are restored here as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils.checkpoint

__all__ = ["recompute_in_backward"]


class _TrackerStatesAsBefore:
    """Context manager: the tracker's states as they were at the forward, for the recompute;
    the states it had before the recompute afterwards."""

    def __init__(self, tracker, states) -> None:
        self.tracker, self.states, self.current = tracker, states, None

    def __enter__(self) -> None:
        self.current = dict(self.tracker.get_states())
        self.tracker.set_states(dict(self.states))

    def __exit__(self, exc_type, exc, tb) -> None:
        self.tracker.set_states(self.current)


def recompute_in_backward(function: Callable, *tensors: torch.Tensor, tracker=None):
    """``function(*tensors)``, keeping none of its intermediate tensors: backward runs it again
    (non-reentrant ``torch.utils.checkpoint``) with the same RNG states."""
    states = None if tracker is None else dict(tracker.get_states())

    def contexts():
        if tracker is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), _TrackerStatesAsBefore(tracker, states)

    return torch.utils.checkpoint.checkpoint(
        function, *tensors, use_reentrant=False, preserve_rng_state=True, context_fn=contexts
    )
