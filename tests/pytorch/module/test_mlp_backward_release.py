"""``te.LayerNormMLP`` gives memory back during its own backward: once FC2's gradients are
computed, the activation FC2 saved (FP8, its transposed copy, under an FP8 recipe) is freed
before FC1's backward allocates the activation's gradient, which is where the step's memory
peaks. A second backward through the same forward is refused with a clear error instead of
failing on the freed tensors.

Whether the memory is free is checked on the objects Python can reach: no tensor anywhere may
still hold the saved activation's buffer when the activation's gradient is computed (a typed
FP8 view kept by the storage would keep the bytes alive although the saved tensor is emptied).
"""

from __future__ import annotations

import gc

import pytest
import torch
from utils import autocast_by_name, live_cpu_tensors_on

import transformer_engine.pytorch as te
from transformer_engine.pytorch.module import _mlp_function

TOKENS, HIDDEN, FFN = 64, 32, 128


def _module(activation: str) -> te.LayerNormMLP:
    torch.manual_seed(0)
    return te.LayerNormMLP(
        HIDDEN, FFN, activation=activation, device="cpu", params_dtype=torch.bfloat16
    )


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("precision", [None, "delayed", "current"])
def test_saved_activation_is_freed_before_the_activation_gradient(
    monkeypatch, precision, activation
):
    module = _module(activation)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    # The activation's saved buffer: FP8 bytes of shape (FFN, TOKENS) (the transposed copy
    # FC2's weight gradient reads), or the BF16 activation (TOKENS, FFN).
    act_shapes = {(FFN, TOKENS), (TOKENS, FFN)}
    act_dtypes = {torch.uint8, torch.bfloat16}
    saved = []

    def pack(tensor):
        if tuple(tensor.shape) in act_shapes and tensor.dtype in act_dtypes:
            saved.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with autocast_by_name(precision):
            y = module(x)
    # FC2's operands are saved before FC1's output (which has the activation's shape too under
    # GELU): the first matching buffer is the activation's.
    assert saved, "the activation must be saved for backward"
    act_address = saved[0]
    assert live_cpu_tensors_on([act_address]), "the activation must be alive after forward"
    still_held = []
    original = _mlp_function._activation_gradient

    def spy(ctx, saved1, d_act, h2):
        gc.collect()
        still_held.extend((tuple(t.shape), t.dtype) for t in live_cpu_tensors_on([act_address]))
        return original(ctx, saved1, d_act, h2)

    monkeypatch.setattr(_mlp_function, "_activation_gradient", spy)
    y.backward(torch.randn_like(y))
    assert x.grad is not None
    assert not still_held, f"the activation's buffer is still held by {still_held}"


@pytest.mark.parametrize("precision", [None, "delayed"])
def test_second_backward_through_one_forward_is_refused(precision):
    module = _module("gelu")
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name(precision):
        y = module(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        y.sum().backward()
    # A new forward backpropagates again.
    with autocast_by_name(precision):
        module(x).sum().backward()
