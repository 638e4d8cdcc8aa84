"""``get_default_recipe()`` / ``get_default_fp8_recipe()``: the recipe an autocast without
``recipe=`` uses, chosen from the current CUDA device's compute capability.

Fact (te_api_facts.md 1.7 and 10.10): ``MXFP8BlockScaling()`` where MXFP8 is available
(compute capability >= 10.0 and < 12.0, sm_100-class); else ``Float8CurrentScaling()`` at
compute capability >= 12.0; else ``DelayedScaling()``. Deliberate difference: this package's
MXFP8 GEMMs are emulated in float32 on every device, so compute capability 10.x/11.x keeps
``DelayedScaling()`` (native per-tensor FP8 GEMMs) rather than a default that would run every
GEMM in float32. The expected recipes below are written
from that rule; the capability query is monkeypatched, so every GPU generation is tested on
any machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
)
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, support


def _fake_gpus(monkeypatch, capabilities: dict[int, tuple[int, int]], current: int = 0):
    """Pretend CUDA exists with ``capabilities[index]`` per device, ``current`` current."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    def capability(device):
        device = torch.device(device)
        assert device.type == "cuda" and device.index is not None
        return capabilities[device.index]

    monkeypatch.setattr(support, "device_compute_capability", capability)


@pytest.mark.parametrize(
    "cc, expected",
    [
        ((8, 9), DelayedScaling),  # Ada
        ((9, 0), DelayedScaling),  # Hopper
        ((10, 0), DelayedScaling),  # B200: upstream's MXFP8 would be emulated here
        ((10, 3), DelayedScaling),  # B300
        ((11, 0), DelayedScaling),
        ((12, 0), Float8CurrentScaling),  # RTX 50 / RTX PRO
        ((12, 1), Float8CurrentScaling),
        ((13, 0), Float8CurrentScaling),
    ],
)
def test_default_recipe_follows_the_compute_capability(monkeypatch, cc, expected):
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    _fake_gpus(monkeypatch, {0: cc})
    for get in (te.get_default_recipe, support.get_default_fp8_recipe):
        recipe = get()
        assert type(recipe) is expected
        assert recipe == expected(), "a default-constructed recipe"
    # what an FP8 query outside any autocast reports
    FP8GlobalStateManager.reset()
    assert type(FP8GlobalStateManager.get_fp8_recipe()) is expected


def test_default_recipe_reads_the_current_device(monkeypatch):
    _fake_gpus(monkeypatch, {0: (9, 0), 1: (12, 0), 2: (12, 0)}, current=1)
    assert type(te.get_default_recipe()) is Float8CurrentScaling
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert type(te.get_default_recipe()) is Float8CurrentScaling
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert type(te.get_default_recipe()) is DelayedScaling


def test_default_recipe_without_cuda_is_delayed_scaling(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert te.get_default_recipe() == DelayedScaling()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real capability)")
def test_default_recipe_on_this_gpu():
    cc = torch.cuda.get_device_capability(torch.cuda.current_device())
    if cc >= (12, 0):
        expected = Float8CurrentScaling
    else:
        expected = DelayedScaling
    assert type(te.get_default_recipe()) is expected
