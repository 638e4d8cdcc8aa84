"""FP8 weights built on ``meta`` under ``quantized_model_init``: with a per-tensor recipe they
are ``Float8Tensor`` parameters on meta already (FSDP2's ``fully_shard`` on meta then gives them
FP8 shards with the FP8 all-gather hooks), and materializing them gives the very bytes, scale
and caller's parameter attributes of a build on the device. Sharded training from meta is in
``distributed/test_fsdp2_gloo.py``."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch.device import materialization_device
from transformer_engine.pytorch.tensor import Float8Tensor

RECIPES = {
    "delayed": DelayedScaling,
    "delayed-e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3),
    "current": Float8CurrentScaling,
}


def _build(recipe, device):
    torch.manual_seed(7)
    with te.quantized_model_init(enabled=True, recipe=recipe()):
        return te.LayerNormMLP(32, 64, device=device, params_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_per_tensor_fp8_weights_are_float8_tensors_on_meta(name):
    module = _build(RECIPES[name], "meta")
    for weight in (module.fc1_weight, module.fc2_weight):
        assert isinstance(weight, Float8Tensor) and isinstance(weight, torch.nn.Parameter)
        assert weight.is_meta and weight.dtype == torch.bfloat16
        assert weight._fp8_dtype == te.DType.kFloat8E4M3  # the forward format of both
        assert hasattr(weight, "fsdp_pre_all_gather")
    assert not isinstance(module.fc1_bias, Float8Tensor) and module.fc1_bias.is_meta


def test_block_scaled_weights_stay_high_precision_until_materialized():
    module = _build(MXFP8BlockScaling, "meta")
    assert type(module.fc1_weight) is torch.nn.Parameter and module.fc1_weight.is_meta


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("to_empty", [True, False], ids=["to_empty", "reset_only"])
def test_materialized_weights_equal_a_build_on_the_device(name, to_empty):
    # to_empty's device, else where a reset materializes (the current CUDA device, else the CPU)
    device = torch.device("cpu") if to_empty else materialization_device()
    direct = _build(RECIPES[name], device)
    module = _build(RECIPES[name], "meta")
    if to_empty:
        module.to_empty(device="cpu")
    module.fc1_weight.sequence_parallel = True  # a caller's attribute survives the reset
    torch.manual_seed(7)
    module.reset_parameters()
    for key in ("fc1_weight", "fc2_weight"):
        got, want = getattr(module, key), getattr(direct, key)
        assert isinstance(got, Float8Tensor) and got.device == device
        assert torch.equal(got._data, want._data), key
        assert torch.equal(got._scale_inv, want._scale_inv), key
    assert module.fc1_weight.sequence_parallel is True
    # the module's own quantizer re-quantizes it (not the empty tensor's missing one)
    assert module.fc1_weight._quantizer is not None
    for key in ("fc1_bias", "layer_norm_weight"):
        assert torch.equal(getattr(module, key), getattr(direct, key))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_values_loaded_without_a_reset_are_cast_as_on_the_device(name):
    """``to_empty`` then ``load_state_dict`` of high-precision values (a checkpoint loaded into
    a model built on meta, no reset): the values are cast as into weights built on the device
    (current scaling: the recipe's own scale of the values; delayed: the first scale, 1), and
    the forwards agree bit for bit."""
    source = te.LayerNormMLP(32, 64, device="cpu", params_dtype=torch.bfloat16)
    module = _build(RECIPES[name], "meta")
    module.to_empty(device="cpu")
    module.load_state_dict(source.state_dict(), strict=False)
    direct = _build(RECIPES[name], "cpu")
    direct.load_state_dict(source.state_dict(), strict=False)
    for key in ("fc1_weight", "fc2_weight"):
        got, want = getattr(module, key), getattr(direct, key)
        assert torch.equal(got._data, want._data), key
        assert torch.equal(got._scale_inv, want._scale_inv), key
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with te.autocast(recipe=RECIPES[name]()):
        assert torch.equal(module(x), direct(x))
