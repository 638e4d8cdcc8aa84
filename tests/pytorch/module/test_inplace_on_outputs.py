"""A module's output may be modified in place (``y += residual``, ``y.mul_(s)``), as a
``torch.nn.Linear``'s may: outputs of 3-D inputs are not views of the GEMM's 2-D tensor
(autograd refuses in-place ops on views a custom function returned, and FSDP2 warns that they
drop its pre-backward hook). Oracle: the same module (a deep copy, same FP8 state) with the
same ops out of place; the gradients must be bitwise equal."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

H, FFN, SEQ, BATCH = 32, 64, 8, 2


def _modules():
    kw = {"device": "cpu"}
    return {
        "Linear": lambda: te.Linear(H, H, **kw),
        "LayerNormLinear": lambda: te.LayerNormLinear(H, H, **kw),
        "LayerNormMLP": lambda: te.LayerNormMLP(H, FFN, **kw),
        "RMSNorm-LayerNormMLP": lambda: te.LayerNormMLP(H, FFN, normalization="RMSNorm", **kw),
        "MultiheadAttention": lambda: te.MultiheadAttention(H, 2, attention_dropout=0.0, **kw),
        "TransformerLayer": lambda: te.TransformerLayer(
            H, FFN, 2, hidden_dropout=0.0, attention_dropout=0.0, **kw
        ),
        "LayerNorm": lambda: te.LayerNorm(H, **kw),
        "ops.Sequential": lambda: te.ops.Sequential(te.ops.Linear(H, H, **kw), te.ops.GELU()),
    }


RECIPES = {"bf16": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}


def _run(module, x, residual, recipe_name, in_place):
    recipe = RECIPES[recipe_name]
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe and recipe()):
        y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    assert not y._is_view(), "a module output is a view"
    if in_place:
        y.mul_(2.0)
        y += residual
    else:
        y = y * 2.0 + residual
    (y.float().square().sum()).backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return y.detach(), grads


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("name", sorted(_modules()))
def test_in_place_ops_on_outputs_match_out_of_place(name, recipe_name):
    torch.manual_seed(0)
    module = _modules()[name]().to(torch.bfloat16)
    oracle = copy.deepcopy(module)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, H, generator=g).bfloat16()
    residual = torch.randn(SEQ, BATCH, H, generator=g).bfloat16()
    y, grads = _run(module, x, residual, recipe_name, in_place=True)
    y_ref, grads_ref = _run(oracle, x, residual, recipe_name, in_place=False)
    assert torch.equal(y, y_ref)
    assert grads.keys() == grads_ref.keys() and len(grads) > 1
    for key in grads:
        assert torch.equal(grads[key], grads_ref[key]), key


def test_inference_outputs_are_not_views_either():
    module = te.Linear(H, H, device="cpu")
    with torch.no_grad():
        y = module(torch.randn(SEQ, BATCH, H))
    assert not y._is_view()
    y += 1.0  # allowed, as for any tensor
