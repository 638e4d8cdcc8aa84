"""LayerNormMLP(checkpoint=True): FC1 and the activation keep no activations and are recomputed
in backward, with the FP8 scales of the original forward, giving the same bits as
checkpoint=False while saving less for backward."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

RECIPES = {"high-precision": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}


def train(checkpoint, recipe, activation="gelu", steps=3):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    module = te.LayerNormMLP(32, 64, device="cpu", checkpoint=checkpoint, activation=activation)
    saved_bytes = []
    outputs, input_grads = [], []
    for step in range(steps):
        torch.manual_seed(10 + step)
        x = (torch.randn(2, 16, 32) * (step + 1)).requires_grad_(True)
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with te.autocast(enabled=recipe is not None, recipe=recipe and recipe()):
                y = module(x)
        y.square().sum().backward()
        saved_bytes.append(sum(sizes))
        outputs.append(y.detach())
        input_grads.append(x.grad)
    grads = {name: p.grad for name, p in module.named_parameters()}
    state = {
        key: (module.fp8_meta[key].scale.clone(), module.fp8_meta[key].amax_history.clone())
        for key in ("scaling_fwd", "scaling_bwd")
        if recipe is DelayedScaling
    }
    return outputs, input_grads, grads, state, saved_bytes


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_checkpoint_gives_the_same_bits_and_saves_less(recipe, activation):
    recomputed = train(True, RECIPES[recipe], activation)
    stored = train(False, RECIPES[recipe], activation)
    for a, b in zip(recomputed[0] + recomputed[1], stored[0] + stored[1]):
        assert torch.equal(a, b)
    assert recomputed[2].keys() == stored[2].keys()
    for name in stored[2]:
        assert torch.equal(recomputed[2][name], stored[2][name]), name
    # delayed scaling: the recompute cast with the original scales and counted no amax twice
    for key in recomputed[3]:
        assert torch.equal(recomputed[3][key][0], stored[3][key][0]), key
        assert torch.equal(recomputed[3][key][1], stored[3][key][1]), key
    assert all(a < b for a, b in zip(recomputed[4], stored[4])), (recomputed[4], stored[4])
    assert guard_depth() == 0


def test_checkpoint_without_grad_runs_plainly():
    torch.manual_seed(0)
    module = te.LayerNormMLP(32, 64, device="cpu", checkpoint=True)
    x = torch.randn(16, 32)
    with torch.no_grad():
        y = module(x)
    module.checkpoint = False
    with torch.no_grad():
        assert torch.equal(y, module(x))


def _train_combined(checkpoint, outer, delay, fuse, recipe):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    module = te.LayerNormMLP(
        32, 64, device="cpu", checkpoint=checkpoint, delay_wgrad_compute=delay,
        fuse_wgrad_accumulation=fuse,
    )  # fmt: skip
    if fuse:
        for w in (module.fc1_weight, module.fc2_weight):
            w.main_grad = torch.zeros_like(w)
    results = []
    for step in range(3):
        torch.manual_seed(10 + step)
        x = (torch.randn(16, 32) * (step + 1)).requires_grad_(True)
        with te.autocast(recipe=recipe()):
            y = te.checkpoint(module, x) if outer else module(x)
        y.square().sum().backward()
        if delay:
            module.backward_dw()
        results += [y.detach(), x.grad]
    results += [p.grad for p in module.parameters() if p.grad is not None]
    if fuse:
        results += [module.fc1_weight.main_grad, module.fc2_weight.main_grad]
    if recipe is DelayedScaling:
        state = module.fp8_meta["scaling_fwd"]
        results += [state.amax_history.clone(), state.scale.clone()]
    return results


@pytest.mark.parametrize(
    "recipe", [DelayedScaling, Float8CurrentScaling], ids=["delayed", "current"]
)
@pytest.mark.parametrize("outer", [False, True], ids=["", "inside-te.checkpoint"])
@pytest.mark.parametrize("delay", [False, True], ids=["", "delay_wgrad"])
@pytest.mark.parametrize("fuse", [False, True], ids=["", "main_grad"])
def test_checkpoint_combines_with_te_checkpoint_delayed_wgrad_and_main_grad(
    recipe, outer, delay, fuse
):
    recomputed = _train_combined(True, outer, delay, fuse, recipe)
    stored = _train_combined(False, False, delay, fuse, recipe)
    assert len(recomputed) == len(stored)
    for a, b in zip(recomputed, stored):
        assert torch.equal(a, b)
