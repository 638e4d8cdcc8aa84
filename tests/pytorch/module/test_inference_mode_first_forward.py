"""A module whose first forward runs under ``torch.inference_mode`` (an evaluation pass before
training) trains afterwards exactly like one whose first forward ran under ``torch.no_grad``.

The first FP8 forward creates the module's recipe state (delayed scaling: scales and amax
histories), which later steps update in place; created inside inference mode it would be made
of inference tensors, and the first training step would fail ("Inplace update to inference
tensor outside InferenceMode"), as would loading a checkpoint into the module. The oracle is the
same module, deep-copied before its first forward, whose first forward runs under no_grad: the
training step after it must give the same output, gradients and FP8 state, bit for bit.
(Dropout is off, so the two steps draw no random numbers.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from utils import autocast_by_name

import transformer_engine.pytorch as te

TOKENS, WIDTH = 32, 64


def _linear():
    return te.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cpu")


def _layernorm_linear():
    return te.LayerNormLinear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cpu")


def _layernorm_mlp():
    return te.LayerNormMLP(WIDTH, 2 * WIDTH, params_dtype=torch.bfloat16, device="cpu")


def _ops_sequential():
    return te.ops.Sequential(
        te.ops.LayerNorm(WIDTH, dtype=torch.bfloat16, device="cpu"),
        te.ops.Linear(WIDTH, WIDTH, dtype=torch.bfloat16, device="cpu"),
    )


def _transformer_layer():
    return te.TransformerLayer(
        WIDTH, 2 * WIDTH, 4, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip


BUILDERS = {
    "Linear": _linear,
    "LayerNormLinear": _layernorm_linear,
    "LayerNormMLP": _layernorm_mlp,
    "ops.Sequential": _ops_sequential,
    "TransformerLayer": _transformer_layer,
}


def _input(name: str) -> torch.Tensor:
    torch.manual_seed(1)
    shape = (TOKENS // 2, 2, WIDTH) if name == "TransformerLayer" else (TOKENS, WIDTH)
    return torch.randn(shape, dtype=torch.bfloat16)


def _state_tensors(module) -> list[torch.Tensor]:
    """Every tensor of the modules' recipe states (scales and amax histories)."""
    found = []
    for m in module.modules():
        metas = [getattr(m, "fp8_meta", None)]
        metas += list((getattr(m, "_fp8_metas", None) or {}).values())
        for meta in metas:
            if not isinstance(meta, dict):
                continue
            for key in ("scaling_fwd", "scaling_bwd"):
                state = meta.get(key)
                delayed = state.delayed_scaling_state() if state is not None else None
                if delayed is not None:
                    found += [delayed.scale, delayed.amax_history]
    return found


def _train_step(module, x, precision):
    x = x.clone().requires_grad_()
    with autocast_by_name(precision):
        y = module(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("precision", ["delayed", "current"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_training_after_an_inference_mode_forward(name, precision):
    torch.manual_seed(0)
    module = BUILDERS[name]()
    oracle = copy.deepcopy(module)
    x = _input(name)
    # One module after the other: delayed scaling's registry is process-wide, and an update at
    # one autocast's exit also rolls the histories of every module with a pending amax.
    with torch.no_grad(), autocast_by_name(precision):
        oracle(x)
    expected = _train_step(oracle, x, precision)
    with torch.inference_mode(), autocast_by_name(precision):
        module(x)
    for t in _state_tensors(module):
        assert not t.is_inference(), "recipe state made of inference tensors"
    got = _train_step(module, x, precision)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert len(got[2]) == len(expected[2]) > 0
    for a, b in zip(got[2], expected[2]):
        assert torch.equal(a, b)
    states, oracle_states = _state_tensors(module), _state_tensors(oracle)
    assert len(states) == len(oracle_states)
    assert (len(states) > 0) == (precision == "delayed")
    for a, b in zip(states, oracle_states):
        assert torch.equal(a, b)


def test_checkpoint_loads_into_a_module_first_run_in_inference_mode():
    torch.manual_seed(0)
    source = _linear()
    x = _input("Linear")
    for _ in range(2):
        _train_step(source, x, "delayed")
    module = _linear()
    with torch.inference_mode(), autocast_by_name("delayed"):
        module(x)
    module.load_state_dict(source.state_dict())
    for a, b in zip(_state_tensors(module), _state_tensors(source)):
        assert torch.equal(a, b)
    assert torch.equal(_train_step(module, x, "delayed")[0], _train_step(source, x, "delayed")[0])
