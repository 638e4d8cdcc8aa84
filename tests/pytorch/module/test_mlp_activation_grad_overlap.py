"""``te.LayerNormMLP``'s backward runs the activation's gradient on a side stream beside FC2's
weight-gradient GEMM (``module/_activation_grad_overlap.py``).

Oracle: the same steps with the overlap off (``NVTE_MLP_OVERLAP_ACTIVATION_GRAD=0``), where
every kernel runs on the calling stream. The overlapped order runs the same kernels on the same
inputs, so outputs, input and parameter gradients and the FP8 scaling state must be bit for bit
those of the sequential order. The ordering is checked by making the side stream's work late: a
sleep queued on the side stream before the activation's gradient, so FC1's GEMMs would read an
unwritten gradient without the join. The CPU part checks when the overlap is used.
"""

from __future__ import annotations

import pytest
import torch
from utils import bitwise_equal, make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.pytorch.module import _activation_grad_overlap as overlap
from transformer_engine.pytorch.module import _mlp_function
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

ENV = "NVTE_MLP_OVERLAP_ACTIVATION_GRAD"
# FC1's output must reach overlap.MIN_ELEMENTS (4M) for the side stream to be used.
TOKENS, HIDDEN, FFN = 1024, 256, 4096
STEPS = 3


def test_overlap_wanted_only_for_large_cuda_tensors(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not overlap.overlap_wanted(torch.empty(4096, 4096))  # a CPU tensor
    assert not overlap.overlap_wanted(torch.empty(1, device="meta"))


def test_the_cpu_backward_matches_with_the_variable_set_either_way(monkeypatch):
    """On the CPU the variable changes nothing (no side stream there)."""
    results = []
    for value in ("0", "1"):
        monkeypatch.setenv(ENV, value)
        torch.manual_seed(0)
        module = te.LayerNormMLP(32, 128, device="cpu", params_dtype=torch.bfloat16)
        x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=make_recipe("current")):
            y = module(x)
        y.float().square().sum().backward()
        results.append([y, x.grad, *(p.grad for p in module.parameters())])
    for a, b in zip(*results):
        assert bitwise_equal(a, b)


def _fp8_state(module) -> list:
    out = []
    for m in module.modules():
        if isinstance(m, TransformerEngineBaseModule) and m.fp8_meta_tensors_initialized:
            for key in ("scaling_fwd", "scaling_bwd"):
                state = m.fp8_meta[key].delayed_scaling_state()
                if state is not None:
                    out += [state.scale.clone(), state.amax_history.clone()]
    return out


def _run(module, recipe, steps=STEPS) -> list:
    """Every step's output, input gradient and parameter gradients (an SGD update between
    steps so the weights move), then the FP8 state."""
    device = next(module.parameters()).device
    g = torch.Generator().manual_seed(7)
    results = []
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16)
        dy = torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16)
        x.requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = module(x)
        y.backward(dy)
        results += [y.detach().clone(), x.grad.clone()]
        with torch.no_grad():
            for p in module.parameters():
                results.append(p.grad.clone())
                p.sub_(0.25 * p.grad)
                p.grad = None
    return results + _fp8_state(module)


def _module(activation: str, device) -> te.LayerNormMLP:
    torch.manual_seed(1234)
    return te.LayerNormMLP(
        HIDDEN, FFN, activation=activation, device=device, params_dtype=torch.bfloat16
    )


def _late_side_stream(monkeypatch, streams: list) -> None:
    """The activation's gradient starts after a sleep queued on the stream it runs on, and
    records that stream."""
    original = _mlp_function._activation_gradient

    def late(ctx, saved1, d_act, h2):
        streams.append(torch.cuda.current_stream(h2.device))
        torch.cuda._sleep(20_000_000)  # tens of milliseconds at GPU clocks
        return original(ctx, saved1, d_act, h2)

    monkeypatch.setattr(_mlp_function, "_activation_gradient", late)


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_overlapped_backward_is_bitwise_the_sequential_one(monkeypatch, recipe_name, activation):
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv(ENV, "0")
    expected = _run(_module(activation, device), make_recipe(recipe_name))
    monkeypatch.setenv(ENV, "1")
    streams = []
    _late_side_stream(monkeypatch, streams)
    got = _run(_module(activation, device), make_recipe(recipe_name))
    assert len(streams) == STEPS
    calling = torch.cuda.current_stream(device)
    assert all(s != calling for s in streams), "the activation's gradient ran on the caller's"
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert bitwise_equal(a, b), f"result {i} differs from the sequential backward's"


@needs_cuda
def test_small_mlps_and_the_variable_keep_the_calling_stream(monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    calling = torch.cuda.current_stream(device)
    for env, ffn in (("0", FFN), ("1", 128)):
        monkeypatch.setenv(ENV, env)
        streams = []
        _late_side_stream(monkeypatch, streams)
        torch.manual_seed(0)
        module = te.LayerNormMLP(HIDDEN, ffn, device=device, params_dtype=torch.bfloat16)
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=make_recipe("current")):
            y = module(x)
        y.sum().backward()
        assert streams == [calling]
        monkeypatch.undo()


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_a_graphed_mlp_captures_the_side_stream(monkeypatch, recipe_name):
    """Captured with the overlap (the fork and join become graph dependencies), replays give
    the eager sequential results."""
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv(ENV, "0")
    expected = _run(_module("gelu", device), make_recipe(recipe_name))
    monkeypatch.setenv(ENV, "1")
    graphed = _module("gelu", device)
    sample = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    recipe = make_recipe(recipe_name)
    make_graphed_callables(graphed, (sample,), enabled=True, recipe=recipe)
    got = _run(graphed, recipe)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert bitwise_equal(a, b), f"result {i} differs from the eager sequential backward's"
