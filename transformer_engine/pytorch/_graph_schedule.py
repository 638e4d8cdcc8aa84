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

A negative step that is not a whole number is a weight-gradient step: ``s`` with
``ceil(s) == -c`` (``-1.5`` for chunk 1) marks where the schedule runs the deferred
weight-gradient GEMMs (``delay_wgrad_compute`` modules) of chunk ``c``'s oldest backward whose
weight gradients have not run: the caller calls its layers' functions' ``backward_dw()`` there.
Those graphs are captured right after their backward and keep what they read alive, so their
place in the schedule changes no capture; it is checked (after that backward, once per
microbatch).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["Schedule"]

_WHO = "make_graphed_callables"


class Schedule:
    """``entries``: per graphed function, ``(sample index, callable index)``; ``plan``: the
    captures in order, ``(True, entry)`` for a forward and ``(False, entry)`` for a backward;
    ``previous_layer``: entry -> the entry of the layer before it in the same chunk and
    microbatch (whose output feeds it in a pipeline schedule); ``chunk_of``: entry -> its model
    chunk."""

    def __init__(self, n_callables: int, order=None, layers_per_chunk=None) -> None:
        self.ordered = order is not None
        if not self.ordered:
            self.num_microbatches = 1
            self.previous_layer: dict[int, int] = {}
            self.chunk_of = [0] * n_callables
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
        self.chunk_of = [c for c in range(chunks) for _ in range(microbatches * layers[c])]
        self.previous_layer = {
            entry(c, m, layer): entry(c, m, layer - 1)
            for c in range(chunks)
            for m in range(microbatches)
            for layer in range(1, layers[c])
        }

        forwards, backwards, self.plan = [0] * chunks, [0] * chunks, []
        for step in order:
            if _is_wgrad_step(step):
                continue  # captured with its backward (module docstring)
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
        if _is_wgrad_step(step):
            if math.ceil(step) == 0:
                raise ValueError(
                    f"{_WHO}: _order holds {step!r}, a weight-gradient step of chunk 0; chunk c's "
                    "is a number between -(c + 1) and -c, such as -1.5 for chunk 1"
                )
            continue
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step == 0:
            raise ValueError(
                f"{_WHO}: _order holds {step!r}; each step is a nonzero int: +c runs the "
                "forward of model chunk c (1-based), -c its backward (and a negative fraction "
                "-c.x the deferred weight gradients of that backward)"
            )
    whole = [s for s in steps if not _is_wgrad_step(s)]
    if not whole:
        raise ValueError(f"{_WHO}: _order is empty" if not steps else
                         f"{_WHO}: _order {steps!r} has weight-gradient steps only")  # fmt: skip
    chunks = max(max(abs(s) for s in whole), max((-math.ceil(s) for s in steps), default=0))
    microbatches = len(whole) // (2 * chunks)
    forwards, backwards, wgrads = [0] * chunks, [0] * chunks, [0] * chunks
    for i, step in enumerate(steps):
        if _is_wgrad_step(step):
            c = -math.ceil(step) - 1
            wgrads[c] += 1
            if wgrads[c] > backwards[c]:
                raise ValueError(
                    f"{_WHO}: _order step {i} ({step}) is weight-gradient step number "
                    f"{wgrads[c]} of chunk {c + 1}, which has had only {backwards[c]} "
                    "backward(s) by then"
                )
            continue
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
    if set(forwards + backwards) != {microbatches} or len(whole) != 2 * chunks * microbatches:
        raise ValueError(
            f"{_WHO}: _order must run every chunk 1..{chunks} forward and backward the same "
            f"number of times (the microbatches); it has forwards {forwards} and backwards "
            f"{backwards} per chunk"
        )
    if not set(wgrads) <= {0, microbatches}:
        raise ValueError(
            f"{_WHO}: _order's weight-gradient steps per chunk are {wgrads}; a chunk has one "
            f"after each of its {microbatches} backwards, or none"
        )
    return chunks, microbatches


def _is_wgrad_step(step) -> bool:
    """A negative step that is not a whole number: a weight-gradient step."""
    return (
        isinstance(step, numbers.Real)
        and not isinstance(step, (bool, numbers.Integral))
        and math.isfinite(step)
        and step < 0
        and step != math.floor(step)
    )


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
