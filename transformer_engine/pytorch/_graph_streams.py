"""Where a graphed callable's replay runs: on the calling stream, or on a side stream the caller
names with upstream's replay keywords ``cuda_graph_stream`` and ``cuda_graph_event``.

A side-stream replay lets the graph overlap with work the caller issues afterwards on its own
stream. The side stream first waits for the calling stream (so the graph reads the inputs as the
caller left them), the graph replays there, and the calling stream then waits for the whole side
stream, or only for ``cuda_graph_event`` when one is given: an event the graph itself records
(``torch.cuda.Event(external=True)`` recorded by the module during capture), after which the
calling stream may go on while the rest of the graph still runs; so the eager copies into the
static tensors that a replay needs (and weight caching's flag) run on the side stream as well,
after the earlier replays.
The backward replays on the same side stream, ordered the same way against the stream autograd
runs it on, except that the calling stream then waits for the whole side stream: the event is
one the forward graph records, and whether the backward graph records it again is not known.
"""

from __future__ import annotations

import torch

__all__ = ["ReplayStream"]


class ReplayStream:
    """A side stream to replay on, and what the calling stream then waits for."""

    __slots__ = ("stream", "event")

    def __init__(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        self.stream, self.event = stream, event

    @staticmethod
    def take(kwargs: dict, device: torch.device, who: str) -> ReplayStream | None:
        """Pop the replay keywords from ``kwargs``; None when the replay runs where it is called
        (no side stream, or the calling stream itself). Checked before anything runs."""
        stream = kwargs.pop("cuda_graph_stream", None)
        event = kwargs.pop("cuda_graph_event", None)
        if stream is None and event is None:
            return None
        if event is not None and not isinstance(event, torch.cuda.Event):
            raise TypeError(
                f"{who}: cuda_graph_event must be a torch.cuda.Event (one the graph records), "
                f"got {type(event).__name__}"
            )
        if stream is None:
            return None  # the graph and its event are on the calling stream: nothing to wait for
        if not isinstance(stream, torch.Stream) or torch.device(stream.device).type != "cuda":
            raise TypeError(f"{who}: cuda_graph_stream must be a torch.cuda.Stream, got {stream!r}")
        if torch.device(stream.device) != device:
            raise ValueError(
                f"{who}: cuda_graph_stream is on {torch.device(stream.device)}, the graph on "
                f"{device}; replay on a stream of {device} (torch.cuda.Stream(device={device!r}))"
            )
        if stream == torch.cuda.current_stream(device):
            return None
        return ReplayStream(stream, event)

    def for_backward(self) -> ReplayStream:
        """The same side stream, awaited whole (the event marks a point of the forward graph)."""
        return ReplayStream(self.stream, None)

    def replay(self, graph: torch.cuda.CUDAGraph, device: torch.device, prepare) -> None:
        """``prepare()`` and ``graph`` replayed on the side stream, ordered after and before the
        calling stream."""
        calling = torch.cuda.current_stream(device)
        self.stream.wait_stream(calling)
        with torch.cuda.stream(self.stream):
            prepare()
            graph.replay()
        if self.event is not None:
            calling.wait_event(self.event)
        else:
            calling.wait_stream(self.stream)
