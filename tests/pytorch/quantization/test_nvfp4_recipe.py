"""NVFP4BlockScaling: fields, environment defaults, derived QParams, validation, predicates,
recipe state, availability, the one-time emulation warning and checkpoint recipe dicts."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
)
from transformer_engine.pytorch.extra_state.recipe_dict import recipe_from_dict, recipe_to_dict
from transformer_engine.pytorch.quantization import support
from transformer_engine.pytorch.quantization.recipe_state import RecipeState


def test_defaults_predicates_and_derived_qparams():
    r = NVFP4BlockScaling()
    assert (r.fp4_format, r.fp8_format, r.fp8_dpa, r.fp8_mha) == (
        Format.E2M1, Format.E4M3, False, False,
    )  # fmt: skip
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode) == (
        "none", "all", "MAE",
    )  # fmt: skip
    assert r.nvfp4() and NVFP4BlockScaling.nvfp4() and not MXFP8BlockScaling().nvfp4()
    assert not r.mxfp8() and not r.float8_block_scaling() and not r.delayed()
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert r.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    off = NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    )
    assert off.fp4_quant_fwd_inp == off.fp4_quant_fwd_weight == off.fp4_quant_bwd_grad == QParams()


@pytest.mark.parametrize(
    "env, field, value",
    [
        ("NVTE_NVFP4_DISABLE_RHT", "disable_rht", True),
        ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "disable_stochastic_rounding", True),
        ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "disable_2d_quantization", True),
        ("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "row_scaled_activation", True),
    ],
)
def test_env_defaults(monkeypatch, env, field, value):
    monkeypatch.setenv(env, "1")
    assert getattr(NVFP4BlockScaling(), field) is value


def test_err_mode_env_is_upper_cased(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_4OVER6_ERR_MODE", "mse")
    assert NVFP4BlockScaling().nvfp4_4over6_err_mode == "MSE"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"fp4_format": Format.E4M3}, ValueError, "fp4_format"),
        ({"fp8_format": Format.HYBRID}, ValueError, "fp8_format"),
        ({"disable_rht": 2}, TypeError, "disable_rht"),
        ({"nvfp4_4over6": "some"}, ValueError, "nvfp4_4over6"),
        ({"nvfp4_4over6_err_mode": "L1"}, ValueError, "nvfp4_4over6_err_mode"),
        ({"nvfp4_4over6": "all"}, ValueError, "stochastic rounding"),
        ({"backward_override": "fast"}, ValueError, "backward_override"),
    ],
)
def test_bad_fields(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        NVFP4BlockScaling(**kwargs)


def test_qparams_are_assignable_and_checked():
    r = NVFP4BlockScaling()
    r.fp4_quant_bwd_grad = QParams(stochastic_rounding=True)
    assert r.fp4_quant_bwd_grad == QParams(stochastic_rounding=True)
    with pytest.raises(TypeError, match="fp4_quant_fwd_inp"):
        r.fp4_quant_fwd_inp = [True]
    # A dict of QParams fields is converted, as pydantic converts nested dataclasses.
    r.fp4_quant_fwd_inp = {"random_hadamard_transform": 1}
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)


def test_recipe_state_per_slot():
    r = NVFP4BlockScaling()
    r.fp4_quant_fwd_inp = QParams()
    fwd = RecipeState.create(r, mode="forward", num_quantizers=3, device="cpu")
    q = fwd.make_quantizers()
    assert [(x.with_rht, x.with_2d_quantization) for x in q] == [
        (False, False), (False, True), (False, False),
    ]  # fmt: skip
    bwd = RecipeState.create(r, mode="backward", num_quantizers=2, device="cpu").make_quantizers()
    assert all(x.with_rht and x.with_post_rht_amax and x.stochastic_rounding for x in bwd)
    assert support.get_align_size_for_quantization(r) == 128


def test_availability_and_one_time_warning(monkeypatch):
    available, reason = te.is_nvfp4_available(return_reason=True, device="cpu")
    assert available is False and "emulation" in reason
    monkeypatch.setattr(support, "_nvfp4_announced", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        support.check_recipe_support(NVFP4BlockScaling())
        support.check_recipe_support(NVFP4BlockScaling())
    messages = [str(w.message) for w in caught if "NVFP4BlockScaling: GEMMs" in str(w.message)]
    assert len(messages) == 1 and "emulation" in messages[0]


def test_checkpoint_recipe_dict_round_trip():
    r = NVFP4BlockScaling(disable_2d_quantization=True)
    r.fp4_quant_fwd_inp = QParams(stochastic_rounding=True)
    back = recipe_from_dict(recipe_to_dict(r))
    assert back == r and back.fp4_quant_fwd_inp == QParams(stochastic_rounding=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_native_availability_follows_compute_capability():
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        available = te.is_nvfp4_available(device=device)
        assert available is (torch.cuda.get_device_capability(device) >= (10, 0))
