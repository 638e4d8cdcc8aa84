"""Upstream-user behaviours of the legacy modules found missing by a conformance probe; each
test checks against upstream's documented behaviour or a float64 computation."""

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te


def float64_linear(layer, x):
    return x.double() @ layer.weight.double().t() + layer.bias.double()


def test_checkpoint_accepts_the_deprecated_positional_form():
    # Upstream still accepts checkpoint(function, distribute_saved_activations,
    # get_rng_state_tracker, tp_group, *args) with a DeprecationWarning.
    torch.manual_seed(0)
    layer = te.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    tracker = te.distributed.CudaRNGStatesTracker()
    with pytest.warns(DeprecationWarning, match="keyword"):
        y = te.checkpoint(layer, False, lambda: tracker, None, x)
    torch.testing.assert_close(y.double(), float64_linear(layer, x), rtol=0, atol=1e-5)
    y.sum().backward()
    expected_grad = layer.weight.double().sum(0).expand(4, 16)
    torch.testing.assert_close(x.grad.double(), expected_grad, rtol=0, atol=1e-5)


def test_checkpoint_keeps_a_tensor_first_call_as_is():
    # A call whose first argument is a tensor is the modern form: nothing is reinterpreted.
    torch.manual_seed(0)
    layer = te.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    y = te.checkpoint(layer, x, is_first_microbatch=True)
    torch.testing.assert_close(y.double(), float64_linear(layer, x), rtol=0, atol=1e-5)


def test_checkpoint_passes_torch_options_to_torch_not_to_the_function():
    # context_fn / determinism_check / debug are torch.utils.checkpoint's options; upstream pops
    # them from kwargs (Linear.forward has no such arguments).
    torch.manual_seed(0)
    layer = te.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    context_fn_calls = []

    def context_fn():
        context_fn_calls.append(1)
        return contextlib.nullcontext(), contextlib.nullcontext()

    y = te.checkpoint(
        layer, x, use_reentrant=False, context_fn=context_fn, determinism_check="none", debug=False
    )
    y.sum().backward()
    assert context_fn_calls == [1]
    torch.testing.assert_close(y.double(), float64_linear(layer, x), rtol=0, atol=1e-5)
