"""Module options used together give the same bits as the plain module: delay_wgrad_compute with
save_original_input, fp8_output and delay_wgrad_compute inside te.checkpoint, GroupedLinear
under te.checkpoint (three steps each, so delayed scales are updated in between)."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


def train(kind, recipe, outer=False, fp8_output=False, **options):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    if kind == "GroupedLinear":
        module = te.GroupedLinear(2, 32, 48, device="cpu", **options)
    else:
        module = te.Linear(32, 48, device="cpu", **options)
    results = []
    for step in range(3):
        torch.manual_seed(10 + step)
        x = (torch.randn(32, 32) * (step + 1)).requires_grad_(True)
        args = (x, [16, 16]) if kind == "GroupedLinear" else (x,)
        kwargs = {} if kind == "GroupedLinear" else {"fp8_output": fp8_output}
        with te.autocast(recipe=recipe()):
            y = te.checkpoint(module, *args, **kwargs) if outer else module(*args, **kwargs)
        values = y.dequantize() if isinstance(y, te.Float8Tensor) else y
        values.float().square().sum().backward()
        if module.need_backward_dw():
            module.backward_dw()
        results += [values.detach(), x.grad]
    return results + [p.grad for p in module.parameters()]


CASES = {
    "Linear delay_wgrad + save_original_input": (
        "Linear", Float8CurrentScaling, {"delay_wgrad_compute": True, "save_original_input": True}, {}
    ),
    "GroupedLinear delay_wgrad + save_original_input": (
        "GroupedLinear", Float8CurrentScaling,
        {"delay_wgrad_compute": True, "save_original_input": True}, {},
    ),
    "Linear fp8_output in te.checkpoint": (
        "Linear", DelayedScaling, {"outer": True, "fp8_output": True}, {"fp8_output": True}
    ),
    "Linear delay_wgrad in te.checkpoint": (
        "Linear", DelayedScaling, {"outer": True, "delay_wgrad_compute": True}, {}
    ),
    "GroupedLinear in te.checkpoint": ("GroupedLinear", DelayedScaling, {"outer": True}, {}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_combined_options_give_the_plain_modules_bits(case):
    kind, recipe, combined, plain = CASES[case]
    got, expected = train(kind, recipe, **combined), train(kind, recipe, **plain)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
