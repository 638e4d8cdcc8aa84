"""te.ops.L2Normalization against the formula written out by hand,
y = x / sqrt(sum(x^2) + eps) over the last dimension, and its gradient (PyTorch autograd through
that formula, and the closed form at a zero vector)."""

import pytest
import torch

from transformer_engine.pytorch import ops


def l2_formula(x, eps):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(7,), (4, 16), (2, 3, 33)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_l2_normalization_float64(shape, eps):
    torch.manual_seed(31)
    x0 = torch.randn(shape, dtype=torch.float64) * 3
    dy = torch.randn(shape, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    y = ops.L2Normalization(eps=eps)(x)
    y.backward(dy)

    xe = x0.clone().requires_grad_()
    ye = l2_formula(xe, eps)
    ye.backward(dy)
    assert y.dtype == torch.float64 and y.shape == x0.shape
    torch.testing.assert_close(y, ye, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)


def test_l2_normalization_unit_norm_and_zero_vector():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    y = ops.L2Normalization(eps=0.0)(x[:1])
    expected = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(y, expected, rtol=1e-15, atol=1e-15)
    # at x = 0 the output is 0 and the gradient is dy / sqrt(eps)
    eps = 0.25
    y = ops.L2Normalization(eps=eps)(x)
    dy = torch.tensor([[0.0, 0.0], [1.0, -2.0]], dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(y[1].detach(), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(x.grad[1], torch.tensor([2.0, -4.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_l2_normalization_low_precision(dtype):
    """Computed in float32 and rounded once to the input's dtype; gradients in that dtype."""
    torch.manual_seed(32)
    x0 = (torch.randn(8, 64) * 2).to(dtype)
    dy = torch.randn(8, 64).to(dtype)
    x = x0.clone().requires_grad_()
    y = ops.L2Normalization()(x)
    y.backward(dy)
    xe = x0.double().requires_grad_()
    ye = l2_formula(xe, 1e-6)
    ye.backward(dy.double())
    assert y.dtype == dtype and x.grad.dtype == dtype
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(y.double(), ye, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), xe.grad, rtol=tol, atol=tol)


def test_l2_normalization_in_a_sequence():
    torch.manual_seed(33)
    linear = ops.Linear(16, 16, device="cpu")
    seq = ops.Sequential(linear, ops.L2Normalization(eps=1e-6))
    x0, dy = torch.randn(4, 16), torch.randn(4, 16)
    x = x0.clone().requires_grad_()
    seq(x).backward(dy)
    xe = x0.clone().requires_grad_()
    l2_formula(torch.nn.functional.linear(xe, linear.weight, linear.bias), 1e-6).backward(dy)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-6)


def test_l2_normalization_arguments():
    op = ops.L2Normalization()
    assert (op.eps, op.seq_length, op.micro_batch_size) == (1e-6, None, None)
    assert list(op.parameters()) == []
    op = ops.L2Normalization(1e-5, seq_length=128, micro_batch_size=2)
    assert (op.eps, op.seq_length, op.micro_batch_size) == (1e-5, 128, 2)
    with pytest.raises(ValueError, match="eps must be non-negative"):
        ops.L2Normalization(eps=-1.0)
    with pytest.raises(ValueError, match="seq_length must be positive, got 0"):
        ops.L2Normalization(seq_length=0)
    with pytest.raises(TypeError, match="micro_batch_size must be an int or None, got 2.5"):
        ops.L2Normalization(micro_batch_size=2.5)
    with pytest.raises(TypeError, match="floating-point"):
        ops.L2Normalization()(torch.ones(3, dtype=torch.int64))
