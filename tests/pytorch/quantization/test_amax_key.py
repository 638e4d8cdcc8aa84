"""Which registered pairs are reduced and updated together: the registry's key objects.

Expected groupings and scales are written out by hand (fp8_max 448 for forward E4M3, an
amax history of one step, so each new scale is ``448 / reduced_amax``); the collective is a
recorder that applies MAX against a fake second rank.
"""

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.quantization import (
    FP8GlobalStateManager,
    RecipeState,
    amax_registry,
    autocast,
)


class UnhashableDelayedScaling(DelayedScaling):
    """Looks like upstream's (mutable, hence unhashable) recipes."""

    __hash__ = None


class AlwaysEqualGroup:
    """A stand-in process group that compares equal to every other: groups must still be told
    apart by identity."""

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def register(recipe, group=None, amaxes=(0.0, 0.0)):
    """A module's forward delayed-scaling state (one history row), registered; row 0 holds
    ``amaxes``."""
    state = RecipeState.create(recipe, mode="forward", num_quantizers=len(amaxes), device="cpu")
    state.amax_history[0] = torch.tensor(amaxes)
    meta = {"recipe": recipe, "fp8_group": group, "scaling_fwd": state}
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    return meta


def forward_keys():
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    return [key for key in registry.keys() if key.forward]


@pytest.fixture
def two_ranks(monkeypatch):
    """torch.distributed pretends to run 2 ranks; the other rank's amaxes are
    ``state['other']`` (per group), and every collective is recorded."""
    state = {"calls": [], "other": {}}

    def all_reduce_max(buffer, group):
        state["calls"].append((buffer.clone(), group))
        other = state["other"].get(id(group))
        if other is not None:
            buffer.copy_(torch.maximum(buffer, other))

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(amax_registry, "_all_reduce_max", all_reduce_max)
    return state


def test_equal_but_distinct_recipes_share_one_reduction(two_ranks):
    first, second = DelayedScaling(amax_history_len=1), DelayedScaling(amax_history_len=1)
    assert first is not second
    a = register(first, amaxes=(2.0, 4.0))
    b = register(second, amaxes=(8.0, 1.0))
    two_ranks["other"][id(None)] = torch.tensor([16.0, 0.0, 0.0, 2.0])

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)

    ((sent, group),) = two_ranks["calls"]  # one collective for both modules
    assert group is None
    assert torch.equal(sent, torch.tensor([2.0, 4.0, 8.0, 1.0]))  # registration order
    assert torch.equal(a["scaling_fwd"].scale, torch.tensor([448.0 / 16, 448.0 / 4]))
    assert torch.equal(b["scaling_fwd"].scale, torch.tensor([448.0 / 8, 448.0 / 2]))
    assert len(forward_keys()) == 1


def test_different_groups_are_reduced_apart_even_when_they_compare_equal(two_ranks):
    recipe = DelayedScaling(amax_history_len=1)
    g1, g2 = AlwaysEqualGroup(), AlwaysEqualGroup()
    a = register(recipe, group=g1, amaxes=(2.0, 4.0))
    b = register(recipe, group=g2, amaxes=(8.0, 1.0))
    two_ranks["other"][id(g1)] = torch.tensor([1.0, 32.0])

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)

    (sent1, group1), (sent2, group2) = two_ranks["calls"]
    assert group1 is g1 and torch.equal(sent1, torch.tensor([2.0, 4.0]))
    assert group2 is g2 and torch.equal(sent2, torch.tensor([8.0, 1.0]))
    assert torch.equal(a["scaling_fwd"].scale, torch.tensor([448.0 / 2, 448.0 / 32]))
    assert torch.equal(b["scaling_fwd"].scale, torch.tensor([448.0 / 8, 448.0 / 1]))
    assert len(forward_keys()) == 2


def test_a_recipe_rebuilt_for_a_second_autocast_lands_in_the_same_group():
    first = UnhashableDelayedScaling(amax_history_len=1)
    with pytest.raises(TypeError):
        hash(first)  # the key must never hash the recipe itself
    with autocast(recipe=first):
        meta = register(first, amaxes=(4.0, 0.0))
    assert torch.equal(meta["scaling_fwd"].scale, torch.tensor([448.0 / 4, 1.0]))
    position = meta["buffer_index_and_autocast_key"][True]

    second = UnhashableDelayedScaling(amax_history_len=1)
    with autocast(recipe=second):
        meta["recipe"] = second  # what a module records when it runs in the new region
        meta["scaling_fwd"].amax_history[0] = torch.tensor([0.0, 8.0])
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    assert meta["buffer_index_and_autocast_key"][True] == position, "not moved"
    assert len(forward_keys()) == 1
    assert torch.equal(meta["scaling_fwd"].scale, torch.tensor([448.0 / 4, 448.0 / 8]))


def test_a_key_stays_findable_after_its_recipe_is_mutated():
    recipe = UnhashableDelayedScaling(amax_history_len=1, margin=0)
    meta = register(recipe, amaxes=(4.0, 4.0))
    # upstream's recipes are mutable; the registry's hash must not depend on field values
    object.__setattr__(recipe, "margin", 1)
    same_values = UnhashableDelayedScaling(amax_history_len=1, margin=1)
    other = register(same_values, amaxes=(2.0, 2.0))
    assert len(forward_keys()) == 1
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
    assert torch.equal(meta["scaling_fwd"].scale, torch.full((2,), 448.0 / 4 / 2))
    assert torch.equal(other["scaling_fwd"].scale, torch.full((2,), 448.0 / 2 / 2))


def test_different_values_or_directions_are_different_groups():
    register(DelayedScaling(amax_history_len=1, margin=0))
    register(DelayedScaling(amax_history_len=1, margin=1))
    assert len(forward_keys()) == 2
    recipe = DelayedScaling()
    meta = {
        "recipe": recipe,
        "scaling_fwd": RecipeState.create(recipe, mode="forward", device="cpu"),
        "scaling_bwd": RecipeState.create(recipe, mode="backward", device="cpu"),
    }
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    fwd_key, _ = meta["buffer_index_and_autocast_key"][True]
    bwd_key, _ = meta["buffer_index_and_autocast_key"][False]
    assert (fwd_key.forward, bwd_key.forward) == (True, False) and fwd_key != bwd_key
