"""``tex.rmsnorm_bwd_add``: RMSNorm backward with a gradient added to ``dx`` (the residual
branch's), against float64 autograd of the RMSNorm formula plus that gradient; the sum is
rounded once (float32 sum, one cast to the input's dtype); bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

import transformer_engine_torch as tex

EPS = 1e-5


def _operands(dtype, seed=0, shape=(6, 5, 32)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    dz = torch.randn(shape, generator=g).to(dtype)
    add = torch.randn(shape, generator=g).to(dtype)
    return x, w, dz, add


def _oracle(x, w, dz, add, zero_centered):
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    gamma = 1 + w64 if zero_centered else w64
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    y.backward(dz.double())
    return x64.grad + add.double(), w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_bwd_add_is_the_backward_plus_the_added_gradient(dtype, zero_centered):
    x, w, dz, add = _operands(dtype)
    _, _, rsigma = tex.rmsnorm_fwd(x, w, EPS, None, None, tex.DType.cast(dtype), 0, zero_centered)
    dx, dgamma = tex.rmsnorm_bwd_add(dz, x, add, rsigma, w, 0, zero_centered)
    assert (dx.dtype, dgamma.dtype, dx.shape) == (dtype, dtype, x.shape)
    ex, ew = _oracle(x, w, dz, add, zero_centered)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(dx.double(), ex, **tol)
    torch.testing.assert_close(dgamma.double(), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)
    # one rounding: the float32 backward plus the addend, cast once
    dx_plain, dgamma_plain = tex.rmsnorm_bwd(dz, x, rsigma, w, 0, zero_centered)
    assert torch.equal(dgamma, dgamma_plain)
    if dtype == torch.float32:
        assert torch.equal(dx, dx_plain + add)


def test_rmsnorm_bwd_add_refuses_an_addend_of_another_shape():
    x, w, dz, add = _operands(torch.float32)
    _, _, rsigma = tex.rmsnorm_fwd(x, w, EPS, None, None, tex.DType.kFloat32, 0, False)
    with pytest.raises(ValueError, match="add has shape"):
        tex.rmsnorm_bwd_add(dz, x, add[:, :1], rsigma, w, 0, False)
    with pytest.raises(TypeError):
        tex.rmsnorm_bwd_add(dz, x, add.to(torch.int32), rsigma, w, 0, False)
