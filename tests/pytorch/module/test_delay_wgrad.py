"""Linear(delay_wgrad_compute=True): backward computes dgrad (and the bias gradient) only; the
weight-gradient GEMMs wait for module.backward_dw() and then give the same gradients."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

RECIPES = [None, DelayedScaling(), Float8CurrentScaling()]


def train(delay, recipe, fuse=False, steps=2):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    layer = te.Linear(32, 48, device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    if fuse:
        layer.weight.main_grad = torch.zeros(48, 32)
    grads_before_dw = []
    x_grads = []
    for step in range(steps):
        x = (torch.randn(16, 32) * (step + 1)).requires_grad_(True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.square().sum().backward()
        grads_before_dw.append(layer.weight.grad)
        if delay:
            assert layer.need_backward_dw() and len(layer.wgrad_store) == 1
            layer.backward_dw()
            assert layer.wgrad_store == []
        x_grads.append(x.grad)
    weight_grad = layer.weight.main_grad if fuse else layer.weight.grad
    return weight_grad, layer.bias.grad, x_grads, grads_before_dw


@pytest.mark.parametrize("recipe", RECIPES, ids=["high-precision", "delayed", "current"])
@pytest.mark.parametrize("fuse", [False, True])
def test_deferred_weight_gradients_equal_the_immediate_ones(recipe, fuse):
    delayed = train(True, recipe, fuse)
    immediate = train(False, recipe, fuse)
    assert torch.equal(delayed[0], immediate[0])
    assert torch.equal(delayed[1], immediate[1])
    for a, b in zip(delayed[2], immediate[2]):
        assert torch.equal(a, b)
    if not fuse:
        assert delayed[3][0] is None  # nothing before backward_dw() on the first step


def test_without_delay_nothing_waits():
    layer = te.Linear(32, 48, device="cpu")
    assert not layer.need_backward_dw()
    layer.backward_dw()  # a no-op


@pytest.mark.parametrize("build", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_wgrad_hooks_run_after_the_delayed_gradients_exist(build):
    """register_wgrad_accumulation_and_reduce_hooks: each hook runs at the end of every
    backward_dw(), in registration order, when the weight gradients are already there."""
    ctor = getattr(te, build)
    layer = ctor(32, 48, device="cpu", delay_wgrad_compute=True)
    weights = [p for name, p in layer.named_parameters() if name.endswith("weight")]
    seen = []
    layer.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append(("first", all(w.grad is not None for w in weights)))
    )
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(("second", None)))
    layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert seen == []
    layer.backward_dw()
    assert seen == [("first", True), ("second", None)]
    with pytest.raises(TypeError, match="must be callable"):
        layer.register_wgrad_accumulation_and_reduce_hooks(None)
    plain = ctor(32, 48, device="cpu")  # nothing deferred: backward_dw runs nothing
    plain.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append("ran"))
    plain.backward_dw()
    assert seen[-1] != "ran"


def test_delay_with_split_parameters_is_refused():
    with pytest.raises(ValueError, match="delay_wgrad_compute=True cannot be combined"):
        te.Linear(32, 48, device="cpu", delay_wgrad_compute=True, parameters_split=("a", "b"))


# ------------------------------------------------------------------------------------------
# The other GEMM modules: LayerNormLinear, LayerNormMLP (two deferred GEMMs per backward) and
# GroupedLinear (one per group).

SPLITS = [16, 0, 32]  # an empty group defers nothing for that group


def build(kind, delay):
    torch.manual_seed(0)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(32, 48, device="cpu", delay_wgrad_compute=delay)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(32, 64, device="cpu", delay_wgrad_compute=delay)
    return te.GroupedLinear(3, 32, 48, device="cpu", delay_wgrad_compute=delay)


def weights(kind, module):
    if kind == "LayerNormMLP":
        return [module.fc1_weight, module.fc2_weight]
    if kind == "GroupedLinear":
        return [getattr(module, f"weight{i}") for i in range(3)]
    return [module.weight]


def train_module(kind, delay, recipe, steps=2):
    FP8GlobalStateManager.reset()
    module = build(kind, delay)
    deferred_counts, x_grads = [], []
    for step in range(steps):
        torch.manual_seed(10 + step)
        x = (torch.randn(48, 32) * (step + 1)).requires_grad_(True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, SPLITS) if kind == "GroupedLinear" else module(x)
        y.square().sum().backward()
        if delay:
            assert module.need_backward_dw()
            deferred_counts.append(len(module.wgrad_store))
            if step == 0:
                assert all(w.grad is None for w in weights(kind, module))
            module.backward_dw()
            assert module.wgrad_store == []
        x_grads.append(x.grad)
    grads = {name: p.grad for name, p in module.named_parameters()}
    return grads, x_grads, deferred_counts


@pytest.mark.parametrize("recipe", RECIPES, ids=["high-precision", "delayed", "current"])
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_other_modules_defer_weight_gradients_to_backward_dw(kind, recipe):
    grads, x_grads, counts = train_module(kind, True, recipe)
    ref_grads, ref_x_grads, _ = train_module(kind, False, recipe)
    assert counts == [{"LayerNormLinear": 1, "LayerNormMLP": 2, "GroupedLinear": 3}[kind]] * 2
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name] is not None and torch.equal(grads[name], ref_grads[name]), name
    for a, b in zip(x_grads, ref_x_grads):
        assert torch.equal(a, b)


def test_layernorm_linear_delay_with_split_parameters_is_refused():
    with pytest.raises(ValueError, match="LayerNormLinear: delay_wgrad_compute=True cannot"):
        te.LayerNormLinear(
            32, 48, device="cpu", delay_wgrad_compute=True, parameters_split=("a", "b")
        )
