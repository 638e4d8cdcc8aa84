"""Which module completes an autocast region's backward scale update: the first FP8 module
whose backward runs. A frozen first module (no parameter and no input requiring grad) never
runs its backward, so it must leave the update to the next module; otherwise the region's
backward scales stay at 1 for good (delayed scaling), and small gradients underflow E5M2."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

H = 32


def make(kind):
    if kind == "GroupedLinear":
        return te.GroupedLinear(2, H, H, device="cpu")
    return getattr(te, kind)(H, H, device="cpu")


def run(kind, module, x):
    return module(x, [8, 8]) if kind == "GroupedLinear" else module(x)


@pytest.mark.parametrize("first", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_a_frozen_first_module_leaves_the_update_to_the_next(first):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    frozen, trained = make(first), te.Linear(H, H, device="cpu")
    frozen.requires_grad_(False)
    for _ in range(2):
        x = torch.randn(16, H)  # no grad: nothing upstream of the frozen module trains
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            y = trained(run(first, frozen, x))
        (y * 3.0).sum().backward()
    state = trained.fp8_meta["scaling_bwd"]
    # the trained layer's output gradient (3 everywhere) was rolled and its scale updated
    assert state.amax_history[0, 0] == 0.0 and state.amax_history[-1, 0] == 3.0
    assert state.scale[0] == torch.tensor(57344.0) / torch.tensor(3.0)
    assert trained.weight.grad is not None


def test_a_trainable_first_module_still_owns_it():
    """The usual case is unchanged: one update a step, by the first module."""
    FP8GlobalStateManager.reset()
    first, second = te.Linear(H, H, device="cpu"), te.Linear(H, H, device="cpu")
    calls = []
    original = FP8GlobalStateManager.reduce_and_update_fp8_tensors

    def spy(forward=True, **kw):
        calls.append(forward)
        return original(forward=forward, **kw)

    FP8GlobalStateManager.reduce_and_update_fp8_tensors = spy
    try:
        with te.autocast(recipe=DelayedScaling()):
            y = second(first(torch.randn(16, H, requires_grad=True)))
        y.sum().backward()
    finally:
        FP8GlobalStateManager.reduce_and_update_fp8_tensors = original
    assert calls.count(False) == 1
