"""The quantization side of CUDA graphs (``quantization/graph_state.py``), on the CPU.

A captured graph cannot run here, but everything ``make_graphed_callables`` does with FP8 state
around its graphs is plain eager code: the capture autocast's arguments, the snapshot that makes
warm-up leave no trace, and, at each replay, the amax-registry registration and the claim of the
backward update. These tests drive that code with CPU modules run under
``te.autocast(_graph=True)`` (what a capture runs) and check the resulting scales against the
delayed-scaling formula written out here: ``scale = fp8_max / amax`` (margin 0, amax > 0).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.quantization import BackwardScaleUpdate, FP8GlobalStateManager
from transformer_engine.pytorch.quantization.graph_state import (
    CaptureAutocast,
    DelayedScalingSnapshot,
    GraphedFP8State,
    delayed_scaling_states,
    graph_capture_backward,
)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def linear() -> te.Linear:
    torch.manual_seed(0)
    return te.Linear(32, 32, device="cpu")


def captured_forward(module, recipe, x=None):
    """What a capture runs: a forward under ``autocast(_graph=True)`` (nothing registered)."""
    x = torch.randn(16, 32) if x is None else x
    with te.autocast(recipe=recipe, _graph=True):
        return module(x)


def registry_size() -> int:
    return len(FP8GlobalStateManager.quantization_state.amax_registry)


def arguments(**given) -> dict:
    args = dict.fromkeys(CaptureAutocast.ARGUMENTS)
    args.update(given)
    return args


# -- the capture autocast's arguments ---------------------------------------------------------
@pytest.mark.parametrize(
    "old, new, value",
    [
        ("fp8_enabled", "enabled", (True,)),
        ("fp8_calibrating", "calibrating", True),
        ("fp8_group", "amax_reduction_group", "group"),
        ("fp8_weight_caching", "cache_quantized_params", True),
    ],
)
def test_old_names_map_to_new_ones_with_a_deprecation_warning(old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; use {new}"):
        resolved = CaptureAutocast(1, arguments(**{old: value}))
    attribute = {"amax_reduction_group": "group"}.get(new, new)
    assert getattr(resolved, attribute) == value


def test_old_recipe_name_maps_to_recipe():
    recipe = DelayedScaling(margin=2)
    with pytest.warns(DeprecationWarning, match="fp8_recipe"):
        resolved = CaptureAutocast(1, arguments(fp8_recipe=recipe, enabled=True))
    assert resolved.recipe is recipe


def test_old_and_new_name_together_are_refused():
    with pytest.raises(ValueError, match="fp8_enabled and enabled are the same argument"):
        CaptureAutocast(1, arguments(fp8_enabled=True, enabled=True))


def test_enabled_per_callable_and_default_recipe():
    resolved = CaptureAutocast(3, arguments(enabled=(False, True, False)))
    assert resolved.enabled == (False, True, False)
    assert resolved.recipe == DelayedScaling()
    for index, enabled in enumerate((False, True, False)):
        ctx = resolved(index)
        assert isinstance(ctx, te.autocast) and ctx.enabled is enabled and ctx._graph is True
    off = CaptureAutocast(2, arguments())
    assert off.enabled == (False, False) and off.recipe is None
    assert off.calibrating is False and off.cache_quantized_params is False


@pytest.mark.parametrize("enabled", [(True,), (True, 1, False), [True, False, True, False]])
def test_enabled_tuple_needs_one_bool_per_callable(enabled):
    with pytest.raises(ValueError, match="one bool per callable"):
        CaptureAutocast(3, arguments(enabled=enabled))


def test_flags_must_be_bools():
    with pytest.raises(TypeError, match="enabled="):
        CaptureAutocast(1, arguments(enabled="yes"))
    with pytest.raises(TypeError, match="cache_quantized_params="):
        CaptureAutocast(1, arguments(cache_quantized_params=1))


# -- warm-up leaves no trace ------------------------------------------------------------------
def test_snapshot_restores_saved_state_and_resets_new_state():
    recipe = DelayedScaling()
    seasoned, fresh = linear(), linear()
    with te.autocast(recipe=recipe):  # a normal step: registered and updated at exit
        seasoned(torch.randn(16, 32))
    states = list(delayed_scaling_states(seasoned))
    assert len(states) == 2  # forward and backward
    before = [(s.scale.clone(), s.amax_history.clone()) for s in states]
    snapshot = DelayedScalingSnapshot([seasoned, fresh])
    for _ in range(2):  # "warm-up": histories and scales move; fresh gets its first state
        with te.autocast(recipe=recipe):
            seasoned(torch.randn(16, 32) * 7)
            fresh(torch.randn(16, 32) * 3)
    assert not torch.equal(states[0].amax_history, before[0][1])
    snapshot.restore()
    for s, (scale, history) in zip(states, before):
        assert torch.equal(s.scale, scale) and torch.equal(s.amax_history, history)
    new_states = list(delayed_scaling_states(fresh))
    assert len(new_states) == 2
    for s in new_states:
        assert torch.equal(s.scale, torch.ones_like(s.scale))
        assert torch.equal(s.amax_history, torch.zeros_like(s.amax_history))


def test_capture_backward_skips_the_backward_update():
    module = linear()
    captured_forward(module, DelayedScaling())
    bwd = module.fp8_meta["scaling_bwd"]
    GraphedFP8State(module, DelayedScaling(), "graphed Linear").end_replay()  # registered
    bwd.amax_history[0].fill_(2.0)
    assert not FP8GlobalStateManager.fp8_graph_capturing()
    with graph_capture_backward():
        assert FP8GlobalStateManager.fp8_graph_capturing()
        BackwardScaleUpdate().complete()
    assert not FP8GlobalStateManager.fp8_graph_capturing()
    assert torch.equal(bwd.scale, torch.ones_like(bwd.scale))


def test_fp8_graph_capturing_also_answers_for_a_capture_by_hand(monkeypatch):
    """As upstream's: True while the current CUDA stream captures (``torch.cuda.graph`` made by
    hand), not only inside make_graphed_callables' capture; False with CUDA uninitialized."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not FP8GlobalStateManager.fp8_graph_capturing()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert FP8GlobalStateManager.fp8_graph_capturing()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not FP8GlobalStateManager.fp8_graph_capturing()


