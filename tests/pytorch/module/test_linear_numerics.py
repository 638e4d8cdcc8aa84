"""te.Linear numerics on CPU against plain PyTorch: forward and backward in high precision and
with delayed and current scaling, FP8 inference without token alignment, a frozen weight,
non-contiguous and FP8 inputs, torch.autocast, and the bias gradient taken from the grad-output
cast.

Weight caching across microbatches, return_bias, parameters_split, params_dtype and fused
weight-gradient accumulation are in ``test_linear_microbatches_and_options.py``; FP8 parameters
and delayed-scaling state over steps in ``test_linear_fp8_params_and_scaling.py``; checkpoints,
deferred initialization, the device guard under exceptions and argument errors in
``test_linear_deferred_init_and_state.py``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import FP8_RECIPES, backward_recipe_state, current_scale, fake_quant

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.linear import Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN, OUT = 64, 48


def fwd_state(module):
    return module.fp8_meta["scaling_fwd"]


def test_linear_is_exported_at_top_level():
    assert te.Linear is Linear


# ------------------------------------------------------------------------------------------
# Forward and backward against plain PyTorch


@pytest.mark.parametrize("shape", [(32,), (2, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_forward_and_backward_match_plain_pytorch(recipe, dtype, bias, shape):
    torch.manual_seed(1)
    m = Linear(IN, OUT, bias=bias, params_dtype=dtype, device="cpu")
    x = torch.randn(*shape, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, OUT, dtype=dtype)
    w = m.weight.detach().clone().requires_grad_()
    b = m.bias.detach().clone().requires_grad_() if bias else None
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w, b)
    y_ref.backward(dy)

    if recipe is None:
        y = m(x)
    else:
        with te.autocast(recipe=FP8_RECIPES[recipe]()):
            y = m(x)
            fwd_scale = fwd_state(m).scale.clone() if recipe == "delayed" else None
        bwd_scale = backward_recipe_state(m).scale.clone() if recipe == "delayed" else None
    y.backward(dy)

    assert y.shape == (*shape, OUT) and y.dtype == dtype
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert m.weight.grad.shape == (OUT, IN) and m.weight.grad.dtype == dtype
    if not bias:
        assert m.bias.numel() == 0  # upstream: an empty tensor, not a Parameter
        assert "bias" not in dict(m.named_parameters())

    if recipe is None:
        if dtype == torch.float32:
            torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(m.weight.grad, w.grad, rtol=1e-6, atol=1e-6)
        else:
            for actual, expected in ((y, y_ref), (x.grad, x_ref.grad), (m.weight.grad, w.grad)):
                assert_close_by_table(actual, expected, ("same_values", dtype))
    else:
        # against plain PyTorch on the original values: the FP8 rows of the table
        assert_close_by_table(y, y_ref, ("e4m3", dtype))
        assert_close_by_table(x.grad, x_ref.grad, ("hybrid", dtype))
        assert_close_by_table(m.weight.grad, w.grad, ("hybrid", dtype))
        # against the dequantized operands the GEMMs saw: tight
        if recipe == "delayed":
            # first step: every scale is still 1, forward E4M3 and gradient E5M2 (HYBRID)
            assert torch.equal(fwd_scale, torch.ones(3))
            assert torch.equal(bwd_scale, torch.ones(2))
            sx, sw, sdy = fwd_scale[0], fwd_scale[1], bwd_scale[0]
        else:
            sx, sw, sdy = (
                current_scale(x, E4M3),
                current_scale(m.weight, E4M3),
                current_scale(dy, E5M2),
            )
        xq = fake_quant(x, sx, E4M3).reshape(-1, IN)
        wq = fake_quant(m.weight, sw, E4M3)
        dyq = fake_quant(dy, sdy, E5M2).reshape(-1, OUT)
        y_deq = xq @ wq.t() + (m.bias.double() if bias else 0)
        assert_close_by_table(y, y_deq.reshape(*shape, OUT), ("fp8_dequantized", dtype))
        assert_close_by_table(x.grad, (dyq @ wq).reshape(*shape, IN), ("fp8_dequantized", dtype))
        assert_close_by_table(m.weight.grad, dyq.t() @ xq, ("fp8_dequantized", dtype))
    if bias:
        assert m.bias.grad.dtype == dtype
        assert_close_by_table(m.bias.grad, b.grad, ("same_values", dtype))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_inference_forward_needs_no_token_alignment(recipe):
    torch.manual_seed(2)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(10, IN)
    with torch.no_grad(), te.autocast(recipe=FP8_RECIPES[recipe]()):
        y = m(x)
    assert y.shape == (10, OUT)
    assert_close_by_table(y, F.linear(x, m.weight, m.bias), ("e4m3", torch.float32))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_with_a_frozen_weight(recipe):
    torch.manual_seed(19)
    m = Linear(IN, OUT, device="cpu")
    m.weight.requires_grad_(False)
    x = torch.randn(32, IN, requires_grad=True)
    dy = torch.randn(32, OUT)
    with te.autocast(recipe=FP8_RECIPES[recipe]()):
        y = m(x)
    y.backward(dy)
    assert m.weight.grad is None
    assert_close_by_table(x.grad, dy @ m.weight, ("hybrid", torch.float32))
    torch.testing.assert_close(m.bias.grad, dy.sum(0))


@pytest.mark.parametrize("recipe", [None, "current"])
def test_non_contiguous_input(recipe):
    torch.manual_seed(20)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(16, 2, IN).transpose(0, 1)
    assert not x.is_contiguous()
    with te.autocast(enabled=recipe is not None, recipe=FP8_RECIPES.get(recipe, DelayedScaling)()):
        y = m(x)
        y_contiguous = m(x.contiguous())
    assert torch.equal(y, y_contiguous)


def test_fp8_input_tensor_is_used_as_is():
    torch.manual_seed(21)
    m = Linear(IN, OUT, device="cpu")
    x = te.Float8CurrentScalingQuantizer(E4M3)(torch.randn(32, IN))
    with te.autocast(recipe=DelayedScaling()):
        y = m(x)
        assert fwd_state(m).amax_history[0, 0] == 0.0  # not cast again
    wq = fake_quant(m.weight, torch.ones(1), E4M3)
    expected = x.dequantize().double() @ wq.t() + m.bias.double()
    assert_close_by_table(y, expected, ("fp8_dequantized", torch.float32))


# ------------------------------------------------------------------------------------------
# torch.autocast


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_torch_autocast_bf16_with_fp32_params(recipe):
    torch.manual_seed(16)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        recipe_object = FP8_RECIPES.get(recipe, DelayedScaling)()
        with te.autocast(enabled=recipe is not None, recipe=recipe_object):
            y = m(x)
        y_ref = F.linear(x, m.weight, m.bias)
    assert y.dtype == torch.bfloat16
    if recipe is None:
        assert torch.equal(y, y_ref)
    else:
        assert_close_by_table(y, F.linear(x, m.weight, m.bias), ("e4m3", torch.bfloat16))
    y.float().sum().backward()
    assert m.weight.dtype == m.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32 and m.bias.grad.dtype == torch.float32


def test_no_warnings_in_the_plain_paths():
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x).sum().backward()
        with te.autocast(recipe=DelayedScaling()):
            y = m(x)
        y.sum().backward()


def test_fp8_frozen_weight_and_constant_input_still_train_the_bias():
    """Only the bias needs a gradient: backward must not try to quantize dy for no GEMM."""
    from transformer_engine.common.recipe import DelayedScaling as _Delayed

    layer = Linear(32, 48, device="cpu")
    layer.weight.requires_grad_(False)
    x = torch.randn(16, 32)
    with te.autocast(recipe=_Delayed()):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(layer.bias.grad, dy.sum(0))
    assert layer.weight.grad is None


@pytest.mark.parametrize(
    "bias, freeze_weight, fused",
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["bias+wgrad: fused", "no bias", "frozen weight: no transpose, separate sum"],
)
def test_backward_takes_the_bias_gradient_from_the_grad_output_cast(
    monkeypatch, bias, freeze_weight, fused
):
    from transformer_engine.pytorch.tensor._float8_quantizers import Float8Quantizer

    calls = []
    original = Float8Quantizer.quantize_with_dbias_impl

    def spy(self, tensor):
        calls.append(tuple(tensor.shape))
        return original(self, tensor)

    monkeypatch.setattr(Float8Quantizer, "quantize_with_dbias_impl", spy)
    torch.manual_seed(0)
    layer = te.Linear(32, 48, bias=bias, device="cpu")
    layer.weight.requires_grad_(not freeze_weight)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 48)
    with te.autocast(recipe=DelayedScaling()):
        y = layer(x)
    y.backward(dy)
    assert calls == ([(16, 48)] if fused else [])
    if bias:
        torch.testing.assert_close(layer.bias.grad, dy.sum(dim=0), rtol=1e-6, atol=1e-5)
