"""fuse_wgrad_accumulation: the weight gradient always reaches weight.main_grad, or the call
fails loudly; it never lands silently in .grad instead."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling


def test_main_grad_is_reached_through_torch_autocast_casts():
    torch.manual_seed(0)
    layer = te.Linear(32, 16, device="cpu", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(16, 32)
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y = layer(x)  # the GEMM sees a bfloat16 copy of the float32 weight
    y.float().sum().backward()
    expected = torch.ones(16, 16).t() @ x.detach()
    assert layer.weight.grad is None
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("recipe", [None, DelayedScaling()])
def test_missing_main_grad_is_an_error(recipe):
    layer = te.Linear(32, 16, device="cpu", fuse_wgrad_accumulation=True)
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x)
    with pytest.raises(RuntimeError, match="set weight.main_grad"):
        y.sum().backward()


def test_split_parameters_cannot_fuse_wgrad_accumulation():
    with pytest.raises(ValueError, match="parameters_split cannot be combined with fuse_wgrad"):
        te.Linear(32, 32, device="cpu", parameters_split=("a", "b"), fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="parameters_split cannot be combined with fuse_wgrad"):
        te.LayerNormLinear(
            32, 32, device="cpu", parameters_split=("a", "b"), fuse_wgrad_accumulation=True
        )


def test_layernorm_mlp_fc_weights_accumulate_into_their_main_grads():
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(32, 64, device="cpu", fuse_wgrad_accumulation=True)
    for p in (mlp.fc1_weight, mlp.fc2_weight):
        p.main_grad = torch.zeros_like(p)
    x = torch.randn(16, 32, requires_grad=True)
    mlp(x).sum().backward()
    for p in (mlp.fc1_weight, mlp.fc2_weight):
        assert p.grad is None and p.main_grad.abs().sum() > 0


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["high-precision", "delayed"])
@pytest.mark.parametrize("zero_out", [False, True])
@pytest.mark.parametrize("under_torch_autocast", [False, True])
def test_megatron_grad_added_to_main_grad_gets_a_placeholder_gradient(
    recipe, zero_out, under_torch_autocast
):
    torch.manual_seed(0)
    layer = te.Linear(32, 16, device="cpu", fuse_wgrad_accumulation=True)
    w = layer.weight
    w.main_grad = torch.zeros(16, 32)
    w.grad_added_to_main_grad = False
    if zero_out:
        w.zero_out_wgrad = True
    hook_calls = []
    w.register_hook(lambda g: hook_calls.append(g.shape))
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_torch_autocast):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
    y.float().sum().backward()
    assert w.grad_added_to_main_grad is True
    assert hook_calls == [torch.Size([16, 32])]  # the weight's gradient hooks fired
    assert w.grad is not None and w.grad.shape == (16, 32) and w.grad.dtype == w.dtype
    if zero_out:
        assert torch.count_nonzero(w.grad) == 0
    expected = torch.ones(16, 16).t() @ x.detach()
    torch.testing.assert_close(w.main_grad, expected, rtol=0.1, atol=0.5)


def test_delayed_wgrad_sets_grad_added_to_main_grad_when_it_runs():
    layer = te.Linear(32, 16, device="cpu", fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    layer.weight.main_grad = torch.zeros(16, 32)
    layer.weight.grad_added_to_main_grad = False
    layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert layer.weight.grad_added_to_main_grad is False  # nothing added yet
    layer.backward_dw()
    assert layer.weight.grad_added_to_main_grad is True
    assert torch.count_nonzero(layer.weight.main_grad) > 0


def test_without_the_megatron_attribute_no_gradient_reaches_grad():
    layer = te.Linear(32, 16, device="cpu", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(16, 32)
    layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert layer.weight.grad is None