# -- each replay ------------------------------------------------------------------------------
def test_capture_registers_nothing_and_replay_registers_the_module():
    recipe = DelayedScaling()
    module = linear()
    captured_forward(module, recipe)
    assert registry_size() == 0
    state = GraphedFP8State(module, recipe, "graphed Linear")
    assert state.metas == [module.fp8_meta] and state.ops == []
    with te.autocast(recipe=recipe):
        assert state.begin_replay(grad=True)[0]
        state.end_replay()
        state.end_replay()  # idempotent
    assert registry_size() == 2  # the forward and the backward pair


def test_replay_registers_again_only_after_the_registry_changed(monkeypatch):
    recipe = DelayedScaling()
    module = linear()
    captured_forward(module, recipe)
    state = GraphedFP8State(module, recipe, "graphed Linear")
    calls = []
    register = FP8GlobalStateManager.add_fp8_tensors_to_global_buffer
    monkeypatch.setattr(
        FP8GlobalStateManager,
        "add_fp8_tensors_to_global_buffer",
        lambda meta: (calls.append(meta is module.fp8_meta), register(meta)),
    )
    with te.autocast(recipe=recipe):
        state.end_replay()
        state.end_replay()  # same registry, unchanged: nothing to do
        assert sum(calls) == 1 and registry_size() == 2
        linear()(torch.randn(16, 32))  # another module registers: the registry changed
        state.end_replay()
        assert sum(calls) == 2
    FP8GlobalStateManager.reset()  # a new registry: registered there at the next replay
    with te.autocast(recipe=recipe):
        state.end_replay()
    assert sum(calls) == 3 and registry_size() == 2
    FP8GlobalStateManager.quantization_state.amax_registry.clear()
    state.end_replay()
    assert sum(calls) == 4 and registry_size() == 2


