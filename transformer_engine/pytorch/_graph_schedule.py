"""Which graphs ``te.make_graphed_callables`` captures, and in what order.

Without ``_order`` every callable gets one forward and one backward graph, captured forwards
first and backwards in reverse: the order of one training step. With ``_order`` (Megatron-LM's
pipeline schedules) the callables are the layers of ``C`` model chunks (``_num_layers_per_chunk``
each, or an equal share), and every layer gets one pair of graphs per microbatch: ``_order``
lists the schedule's steps, ``+c`` the forward of chunk ``c``'s next microbatch (its layers in
order), ``-c`` the backward of its oldest one whose backward has not run (its layers in
reverse). Graphs are captured in that order into one memory pool, so a graph may reuse memory
that an earlier step's graphs no longer need by then in that schedule: replays must follow the
same order. ``sample_args`` holds one entry per graph, chunk by chunk, then microbatch by
microbatch, then layer by layer; the graphed functions come back in the same layout.
"""

from __future__ import annotations

import numbers

__all__ = ["Schedule"]

_WHO = "make_graphed_callables"


class Schedule:
    """``entries``: per graphed function, ``(sample index, callable index)``; ``plan``: the
    captures in order, ``(True, entry)`` for a forward and ``(False, entry)`` for a backward."""

    def __init__(self, n_callables: int, order=None, layers_per_chunk=None) -> None:
        self.ordered = order is not None
        if not self.ordered:
            self.num_microbatches = 1
            self.entries = [(i, i) for i in range(n_callables)]
            self.plan = [(True, i) for i in range(n_callables)]
            self.plan += [(False, i) for i in reversed(range(n_callables))]
            return
        chunks, microbatches = _check_order(order)
        layers = _layers_per_chunk(layers_per_chunk, chunks, n_callables)
        self.num_microbatches = microbatches
        first_callable = [sum(layers[:c]) for c in range(chunks)]
        first_sample = [f * microbatches for f in first_callable]

        def entry(c: int, m: int, layer: int) -> int:  # the sample index is the entry's
            return first_sample[c] + m * layers[c] + layer

        self.entries = [
            (entry(c, m, layer), first_callable[c] + layer)
            for c in range(chunks)
            for m in range(microbatches)
            for layer in range(layers[c])
        ]

        forwards, backwards, self.plan = [0] * chunks, [0] * chunks, []
        for step in order:
            c = abs(step) - 1
            if step > 0:
                self.plan += [(True, entry(c, forwards[c], layer)) for layer in range(layers[c])]
                forwards[c] += 1
            else:
                backs = reversed(range(layers[c]))
                self.plan += [(False, entry(c, backwards[c], layer)) for layer in backs]
                backwards[c] += 1

    @property
    def num_samples(self) -> int:
        return len(self.entries)


def _check_order(order) -> tuple[int, int]:
    """``(chunks, microbatches)`` of a valid ``_order``, else a ``ValueError`` naming the fault."""
    if isinstance(order, (str, bytes)) or not hasattr(order, "__len__"):
        raise ValueError(f"{_WHO}: _order must be a list of chunk numbers, got {order!r}")
    steps = list(order)
    for step in steps:
        if isinstance(step, numbers.Real) and not isinstance(step, bool) and step != int(step):
            raise NotImplementedError(
                f"{_WHO}: _order holds {step!r}; fractional steps (separate weight-gradient "
                "graphs in the schedule) are not supported: use whole chunk numbers, and "
                "delay_wgrad_compute's backward_dw() on each graphed function"
            )
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step == 0:
            raise ValueError(
                f"{_WHO}: _order holds {step!r}; each step is a nonzero int: +c runs the "
                "forward of model chunk c (1-based), -c its backward"
            )
    if not steps:
        raise ValueError(f"{_WHO}: _order is empty")
    chunks = max(abs(s) for s in steps)
    microbatches = len(steps) // (2 * chunks)
    forwards, backwards = [0] * chunks, [0] * chunks
    for i, step in enumerate(steps):
        c = abs(step) - 1
        if step > 0:
            forwards[c] += 1
        else:
            backwards[c] += 1
            if backwards[c] > forwards[c]:
                raise ValueError(
                    f"{_WHO}: _order step {i} ({step}) is backward number {backwards[c]} of "
                    f"chunk {c + 1}, which has had only {forwards[c]} forward(s) by then"
                )
    if set(forwards + backwards) != {microbatches} or len(steps) != 2 * chunks * microbatches:
        raise ValueError(
            f"{_WHO}: _order must run every chunk 1..{chunks} forward and backward the same "
            f"number of times (the microbatches); it has forwards {forwards} and backwards "
            f"{backwards} per chunk"
        )
    return chunks, microbatches


def _layers_per_chunk(layers, chunks: int, n_callables: int) -> list[int]:
    if layers is None:
        if n_callables % chunks:
            raise ValueError(
                f"{_WHO}: {n_callables} callables do not split evenly into the {chunks} model "
                "chunks of _order; pass _num_layers_per_chunk"
            )
        return [n_callables // chunks] * chunks
    layers = list(layers)
    if (
        len(layers) != chunks
        or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in layers)
        or sum(layers) != n_callables
    ):
        raise ValueError(
            f"{_WHO}: _num_layers_per_chunk={layers!r} must give {chunks} positive ints (one "
            f"per model chunk of _order) summing to the {n_callables} callables"
        )
    return layers
