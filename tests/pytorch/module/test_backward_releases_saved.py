"""After its backward, a module keeps none of what its forward saved, although the output (and
with it the autograd graph) stays alive: a training loop that keeps ``loss`` bound until the
next step's forward would otherwise hold every layer's saved input through that forward.

Autograd drops the tensors handed to ``save_for_backward`` once the node's backward ran; what
the module itself put back for its backward (the unpacked operands, an FP8 storage refilled
with its buffers and the typed views the GEMMs made of them) must go too. Checked on the
objects Python can reach: after the backward no live tensor may still hold a saved buffer. A
second backward through the graph (``retain_graph=True``) still works where it did.
"""

from __future__ import annotations

import gc

import pytest
import torch
from utils import autocast_by_name, live_cpu_tensors_on

import transformer_engine.pytorch as te

TOKENS, WIDTH = 64, 128


def _saved_buffers(run, parameters):
    """``(addresses of the non-parameter buffers saved for backward, run()'s result)``."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    addresses = set()

    def pack(tensor):
        for name in ("_data", "_transpose", "_rowwise_data", "_columnwise_data"):
            inner = getattr(tensor, name, None)
            if isinstance(inner, torch.Tensor):
                addresses.add(inner.untyped_storage().data_ptr())
        if not hasattr(tensor, "_data"):
            addresses.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return addresses - excluded - {0}, out


MODULES = {
    "Linear": lambda: te.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cpu"),
    "LayerNormLinear": lambda: te.LayerNormLinear(
        WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cpu"
    ),
    "LayerNormMLP": lambda: te.LayerNormMLP(
        WIDTH, 2 * WIDTH, params_dtype=torch.bfloat16, device="cpu"
    ),
}


@pytest.mark.parametrize("precision", [None, "delayed", "current"])
@pytest.mark.parametrize("name", list(MODULES))
def test_nothing_saved_outlives_the_backward(name, precision):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)

    def run():
        h = x * 2  # not a leaf the test holds: only the graph keeps it
        with autocast_by_name(precision):
            return module(h)

    addresses, y = _saved_buffers(run, list(module.parameters()))
    assert addresses and live_cpu_tensors_on(addresses)
    y.float().sum().backward()
    gc.collect()
    assert y.grad_fn is not None  # the graph is alive
    assert not live_cpu_tensors_on(addresses), "saved buffers still held after the backward"


@pytest.mark.parametrize("name", list(MODULES))
def test_weight_copies_under_torch_autocast_are_let_go(name):
    """Float32 parameters under torch.autocast: the GEMMs read bfloat16 copies of the weights,
    which must not outlive the backward either (a second copy of every weight)."""
    torch.manual_seed(0)
    module = {
        "Linear": lambda: te.Linear(WIDTH, WIDTH, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(WIDTH, WIDTH, device="cpu"),
        "LayerNormMLP": lambda: te.LayerNormMLP(WIDTH, 2 * WIDTH, device="cpu"),
    }[name]()
    x = torch.randn(TOKENS, WIDTH, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(x * 2)

    addresses, y = _saved_buffers(run, list(module.parameters()))
    y.float().sum().backward()
    gc.collect()
    assert not live_cpu_tensors_on(addresses), "saved buffers still held after the backward"
    first = [p.grad.clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    run().float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, module.parameters()))


@pytest.mark.parametrize("precision", [None, "current"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear"])
def test_second_backward_still_works(name, precision):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name(precision):
        y = module(x * 2)
    y.float().sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.float().sum().backward()
    assert torch.equal(x.grad, first)
