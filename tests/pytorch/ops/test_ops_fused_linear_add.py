"""te.ops fused linear operations upstream code imports: ``ForwardLinearBiasAdd``,
``ForwardLinearScaleAdd``, ``BackwardLinearAdd`` and ``BackwardLinearScale``.

Each is checked three ways: the fuser's plan contains it for the matching basic operations
(and not when upstream's conditions fail), its outputs and every gradient have the same bits
as the same operations run with every fusion switched off (high precision, FP8 delayed and
current scaling, FP32 and BF16), and the high-precision values agree with the formula written
in plain PyTorch in float64. ``BackwardLinearBias`` stays off in both runs: under FP8 its bias
gradient is the grad-output cast's own sum, whose bits on CUDA differ from the chain's by design
(test_ops_fused_linear_bias.py checks it against te.Linear's)."""

import pytest
import torch
from utils import autocast_by_name, bitwise_equal, needs_cuda

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fused import (
    BackwardLinearAdd,
    BackwardLinearScale,
    ForwardLinearBiasActivation,
    ForwardLinearBiasAdd,
    ForwardLinearScaleAdd,
    fuse_backward_linear_bias,
)
from transformer_engine.pytorch.ops.fuser import OperationFuser

IN, OUT, TOKENS = 32, 48, 16
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
CASES = [
    pytest.param(
        device,
        recipe,
        dtype,
        id=f"{device}-{recipe}-{str(dtype)[6:]}",
        marks=[needs_cuda] if device == "cuda" else [],
    )
    for device in ("cpu", "cuda")
    for recipe in (None, "delayed", "current")
    for dtype in (torch.float32, torch.bfloat16)
]


def linear(device, dtype, seed=30):
    torch.manual_seed(seed)
    return ops.BasicLinear(IN, OUT, device=device, dtype=dtype)


def bias(device, dtype):
    op = ops.Bias(OUT, device=device, dtype=dtype)
    with torch.no_grad():
        op.bias.normal_()  # a zero bias would hide a missing or doubled bias
    return op


def run(model, x, extras, grads, recipe, steps=2):
    """Outputs and every gradient of ``steps`` iterations (the second uses the scales the
    first updated under delayed scaling). Every tensor the ops may write is a fresh copy."""
    results = []
    for _ in range(steps):
        xs = x.detach().clone().requires_grad_(True)
        extra_leaves = [e.detach().clone().requires_grad_(True) for e in extras]
        # the extra inputs are intermediates, as a residual stream is
        extra_inputs = [e * 1.0 for e in extra_leaves]
        for p in model.parameters():
            p.grad = None
        with autocast_by_name(recipe):
            outs = model(xs, *extra_inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [g.clone() if g.dim() else g for g in grads])
        results += [o.detach().clone() for o in outs]
        results += [xs.grad, *(e.grad for e in extra_leaves)]
        results += [p.grad for p in model.parameters()]
    return results


def run_fused_and_unfused(monkeypatch, build, x, extras, grads, recipe):
    """``(fused results, unfused results, fuser of the fused run)``."""
    backward = [
        f for f in OperationFuser.backward_fusion_functions if f is not fuse_backward_linear_bias
    ]
    with monkeypatch.context() as patch:
        patch.setattr(OperationFuser, "backward_fusion_functions", backward)
        fused_model = build()
        fused = run(fused_model, x, extras, grads, recipe)
    with monkeypatch.context() as patch:
        patch.setattr(OperationFuser, "forward_fusion_functions", [])
        patch.setattr(OperationFuser, "backward_fusion_functions", [])
        unfused_model = build()
        unfused = run(unfused_model, x, extras, grads, recipe)
        (fuser,) = unfused_model._get_module_groups()
        assert not any(op.is_fused_op for op, _ in fuser._forward_ops + fuser._backward_ops)
    (fuser,) = fused_model._get_module_groups()
    return fused, unfused, fuser


def assert_bitwise(fused, unfused):
    assert len(fused) == len(unfused)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert bitwise_equal(a, b), f"result {i} differs: {(a.float() - b.float()).abs().max()}"


def plan(fuser, which):
    return [(type(op), idxs) for op, idxs in getattr(fuser, f"_{which}_ops")]


def data(device, dtype, *shapes, seed=31):
    torch.manual_seed(seed)
    return [torch.randn(s, device=device, dtype=dtype) for s in shapes]


