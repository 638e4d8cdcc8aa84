"""recipe.backward_override: FP8 forward, high-precision backward.

"high_precision" uses the original operands in backward, "dequantized" the dequantized FP8
operands; either way the gradient GEMMs run in high precision and no backward scale updates.
"""

import fp8_oracle as oracle
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


def run(override, module_factory=lambda: te.Linear(32, 48, device="cpu")):
    torch.manual_seed(0)
    layer = module_factory()
    x = (torch.randn(16, 32) * 2).requires_grad_(True)
    recipe = Float8CurrentScaling(backward_override=override)
    with te.autocast(recipe=recipe):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return layer, x, y, dy


def test_high_precision_backward_uses_the_original_operands():
    layer, x, y, dy = run("high_precision")
    torch.testing.assert_close(x.grad, dy @ layer.weight.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, dy.sum(0))


def test_dequantized_backward_uses_the_fp8_operands():
    layer, x, y, dy = run("dequantized")

    def fp8_values(t):
        e4m3 = torch.float8_e4m3fn
        scale = oracle.scale_from_amax(oracle.amax(t), e4m3)
        q = oracle.cast_bytes(t, scale, e4m3)
        return oracle.dequantize(q, oracle.reciprocal(scale), torch.float32, e4m3)

    w_hat, x_hat = fp8_values(layer.weight), fp8_values(x)
    torch.testing.assert_close(x.grad, dy @ w_hat, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x_hat, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(layer.weight.grad, dy.t() @ x.detach(), rtol=1e-6, atol=1e-6)


def test_the_first_module_flag_is_left_for_a_module_with_backward_state():
    with te.autocast(recipe=Float8CurrentScaling(backward_override="high_precision")):
        te.Linear(32, 48, device="cpu")(torch.randn(16, 32, requires_grad=True))
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module


def test_layernorm_mlp_with_an_override_trains():
    layer, x, y, dy = run(
        "high_precision", lambda: te.LayerNormMLP(32, 64, device="cpu", activation="swiglu")
    )
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in layer.parameters())


def test_ops_linear_honours_the_override_like_the_module():
    """te.ops.Linear takes its GEMM settings from the same config_from_recipe as te.Linear, so
    backward_override="high_precision" gives the exact high-precision gradients there too."""
    torch.manual_seed(0)
    op = te.ops.Linear(32, 48, device="cpu")
    x = (torch.randn(16, 32) * 2).requires_grad_(True)
    with te.autocast(recipe=Float8CurrentScaling(backward_override="high_precision")):
        y = op(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ op.weight.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(op.weight.grad, dy.t() @ x.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(op.bias.grad, dy.sum(0))
