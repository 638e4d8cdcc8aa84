"""te.ops.ScaledSwiGLU: SwiGLU times an extra input of one scale per row, forward and both
gradients against float64 autograd through the formula."""

import pytest
import torch
import torch.nn.functional as F
from utils import needs_cuda

import transformer_engine.pytorch as te

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def oracle(x, scales):
    x1, x2 = x.chunk(2, dim=-1)
    return F.silu(x1) * x2 * scales.unsqueeze(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_and_gradients_match_float64(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g).to(device, dtype).requires_grad_()
    scales = torch.rand(3, 5, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(3, 5, 8, generator=g).to(device, dtype)
    model = te.ops.Sequential(te.ops.ScaledSwiGLU())
    y = model(x, scales)
    y.backward(dy)
    x64 = x.detach().double().cpu().requires_grad_()
    s64 = scales.detach().double().cpu().requires_grad_()
    y64 = oracle(x64, s64)
    y64.backward(dy.double().cpu())
    assert y.shape == (3, 5, 8) and y.dtype == dtype and y.device == x.device
    for got, want in ((y, y64), (x.grad, x64.grad), (scales.grad, s64.grad)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=tol, atol=tol * scale)


def test_scales_of_the_wrong_size_are_refused():
    model = te.ops.Sequential(te.ops.ScaledSwiGLU())
    with pytest.raises(ValueError, match="one scale per row"):
        model(torch.randn(4, 8), torch.ones(3))