# ------------------------------------------------------------------------------------------
# ForwardLinearBiasAdd


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device, recipe, dtype", CASES)
def test_linear_bias_add_is_fused_and_bitwise_equal(monkeypatch, device, recipe, dtype, with_bias):
    def build():
        basic = [linear(device, dtype)]
        if with_bias:
            basic.append(bias(device, dtype))
        return ops.Sequential(*basic, ops.AddExtraInput(in_place=True))

    x, residual, dy = data(device, dtype, (2, 8, IN), (2, 8, OUT), (2, 8, OUT))
    fused, unfused, fuser = run_fused_and_unfused(monkeypatch, build, x, [residual], [dy], recipe)
    covered = [0, 1, 2] if with_bias else [0, 1]
    assert plan(fuser, "forward") == [(ForwardLinearBiasAdd, covered)]
    assert_bitwise(fused, unfused)


def test_linear_bias_add_matches_float64_and_writes_into_the_extra_input():
    model = ops.Sequential(linear("cpu", torch.float32), bias("cpu", torch.float32))
    model.append(ops.AddExtraInput(in_place=True))
    x, residual, dy = data("cpu", torch.float32, (TOKENS, IN), (TOKENS, OUT), (TOKENS, OUT))
    w, b = model[0].weight, model[1].bias
    xs = x.clone().requires_grad_(True)
    stream = residual.clone()
    y = model(xs, stream)
    assert y.data_ptr() == stream.data_ptr()  # the sum went into the extra input's storage
    y.backward(dy)

    x64, w64, b64 = x.double(), w.detach().double(), b.detach().double()
    expected = x64 @ w64.T + b64 + residual.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(xs.grad.double(), dy.double() @ w64, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), dy.double().T @ x64, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), dy.double().sum(0), rtol=1e-6, atol=1e-5)


def test_linear_bias_add_needs_an_in_place_add():
    model = ops.Sequential(linear("cpu", torch.float32), bias("cpu", torch.float32))
    model.append(ops.AddExtraInput(in_place=False))
    x, residual = data("cpu", torch.float32, (TOKENS, IN), (TOKENS, OUT))
    model(x, residual)
    (fuser,) = model._get_module_groups()
    assert plan(fuser, "forward") == [
        (ForwardLinearBiasActivation, [0, 1]),
        (ops.AddExtraInput, [2]),
    ]
    with pytest.raises(ValueError, match="in_place=True"):
        ForwardLinearBiasAdd(linear=model[0], bias=model[1], add=model[2])


# ------------------------------------------------------------------------------------------
# ForwardLinearScaleAdd and BackwardLinearScale


@pytest.mark.parametrize("device, recipe, dtype", CASES)
def test_linear_scale_add_is_fused_and_bitwise_equal(monkeypatch, device, recipe, dtype):
    def build():
        return ops.Sequential(
            linear(device, dtype), ops.ConstantScale(0.37), ops.AddExtraInput(in_place=True)
        )

    x, residual, dy = data(device, dtype, (TOKENS, IN), (TOKENS, OUT), (TOKENS, OUT))
    fused, unfused, fuser = run_fused_and_unfused(monkeypatch, build, x, [residual], [dy], recipe)
    assert plan(fuser, "forward") == [(ForwardLinearScaleAdd, [0, 1, 2])]
    assert plan(fuser, "backward") == [(BackwardLinearScale, [0, 1]), (ops.AddExtraInput, [2])]
    assert_bitwise(fused, unfused)


@pytest.mark.parametrize("device, recipe, dtype", CASES)
def test_linear_scale_is_fused_in_backward_and_bitwise_equal(monkeypatch, device, recipe, dtype):
    def build():
        return ops.Sequential(linear(device, dtype), ops.ConstantScale(-1.7), bias(device, dtype))

    x, dy = data(device, dtype, (TOKENS, IN), (TOKENS, OUT))
    fused, unfused, fuser = run_fused_and_unfused(monkeypatch, build, x, [], [dy], recipe)
    assert plan(fuser, "backward") == [(BackwardLinearScale, [0, 1]), (ops.Bias, [2])]
    assert_bitwise(fused, unfused)


def test_linear_scale_add_matches_float64():
    model = ops.Sequential(
        linear("cpu", torch.float32), ops.ConstantScale(0.37), ops.AddExtraInput(in_place=True)
    )
    x, residual, dy = data("cpu", torch.float32, (TOKENS, IN), (TOKENS, OUT), (TOKENS, OUT))
    xs, r = x.clone().requires_grad_(True), residual.clone().requires_grad_(True)
    y = model(xs, r * 1.0)
    y.backward(dy)
    x64, w64, dy64 = x.double(), model[0].weight.detach().double(), dy.double()
    torch.testing.assert_close(
        y.double(), 0.37 * (x64 @ w64.T) + residual.double(), rtol=1e-6, atol=1e-5
    )
    torch.testing.assert_close(xs.grad.double(), 0.37 * dy64 @ w64, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        model[0].weight.grad.double(), 0.37 * dy64.T @ x64, rtol=1e-6, atol=1e-5
    )
    assert torch.equal(r.grad, dy)


