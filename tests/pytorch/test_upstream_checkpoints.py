"""Checkpoint interchange with upstream Transformer Engine, module by module: the state-dict key
names, upstream-written state dicts (BF16 and FP8 delayed scaling) loading here, and what this
package writes for upstream to read (docs/compatibility.md, "Checkpoints").

Upstream's layouts are written out here from its documented format: the
parameter names, and extra state as an empty ``torch.uint8`` tensor (no FP8 state) or the pickled
dict ``{"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
"extra_fp8_variables"}`` as bytes in a ``torch.uint8`` tensor.
"""

from __future__ import annotations

import pickle

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
H, F = 32, 64

# class -> (constructor, upstream's state-dict keys)
UPSTREAM_KEYS = {
    "Linear": (lambda: te.Linear(H, H, device="cpu"), ["weight", "bias", "_extra_state"]),
    "LayerNormLinear": (
        lambda: te.LayerNormLinear(H, H, device="cpu"),
        ["layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state"],
    ),
    "LayerNormMLP": (
        lambda: te.LayerNormMLP(H, F, device="cpu"),
        [
            "layer_norm_weight",
            "layer_norm_bias",
            "fc1_weight",
            "fc1_bias",
            "fc2_weight",
            "fc2_bias",
            "_extra_state",
        ],
    ),  # fmt: skip
    "ops.Linear": (
        lambda: te.ops.Linear(H, H, device="cpu"),
        [
            "basic_ops.0.weight",
            "basic_ops.0._extra_state",
            "basic_ops.1.bias",
            "basic_ops.1._extra_state",
        ],
    ),  # fmt: skip
}
# te.LayerNorm / te.RMSNorm: upstream's are te.ops basic operations without quantizers, so their
# state dict holds the parameters and an "_extra_state" that is always an empty uint8 tensor.
NORM_PARAMS = {
    "LayerNorm": (lambda: te.LayerNorm(H, device="cpu"), ["weight", "bias"]),
    "RMSNorm": (lambda: te.RMSNorm(H, device="cpu"), ["weight"]),
}


