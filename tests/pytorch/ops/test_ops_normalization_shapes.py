"""te.ops.LayerNorm / te.ops.RMSNorm over a multi-dimensional ``normalized_shape``: the trailing
dimensions are normalized together, with parameters of that shape. Against
torch.nn.functional.layer_norm / rms_norm in float64 (float64 input; the float32 parameters
hold values that float64 represents exactly)."""

import re

import pytest
import torch
import torch.nn.functional as F

from transformer_engine.pytorch import ops


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("normalized_shape", [(4, 6), (2, 3, 5)], ids=["2d", "3d"])
def test_multi_dim_normalized_shape_against_float64(kind, zero_centered_gamma, normalized_shape):
    torch.manual_seed(21)
    op = getattr(ops, kind)(
        list(normalized_shape), eps=1e-5, device="cpu", zero_centered_gamma=zero_centered_gamma
    )
    assert op.normalized_shape == normalized_shape
    params = list(op.parameters())
    assert all(p.shape == normalized_shape and p.dtype == torch.float32 for p in params)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(normalized_shape) * 0.5 + 0.25)

    x0 = torch.randn(3, 2, *normalized_shape, dtype=torch.float64) * 2 + 1
    dy = torch.randn(x0.shape, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    y = op(x)
    y.backward(dy)

    xe = x0.clone().requires_grad_()
    leaves = [p.detach().double().requires_grad_() for p in params]
    gamma = leaves[0] + 1 if zero_centered_gamma else leaves[0]
    if kind == "LayerNorm":
        ye = F.layer_norm(xe, normalized_shape, gamma, leaves[1], 1e-5)
    else:
        ye = F.rms_norm(xe, normalized_shape, gamma, 1e-5)
    ye.backward(dy)

    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ye, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)
    for p, leaf in zip(params, leaves):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.double(), leaf.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_multi_dim_normalized_shape_on_meta_materializes_with_its_shape(kind):
    op = getattr(ops, kind)((4, 6), device="meta")
    y = op(torch.randn(2, 4, 6))
    assert all(p.shape == (4, 6) and not p.is_meta for p in op.parameters())
    assert y.shape == (2, 4, 6)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_input_without_the_normalized_trailing_dims(kind):
    op = getattr(ops, kind)((4, 6), device="cpu")
    msg = "input has shape (2, 6, 4), whose trailing dimensions must be normalized_shape=(4, 6)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        op(torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match=re.escape("normalized_shape=() names no dimension")):
        getattr(ops, kind)((), device="cpu")
