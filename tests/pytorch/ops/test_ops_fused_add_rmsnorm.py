"""te.ops ``BackwardAddRMSNorm`` (a residual branch taken before an ``RMSNorm``) and the rule
its sum relies on (``_owned_buffers.add_into_fresh``): the fuser's plan, the same bits as the
unfused operations (high precision and FP8 with a linear after the norm), and float64 formulas
written in plain PyTorch."""

import pytest
import torch
from utils import autocast_by_name, bitwise_equal, needs_cuda

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fused import BackwardAddRMSNorm
from transformer_engine.pytorch.ops.fused._owned_buffers import add_into_fresh
from transformer_engine.pytorch.ops.fuser import OperationFuser

HIDDEN, OUT, TOKENS = 32, 16, 16
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


def pre_norm_block(device, dtype, in_place=False):
    """``h -> (W RMSNorm(h), h)``: the residual stream leaves as the extra output."""
    torch.manual_seed(40)
    norm = ops.RMSNorm(HIDDEN, eps=1e-5, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # a unit weight would hide a wrong weight gradient
    return ops.Sequential(
        ops.MakeExtraOutput(in_place=in_place),
        norm,
        ops.BasicLinear(HIDDEN, OUT, device=device, dtype=dtype),
    )


def run(model, x, dy, dres, recipe):
    results = []
    for _ in range(2):  # the second step uses the scales the first updated
        xs = x.detach().clone().requires_grad_(True)
        for p in model.parameters():
            p.grad = None
        with autocast_by_name(recipe):
            y, residual = model(xs * 1.0)
        torch.autograd.backward([y, residual], [dy, dres])
        results += [y.detach().clone(), residual.detach().clone(), xs.grad]
        results += [p.grad for p in model.parameters()]
    return results


@pytest.mark.parametrize("device, recipe, dtype", CASES)
def test_add_rmsnorm_is_fused_in_backward_and_bitwise_equal(monkeypatch, device, recipe, dtype):
    torch.manual_seed(41)
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn(TOKENS, OUT, device=device, dtype=dtype)
    dres = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)
    fused_model = pre_norm_block(device, dtype)
    fused = run(fused_model, x, dy, dres, recipe)
    (fuser,) = fused_model._get_module_groups()
    assert [(type(op), idxs) for op, idxs in fuser._backward_ops] == [
        (BackwardAddRMSNorm, [0, 1]),
        (ops.BasicLinear, [2]),
    ]
    with monkeypatch.context() as patch:
        patch.setattr(OperationFuser, "forward_fusion_functions", [])
        patch.setattr(OperationFuser, "backward_fusion_functions", [])
        unfused = run(pre_norm_block(device, dtype), x, dy, dres, recipe)
    assert len(fused) == len(unfused)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert bitwise_equal(a, b), f"result {i} differs"


def test_add_rmsnorm_matches_float64():
    model = pre_norm_block("cpu", torch.float32)
    torch.manual_seed(42)
    x = torch.randn(TOKENS, HIDDEN)
    dy, dres = torch.randn(TOKENS, OUT), torch.randn(TOKENS, HIDDEN)
    xs = x.clone().requires_grad_(True)
    y, residual = model(xs)
    torch.autograd.backward([y, residual], [dy, dres])

    x64 = x.double().requires_grad_(True)
    g64 = model[1].weight.detach().double().requires_grad_(True)
    w64 = model[2].weight.detach().double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * g64
    expected = normed @ w64.T
    torch.autograd.backward([expected, x64], [dy.double(), dres.double()])
    torch.testing.assert_close(y.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, x)
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[1].weight.grad.double(), g64.grad, rtol=1e-5, atol=1e-5)


def test_add_rmsnorm_is_not_fused_with_an_in_place_branch():
    model = pre_norm_block("cpu", torch.float32, in_place=True)
    y, residual = model(torch.randn(TOKENS, HIDDEN, requires_grad=True))
    (y.sum() + residual.sum()).backward()
    (fuser,) = model._get_module_groups()
    assert BackwardAddRMSNorm not in [type(op) for op, _ in fuser._backward_ops]
    with pytest.raises(ValueError, match="in_place=False"):
        BackwardAddRMSNorm(add=model[0], rmsnorm=model[1])


def test_add_rmsnorm_without_a_branch_gradient():
    """Only the main output is used: the extra output's gradient is None and the norm's
    gradient passes on unchanged."""
    model = pre_norm_block("cpu", torch.float32)
    torch.manual_seed(43)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    y, _ = model(x)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    norm, lin = model[1], model[2]
    expected = torch.nn.functional.rms_norm(x2, (HIDDEN,), norm.weight.detach(), 1e-5)
    (expected @ lin.weight.detach().T).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_add_into_fresh_writes_only_where_the_bits_and_memory_allow():
    fresh, other = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    out = add_into_fresh(fresh, other)
    assert out.data_ptr() == fresh.data_ptr() and torch.equal(out, torch.tensor([1.5, 2.25]))

    # a parameter (the bias) may be the operand; a broadcast one is fine; a result of another dtype or shape needs a new buffer
    fresh = torch.zeros(2, 3)
    assert add_into_fresh(fresh, torch.ones(3)).data_ptr() == fresh.data_ptr()
    bias = torch.nn.Parameter(torch.ones(3))
    assert add_into_fresh(fresh, bias).data_ptr() == fresh.data_ptr()
    assert torch.equal(fresh, torch.full((2, 3), 2.0))
    low = torch.zeros(3, dtype=torch.bfloat16)
    promoted = add_into_fresh(low, torch.ones(3))
    assert promoted.dtype == torch.float32 and torch.equal(low, torch.zeros(3, dtype=low.dtype))
    small = torch.zeros(3)
    grown = add_into_fresh(small, torch.ones(2, 3))
    assert grown.shape == (2, 3) and torch.equal(small, torch.zeros(3))

    # a tensor the caller must not see change is never the target
    passed_through = torch.ones(3)
    kept = add_into_fresh(passed_through, torch.ones(3), not_aliasing=(passed_through[:2],))
    assert torch.equal(passed_through, torch.ones(3)) and torch.equal(kept, torch.full((3,), 2.0))