@pytest.fixture(autouse=True)
def _no_unsafe_pickle(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _empty_extra_state():
    return torch.empty(0, dtype=torch.uint8)


def _upstream_state_dict(keys, seed=0):
    """Upstream's BF16 checkpoint of a module: random parameters, empty extra state."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in keys:
        state[key] = (
            _empty_extra_state()
            if key.endswith("_extra_state")
            else torch.randn(value.shape, generator=g)
        )
    return state


@pytest.mark.parametrize("name", list(UPSTREAM_KEYS))
def test_state_dict_keys_are_upstreams(name):
    make, keys = UPSTREAM_KEYS[name]
    assert list(make().state_dict()) == keys


@pytest.mark.parametrize("name", list(NORM_PARAMS))
def test_norm_state_dict_is_upstreams(name):
    """Upstream's keys, and upstream's empty uint8 extra state (its loader skips it)."""
    make, keys = NORM_PARAMS[name]
    state = make().state_dict()
    assert list(state) == [*keys, "_extra_state"]
    extra = state["_extra_state"]
    assert isinstance(extra, torch.Tensor) and extra.dtype == torch.uint8 and extra.numel() == 0


@pytest.mark.parametrize("name", list(UPSTREAM_KEYS))
def test_upstream_bf16_state_dict_loads_strictly(name):
    make, _ = UPSTREAM_KEYS[name]
    m = make()
    upstream = _upstream_state_dict(m.state_dict().items())
    result = m.load_state_dict(upstream, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in m.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(value, upstream[key]), key


@pytest.mark.parametrize("extra", [_empty_extra_state(), None], ids=["empty", "none"])
@pytest.mark.parametrize("name", list(NORM_PARAMS))
def test_upstream_norm_state_dict_with_extra_state_loads_strictly(name, extra):
    make, keys = NORM_PARAMS[name]
    m = make()
    upstream = {key: torch.randn(H) for key in keys}
    result = m.load_state_dict({**upstream, "_extra_state": extra}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key in keys:
        assert torch.equal(m.state_dict()[key], upstream[key])


@pytest.mark.parametrize("name", list(NORM_PARAMS))
def test_ours_norm_state_dict_has_every_key_upstream_loads_strictly(name):
    """Upstream's strict load needs exactly its keys: parameters plus _extra_state."""
    make, keys = NORM_PARAMS[name]
    assert set(make().state_dict()) == {*keys, "_extra_state"}


@pytest.mark.parametrize(
    "norm, plain",
    [
        (lambda: te.LayerNorm(H, device="cpu"), lambda: torch.nn.LayerNorm(H)),
        (lambda: te.RMSNorm(H, device="cpu"), lambda: torch.nn.RMSNorm(H)),
    ],
    ids=["LayerNorm", "RMSNorm"],
)
def test_parameter_only_norm_state_dict_still_loads_strictly(norm, plain):
    """A state dict without _extra_state (torch.nn's norms, earlier versions of ours) loads."""
    source = plain()
    with torch.no_grad():
        for p in source.parameters():
            p.uniform_()
    m = norm()
    result = m.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in source.state_dict().items():
        assert torch.equal(m.state_dict()[key], value)


@pytest.mark.parametrize(
    "extra, held",
    [
        (torch.ones(5, dtype=torch.uint8), "torch.uint8 tensor of 5 elements"),
        ({"format": "transformer_engine/extra_state"}, "a dict"),
    ],
    ids=["bytes", "dict"],
)
@pytest.mark.parametrize("name", list(NORM_PARAMS))
def test_norm_refuses_extra_state_it_cannot_hold(name, extra, held):
    make, keys = NORM_PARAMS[name]
    m = make()
    state = {key: torch.randn(H) for key in keys}
    with pytest.raises(ValueError, match=f"{name}: the checkpoint's _extra_state is .*{held}"):
        m.load_state_dict({**state, "_extra_state": extra}, strict=True)


def _upstream_fp8_linear_state(recipe, length):
    """Upstream's delayed-scaling checkpoint of a te.Linear (3 forward, 2 backward slots)."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "scale_fwd": torch.rand(3, generator=g) + 0.5,
        "amax_history_fwd": torch.rand(length, 3, generator=g),
        "scale_bwd": torch.rand(2, generator=g) + 0.5,
        "amax_history_bwd": torch.rand(length, 2, generator=g),
    }
    payload = {
        "recipe": recipe,
        **tensors,
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1},
    }
    extra = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    return extra, tensors


def test_upstream_fp8_delayed_linear_loads_with_the_opt_in(monkeypatch):
    recipe = DelayedScaling(margin=1, amax_history_len=4)
    extra, tensors = _upstream_fp8_linear_state(recipe, 4)
    m = te.Linear(H, H, device="cpu")
    state = {"weight": torch.randn(H, H), "bias": torch.randn(H), "_extra_state": extra}
    with pytest.raises(RuntimeError, match=ENV):
        m.load_state_dict(state)
    monkeypatch.setenv(ENV, "1")
    m.load_state_dict(state)
    fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
    assert m.fp8_meta["recipe"] == recipe
    assert torch.equal(fwd.scale, tensors["scale_fwd"])
    assert torch.equal(fwd.amax_history, tensors["amax_history_fwd"])
    assert torch.equal(bwd.scale, tensors["scale_bwd"])
    assert torch.equal(bwd.amax_history, tensors["amax_history_bwd"])


def test_upstream_fp8_delayed_ops_linear_loads_with_the_opt_in(monkeypatch):
    """Upstream's te.ops extra state: one dict per direction, each with the recipe and that
    direction's scales and histories (BasicLinear: input and weight forward, grad_output
    backward)."""
    monkeypatch.setenv(ENV, "1")
    recipe = DelayedScaling(amax_history_len=4)
    scale_fwd, history_fwd = torch.tensor([2.0, 0.5]), torch.arange(8.0).reshape(4, 2)
    scale_bwd, history_bwd = torch.tensor([0.25]), torch.arange(4.0).reshape(4, 1) + 10
    assert history_fwd.amax(0).tolist() == [6.0, 7.0] and history_bwd.max() == 13
    payload = {
        "forward": {"recipe": recipe, "scale_fwd": scale_fwd, "amax_history_fwd": history_fwd,
                    "extra_fp8_variables": {}},
        "backward": {"recipe": recipe, "scale_bwd": scale_bwd, "amax_history_bwd": history_bwd,
                     "extra_fp8_variables": {}},
    }  # fmt: skip
    extra = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    m = te.ops.Linear(H, H, device="cpu")
    state = dict(m.state_dict())
    state["basic_ops.0._extra_state"] = extra
    m.load_state_dict(state)
    with te.autocast(recipe=recipe):
        m(0.01 * torch.randn(16, H)).sum().backward()
    # The step's own amaxes (inputs of 0.01 * N(0, 1), weights and grads of order 1) are below
    # the loaded histories' maxima, so the updated scales are fp8_max / those maxima: the
    # histories were restored (E4M3 448 forward, E5M2 57344 backward).
    op = m.basic_ops[0]
    fwd, bwd = op.recipe_state("forward"), op.recipe_state("backward")
    torch.testing.assert_close(fwd.scale.cpu(), torch.tensor([448 / 6, 448 / 7]))
    torch.testing.assert_close(bwd.scale.cpu(), torch.tensor([57344 / 13]))


def test_upstream_ops_extra_state_with_two_recipes_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    payload = {
        "forward": {"recipe": DelayedScaling(amax_history_len=4), "scale_fwd": torch.ones(2),
                    "amax_history_fwd": torch.zeros(4, 2)},
        "backward": {"recipe": DelayedScaling(amax_history_len=8), "scale_bwd": torch.ones(1),
                     "amax_history_bwd": torch.zeros(8, 1)},
    }  # fmt: skip
    extra = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    m = te.ops.Linear(H, H, device="cpu")
    state = dict(m.state_dict())
    state["basic_ops.0._extra_state"] = extra
    with pytest.raises(ValueError, match="different recipes"):
        m.load_state_dict(state)


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling], ids=["bf16", "current"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "ops.Linear"])
def test_ours_without_delayed_state_writes_upstreams_empty_extra_state(name, recipe):
    """Upstream's "no state" (an empty uint8 tensor, which its reader skips): ours then holds
    exactly upstream's BF16 layout under upstream's key names."""
    make, keys = UPSTREAM_KEYS[name]
    m = make()
    with te.autocast(enabled=recipe is not None, recipe=recipe() if recipe else None):
        m(torch.randn(16, H)).sum().backward()
    state = m.state_dict()
    assert list(state) == keys
    for key in keys:
        if key.endswith("_extra_state"):
            assert state[key].dtype == torch.uint8 and state[key].shape == (0,), key


def test_ours_with_delayed_state_is_bytes_upstreams_reader_refuses_without_running_them():
    """Our delayed-scaling state is a uint8 tensor like upstream's, but holds no pickle:
    upstream's policy check (ported in transformer_engine.pytorch._extra_state) cannot
    classify it and asks for the opt-in, and unpickling it fails at the first byte."""
    from transformer_engine.pytorch._extra_state import should_load_extra_state_pickle

    m = te.Linear(H, H, device="cpu")
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        m(torch.randn(16, H)).sum().backward()
    extra = m.state_dict()["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.dim() == 1 and extra.numel() > 0
    data = bytes(extra.tolist())
    assert data[0] == 0xFF  # not a pickle opcode
    with pytest.raises(RuntimeError, match=ENV):
        should_load_extra_state_pickle(data, "Linear")
    with pytest.raises(pickle.UnpicklingError, match="invalid load key"):
        pickle.loads(data)
