"""te.checkpoint: recomputed FP8 forwards cast with the original forward's scales, and the
delayed-scaling state ends exactly as without recompute."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.module import Linear


def two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(32, 64, device="cpu"), Linear(64, 32, device="cpu"))


def states(model):
    out = []
    for layer in model:
        for key in ("scaling_fwd", "scaling_bwd"):
            st = layer.fp8_meta[key]
            out += [st.scale.clone(), st.amax_history.clone()]
    return out


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=3), Float8CurrentScaling()])
def test_recompute_matches_the_plain_run_step_by_step(use_reentrant, recipe):
    plain = two_layers()
    ckpt = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(16, 32, generator=g) * (1 + step)
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        with te.autocast(recipe=recipe):
            y_plain = plain(xs[0])
        with te.autocast(recipe=recipe):
            y_ckpt = te.checkpoint(ckpt, xs[1], use_reentrant=use_reentrant)
        assert torch.equal(y_plain, y_ckpt), step
        y_plain.square().sum().backward()
        y_ckpt.square().sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad), step
        for a, b in zip(plain.parameters(), ckpt.parameters()):
            assert torch.equal(a.grad, b.grad), step
        if isinstance(recipe, DelayedScaling):
            for a, b in zip(states(plain), states(ckpt)):
                assert torch.equal(a, b), step
        assert guard_depth() == 0
    if isinstance(recipe, DelayedScaling):
        assert not torch.equal(plain[0].fp8_meta["scaling_bwd"].scale, torch.ones(2))


def test_distribute_saved_activations_without_a_tensor_parallel_group_changes_nothing():
    # Upstream: it has effect only under tensor parallelism (the 2-process case is in
    # tests/pytorch/distributed/test_distributed_checkpoint_gloo.py).
    x = torch.randn(3, 5, requires_grad=True)
    y = te.checkpoint(lambda t: t.sin() * 2, x, distribute_saved_activations=True)
    assert x.shape == (3, 5)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().cos())


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_without_grad_runs_the_function_and_stashes_nothing(use_reentrant):
    """Under no_grad there is nothing to recompute: the output is the function's, and no module
    keeps scales for a recompute (an evaluation loop through checkpointed layers grew the
    modules' stashes by one entry per call)."""
    torch.manual_seed(0)
    layer = Linear(64, 64, device="cpu")
    ops = te.ops.Sequential(te.ops.Linear(64, 64, device="cpu"))
    x = torch.randn(32, 64)
    for module in (layer, ops):
        with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
            expected = module(x)
        for _ in range(3):
            with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
                out = te.distributed.checkpoint(module, x, use_reentrant=use_reentrant)
            assert torch.equal(out, expected)
        for m in module.modules():
            assert not m.__dict__.get("_recompute_stash"), type(m).__name__