def test_linear_scale_backward_with_only_the_scale_needing_a_gradient(monkeypatch):
    """A frozen linear on an input without gradient, followed by a trainable bias: the fused
    backward must stop where the unfused fuser stops."""

    def build():
        model = ops.Sequential(
            linear("cpu", torch.float32), ops.ConstantScale(2.5), bias("cpu", torch.float32)
        )
        model[0].weight.requires_grad_(False)
        return model

    (x,) = data("cpu", torch.float32, (TOKENS, IN))
    (dy,) = data("cpu", torch.float32, (TOKENS, OUT), seed=32)
    model = build()
    y = model(
        x,
    )
    y.backward(dy)
    assert torch.equal(model[2].bias.grad, dy.sum(0))
    fused, unfused, _ = run_fused_and_unfused(monkeypatch, build, x, [], [dy], None)
    assert_bitwise(fused[:1] + fused[2:], unfused[:1] + unfused[2:])  # x.grad: no leaf grad


# ------------------------------------------------------------------------------------------
# BackwardLinearAdd


def branch_model(device, dtype, in_place=True):
    return ops.Sequential(ops.MakeExtraOutput(in_place=in_place), linear(device, dtype))


@pytest.mark.parametrize("device, recipe, dtype", CASES)
def test_linear_add_is_fused_in_backward_and_bitwise_equal(monkeypatch, device, recipe, dtype):
    x, dy, dbranch = data(device, dtype, (TOKENS, IN), (TOKENS, OUT), (TOKENS, IN))
    fused, unfused, fuser = run_fused_and_unfused(
        monkeypatch, lambda: branch_model(device, dtype), x, [], [dy, dbranch], recipe
    )
    assert plan(fuser, "backward") == [(BackwardLinearAdd, [0, 1])]
    assert_bitwise(fused, unfused)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_add_with_a_broadcast_branch_gradient(monkeypatch, device):
    """``branch.sum()`` gives the extra output a zero-stride gradient, which cannot receive
    the sum: it goes into the dgrad output instead, with the same bits."""
    x, dy = data(device, torch.float32, (TOKENS, IN), (TOKENS, OUT))

    def results(model):
        xs = x.clone().requires_grad_(True)
        y, branch = model(xs)
        ((y * dy).sum() + 3.0 * branch.sum()).backward()
        return [xs.grad, model[1].weight.grad]

    fused_model = branch_model(device, torch.float32)
    fused = results(fused_model)
    (fuser,) = fused_model._get_module_groups()
    assert plan(fuser, "backward") == [(BackwardLinearAdd, [0, 1])]
    with monkeypatch.context() as patch:
        patch.setattr(OperationFuser, "backward_fusion_functions", [])
        unfused = results(branch_model(device, torch.float32))
    assert_bitwise(fused, unfused)
    w64 = fused_model[1].weight.detach().double()
    torch.testing.assert_close(fused[0].double(), dy.double() @ w64 + 3.0, rtol=1e-6, atol=1e-5)


def test_linear_add_matches_float64_and_needs_an_in_place_branch():
    model = branch_model("cpu", torch.float32)
    x, dy, dbranch = data("cpu", torch.float32, (TOKENS, IN), (TOKENS, OUT), (TOKENS, IN))
    xs = x.clone().requires_grad_(True)
    y, branch = model(xs)
    torch.autograd.backward([y, branch], [dy, dbranch.clone()])
    w64 = model[1].weight.detach().double()
    torch.testing.assert_close(
        xs.grad.double(), dy.double() @ w64 + dbranch.double(), rtol=1e-6, atol=1e-5
    )

    plain_branch = branch_model("cpu", torch.float32, in_place=False)
    y, branch = plain_branch(xs)
    (y.sum() + branch.sum()).backward()
    (fuser,) = plain_branch._get_module_groups()
    assert BackwardLinearAdd not in [t for t, _ in plan(fuser, "backward")]
    with pytest.raises(ValueError, match="in_place=True"):
        BackwardLinearAdd(backward_add=plain_branch[0], linear=plain_branch[1])


def test_linear_add_when_only_the_weight_needs_a_gradient(monkeypatch):
    (x,) = data("cpu", torch.float32, (TOKENS, IN))
    dy, dbranch = data("cpu", torch.float32, (TOKENS, OUT), (TOKENS, IN), seed=33)

    def results(model):
        y, _ = model(x)  # x needs no gradient: only the weight's is computed
        y.backward(dy)
        return [model[1].weight.grad]

    fused = results(branch_model("cpu", torch.float32))
    with monkeypatch.context() as patch:
        patch.setattr(OperationFuser, "backward_fusion_functions", [])
        unfused = results(branch_model("cpu", torch.float32))
    assert_bitwise(fused, unfused)
    torch.testing.assert_close(fused[0], dy.T @ x)
