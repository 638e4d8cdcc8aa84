"""te.optimizers.FusedSGD against torch.optim.SGD run in float64 (plain, momentum, dampening,
Nesterov, weight decay; several steps and parameter groups), ``wd_after_momentum`` against the
formula written out by hand, bfloat16 parameters step by step, and the argument checks."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.optimizers import FusedSGD

SHAPES = [(6, 7), (11,), (2, 2, 5)]
STEPS = 4


def initial(dtype=torch.float32):
    return [torch.randn(s).to(dtype) for s in SHAPES]


def gradients(steps=STEPS, dtype=torch.float32):
    return [[torch.randn(s).to(dtype) for s in SHAPES] for _ in range(steps)]


def grouped(params, lrs=(0.05, 0.02)):
    """Two groups: the first two parameters at lrs[0], the last at lrs[1]."""
    return [dict(params=params[:2], lr=lrs[0]), dict(params=params[2:], lr=lrs[1])]


def run(cls, start, grads, dtype, **kw):
    params = [torch.nn.Parameter(p.to(dtype, copy=True)) for p in start]
    opt = cls(grouped(params), **kw)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


def assert_close32(got, ref):
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-6, atol=1e-6)


CONFIGS = {
    "plain": dict(),
    "weight_decay": dict(weight_decay=0.01),
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.3),
    "nesterov": dict(momentum=0.8, nesterov=True),
    "momentum_weight_decay": dict(momentum=0.9, dampening=0.1, weight_decay=0.05),
    "nesterov_weight_decay": dict(momentum=0.9, nesterov=True, weight_decay=0.05),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_torch_sgd(config):
    start, grads = initial(), gradients()
    ours, opt = run(FusedSGD, start, grads, torch.float32, **config)
    ref, ref_opt = run(torch.optim.SGD, start, grads, torch.float64, **config)
    for p, r in zip(ours, ref):
        assert p.dtype == torch.float32
        assert_close32(p, r)
        if config.get("momentum"):
            buf = opt.state[p]["momentum_buffer"]
            assert buf.dtype == torch.float32
            assert_close32(buf, ref_opt.state[r]["momentum_buffer"])
        else:
            assert "momentum_buffer" not in opt.state[p]


def test_group_learning_rates_are_used():
    start, grads = initial(), gradients(1)
    ours, _ = run(FusedSGD, start, grads, torch.float32)
    for i, lr in enumerate((0.05, 0.05, 0.02)):
        expected = start[i].double() - lr * grads[0][i].double()
        assert_close32(ours[i], expected)


def wd_after_momentum_by_hand(start, grads, lrs, momentum, dampening, nesterov, wd):
    out = []
    for i, p0 in enumerate(start):
        p, buf = p0.double(), None
        for step_grads in grads:
            g = step_grads[i].double()
            if momentum:
                buf = g.clone() if buf is None else momentum * buf + (1 - dampening) * g
                g = g + momentum * buf if nesterov else buf
            g = g + wd * p  # the decay after the momentum
            p = p - lrs[i] * g
        out.append(p)
    return out


@pytest.mark.parametrize(
    "momentum,dampening,nesterov", [(0.9, 0.0, False), (0.9, 0.25, False), (0.8, 0.0, True),
                                    (0.0, 0.0, False)]
)  # fmt: skip
def test_wd_after_momentum(momentum, dampening, nesterov):
    start, grads = initial(), gradients()
    kw = dict(momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=0.1)
    ours, opt = run(FusedSGD, start, grads, torch.float32, wd_after_momentum=True, **kw)
    expected = wd_after_momentum_by_hand(start, grads, [0.05, 0.05, 0.02], momentum, dampening,
                                         nesterov, 0.1)  # fmt: skip
    for p, e in zip(ours, expected):
        assert_close32(p, e)
    if momentum:
        # Not the same as decaying before the momentum (torch's order).
        before, _ = run(torch.optim.SGD, start, grads, torch.float64, **kw)
        assert not torch.allclose(ours[0].double(), before[0], rtol=1e-4, atol=1e-4)


def test_bf16_params_step_by_step():
    """Each step: torch's SGD in float64 from the current bfloat16 parameter and buffer, then
    the parameter and buffer rounded once to bfloat16."""
    kw = dict(momentum=0.9, dampening=0.1, weight_decay=0.01)
    start, grads = initial(torch.bfloat16), gradients(dtype=torch.bfloat16)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = FusedSGD(grouped(params), **kw)
    ref = [torch.nn.Parameter(p.double()) for p in start]
    ref_opt = torch.optim.SGD(grouped(ref), **kw)
    eps = torch.finfo(torch.bfloat16).eps
    for step_grads in grads:
        for p, r, g in zip(params, ref, step_grads):
            with torch.no_grad():
                r.copy_(p.double())
                if opt.state[p]:
                    ref_opt.state[r]["momentum_buffer"].copy_(opt.state[p]["momentum_buffer"])
            p.grad = g.clone()
            r.grad = g.double()
        opt.step()
        ref_opt.step()
        for p, r in zip(params, ref):
            buf = opt.state[p]["momentum_buffer"]
            assert p.dtype == buf.dtype == torch.bfloat16
            for got, want in ((p.detach(), r.detach()), (buf, ref_opt.state[r]["momentum_buffer"])):
                assert ((got.double() - want).abs() <= eps * want.abs()).all()
    moved = [not torch.equal(p, s) for p, s in zip(params, start)]
    assert all(moved)


# --- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
        dict(lr=0.1, momentum=0.0, nesterov=True),
        dict(lr=-0.1),
        dict(lr=0.1, momentum=-0.5),
        dict(lr=0.1, weight_decay=-1e-3),
    ],
    ids=["nesterov_dampening", "nesterov_no_momentum", "lr", "momentum", "weight_decay"],
)
def test_invalid_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        FusedSGD([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_missing_lr_raises():
    with pytest.raises(ValueError):
        FusedSGD([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError):
        FusedSGD([dict(params=[torch.nn.Parameter(torch.zeros(2))])], momentum=0.9)
    # A learning rate per group is enough.
    p = torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([dict(params=[p], lr=0.5)])
    p.grad = torch.ones(2)
    opt.step()
    assert p.tolist() == [0.5, 0.5]


def test_fp8_parameter_is_refused():
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        linear = te.Linear(32, 16, params_dtype=torch.bfloat16, device="cpu")
    linear.weight.grad = torch.randn(16, 32, dtype=torch.bfloat16)
    opt = FusedSGD([linear.weight], lr=0.1)
    with pytest.raises(TypeError):
        opt.step()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_gradient_raises():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.sparse_coo_tensor([[1]], [1.0], (4,))
    with pytest.raises(RuntimeError):
        FusedSGD([p], lr=0.1).step()


# --- gradients, closures, zero_grad --------------------------------------------------------------


def test_params_without_grad_are_skipped():
    start, grads = initial(), gradients(2)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = FusedSGD(grouped(params), momentum=0.9)
    for step_grads in grads:
        params[0].grad = step_grads[0].clone()
        opt.step()
    assert torch.equal(params[1], start[1]) and len(opt.state[params[1]]) == 0
    assert torch.equal(params[2], start[2]) and len(opt.state[params[2]]) == 0
    buf = grads[0][0].double() * 0.9 + grads[1][0].double()
    expected = start[0].double() - 0.05 * grads[0][0].double() - 0.05 * buf
    assert_close32(params[0], expected)


def test_closure_loss_is_returned():
    w0, x = torch.randn(5), torch.randn(5)
    w = torch.nn.Parameter(w0.clone())
    opt = FusedSGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * x).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(float((w0 * x).sum()), rel=1e-6)
    assert_close32(w, w0.double() - 0.1 * x.double())
    assert opt.step() is None


def test_zero_grad_set_to_none():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3))


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_set_grad_none_is_deprecated(set_grad_none):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.warns(DeprecationWarning):
        opt = FusedSGD([p], lr=0.1, set_grad_none=set_grad_none)
    p.grad = torch.ones(3)
    opt.zero_grad()
    if set_grad_none:
        assert p.grad is None
    else:
        assert torch.equal(p.grad, torch.zeros(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedSGD([p], lr=0.1)


def test_materialize_master_grads_changes_nothing():
    start, grads = initial(), gradients(2)
    kw = dict(momentum=0.9, weight_decay=0.01)
    ours, _ = run(FusedSGD, start, grads, torch.float32, materialize_master_grads=False, **kw)
    ref, _ = run(torch.optim.SGD, start, grads, torch.float64, **kw)
    for p, r in zip(ours, ref):
        assert_close32(p, r)
