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
