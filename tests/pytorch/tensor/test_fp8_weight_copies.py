"""Copies of modules with delayed-scaling FP8 weights (``te.quantized_model_init``) own their
FP8 state.

``copy.deepcopy`` of a module (and ``torch.save`` / ``torch.load`` of a whole module) gives the
copy its own recipe state; its FP8 weights re-quantize with the copy's weight quantizers: the
copy's scale, and the amax recorded into the copy's history. Training the copy leaves the
original's scales and amax histories exactly as they were.

Oracles: ``fp8_oracle``'s byte cast, float32 reciprocal and amax; the original's state and
bytes cloned before the copy was made.
"""

from __future__ import annotations

import copy
import io

import fp8_oracle as oracle
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

E4M3 = torch.float8_e4m3fn


def _recipe():
    return DelayedScaling(amax_history_len=4)


def _build(make):
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=_recipe()):
        return make()


MODULES = {
    "Linear": lambda: te.Linear(32, 32, bias=False, params_dtype=torch.float32, device="cpu"),
    "LayerNormMLP": lambda: te.LayerNormMLP(32, 64, params_dtype=torch.float32, device="cpu"),
}


def _deepcopy(module):
    return copy.deepcopy(module)


def _save_and_load(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _deepcopy, "torch_save_load": _save_and_load}


def _fp8_weights(module):
    """``(name, parameter, weight slot in scaling_fwd)`` of each FP8 weight."""
    out = [
        (name, p, module.param_init_meta[name][1])
        for name, p in module.named_parameters()
        if isinstance(p, QuantizedTensor)
    ]
    assert out
    return out


def _snapshot(module):
    state = module.fp8_meta["scaling_fwd"]
    weights = {name: p._data.clone() for name, p, _ in _fp8_weights(module)}
    return state.scale.clone(), state.amax_history.clone(), weights


def _assert_unchanged(module, snapshot):
    scale, history, weights = snapshot
    state = module.fp8_meta["scaling_fwd"]
    assert torch.equal(state.scale, scale)
    assert torch.equal(state.amax_history, history)
    for name, p, _ in _fp8_weights(module):
        assert torch.equal(p._data, weights[name]), name


def _requantize_with(module, new_scale):
    """Set the copy's weight scales to ``new_scale``, re-quantize every FP8 weight in place
    (``add_(0)``); return each weight's values after the add (-0.0 + 0.0 is +0.0)."""
    state = module.fp8_meta["scaling_fwd"]
    before = {}
    for name, p, slot in _fp8_weights(module):
        before[name] = oracle.dequantize(p._data, p._scale_inv, torch.float32, E4M3) + 0.0
        state.scale[slot] = new_scale
        with torch.no_grad():
            p.add_(0.0)
    return before


@pytest.mark.parametrize("copy_fn", list(COPIES.values()), ids=list(COPIES))
@pytest.mark.parametrize("make", list(MODULES.values()), ids=list(MODULES))
def test_copied_weights_requantize_with_the_copy_state(make, copy_fn):
    module = _build(make)
    snapshot = _snapshot(module)
    clone = copy_fn(module)
    state = clone.fp8_meta["scaling_fwd"]
    history = state.amax_history.clone()
    values = _requantize_with(clone, 64.0)
    for name, p, slot in _fp8_weights(clone):
        assert torch.equal(p._scale_inv, oracle.reciprocal(64.0)), name
        assert torch.equal(p._data, oracle.cast_bytes(values[name], 64.0, E4M3)), name
        # the cast max-accumulated its amax into the copy's history, weight slot, row 0
        expected = torch.maximum(history[0, slot].reshape(1), oracle.amax(values[name]))
        assert torch.equal(state.amax_history[0, slot].reshape(1), expected), name
    _assert_unchanged(module, snapshot)


@pytest.mark.parametrize("copy_fn", list(COPIES.values()), ids=list(COPIES))
def test_training_the_copy_leaves_the_original_state_alone(copy_fn):
    module = _build(MODULES["Linear"])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    with te.autocast(enabled=True, recipe=_recipe()):
        module(x).sum().backward()
    module.weight.grad = None
    snapshot = _snapshot(module)
    clone = copy_fn(module)
    optimizer = torch.optim.SGD(clone.parameters(), lr=10.0)
    for _ in range(2):
        with te.autocast(enabled=True, recipe=_recipe()):
            clone(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    _assert_unchanged(module, snapshot)
    state = clone.fp8_meta["scaling_fwd"]
    slot = clone.param_init_meta["weight"][1]
    assert not torch.equal(state.amax_history[:, slot], snapshot[1][:, slot])
    # the copy's weight re-quantizes with the copy's weight scale
    assert clone.weight._quantizer.scale.data_ptr() == state.scale[slot].data_ptr()


@pytest.mark.parametrize("copy_fn", list(COPIES.values()), ids=list(COPIES))
def test_copied_te_ops_linear_weight_requantizes_with_the_copy_state(copy_fn):
    op = _build(lambda: te.ops.Linear(32, 32, bias=False, dtype=torch.float32, device="cpu"))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with te.autocast(enabled=True, recipe=_recipe()):
        op(x).sum().backward()
    basic = op.basic_ops[0]
    state = basic.recipe_state("forward")
    saved = (state.scale.clone(), state.amax_history.clone(), basic.weight._data.clone())
    copied = copy_fn(op).basic_ops[0]
    copied_state = copied.recipe_state("forward")
    weight = copied.weight
    values = oracle.dequantize(weight._data, weight._scale_inv, torch.float32, E4M3) + 0.0
    copied_state.scale.fill_(64.0)
    with torch.no_grad():
        weight.add_(0.0)
    assert torch.equal(weight._scale_inv, oracle.reciprocal(64.0))
    assert torch.equal(weight._data, oracle.cast_bytes(values, 64.0, E4M3))
    assert torch.equal(state.scale, saved[0]) and torch.equal(state.amax_history, saved[1])
    assert torch.equal(basic.weight._data, saved[2])