def test_forward_scales_update_at_the_outer_autocast_exit():
    recipe = DelayedScaling()
    module = linear()
    captured_forward(module, recipe)
    fwd = module.fp8_meta["scaling_fwd"]
    amax = torch.tensor([3.0, 0.5, 0.0])  # input, weight, output slot (0: scale kept)
    state = GraphedFP8State(module, recipe, "graphed Linear")
    with te.autocast(recipe=recipe):
        fp8, _ = state.begin_replay(grad=True)
        fwd.amax_history[0].copy_(amax)  # what the replayed casts write
        state.end_replay()
        assert torch.equal(fwd.scale, torch.ones(3))  # not before the exit
    expected = torch.tensor([E4M3_MAX / 3.0, E4M3_MAX / 0.5, 1.0], dtype=torch.float32)
    assert fp8 and torch.equal(fwd.scale, expected)


def test_without_registration_the_exit_updates_nothing():
    """The reason replays register: a captured forward never did."""
    recipe = DelayedScaling()
    module = linear()
    captured_forward(module, recipe)
    fwd = module.fp8_meta["scaling_fwd"]
    with te.autocast(recipe=recipe):
        fwd.amax_history[0].fill_(3.0)
    assert torch.equal(fwd.scale, torch.ones(3))


def test_first_replay_of_a_region_claims_the_backward_update():
    recipe = DelayedScaling()
    module = linear()
    captured_forward(module, recipe)
    bwd = module.fp8_meta["scaling_bwd"]
    state = GraphedFP8State(module, recipe, "graphed Linear")
    with te.autocast(recipe=recipe):
        _, first = state.begin_replay(grad=True)
        _, second = state.begin_replay(grad=True)
        state.end_replay()
    assert isinstance(first, BackwardScaleUpdate) and second is None
    bwd.amax_history[0].copy_(torch.tensor([4.0, 0.0]))  # what the backward replay writes
    first.complete()  # after the backward replay
    assert torch.equal(bwd.scale, torch.tensor([E5M2_MAX / 4.0, 1.0], dtype=torch.float32))
    with te.autocast(recipe=recipe):
        assert state.begin_replay(grad=False)[1] is None  # no backward: nothing to claim


def test_backward_override_claims_nothing():
    recipe = Float8CurrentScaling(backward_override="high_precision")
    module = linear()
    captured_forward(module, recipe)
    state = GraphedFP8State(module, recipe, "graphed Linear")
    assert state.metas == []  # current scaling: no delayed state to register
    with te.autocast(recipe=recipe):
        assert state.begin_replay(grad=True) == (True, None)


def test_replay_under_another_recipe_is_refused():
    module = linear()
    captured_forward(module, DelayedScaling())
    state = GraphedFP8State(module, DelayedScaling(), "graphed Linear")
    with te.autocast(recipe=DelayedScaling()):  # equal by value: fine
        assert state.begin_replay(grad=False)[0]
    with te.autocast(recipe=DelayedScaling(margin=1)):
        with pytest.raises(ValueError, match="graphed Linear: captured under"):
            state.begin_replay(grad=False)


def test_replay_outside_autocast_warns_once_and_registers_nothing():
    module = linear()
    captured_forward(module, DelayedScaling())
    state = GraphedFP8State(module, DelayedScaling(), "graphed Linear")
    with pytest.warns(UserWarning, match="replayed outside an enabled te.autocast"):
        assert state.begin_replay(grad=True) == (False, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert state.begin_replay(grad=True) == (False, None)


def test_bf16_capture_collects_nothing():
    module = linear()
    module(torch.randn(16, 32))
    assert GraphedFP8State(module, None, "graphed Linear").metas == []


def test_fusible_operations_register_through_their_own_method():
    recipe = DelayedScaling()
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 32, device="cpu"))
    captured_forward(model, recipe)
    assert registry_size() == 0
    state = GraphedFP8State(model, recipe, "graphed Sequential")
    assert len(state.ops) == 1 and state.metas == []
    with te.autocast(recipe=recipe):
        state.begin_replay(grad=True)
        state.end_replay()
    assert registry_size() == 2
