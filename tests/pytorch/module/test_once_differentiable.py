"""The modules' and te.ops' backward passes are differentiable once, as upstream's: a second
derivative through them raises instead of coming back from a partial graph (their backward
runs on saved, detached statistics, so a graph built through it would be wrong: a LayerNorm's
second derivative was off by 143 against torch's). First derivatives under create_graph=True
are unchanged."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te

BUILDERS = {
    "Linear": lambda: te.Linear(16, 16, device="cpu"),
    "LayerNormLinear": lambda: te.LayerNormLinear(16, 16, device="cpu"),
    "LayerNormMLP": lambda: te.LayerNormMLP(16, 32, device="cpu"),
    "LayerNorm": lambda: te.LayerNorm(16, device="cpu"),
    "RMSNorm": lambda: te.RMSNorm(16, device="cpu"),
    "GroupedLinear": lambda: te.GroupedLinear(2, 16, 16, device="cpu"),
    "ops": lambda: te.ops.Sequential(te.ops.Linear(16, 16, device="cpu"), te.ops.GELU()),
}


def run(name, module, x):
    return module(x, [2, 2]) if name == "GroupedLinear" else module(x)


@pytest.mark.parametrize("name", BUILDERS)
def test_second_derivative_raises(name):
    torch.manual_seed(0)
    module, x = BUILDERS[name](), torch.randn(4, 16, requires_grad=True)
    (first,) = torch.autograd.grad(run(name, module, x).pow(2).sum(), x, create_graph=True)
    plain = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(run(name, module, plain).pow(2).sum(), plain)
    assert torch.equal(first.detach(), expected)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first.sum().backward()
