"""Recipes are mutable, as upstream's are: fields (and any other attribute) can be assigned after
construction, every field assignment is checked (lax conversions of assigned values:
test_recipe_lax_construction.py), and a recipe changed between steps makes te.Linear and te.ops.Linear
refresh their recipe state exactly as an equal new recipe object would.

Oracles: hand-written expected values (fields, error messages, scales ``fp8_max * 2**-margin /
amax``), and, for "refreshes exactly like a new recipe", a twin model driven by fresh recipe
objects (the path that never saw a mutation).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
)
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState

IN, OUT, TOKENS = 32, 16, 16


# ---------------------------------------------------------------- assigning fields


@pytest.mark.parametrize(
    "cls, name, value",
    [
        (DelayedScaling, "margin", 3),
        (DelayedScaling, "fp8_format", Format.E4M3),
        (DelayedScaling, "amax_history_len", 16),
        (DelayedScaling, "amax_compute_algo", "most_recent"),
        (DelayedScaling, "reduce_amax", False),
        (DelayedScaling, "fp8_dpa", True),
        (DelayedScaling, "fp8_mha", True),
        (DelayedScaling, "backward_override", None),
        (Float8CurrentScaling, "use_power_2_scales", True),
        (Float8CurrentScaling, "backward_override", "dequantized"),
        (Float8CurrentScaling, "backward_override", "high_precision"),
        (Float8CurrentScaling, "fp8_gemm_fprop", MMParams(True)),
        (Float8CurrentScaling, "fp8_mha", True),
    ],
)
def test_assigned_field_equals_a_recipe_constructed_with_it(cls, name, value):
    recipe = cls()
    setattr(recipe, name, value)
    assert getattr(recipe, name) == value
    assert recipe == cls(**{name: value})
    assert repr(recipe) == repr(cls(**{name: value}))


def test_assigned_integer_likes_are_normalised_like_construction():
    np = pytest.importorskip("numpy")
    recipe = DelayedScaling()
    recipe.amax_history_len = np.int64(8)
    assert type(recipe.amax_history_len) is int and recipe.amax_history_len == 8


@pytest.mark.parametrize(
    "cls, name, value, exc, match",
    [
        (DelayedScaling, "margin", -1, ValueError, r"DelayedScaling: margin .*-1"),
        (DelayedScaling, "margin", 1.5, TypeError, r"margin .*1\.5"),
        (DelayedScaling, "amax_history_len", 0, ValueError, r"amax_history_len .*0"),
        (DelayedScaling, "fp8_format", Format.E5M2, ValueError, r"fp8_format=Format\.E5M2"),
        (DelayedScaling, "amax_compute_algo", "mean", ValueError, r"amax_compute_algo='mean'"),
        (DelayedScaling, "reduce_amax", 2, TypeError, r"reduce_amax .*2"),
        (DelayedScaling, "margin", "abc", ValueError, r"margin .*'abc'"),
        (
            DelayedScaling,
            "backward_override",
            "high_precision",
            ValueError,
            r"backward_override='high_precision'.*delayed scaling",
        ),
        (
            Float8CurrentScaling,
            "backward_override",
            "fp32",
            ValueError,
            r"backward_override='fp32'",
        ),
        (Float8CurrentScaling, "use_power_2_scales", "2", TypeError, r"use_power_2_scales .*'2'"),
        (Float8CurrentScaling, "fp8_gemm_wgrad", True, TypeError, r"fp8_gemm_wgrad .*True"),
    ],
)
def test_invalid_assignment_is_refused_and_leaves_the_field_unchanged(cls, name, value, exc, match):
    recipe = cls()
    before = getattr(recipe, name)
    with pytest.raises(exc, match=match):
        setattr(recipe, name, value)
    assert getattr(recipe, name) == before
    assert recipe == cls()


def test_other_attributes_are_allowed_and_change_nothing():
    # Upstream allows any attribute on a recipe; it is not a field, so equality and repr
    # (which decide shared amax state) ignore it.
    recipe = DelayedScaling()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe.my_tag = 1
        recipe._private = "x"
    assert (recipe.my_tag, recipe._private) == (1, "x")
    assert recipe == DelayedScaling() and repr(recipe) == repr(DelayedScaling())
    del recipe.my_tag
    assert not hasattr(recipe, "my_tag")


def test_a_misspelt_field_is_set_with_a_warning_naming_the_field():
    recipe = DelayedScaling()
    with pytest.warns(UserWarning, match=r"'amax_histroy_len' is not a field.*'amax_history_len'"):
        recipe.amax_histroy_len = 4
    assert recipe.amax_histroy_len == 4 and recipe.amax_history_len == 1024


def test_class_level_role_qparams_assigned_on_an_instance_apply_to_that_recipe():
    recipe = Float8CurrentScaling()
    eps = QParams(amax_epsilon=0.5)
    recipe.fp8_quant_fwd_inp = eps
    assert recipe.fp8_quant_fwd_inp is eps
    assert Float8CurrentScaling.fp8_quant_fwd_inp.amax_epsilon == 0.0, "the class keeps its own"
    state = RecipeState.create(recipe, mode="forward", num_quantizers=1, device="cpu")
    assert state.make_quantizers()[0].amax_epsilon == 0.5


def test_fields_cannot_be_deleted():
    recipe = DelayedScaling()
    with pytest.raises(AttributeError, match="margin"):
        del recipe.margin
    assert recipe.margin == 0


def test_equality_follows_assignments_and_copies_are_independent():
    a, b = DelayedScaling(), DelayedScaling()
    snapshot = copy.copy(a)
    a.margin = 2
    assert a != b and a != snapshot and snapshot == b
    b.margin = 2
    assert a == b
    assert dataclasses.replace(a, margin=0) == snapshot


# ---------------------------------------------------------------- modules and operations


def _linear_pair(kind: str):
    torch.manual_seed(0)
    if kind == "module":
        first = te.Linear(IN, OUT, device="cpu")
    else:
        first = te.ops.Linear(IN, OUT, device="cpu")
    return first, copy.deepcopy(first)


def _forward_state(model):
    if isinstance(model, te.Linear):
        return model.fp8_meta["scaling_fwd"]
    return model.basic_ops[0].recipe_state("forward")  # te.ops.Linear = BasicLinear + Bias


def _step(model, recipe, x):
    with te.autocast(recipe=recipe):
        y = model(x)
    y.float().square().sum().backward()
    return y.detach()


def _state_tensors(model):
    state = _forward_state(model)
    return state.scale.clone(), state.amax_history.clone()


@pytest.mark.parametrize("kind", ["module", "op"])
def test_delayed_scaling_mutated_between_steps_matches_fresh_recipes(kind):
    mutated_model, fresh_model = _linear_pair(kind)
    recipe = DelayedScaling(amax_history_len=4)
    schedule = [{}, {}, {"margin": 2}, {"margin": 2, "amax_history_len": 2}, {}]
    g = torch.Generator().manual_seed(1)
    settings = {"amax_history_len": 4}
    for step, change in enumerate(schedule):
        for name, value in change.items():
            setattr(recipe, name, value)
        settings.update(change)
        x = torch.randn(TOKENS, IN, generator=g) * (1 + step)
        y_mutated = _step(mutated_model, recipe, x)
        y_fresh = _step(fresh_model, DelayedScaling(**settings), x)
        assert torch.equal(y_mutated, y_fresh), step
        for a, b in zip(_state_tensors(mutated_model), _state_tensors(fresh_model)):
            assert torch.equal(a, b), step
        for a, b in zip(mutated_model.parameters(), fresh_model.parameters()):
            assert torch.equal(a.grad, b.grad), step
    assert _forward_state(mutated_model).amax_history.shape[0] == 2


@pytest.mark.parametrize("kind", ["module", "op"])
def test_mutated_margin_reaches_the_scale_update(kind):
    model, _ = _linear_pair(kind)
    recipe = DelayedScaling(amax_history_len=1)
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(2))
    _step(model, recipe, x)
    recipe.margin = 3
    x2 = x * 4
    _step(model, recipe, x2)
    # forward slot 0 is the input: its next scale is 448 * 2**-3 / amax(x2) (history of 1 step)
    expected = torch.tensor(448.0 * 2.0**-3, dtype=torch.float32) / x2.abs().max()
    assert torch.equal(_forward_state(model).scale[0], expected)
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    assert all(key.recipe is not recipe for key in registry.keys()), "keys hold copies"
    assert all(key.recipe == recipe for key in registry.keys())


@pytest.mark.parametrize("kind", ["module", "op"])
def test_current_scaling_mutated_between_steps_matches_fresh_recipes(kind):
    mutated_model, fresh_model = _linear_pair(kind)
    recipe = Float8CurrentScaling()
    g = torch.Generator().manual_seed(3)
    # inputs whose current scale 448 / amax is far from a power of 2, so the flag shows
    for step, pow2 in enumerate([False, True, True, False]):
        recipe.use_power_2_scales = pow2
        x = torch.randn(TOKENS, IN, generator=g) * 3.3
        y_mutated = _step(mutated_model, recipe, x)
        y_fresh = _step(fresh_model, Float8CurrentScaling(use_power_2_scales=pow2), x)
        assert torch.equal(y_mutated, y_fresh), step
        for a, b in zip(mutated_model.parameters(), fresh_model.parameters()):
            assert torch.equal(a.grad, b.grad), step


def test_current_scaling_power_2_flag_changes_the_result():
    """The previous test is only meaningful if the flag changes the output."""
    model, _ = _linear_pair("module")
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(3)) * 3.3
    with torch.no_grad():
        with te.autocast(recipe=Float8CurrentScaling(use_power_2_scales=False)):
            plain = model(x)
        with te.autocast(recipe=Float8CurrentScaling(use_power_2_scales=True)):
            pow2 = model(x)
    assert not torch.equal(plain, pow2)


# ---------------------------------------------------------------- the amax registry


def test_registry_key_stays_findable_when_a_registered_recipe_is_mutated():
    recipe = DelayedScaling(amax_history_len=1)
    state = RecipeState.create(recipe, mode="forward", num_quantizers=2, device="cpu")
    meta = {"recipe": recipe, "fp8_group": None, "scaling_fwd": state}
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    position = meta["buffer_index_and_autocast_key"][True]
    recipe.margin = 1
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    assert meta["buffer_index_and_autocast_key"][True] == position, "found, not re-registered"
    state.amax_history[0] = torch.tensor([4.0, 0.0])
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
    assert torch.equal(state.scale, torch.tensor([448.0 / 2 / 4, 1.0]))


# ---------------------------------------------------------------- availability of other recipes


@pytest.mark.parametrize(
    "is_available, check, recipe_name",
    [
        ("is_mxfp8_available", "check_mxfp8_support", "MXFP8BlockScaling"),
        ("is_nvfp4_available", "check_nvfp4_support", "NVFP4BlockScaling"),
    ],
)
def test_block_scaled_recipes_report_emulation_off_blackwell(is_available, check, recipe_name):
    from transformer_engine.pytorch import quantization

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from transformer_engine.pytorch import fp8

    top = getattr(te, is_available)
    assert top is getattr(quantization, is_available)
    assert top() is False
    assert top(return_reason=False) is False
    available, reason = top(return_reason=True)
    assert available is False
    # MXFP8 and NVFP4 run (emulated GEMMs) but have no native support off Blackwell.
    assert recipe_name in reason and "emulation" in reason
    for module in (quantization, fp8):
        assert getattr(module, check)() == (False, reason)
    if not te.is_fp8_available():
        assert "FP8 itself is not available" in reason


def test_accelerate_import_path():
    # accelerate's apply_fp8_autowrap / is_transformer_engine_mxfp8_available
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from transformer_engine.pytorch.fp8 import check_mxfp8_support
    available, message = check_mxfp8_support()
    assert available is False and "MXFP8BlockScaling" in message
    assert hasattr(te, "fp8_autocast")


def test_meta_device_reason_includes_why_fp8_is_unavailable():
    available, reason = te.is_mxfp8_available(return_reason=True, device="meta")
    assert available is False
    assert "MXFP8BlockScaling" in reason and "FP8 itself is not available here" in reason
    assert "meta" in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_scaled_recipe_availability_on_every_gpu():
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        # Float8BlockScaling runs from compute capability 9.0 (upstream's rule)
        block_ok = te.is_fp8_block_scaling_available(device=device)
        assert block_ok is (torch.cuda.get_device_capability(device) >= (9, 0))
        cc = torch.cuda.get_device_capability(device)
        fp8_ok = te.is_fp8_available(device=device)
        # MXFP8: native on 10.x and 11.x only (upstream's meaning); emulated elsewhere.
        available, reason = te.is_mxfp8_available(return_reason=True, device=device)
        assert available is ((10, 0) <= cc < (12, 0))
        assert available or ("MXFP8BlockScaling" in reason and "emulation" in reason)
        # NVFP4: native from 10.0 (upstream's meaning); emulated elsewhere.
        available, reason = te.is_nvfp4_available(return_reason=True, device=device)
        assert available is (fp8_ok and cc >= (10, 0))
        assert available or ("NVFP4BlockScaling" in reason and "emulation" in reason)
        assert ("FP8 itself is not available" in reason) is (not fp8_ok)
