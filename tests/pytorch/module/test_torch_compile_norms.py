"""Norm backward under torch.compile (CPU, the aot_eager backend: no C++ compiler needed) is the
eager backward: the compute dtype is float32 whatever the traced statistics report (the fake
kernel of torch.native_layer_norm says bfloat16 for bfloat16 input on the CPU, where the real
one returns float32; a backward taking its dtype from them ran in bfloat16, 60x less precise
on inputs whose gradient cancels)."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te

H = 64


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_compiled_bf16_norm_backward_equals_eager(kind):
    torch.manual_seed(0)
    norm = getattr(te, kind)(H, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.01)
    x = torch.randn(32, H, dtype=torch.bfloat16)
    dy = (1 + 1e-2 * torch.randn(32, H)).to(torch.bfloat16)  # a gradient that mostly cancels
    results = []
    for fn in (norm, torch.compile(norm, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        norm.zero_grad(set_to_none=True)
        fn(xi).backward(dy)
        results.append((xi.grad, norm.weight.grad))
    torch._dynamo.reset()
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
