"""The one owner of the backward scale update of an autocast region.

Forward scales update when the outermost enabled autocast exits; the backward pass ends later,
outside any autocast, so someone inside it must say "the backward of this region is complete".
That someone is the single :class:`BackwardScaleUpdate` claimed by the region's first FP8
module or fuser.
"""

from __future__ import annotations

from .state import FP8GlobalStateManager

__all__ = ["BackwardScaleUpdate", "claim_backward_update"]


class BackwardScaleUpdate:
    """The one owner of "the backward pass of this autocast region is complete: update the
    backward scales".

    The first FP8 module or fuser of an autocast region whose forward records a graph claims it
    (:func:`claim_backward_update`). Autograd runs backward in reverse order, so that module's
    backward is the region's last one; at its end the module (not the functional core, which
    touches no global state) calls :meth:`complete`. Nothing is updated while a CUDA graph is
    being captured (the graph helpers update outside the graph).
    """

    __slots__ = ()

    def complete(self) -> None:
        if not FP8GlobalStateManager.quantization_state.fp8_graph_capturing:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def claim_backward_update() -> BackwardScaleUpdate | None:
    """A :class:`BackwardScaleUpdate` for the region's first FP8 module, ``None`` for every other.

    Claiming clears the region's first-module flag, so call it only once the caller knows it
    will quantize in backward (an FP8 forward in grad mode without ``backward_override``).
    """
    if FP8GlobalStateManager.is_first_fp8_module():
        return BackwardScaleUpdate()
    return None
