"""te.autocast, quantized_model_init, availability, recipe state and the global manager."""

import warnings

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import quantization as q
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.quantization import (
    DelayedScalingRecipeState,
    Float8CurrentScalingRecipeState,
    FP8GlobalStateManager,
    RecipeState,
    autocast,
    support,
)


def registered_meta(recipe, device="cpu", slots=2, forward=True, backward=True):
    meta = {"recipe": recipe, "fp8_group": None}
    if forward:
        meta["scaling_fwd"] = RecipeState.create(
            recipe, mode="forward", num_quantizers=slots, device=device
        )
    if backward:
        meta["scaling_bwd"] = RecipeState.create(
            recipe, mode="backward", num_quantizers=slots, device=device
        )
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    return meta


def test_state_is_restored_after_nesting_and_exceptions():
    outer, inner = DelayedScaling(), Float8CurrentScaling()
    before = FP8GlobalStateManager.get_autocast_state()
    with autocast(recipe=outer):
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
        with pytest.raises(ZeroDivisionError):
            with autocast(enabled=False, calibrating=True, recipe=inner):
                assert not FP8GlobalStateManager.is_fp8_enabled()
                assert FP8GlobalStateManager.is_fp8_calibration()
                1 / 0  # noqa: B018
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
        assert FP8GlobalStateManager.quantization_state.autocast_depth == 1
    assert FP8GlobalStateManager.get_autocast_state() == before
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0


def test_an_active_instance_cannot_be_reentered_but_can_be_reused():
    ctx = autocast(recipe=DelayedScaling())
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            ctx.__enter__()
    with ctx:
        assert FP8GlobalStateManager.is_fp8_enabled()
    assert not FP8GlobalStateManager.is_fp8_enabled()


def test_forward_scales_update_only_at_the_outermost_exit_in_grad_mode():
    recipe = DelayedScaling(amax_history_len=2)
    with autocast(recipe=recipe):
        meta = registered_meta(recipe)
        state = meta["scaling_fwd"]
        state.amax_history[0] = torch.tensor([4.0, 0.0])
        with autocast(recipe=recipe):
            pass
        assert torch.equal(state.scale, torch.ones(2)), "an inner exit must not update"
    assert torch.equal(state.scale, torch.tensor([112.0, 1.0]))  # 448 / 4, zero slot kept
    assert torch.equal(state.amax_history, torch.tensor([[0.0, 0.0], [4.0, 0.0]]))
    assert torch.equal(meta["scaling_bwd"].scale, torch.ones(2)), "backward waits for backward"

    state.amax_history[0] = torch.tensor([8.0, 8.0])
    with torch.no_grad(), autocast(recipe=recipe):
        pass
    assert torch.equal(state.scale, torch.tensor([112.0, 1.0])), "no update under no_grad"


def test_an_exception_skips_the_update():
    recipe = DelayedScaling()
    with pytest.raises(KeyError):
        with autocast(recipe=recipe):
            meta = registered_meta(recipe)
            meta["scaling_fwd"].amax_history[0] = 2.0
            raise KeyError("boom")
    assert torch.equal(meta["scaling_fwd"].scale, torch.ones(2))
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0


def test_backward_update_touches_only_backward_state():
    recipe = DelayedScaling(fp8_format=Format.HYBRID, margin=1)
    meta = registered_meta(recipe)  # no autocast needed: the key carries recipe and group
    meta["scaling_fwd"].amax_history[0] = 2.0
    meta["scaling_bwd"].amax_history[0] = 2.0
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    assert torch.equal(meta["scaling_bwd"].scale, torch.full((2,), 57344.0 / 2 / 2))
    assert torch.equal(meta["scaling_fwd"].scale, torch.ones(2))


def test_first_fp8_module_flag_is_true_once_per_region():
    with autocast(recipe=DelayedScaling()):
        assert FP8GlobalStateManager.is_first_fp8_module()
        assert not FP8GlobalStateManager.is_first_fp8_module()
        with autocast(recipe=DelayedScaling()):
            assert not FP8GlobalStateManager.is_first_fp8_module()
    with autocast(recipe=DelayedScaling()):
        assert FP8GlobalStateManager.is_first_fp8_module()


def test_registration_is_idempotent_and_follows_replaced_state():
    recipe = DelayedScaling()
    meta = registered_meta(recipe)
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    assert len(registry) == 2
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    assert len(registry) == 2
    # a rebuilt state (e.g. after module.to(...)) is re-pointed in place, not appended
    moved = RecipeState.create(recipe, mode="forward", num_quantizers=2, device="cpu")
    moved.amax_history, moved.scale = moved.amax_history.to("meta"), moved.scale.to("meta")
    meta["scaling_fwd"] = moved  # stands in for a state moved to another device
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    assert len(registry) == 2
    key, position = meta["buffer_index_and_autocast_key"][True]
    assert registry.entry(key, position)[0] is meta["scaling_fwd"].amax_history
    assert [d.type for d, _ in registry.device_groups(key)] == ["meta"]


def test_current_scaling_state_is_not_registered():
    recipe = Float8CurrentScaling()
    registered_meta(recipe)
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 0


def test_fp8_autocast_is_a_deprecated_alias():
    recipe, group = DelayedScaling(), object()
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        ctx = q.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
    assert isinstance(ctx, autocast)
    assert ctx.recipe is recipe and ctx.amax_reduction_group is group


