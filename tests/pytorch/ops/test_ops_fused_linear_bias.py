"""te.ops backward fusion ``BackwardLinearBias``: ``BasicLinear`` followed by its ``Bias``, the
bias gradient taken from the pass that casts the output gradient to FP8 (with the transposed
copy the weight gradient reads), as ``te.Linear`` takes it, instead of a second pass over the
gradient. Under delayed and current scaling only.

Checked on the CPU and CUDA: the plan (fused under FP8, the chain without it), bits equal to
``te.Linear``'s with the same parameters over two steps (outputs, input, weight and bias
gradients: on CUDA the bias gradient is the cast kernel's sum, whose bits a plain sum need not
have), the bias gradient against a float64 column sum, the chain's separate sum not run, and
the cases where the cast writes no transposed copy (frozen weight) or the bias needs no
gradient.
"""

from __future__ import annotations

import pytest
import torch
from fusion_harness import fuser_of, plan
from utils import autocast_by_name, bitwise_equal, count_calls, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.basic.bias import Bias

IN, OUT, TOKENS = 32, 48, 16
RECIPES = ["delayed", "current"]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.bfloat16]


def build_pair(device, dtype, seed=3):
    """``te.Linear`` and ``ops.Sequential(ops.Linear)`` with the same weight and bias."""
    torch.manual_seed(seed)
    module = te.Linear(IN, OUT, bias=True, device=device, params_dtype=dtype)
    sequential = ops.Sequential(ops.Linear(IN, OUT, bias=True, device=device, dtype=dtype))
    with torch.no_grad():
        module.bias.normal_()
        sequential[0].weight.copy_(module.weight)
        sequential[0].bias.copy_(module.bias)
    return module, sequential


def step(model, x, dy, recipe, *, retain_graph=False):
    """``[output, dx, parameter gradients...]`` of one forward + backward under ``recipe``."""
    xs = x.detach().clone().requires_grad_(x.requires_grad)
    for p in model.parameters():
        p.grad = None
    with autocast_by_name(recipe):
        y = model(xs)
    y.backward(dy, retain_graph=retain_graph)
    return y, [y.detach(), xs.grad, *(p.grad for p in model.parameters())]


def data(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=g).to(device=device, dtype=dtype)
    dy = (2 * torch.randn(TOKENS, OUT, generator=g) + 0.5).to(device=device, dtype=dtype)
    return x.requires_grad_(), dy


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_under_fp8(recipe):
    _, sequential = build_pair("cpu", torch.float32)
    x, dy = data("cpu", torch.float32, 0)
    step(sequential, x, dy, recipe)
    fuser = fuser_of(sequential)
    assert plan(fuser, "forward") == [("ForwardLinearBiasActivation", [0, 1])]
    assert plan(fuser, "backward") == [("BackwardLinearBias", [0, 1])]


def test_plan_without_fp8_keeps_the_chain():
    _, sequential = build_pair("cpu", torch.float32)
    x, dy = data("cpu", torch.float32, 0)
    step(sequential, x, dy, None)
    assert plan(fuser_of(sequential), "backward") == [("BasicLinear", [0]), ("Bias", [1])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_bits_equal_te_linear(device, dtype, recipe):
    module, sequential = build_pair(device, dtype)
    for seed in (1, 2):  # two steps: delayed scaling's update between them
        x, dy = data(device, dtype, seed)
        _, expected = step(module, x, dy, recipe)
        _, actual = step(sequential, x, dy, recipe)
        for name, a, b in zip(["out", "dx", "dW", "db"], actual, expected):
            assert bitwise_equal(a, b), (name, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_bias_gradient_is_the_column_sum_without_a_second_pass(monkeypatch, device, recipe):
    calls = count_calls(monkeypatch, Bias, bias_grad="bias_grad")
    _, sequential = build_pair(device, torch.bfloat16)
    x, dy = data(device, torch.bfloat16, 4)
    _, (_, _, _, db) = step(sequential, x, dy, recipe)
    assert calls["bias_grad"] == 0  # the chain's own sum never ran
    expected = dy.double().sum(dim=0).cpu()
    # float32 sums rounded once to BF16
    tol = 2**-8 * expected.abs().max().item()
    torch.testing.assert_close(db.double().cpu(), expected, rtol=0, atol=tol)
    # without FP8 the chain runs, and sums the same gradient
    _, (_, _, _, db_chain) = step(sequential, x, dy, None)
    assert calls["bias_grad"] == 1
    torch.testing.assert_close(db_chain.double().cpu(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_weight_frozen_bias_and_a_second_backward(device, recipe):
    x, dy = data(device, torch.float32, 5)
    expected_db = dy.double().sum(dim=0).cpu()
    # no weight gradient: the cast writes no transposed copy, the bias gradient is a sum
    module, sequential = build_pair(device, torch.float32)
    module.weight.requires_grad_(False)
    sequential[0].weight.requires_grad_(False)
    _, expected = step(module, x, dy, recipe)
    _, (out, dx, dw, db) = step(sequential, x, dy, recipe)
    assert dw is None and sequential[0].weight.grad is None
    assert bitwise_equal(out, expected[0]) and bitwise_equal(dx, expected[1])
    torch.testing.assert_close(db.double().cpu(), expected_db, rtol=1e-6, atol=1e-5)
    # no bias gradient
    module, sequential = build_pair(device, torch.float32)
    module.bias.requires_grad_(False)
    sequential[0].bias.requires_grad_(False)
    _, expected = step(module, x, dy, recipe)
    _, actual = step(sequential, x, dy, recipe)
    assert sequential[0].bias.grad is None and actual[3] is None and expected[3] is None
    for a, b in zip(actual[:3], expected[:3]):
        assert bitwise_equal(a, b)
    # a second backward of the same graph (retain_graph) runs as te.Linear's does (delayed
    # scaling's grad-output scale may have moved in between, so both are compared to each other)
    module, sequential = build_pair(device, torch.float32)
    second = []
    for model in (module, sequential):
        y, _ = step(model, x, dy, recipe, retain_graph=True)
        for p in model.parameters():
            p.grad = None
        y.backward(dy)
        second.append([p.grad for p in model.parameters()])
    for a, b in zip(*second):
        assert bitwise_equal(a, b)
