"""``once_differentiable`` for the hot backward passes: PyTorch's decorator, paid only when a
graph of the backward is being recorded.

Autograd runs a backward with grad mode off unless ``create_graph=True``; PyTorch's
``torch.autograd.function.once_differentiable`` enters ``no_grad`` and inspects the outputs on
every call all the same, a dozen Python calls per backward node on the host-bound path of small
layers. Under ``create_graph=True`` this hands the call to PyTorch's decorator, which makes a
later second derivative raise ("trying to differentiate twice") instead of flowing through a
backward whose saved statistics are detached (which would give wrong values).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable as _torch_once_differentiable

__all__ = ["once_differentiable"]


def once_differentiable(backward):
    """Mark an ``autograd.Function.backward`` as differentiable once (see the module doc)."""
    recorded = _torch_once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: record the deferred error
            return recorded(ctx, *grads)
        return backward(ctx, *grads)

    return wrapper
