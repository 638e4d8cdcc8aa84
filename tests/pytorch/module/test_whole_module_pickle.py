"""``torch.save(model)`` of a whole model (not its state dict), as quick checkpoints and some
frameworks do: every module pickles and loads back computing the same outputs, also after an
FP8 forward. Modules keep their init method and activation as callables: those are partials of
module-level functions (closures do not pickle: "Can't pickle local object")."""

from __future__ import annotations

import io

import pytest
import torch
from utils import autocast_by_name

import transformer_engine.pytorch as te

WIDTH = 64


def _builders():
    return {
        "Linear": lambda: te.Linear(WIDTH, WIDTH, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(WIDTH, WIDTH, device="cpu"),
        "LayerNormMLP gelu": lambda: te.LayerNormMLP(WIDTH, 2 * WIDTH, device="cpu"),
        "LayerNormMLP clamped_swiglu": lambda: te.LayerNormMLP(
            WIDTH,
            2 * WIDTH,
            activation="clamped_swiglu",
            device="cpu",
            activation_params={"limit": 5.0, "alpha": 1.5},
        ),  # fmt: skip
        "TransformerLayer": lambda: te.TransformerLayer(
            WIDTH,
            2 * WIDTH,
            4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            device="cpu",
            output_layer_init_method=te.utils.scaled_init_method_normal(0.02, 4),
        ),  # fmt: skip
        "ops.Sequential": lambda: te.ops.Sequential(
            te.ops.LayerNorm(WIDTH, device="cpu"), te.ops.Linear(WIDTH, WIDTH, device="cpu")
        ),
    }


@pytest.mark.parametrize("precision", [None, "delayed"])
@pytest.mark.parametrize("name", list(_builders()))
def test_whole_module_round_trips_through_torch_save(name, precision):
    torch.manual_seed(0)
    module = _builders()[name]()
    x = torch.randn(16, 2, WIDTH)
    with torch.no_grad(), autocast_by_name(precision):
        expected = module(x)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad(), autocast_by_name(precision):
        again = module(x)
        got = loaded(x)
    assert torch.equal(got, again)
    assert expected.shape == got.shape


def test_init_methods_pickle_and_fill_as_documented():
    torch.manual_seed(0)
    normal = te.utils.init_method_normal(0.5)
    loaded = torch.load(io.BytesIO(_dumps(normal)), weights_only=False)
    a, b = torch.empty(4096), torch.empty(4096)
    torch.manual_seed(1)
    normal(a)
    torch.manual_seed(1)
    loaded(b)
    assert torch.equal(a, b) and abs(a.std().item() - 0.5) < 0.05
    for value in (0.0, 1.0, 2.5):
        fill = torch.load(io.BytesIO(_dumps(te.utils.init_method_constant(value))),
                          weights_only=False)  # fmt: skip
        t = fill(torch.empty(3))
        assert torch.equal(t, torch.full((3,), value))


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
