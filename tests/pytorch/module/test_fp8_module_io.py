"""fp8_output and fp8_grad of Linear and LayerNormLinear.

``fp8_output=True`` returns the output as a Float8Tensor (the forward state's output slot) that
stays differentiable: the gradient passes through in high precision. ``fp8_grad=True`` returns
the input's gradient as a Float8Tensor quantized with the backward state's grad-input slot, whose
amax enters the same backward's scale update.
"""

import fp8_oracle as oracle
import pytest
import torch
from utils import FP8_RECIPES

import transformer_engine.pytorch as te
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

KINDS = ["Linear", "LayerNormLinear"]
GRAD_INPUT1 = 1  # backward slot of the input gradient (upstream's layout)


def build(kind):
    torch.manual_seed(0)
    return getattr(te, kind)(32, 48, device="cpu")


def inputs():
    torch.manual_seed(1)
    return (torch.randn(16, 32) * 2).requires_grad_(True), torch.randn(16, 48)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_output_is_a_differentiable_float8_tensor(kind, recipe):
    results = {}
    for fp8_output in (False, True):
        FP8GlobalStateManager.reset()
        module, (x, dy) = build(kind), inputs()
        with te.autocast(recipe=FP8_RECIPES[recipe]()):
            out = module(x, fp8_output=fp8_output)
        if fp8_output:
            assert isinstance(out, te.Float8Tensor) and out.requires_grad
            assert out.grad_fn is not None
            values = out.dequantize()
        else:
            values = out
        (out.float() * dy).sum().backward()
        results[fp8_output] = (values.detach(), x.grad, module.weight.grad)
    plain, quantized = results[False], results[True]
    # the FP8 output is the high-precision output cast with the output slot's scale
    if recipe == "delayed":
        scale = torch.ones(1)  # the output slot's scale in the first step (updated at the exit)
        expected = oracle.dequantize(
            oracle.cast_bytes(plain[0], scale, torch.float8_e4m3fn),
            oracle.reciprocal(scale),
            plain[0].dtype,
            torch.float8_e4m3fn,
        )
        assert torch.equal(quantized[0], expected)
    else:
        torch.testing.assert_close(quantized[0], plain[0], rtol=0.07, atol=0.0)
    # straight-through: the same gradient reaches the GEMM, so the same grads come out
    assert torch.equal(quantized[1], plain[1]) and torch.equal(quantized[2], plain[2])


# the plain op before the module gets an FP8 gradient and runs on its dequantized values
@pytest.mark.filterwarnings("ignore:aten.mul.Tensor has no quantized implementation")
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_grad_returns_the_input_gradient_in_fp8(kind, recipe):
    grads = {}
    for fp8_grad in (False, True):
        FP8GlobalStateManager.reset()
        module = build(kind)
        torch.manual_seed(1)
        x0 = (torch.randn(16, 32) * 2).requires_grad_(True)
        x = x0 * 1.0  # not a leaf: the gradient reaches x0 through a plain torch op
        dy = torch.randn(16, 48)
        seen = {}
        x.register_hook(lambda g, seen=seen: seen.setdefault("grad", g))
        with te.autocast(recipe=FP8_RECIPES[recipe]()):
            out = module(x, fp8_grad=fp8_grad)
        (out * dy).sum().backward()
        grads[fp8_grad] = (seen["grad"], x0.grad, module)
    plain, fp8 = grads[False][0], grads[True][0]
    assert not isinstance(plain, te.Float8Tensor)
    assert isinstance(fp8, te.Float8Tensor) and fp8.dtype == plain.dtype
    assert fp8.shape == plain.shape
    module = grads[True][2]
    bwd = module.fp8_meta["scaling_bwd"]
    if recipe == "delayed":
        # cast with the grad-input slot's scale of this backward (1.0 before any update)
        expected = oracle.cast_bytes(plain, 1.0, torch.float8_e5m2).view(torch.float8_e5m2)
        assert torch.equal(fp8._data.view(torch.float8_e5m2).float(), expected.float())
        # its amax entered this backward's update, as upstream's cast inside the module's
        # backward does: rolled into the newest row, row 0 cleared, the scale updated from it
        amax = plain.abs().max()
        assert bwd.amax_history[-1, GRAD_INPUT1] == amax
        assert bwd.amax_history[0, GRAD_INPUT1] == 0.0
        expected_scale = torch.tensor(57344.0, dtype=torch.float32) / amax.float()
        assert bwd.scale[GRAD_INPUT1] == expected_scale
    else:
        torch.testing.assert_close(fp8.dequantize(), plain, rtol=0.14, atol=0.0)
    # the plain op before the module received the dequantized FP8 gradient
    torch.testing.assert_close(grads[True][1], fp8.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_grad_update_runs_when_only_the_weights_gradient_is_asked(kind):
    """The backward scale update that waits for the grad-input cast still runs when the pass
    does not compute the input's gradient (torch.autograd.grad on the weight only)."""
    FP8GlobalStateManager.reset()
    module, (x, dy) = build(kind), inputs()
    with te.autocast(recipe=FP8_RECIPES["delayed"]()):
        out = module(x, fp8_grad=True)
    (dw,) = torch.autograd.grad((out * dy).sum(), [module.weight])
    assert dw is not None
    history = module.fp8_meta["scaling_bwd"].amax_history
    assert history[0, 0] == 0.0 and history[-1, 0] > 0.0, "the grad-output amax was rolled"


def test_fp8_grad_outside_fp8_is_ignored():
    module, (x, dy) = build("Linear"), inputs()
    out = module(x, fp8_grad=True)
    (out * dy).sum().backward()
    assert not isinstance(x.grad, te.Float8Tensor)
