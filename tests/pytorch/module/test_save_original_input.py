"""Linear(save_original_input=True): the input is kept in high precision and quantized again
in backward for the weight gradient, which is exact for current scaling only."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


def run(save_original_input):
    torch.manual_seed(0)
    layer = te.Linear(32, 48, device="cpu", save_original_input=save_original_input)
    x = (torch.randn(16, 32) * 3).requires_grad_(True)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = layer(x)
    y.square().sum().backward()
    return y, x.grad, layer.weight.grad, layer.bias.grad


def test_same_bits_as_saving_the_fp8_input_under_current_scaling():
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_the_forward_keeps_no_column_wise_copy(monkeypatch):
    from transformer_engine.pytorch.functional import linear as functional_linear

    calls = []
    original = functional_linear._quantize

    def spy(quantizer, tensor, *, rowwise, columnwise, **kwargs):
        calls.append((tuple(tensor.shape), rowwise, columnwise))
        return original(quantizer, tensor, rowwise=rowwise, columnwise=columnwise, **kwargs)

    monkeypatch.setattr(functional_linear, "_quantize", spy)
    run(True)
    input_calls = [c for c in calls if c[0] == (16, 32)]
    assert input_calls == [((16, 32), True, False), ((16, 32), False, True)]


def test_delayed_scaling_is_refused_with_the_reason():
    layer = te.Linear(32, 48, device="cpu", save_original_input=True)
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.raises(ValueError, match="only exact for stateless recipes"):
        with te.autocast(recipe=DelayedScaling()):
            layer(x)
    with torch.no_grad():  # outside FP8 the flag changes nothing
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
        )


def run_grouped(save_original_input, recipe=None):
    torch.manual_seed(0)
    layer = te.GroupedLinear(2, 32, 48, device="cpu", save_original_input=save_original_input)
    x = (torch.randn(48, 32) * 3).requires_grad_(True)
    with te.autocast(recipe=recipe or Float8CurrentScaling()):
        y = layer(x, [16, 32])
    y.square().sum().backward()
    return (y, x.grad, *(p.grad for p in layer.parameters()))


def test_grouped_linear_same_bits_as_saving_the_fp8_inputs_under_current_scaling():
    for a, b in zip(run_grouped(True), run_grouped(False), strict=True):
        assert torch.equal(a, b)


def test_grouped_linear_refuses_delayed_scaling_with_the_reason():
    with pytest.raises(ValueError, match="GroupedLinear: save_original_input=True .* stateless"):
        run_grouped(True, DelayedScaling())
    assert FP8GlobalStateManager.quantization_state.is_first_fp8_module in (True, False)
