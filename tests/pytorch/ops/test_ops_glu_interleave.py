"""``glu_interleave_size`` of the SwiGLU ops (SwiGLU, ClampedSwiGLU, ScaledSwiGLU): the input's
halves interleaved in blocks of k columns, ``[G0:k, V0:k, Gk:2k, Vk:2k, ...]``, as an FC1 weight
reordered by ``te.interleave_glu_tensor`` produces. Oracle: the halves gathered block by block
with plain slicing, and the activation's formula in float64 (autograd for the gradients)."""

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import ops


def gather_halves(x, k):
    """[G, V] of an interleaved last dimension, by slicing each pair of blocks."""
    n = x.shape[-1]
    g = torch.cat([x[..., j : j + k] for j in range(0, n, 2 * k)], dim=-1)
    v = torch.cat([x[..., j + k : j + 2 * k] for j in range(0, n, 2 * k)], dim=-1)
    return g, v


def swiglu64(g, v):
    return F.silu(g) * v


def clamped64(g, v, limit=7.0, alpha=1.702, offset=1.0):
    a = g.clamp(max=limit)
    b = v.clamp(-limit, limit)
    return a * torch.sigmoid(alpha * a) * (b + offset)


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize(
    "make, formula",
    [(ops.SwiGLU, swiglu64), (ops.ClampedSwiGLU, clamped64)],
    ids=["swiglu", "clamped_swiglu"],
)
def test_interleaved_swiglu_matches_the_formula_on_the_gathered_halves(k, make, formula):
    torch.manual_seed(0)
    x = (3 * torch.randn(6, 64)).requires_grad_()
    dy = torch.randn(6, 32)
    y = make(glu_interleave_size=k)(x)
    (y * dy).sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64 = formula(*gather_halves(x64, k))
    (y64 * dy.double()).sum().backward()
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 8])
def test_scaled_swiglu_interleaved(k):
    torch.manual_seed(1)
    x = torch.randn(5, 32, requires_grad=True)
    scales = torch.rand(5, requires_grad=True)
    dy = torch.randn(5, 16)
    model = ops.Sequential(ops.ScaledSwiGLU(glu_interleave_size=k))
    (model(x, scales) * dy).sum().backward()
    x64 = x.detach().double().requires_grad_()
    s64 = scales.detach().double().requires_grad_()
    y64 = swiglu64(*gather_halves(x64, k)) * s64[:, None]
    (y64 * dy.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scales.grad.double(), s64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_delayed"])
def test_interleaved_fc1_weight_gives_the_same_mlp(fp8):
    # FC1 with its weight reordered by interleave_glu_tensor, then SwiGLU(glu_interleave_size=k),
    # computes what the contiguous weight and SwiGLU() compute; under FP8 the interleaved op runs
    # outside the fused activation ops, so the two agree within the FP8 casts' rounding.
    torch.manual_seed(2)
    k, hidden, ffn = 4, 32, 64
    plain_model = ops.Sequential(
        ops.Linear(hidden, 2 * ffn, device="cpu"),
        ops.SwiGLU(),
        ops.Linear(ffn, hidden, device="cpu"),
    )
    inter_model = ops.Sequential(
        ops.Linear(hidden, 2 * ffn, device="cpu"),
        ops.SwiGLU(glu_interleave_size=k),
        ops.Linear(ffn, hidden, device="cpu"),
    )
    with torch.no_grad():
        inter_model[0].weight.copy_(te.interleave_glu_tensor(plain_model[0].weight, k))
        inter_model[0].bias.copy_(te.interleave_glu_tensor(plain_model[0].bias, k))
        inter_model[2].weight.copy_(plain_model[2].weight)
        inter_model[2].bias.copy_(plain_model[2].bias)
    x = torch.randn(16, hidden)
    outs = []
    for model in (plain_model, inter_model):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=fp8, recipe=DelayedScaling()):
            y = model(xi)
        y.sum().backward()
        outs.append((y.detach(), xi.grad, model[0].weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    tol = dict(rtol=0.1, atol=0.05) if fp8 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(dx1, dx0, **tol)
    # FC1's weight gradient comes back in the interleaved row order.
    torch.testing.assert_close(te.deinterleave_glu_tensor(dw1, k), dw0, **tol)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_interleave_sizes_are_refused(bad):
    for make in (ops.SwiGLU, ops.ClampedSwiGLU, ops.ScaledSwiGLU):
        with pytest.raises(ValueError, match="glu_interleave_size"):
            make(glu_interleave_size=bad)


def test_a_last_dimension_without_whole_block_pairs_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 2 \\* glu_interleave_size = 8"):
        ops.SwiGLU(glu_interleave_size=4)(torch.randn(2, 12))
