"""Upstream-user behaviours of the legacy modules found missing by a conformance probe; each
test checks against upstream's documented behaviour or a float64 computation."""

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling


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


def delayed_step(layer, x, recipe):
    with te.autocast(recipe=recipe):
        layer(x).sum().backward()


def meta_snapshot(layer):
    """Copies of each direction's ``[scale, amax_history]`` (reset_fp8_meta_tensors' format)."""
    return {
        key: [layer.fp8_meta[key].scale.clone(), layer.fp8_meta[key].amax_history.clone()]
        for key in ("scaling_fwd", "scaling_bwd")
    }


def assert_meta_equals(layer, snapshot):
    for key, (scale, history) in snapshot.items():
        assert torch.equal(layer.fp8_meta[key].scale, scale)
        assert torch.equal(layer.fp8_meta[key].amax_history, history)


def test_reset_fp8_meta_tensors_to_defaults_and_to_saved_values():
    # Upstream's base module: reset_fp8_meta_tensors() sets scale 1 and history 0;
    # reset_fp8_meta_tensors(saved) copies saved[key] = [scale, amax_history] back in place.
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32) * 3
    delayed_step(layer, x, recipe)
    saved = meta_snapshot(layer)
    assert not torch.all(saved["scaling_fwd"][0] == 1)  # the step moved the scales
    quantizer_scale = layer.quantizers["scaling_fwd"][0].scale
    layer.reset_fp8_meta_tensors()
    for key in saved:
        assert torch.all(layer.fp8_meta[key].scale == 1)
        assert torch.all(layer.fp8_meta[key].amax_history == 0)
    assert quantizer_scale.item() == 1.0  # in place: the quantizers see the reset
    layer.reset_fp8_meta_tensors(saved)
    assert_meta_equals(layer, saved)


def test_reset_fp8_meta_tensors_with_a_missing_direction_changes_nothing():
    layer = te.Linear(32, 32, device="cpu")
    delayed_step(layer, torch.randn(16, 32) * 3, DelayedScaling(amax_history_len=4))
    before = meta_snapshot(layer)
    forward_only = {"scaling_fwd": [torch.ones(3), torch.zeros(4, 3)]}
    with pytest.raises(KeyError, match="scaling_bwd"):
        layer.reset_fp8_meta_tensors(forward_only)
    assert_meta_equals(layer, before)


def test_a_new_amax_history_len_keeps_the_scales():
    # Upstream's set_meta_tensor only adjusts the history length when the new recipe is still
    # delayed scaling: the scales computed so far stay.
    layer = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32) * 3
    for _ in range(2):
        delayed_step(layer, x, DelayedScaling(amax_history_len=8))
    scale = layer.fp8_meta["scaling_fwd"].scale.clone()
    history = layer.fp8_meta["scaling_fwd"].amax_history.clone()
    with torch.no_grad(), te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(x)
    state = layer.fp8_meta["scaling_fwd"]
    assert state.amax_history.shape == (4, 3)
    assert torch.equal(state.scale, scale)
    # rows 1..3 are the old ones; row 0 also holds this forward's amaxes (max-accumulated)
    assert torch.equal(state.amax_history[1:], history[1:4])


def test_adjust_amax_history_length_pads_and_later_updates_use_the_new_history():
    recipe = DelayedScaling(amax_history_len=2)
    layer = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32) * 3
    delayed_step(layer, x, recipe)
    before = layer.fp8_meta["scaling_fwd"].amax_history.clone()
    layer.adjust_amax_history_length(5, fwd=True)
    after = layer.fp8_meta["scaling_fwd"].amax_history
    assert after.shape == (5, 3) and layer.fp8_meta["scaling_bwd"].amax_history.shape == (2, 2)
    assert torch.equal(after[:2], before) and torch.all(after[2:] == 0)
    layer.reset_fp8_meta_tensors()
    delayed_step(layer, x, recipe)
    # amax_compute_algo="max", margin 0: scale = E4M3 max / max over the history
    expected_input_scale = 448.0 / x.abs().max().item()
    torch.testing.assert_close(
        layer.fp8_meta["scaling_fwd"].scale[0].item(), expected_input_scale, rtol=1e-6, atol=0
    )
    assert layer.fp8_meta["scaling_fwd"].amax_history[-1, 0].item() == x.abs().max().item()


@pytest.mark.parametrize(
    "make, bias_names",
    [
        (lambda: te.Linear(32, 16, bias=False, device="cpu"), ["bias"]),
        (lambda: te.LayerNormLinear(32, 16, bias=False, device="cpu"), ["bias"]),
        (
            lambda: te.Linear(32, 16, bias=False, parameters_split=("q", "k"), device="cpu"),
            ["q_bias", "k_bias"],
        ),
        (lambda: te.LayerNormMLP(32, 16, bias=False, device="cpu"), ["fc1_bias", "fc2_bias"]),
        (lambda: te.GroupedLinear(2, 32, 16, bias=False, device="cpu"), ["bias0", "bias1"]),
    ],
)
def test_without_bias_the_bias_attribute_is_an_empty_tensor(make, bias_names):
    # Upstream: without bias, the bias attribute is an empty tensor, not a Parameter (code that
    # calls .numel() / .to() on it must keep working); it is not in the state dict.
    layer = make()
    state_dict = layer.state_dict()
    for name in bias_names:
        bias = getattr(layer, name)
        assert isinstance(bias, torch.Tensor) and not isinstance(bias, torch.nn.Parameter)
        assert bias.numel() == 0
        assert name not in state_dict
    x = torch.randn(8, 32)
    out = layer(x, [4, 4]) if isinstance(layer, te.GroupedLinear) else layer(x)
    if bias_names == ["bias"] and isinstance(layer, te.Linear):  # no bias added: x @ W^T
        torch.testing.assert_close(
            out.double(), x.double() @ layer.weight.double().t(), rtol=0, atol=1e-5
        )
