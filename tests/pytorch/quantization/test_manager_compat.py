"""Upstream surface that clients call on the quantization state and the recipes:
FP8GlobalStateManager's block-scaled availability answers and its fp8_meta-level recompute
protocol, and DelayedScaling's constructor arguments of older releases (Megatron-LM's
override_linear_precision, accelerate's interval)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as ShimManager
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.quantization.recipe_state import DelayedScalingRecipeState

# ---------------------------------------------------------------- availability


@pytest.mark.parametrize(
    "method, recipe_name",
    [
        ("is_mxfp8_available", "MXFP8BlockScaling"),
        ("is_nvfp4_available", "NVFP4BlockScaling"),
    ],
)
def test_block_scaled_availability_is_a_tuple_naming_the_recipe(method, recipe_name):
    # MXFP8 and NVFP4 are natively supported only on Blackwell (these runs: CPU or Hopper), and
    # their reasons say the GEMMs are emulated.
    expected = "emulation"
    for manager in (FP8GlobalStateManager, ShimManager):
        available, reason = getattr(manager, method)()
        assert available is False
        assert recipe_name in reason and expected in reason
    # The package-level function of the same name gives the same answer.
    assert getattr(te, method)(return_reason=True) == (False, reason)


def test_fp8_availability_tuple_unchanged():
    available, reason = FP8GlobalStateManager.is_fp8_available()
    assert isinstance(available, bool) and isinstance(reason, str)
    assert (reason == "") == available


# ---------------------------------------------------------------- recompute protocol


def _fp8_meta(history_len=4, n=3):
    state = DelayedScalingRecipeState(
        DelayedScaling(amax_history_len=history_len), mode="forward", num_quantizers=n, device="cpu"
    )
    return {"recipe": DelayedScaling(amax_history_len=history_len), "scaling_fwd": state}


def test_recompute_swaps_in_the_queued_values_and_restores_in_place():
    FP8GlobalStateManager.reset()
    meta = _fp8_meta()
    state = meta["scaling_fwd"]
    scale_tensor, history_tensor = state.scale, state.amax_history
    # Step 1 forward: values v1 are queued; step 2 forward: v2 queued.
    state.scale.copy_(torch.tensor([1.0, 2.0, 3.0]))
    state.amax_history.fill_(1.0)
    FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(meta)
    state.scale.copy_(torch.tensor([4.0, 5.0, 6.0]))
    state.amax_history.fill_(2.0)
    FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(meta)
    # Scales move on (an update), then the recompute of step 1 runs, then of step 2.
    state.scale.copy_(torch.tensor([7.0, 8.0, 9.0]))
    state.amax_history.fill_(3.0)
    for expected_scale, expected_amax in (([1.0, 2.0, 3.0], 1.0), ([4.0, 5.0, 6.0], 2.0)):
        FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(meta)
        assert state.scale.tolist() == expected_scale
        assert torch.all(state.amax_history == expected_amax)
        state.amax_history[0].fill_(100.0)  # the recompute's own amaxes are dropped
        FP8GlobalStateManager.restore_fp8_meta_tensors(meta)
        assert state.scale.tolist() == [7.0, 8.0, 9.0]
        assert torch.all(state.amax_history == 3.0)
    # In place: quantizers and the registry keep pointing at the same tensors.
    assert state.scale is scale_tensor and state.amax_history is history_tensor
    assert "updated_scale_fwd" not in meta


def test_recompute_protocol_misuse_is_named():
    FP8GlobalStateManager.reset()
    meta = _fp8_meta()
    with pytest.raises(RuntimeError, match="copy_forward_fp8_meta_tensors_for_recompute"):
        FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(meta)
    with pytest.raises(RuntimeError, match="get_old_fp8_meta_tensors_for_recompute"):
        FP8GlobalStateManager.restore_fp8_meta_tensors(meta)


def test_recompute_protocol_without_delayed_state_does_nothing():
    FP8GlobalStateManager.reset()
    meta = {"recipe": Float8CurrentScaling()}  # current scaling keeps no scales
    FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(meta)
    FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(meta)
    FP8GlobalStateManager.restore_fp8_meta_tensors(meta)
    assert meta == {"recipe": Float8CurrentScaling()}
    assert FP8GlobalStateManager.quantization_state.fp8_tensors_recompute_buffer == []


# ---------------------------------------------------------------- DelayedScaling arguments


def _no_warnings(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return DelayedScaling(**kwargs)


def test_megatron_override_linear_precision_with_fp8_wgrad_is_silent_and_changes_nothing():
    recipe = _no_warnings(margin=1, override_linear_precision=(False, False, False))
    assert recipe == DelayedScaling(margin=1)
    assert repr(recipe) == repr(DelayedScaling(margin=1))


def test_override_linear_precision_asking_high_precision_warns_naming_the_gemm():
    with pytest.warns(
        UserWarning,
        match=r"override_linear_precision=\(False, False, True\).*"
        r"wgrad GEMM.*FP8",
    ) as record:
        recipe = DelayedScaling(margin=1, override_linear_precision=(False, False, True))
    assert record[0].filename == __file__  # points at the caller
    # Nothing is stored: the recipe is the one without the argument (same amax group).
    assert recipe == DelayedScaling(margin=1)
    assert [f.name for f in dataclasses.fields(recipe)] == [
        f.name for f in dataclasses.fields(DelayedScaling())
    ]
    with pytest.warns(UserWarning, match="fprop/dgrad GEMM"):
        DelayedScaling(override_linear_precision=[True, True, False])


def test_interval_accepted_warned_only_when_it_would_change_something():
    assert _no_warnings(interval=1) == DelayedScaling()
    with pytest.warns(UserWarning, match="interval=4.*every step"):
        assert DelayedScaling(interval=4, amax_history_len=8) == DelayedScaling(amax_history_len=8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interval": 0}, r"interval=0 is not an int >= 1.*ignored"),
        ({"interval": 1.5}, r"interval=1\.5 is not an int >= 1.*ignored"),
        ({"interval": "often"}, r"interval='often' is not an int >= 1.*ignored"),
        ({"override_linear_precision": (False, True)}, "override_linear_precision.*ignored"),
        ({"override_linear_precision": "wgrad"}, "override_linear_precision.*ignored"),
    ],
)
def test_compat_arguments_bad_values_warn_and_change_nothing(kwargs, match):
    # Upstream drops both arguments whatever they hold, so no value may raise.
    with pytest.warns(UserWarning, match=match) as record:
        recipe = DelayedScaling(**kwargs)
    assert record[0].filename == __file__  # points at the caller
    assert recipe == DelayedScaling()


def test_compat_arguments_lax_values_read_like_pydantic():
    # (0, 0, 1) reads as (False, False, True): pydantic's lax bools.
    with pytest.warns(UserWarning, match=r"wgrad GEMM in high precision"):
        DelayedScaling(override_linear_precision=(0, 0, 1))
    assert _no_warnings(interval="1", override_linear_precision=("false", 0, False)) == (
        DelayedScaling()
    )


def test_compat_arguments_are_keyword_only_and_not_attributes():
    with pytest.raises(TypeError):
        DelayedScaling(0, DelayedScaling().fp8_format, 16, "max", None, True, False, False, None, 1)
    with pytest.warns(UserWarning):
        recipe = DelayedScaling(interval=3, override_linear_precision=(False, False, True))
    # Not stored: the class-level defaults (None: "not given") are all an instance shows.
    assert recipe.interval is None and recipe.override_linear_precision is None
    # Assigning them sets a plain attribute (upstream allows any attribute); not a field.
    recipe.override_linear_precision = (False, False, False)
    assert recipe == DelayedScaling()
    del recipe.override_linear_precision
    # dataclasses.replace does not pass them on.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(recipe, margin=2) == DelayedScaling(margin=2)
    # Copies and pickles (modules snapshot recipes; checkpoints pickle them) do not re-run the
    # constructor, and carry nothing extra.
    assert copy.copy(recipe) == recipe
    assert pickle.loads(pickle.dumps(recipe)) == recipe


def test_float8_current_scaling_does_not_take_them():
    # Only DelayedScaling ever had these arguments; elsewhere they are unknown keywords,
    # dropped with a warning (upstream drops them silently).
    with pytest.warns(UserWarning, match="Float8CurrentScaling: keyword argument 'interval'"):
        assert Float8CurrentScaling(interval=1) == Float8CurrentScaling()


def test_subclass_passing_them_like_megatron():
    class TEDelayedScaling(DelayedScaling):
        def __init__(self, fp8_wgrad: bool):
            super().__init__(
                margin=0,
                amax_history_len=16,
                override_linear_precision=(False, False, not fp8_wgrad),
            )

    assert TEDelayedScaling(fp8_wgrad=True).amax_history_len == 16
    with pytest.warns(UserWarning, match="wgrad"):
        TEDelayedScaling(fp8_wgrad=False)