def test_quantized_model_init_sets_and_restores_flags():
    recipe = Float8CurrentScaling()
    with q.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        assert FP8GlobalStateManager.with_fp8_parameters()
        assert FP8GlobalStateManager.with_high_precision_init_val()
        assert FP8GlobalStateManager.get_fp8_recipe() is recipe
    assert not FP8GlobalStateManager.with_fp8_parameters()
    assert not FP8GlobalStateManager.with_high_precision_init_val()
    with pytest.warns(DeprecationWarning):
        with q.fp8_model_init():
            assert FP8GlobalStateManager.with_fp8_parameters()
    assert not FP8GlobalStateManager.with_fp8_parameters()


def test_recipe_support_checks():
    with pytest.raises(TypeError, match="is not a transformer_engine Recipe"):
        q.check_recipe_support("delayed")
    with pytest.raises(TypeError):
        with autocast(recipe="delayed"):
            pass
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0


@pytest.mark.parametrize(
    "device, message",
    [
        (None, "needs device="),
        ("meta", "cannot live on the meta device"),
        ("cuda", "names no CUDA index"),
    ],
)
def test_recipe_state_needs_a_concrete_device(device, message):
    with pytest.raises(ValueError, match=message):
        RecipeState.create(DelayedScaling(), mode="forward", num_quantizers=1, device=device)


def test_recipe_state_layout_and_formats():
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=7)
    fwd = RecipeState.create(recipe, mode="forward", num_quantizers=3, device="cpu")
    bwd = RecipeState.create(recipe, mode="backward", num_quantizers=2, device="cpu")
    assert isinstance(fwd, DelayedScalingRecipeState)
    assert fwd.scale.shape == (3,) and torch.equal(fwd.scale, torch.ones(3))
    assert fwd.amax_history.shape == (7, 3) and not fwd.amax_history.any()
    assert (fwd.dtype, bwd.dtype) == (DType.kFloat8E4M3, DType.kFloat8E5M2)
    cs = RecipeState.create(Float8CurrentScaling(), mode="backward", num_quantizers=2, device="cpu")
    assert isinstance(cs, Float8CurrentScalingRecipeState)
    with pytest.raises(ValueError, match="mode="):
        RecipeState.create(recipe, mode="sideways", device="cpu")


def test_inherit_state_rebinds_only_tensors_of_its_own_device():
    recipe = DelayedScaling(amax_history_len=3)
    old = RecipeState.create(recipe, mode="forward", num_quantizers=2, device="cpu")
    old.scale.fill_(5.0)
    same = RecipeState.create(recipe, mode="forward", num_quantizers=2, device="cpu")
    same.inherit_state_from(old)
    assert same.scale is old.scale and same.amax_history is old.amax_history
    elsewhere = RecipeState.create(recipe, mode="forward", num_quantizers=2, device="cpu")
    # stands in for a state on another device (a second GPU where there is none)
    elsewhere.device = torch.device("meta")
    elsewhere.scale, elsewhere.amax_history = (
        elsewhere.scale.to("meta"),
        elsewhere.amax_history.to("meta"),
    )
    elsewhere.inherit_state_from(old)
    assert elsewhere.scale.device.type == "meta" and elsewhere.scale is not old.scale


def test_adjust_amax_history_length():
    state = RecipeState.create(DelayedScaling(amax_history_len=3), mode="forward", device="cpu")
    state.amax_history[:, 0] = torch.tensor([1.0, 2.0, 3.0])
    state.adjust_amax_history_length(5)
    assert torch.equal(state.amax_history[:, 0], torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0]))
    state.adjust_amax_history_length(2)
    assert torch.equal(state.amax_history[:, 0], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="amax_history_len=0"):
        state.adjust_amax_history_length(0)


def test_fp8_availability_per_device(monkeypatch):
    assert q.is_fp8_available(device="cpu") is True
    assert q.is_fp8_available(return_reason=True, device="cpu") == (True, "")
    assert q.check_fp8_support("meta")[0] is False
    with pytest.raises(ValueError, match="names no CUDA index"):
        q.check_fp8_support("cuda")
    support._cuda_fp8_support.cache_clear()
    monkeypatch.setattr(
        support, "device_compute_capability", lambda d: (8, 0) if d.index == 3 else (9, 0)
    )
    try:
        assert q.check_fp8_support("cuda:1") == (True, "")
        ok, reason = q.check_fp8_support("cuda:3")
        assert not ok and "cuda:3 has compute capability 8.0" in reason
    finally:
        support._cuda_fp8_support.cache_clear()
    if not torch.cuda.is_available():
        assert q.is_fp8_available() is True  # the CPU reference path


def test_autocast_key_helpers():
    recipe = DelayedScaling()
    key = FP8GlobalStateManager.get_key_in_buffer(False, recipe, None)
    assert key.startswith("backward_recipe=")
    assert FP8GlobalStateManager.split_key_in_buffer(key) == (
        False,
        FP8GlobalStateManager.get_unique_autocast_key(recipe, None),
    )
    assert FP8GlobalStateManager.get_meta_tensor_key(False) == "scaling_bwd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert q.get_default_fp8_recipe() == DelayedScaling()
