"""te.ops FP8 producer fusion of the norms: ``ForwardNormCast`` (``LayerNorm`` / ``RMSNorm``
output cast once with the next ``BasicLinear``'s input quantizer, handed over in FP8).

Checked for both norms (with and without zero-centered gamma), delayed and current scaling,
float32 and BF16, CPU and CUDA: the plan holds the fused operation under FP8 and not without
it; the fused ``Sequential`` has the bits of the same operations with this fusion switched off
(outputs, input and parameter gradients over two steps, the delayed-scaling scales and amax
histories); the linear receives the FP8 tensor (it does not cast again); the bytes kept for
backward are no more than the unfused chain's, with no high-precision copy of the norm output.
"""

from __future__ import annotations

import pytest
import torch
from fusion_harness import fuser_of, fusions_off, plan, run, saved
from utils import autocast_by_name, bitwise_equal, needs_cuda

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear, is_produced_input
from transformer_engine.pytorch.ops.fused import ForwardNormCast, fuse_forward_norm_cast

HIDDEN, FFN, OUT, TOKENS = 64, 96, 48, 32
NORMS = {"layernorm": ops.LayerNorm, "rmsnorm": ops.RMSNorm}
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
RECIPES = ["delayed", "current"]
DTYPES = [torch.float32, torch.bfloat16]


def build(norm, device, dtype, *, zero_centered_gamma=False, mlp=False, seed=7):
    """``norm -> Linear(HIDDEN, FFN)`` (``-> GELU -> Linear(FFN, OUT)`` with ``mlp``), with
    norm parameters away from their initial values."""
    torch.manual_seed(seed)
    modules = [
        NORMS[norm](HIDDEN, device=device, dtype=dtype, zero_centered_gamma=zero_centered_gamma),
        ops.Linear(HIDDEN, FFN, device=device, dtype=dtype),
    ]
    if mlp:
        modules += [ops.GELU(), ops.Linear(FFN, OUT, device=device, dtype=dtype)]
    model = ops.Sequential(*modules)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_plan_holds_the_fused_norm_under_fp8(norm, recipe):
    model = build(norm, "cpu", torch.float32, mlp=True)
    with autocast_by_name(recipe):
        model(torch.randn(TOKENS, HIDDEN, requires_grad=True)).sum().backward()
    # basic ops: 0 norm, 1 BasicLinear, 2 Bias, 3 GELU, 4 BasicLinear, 5 Bias
    assert plan(fuser_of(model), "forward") == [
        ("ForwardNormCast", [0]),
        ("ForwardLinearBiasActivation", [1, 2]),
        ("ForwardActivationCast", [3]),
        ("ForwardLinearBiasActivation", [4, 5]),
    ]


def test_plan_without_fp8_is_unchanged():
    model = build("layernorm", "cpu", torch.float32)
    model(torch.randn(TOKENS, HIDDEN, requires_grad=True)).sum().backward()
    assert plan(fuser_of(model), "forward") == [
        ("LayerNorm", [0]),
        ("ForwardLinearBiasActivation", [1, 2]),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_bits_equal_the_unfused_chain(
    monkeypatch, norm, zero_centered_gamma, recipe, dtype, device
):
    torch.manual_seed(13)
    x = torch.randn(2, TOKENS // 2, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn(2, TOKENS // 2, FFN, device=device, dtype=dtype)
    fused_model = build(norm, device, dtype, zero_centered_gamma=zero_centered_gamma)
    fused = run(fused_model, x, dy, recipe)
    assert ("ForwardNormCast", [0]) in plan(fuser_of(fused_model), "forward")
    with fusions_off(monkeypatch, fuse_forward_norm_cast):
        unfused_model = build(norm, device, dtype, zero_centered_gamma=zero_centered_gamma)
        unfused = run(unfused_model, x, dy, recipe)
        assert all(
            type(op) is not ForwardNormCast for op, _ in fuser_of(unfused_model)._forward_ops
        )
    assert [n for n, _ in fused] == [n for n, _ in unfused]
    for (name, a), (_, b) in zip(fused, unfused):
        assert (a is None) == (b is None), name
        if a is not None:
            assert bitwise_equal(a, b), f"{name}: {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_bits_equal_the_unfused_chain_for_any_token_count(monkeypatch, recipe, device):
    # 10 tokens: the weight-gradient GEMM reduces over a count that is not a multiple of 16.
    torch.manual_seed(14)
    x = torch.randn(2, 5, HIDDEN, device=device)
    dy = torch.randn(2, 5, FFN, device=device)
    fused_model = build("rmsnorm", device, torch.float32)
    fused = run(fused_model, x, dy, recipe)
    assert ("ForwardNormCast", [0]) in plan(fuser_of(fused_model), "forward")
    with fusions_off(monkeypatch, fuse_forward_norm_cast):
        unfused = run(build("rmsnorm", device, torch.float32), x, dy, recipe)
    assert [n for n, _ in fused] == [n for n, _ in unfused]
    for (name, a), (_, b) in zip(fused, unfused):
        assert (a is None) == (b is None), name
        if a is not None:
            assert bitwise_equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_linear_takes_the_fp8_norm_output(monkeypatch, recipe, device):
    seen = []
    original = BasicLinear.linear_forward

    def spy(self, ctx, input_, bias=None):
        seen.append(is_produced_input(input_))
        return original(self, ctx, input_, bias)

    monkeypatch.setattr(BasicLinear, "linear_forward", spy)
    model = build("rmsnorm", device, torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name(recipe):
        model(x).float().sum().backward()
    assert seen == [True]
    seen.clear()
    model(x).float().sum().backward()  # without FP8 the norm output stays high precision
    assert seen == [False]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_saved_bytes_are_no_more_than_unfused(monkeypatch, norm, recipe):
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    fused_bytes, kinds = saved(build(norm, "cpu", torch.bfloat16), x, recipe)
    with fusions_off(monkeypatch, fuse_forward_norm_cast):
        unfused_bytes, _ = saved(build(norm, "cpu", torch.bfloat16), x, recipe)
    assert fused_bytes <= unfused_bytes
    # kept: the norm's input (BF16) and the linear's FP8 input, transposed; no BF16 norm output
    assert [s for s, d in kinds if d == torch.bfloat16] == [(TOKENS, HIDDEN)]
    assert (HIDDEN, TOKENS) in [s for s, d in kinds if d == torch.uint8]
