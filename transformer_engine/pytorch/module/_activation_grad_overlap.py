"""``LayerNormMLP``'s backward: the activation's gradient beside FC2's weight-gradient GEMM.

FC2's backward computes its input gradient (the activation's output gradient), then its weight
gradient. The activation's gradient (written in FP8 with FC1's grad-output scale; under current
scaling after an amax pass) needs only the first. Its passes are memory-bound and the weight
gradient GEMM compute-bound, so they run side by side: after the input-gradient GEMM a side
stream of the device waits for the calling stream and runs the activation's gradient while the
calling stream runs the weight-gradient GEMM; the calling stream waits for the side stream
before FC1's GEMMs read the result. The numbers are those of the sequential order (the same
kernels on the same inputs).

Memory across the two streams: what the side stream reads (FC2's input gradient, FC1's saved
output) was allocated on the calling stream and is held until the join. What it allocates (the
FP8 gradient, its transposed copy, the bias gradient, scratch) comes from the side stream's
pool and is used and freed on the calling stream after the join; every later allocation on the
side stream follows another fork, a wait for the calling stream, so it is ordered after those
uses. Inside a CUDA-graph capture the fork and join are captured like any stream dependency.

Used where nothing in the activation's gradient communicates (no amax reduction group, no
collectives on FC2's backward), FC2's weight gradient runs now (not deferred) and the tensors
are large enough for the overlap to outweigh the fork's host cost (``MIN_ELEMENTS``).
``NVTE_MLP_OVERLAP_ACTIVATION_GRAD=0`` (read at each backward) keeps everything on the calling
stream.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ActivationGradientBesideWgrad", "overlap_wanted"]

#: Below this many elements of FC1's output the activation's gradient runs in a few
#: microseconds and the fork and join (two stream waits, about 10-20 us of host time) would
#: cost more than they hide.
MIN_ELEMENTS = 1 << 22

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def overlap_wanted(h2: torch.Tensor) -> bool:
    """Whether the activation's gradient of FC1's output ``h2`` runs on the side stream (the
    caller checks the rest: FP8 producer, no communication, weight gradient now)."""
    return (
        h2.device.type == "cuda"
        and h2.numel() >= MIN_ELEMENTS
        and os.environ.get("NVTE_MLP_OVERLAP_ACTIVATION_GRAD", "1") != "0"
    )


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


class ActivationGradientBesideWgrad:
    """``linear_backward``'s ``communication`` hooks for FC2's backward, communicating
    nothing: once the input gradient ``dx`` is computed (``dgrad_ready``, called before the
    weight-gradient GEMM is issued), ``compute(dx)`` is issued on the side stream; ``join()``
    makes the calling stream wait for it and returns its result."""

    __slots__ = ("compute", "result", "calling", "side")

    def __init__(self, compute) -> None:
        self.compute = compute
        self.result = self.calling = self.side = None

    def before_dgrad(self) -> None:
        pass

    def dgrad(self, gemm, grad):
        return gemm(grad)

    def before_wgrad(self) -> None:
        pass

    def wgrad_operand(self, grad):
        return grad

    def dgrad_ready(self, dx: torch.Tensor) -> None:
        calling = torch.cuda.current_stream(dx.device)
        side = _side_stream(dx.device)
        side.wait_stream(calling)
        with torch.cuda.stream(side):
            self.result = self.compute(dx)
        self.calling, self.side = calling, side

    def join(self):
        """The calling stream waits for the side stream; ``compute``'s result. ``None`` when
        ``dgrad_ready`` never ran (no input gradient)."""
        if self.side is None:
            return None
        self.calling.wait_stream(self.side)
        return self.result
