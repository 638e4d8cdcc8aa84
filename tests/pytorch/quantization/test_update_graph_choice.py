"""When the amax registry replays a device group's update from a graph, and when it launches it
(quantization/update_graph.py), on the CPU: a CUDA device is faked for the pairs, the graph is a
recorder, and the native update a recorder too. The GPU file test_update_graphs_gpu.py checks the
replayed numbers against the reference."""

import gc

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.quantization import amax_registry, update_graph
from transformer_engine.pytorch.quantization.amax_registry import AmaxRegistry

CUDA0 = torch.device("cuda:0")


class FakeGraph:
    made = []

    def __init__(self, device, histories, scales, fp8_dtype, margin, algo):
        self.device, self.config, self.replays = device, (fp8_dtype, margin, algo), 0
        self.pairs = len(histories)
        FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1


@pytest.fixture(name="world")
def world_fixture(monkeypatch):
    """Pairs on the CPU that the registry takes for cuda:0; returns the native-call log and a
    switch for "the current stream is capturing"."""
    FakeGraph.made = []
    state = {"native": [], "capturing": False}
    monkeypatch.setattr(amax_registry._Entry, "device", property(lambda self: CUDA0))
    monkeypatch.setattr(amax_registry, "UpdateGraph", FakeGraph)
    monkeypatch.setattr(amax_registry, "stream_is_capturing", lambda d: state["capturing"])
    monkeypatch.setattr(amax_registry, "native_for", lambda op, device: object())
    monkeypatch.setattr(
        amax_registry, "_fused_update", lambda h, s, *config: state["native"].append(len(h))
    )
    monkeypatch.setattr(update_graph, "GRAPH_SCALE_UPDATES", True)
    return state


def pair(slots=2):
    return torch.zeros(4, slots), torch.ones(slots)


def update(registry, recipe):
    registry.reduce_and_update("k", recipe, forward=True)


def test_first_update_is_native_then_one_capture_replayed(world):
    registry, recipe = AmaxRegistry(), DelayedScaling(fp8_format=Format.E4M3)
    pairs = [pair(2), pair(3)]
    for p in pairs:
        registry.register("k", *p)
    update(registry, recipe)
    assert world["native"] == [2] and FakeGraph.made == []
    for _ in range(3):
        update(registry, recipe)
    assert world["native"] == [2] and len(FakeGraph.made) == 1
    graph = FakeGraph.made[0]
    assert graph.replays == 3 and graph.pairs == 2 and graph.device == CUDA0
    assert graph.config == (torch.float8_e4m3fn, 0.0, "max")


def test_a_group_change_or_a_new_recipe_value_captures_again(world):
    registry, recipe = AmaxRegistry(), DelayedScaling(fp8_format=Format.E4M3)
    first = pair()
    registry.register("k", *first)
    update(registry, recipe)
    update(registry, recipe)
    second = pair()
    registry.register("k", *second)  # the group changed: a native call, then a new graph
    update(registry, recipe)
    update(registry, recipe)
    assert world["native"] == [1, 2] and [g.pairs for g in FakeGraph.made] == [1, 2]
    recipe.margin = 2  # captured again with the new margin, no native call
    update(registry, recipe)
    assert len(FakeGraph.made) == 3 and FakeGraph.made[-1].config[1] == 2
    del second
    gc.collect()  # a freed pair: the grouping and its graph go
    update(registry, recipe)
    update(registry, recipe)
    assert world["native"] == [1, 2, 1] and FakeGraph.made[-1].pairs == 1


def test_while_capturing_or_switched_off_or_reduced_the_update_is_native(world, monkeypatch):
    registry, recipe = AmaxRegistry(), DelayedScaling(fp8_format=Format.E4M3)
    kept = pair()
    registry.register("k", *kept)
    update(registry, recipe)
    update(registry, recipe)
    world["capturing"] = True  # a user's capture records the native launch
    update(registry, recipe)
    world["capturing"] = False
    assert world["native"] == [1, 1] and FakeGraph.made[0].replays == 1
    monkeypatch.setattr(update_graph, "GRAPH_SCALE_UPDATES", False)
    update(registry, recipe)
    assert world["native"] == [1, 1, 1] and FakeGraph.made[0].replays == 1
    monkeypatch.setattr(update_graph, "GRAPH_SCALE_UPDATES", True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(amax_registry, "_all_reduce_max", lambda buffer, group: None)
    monkeypatch.setattr(amax_registry.AmaxRegistry, "_reduce", staticmethod(
        lambda entries, groups, group: {CUDA0: torch.zeros(1)}))  # fmt: skip
    update(registry, recipe)  # with a reduction buffer: native
    assert world["native"] == [1, 1, 1, 1] and FakeGraph.made[0].replays == 1


def test_without_the_native_library_nothing_is_captured(world, monkeypatch):
    monkeypatch.setattr(amax_registry, "native_for", lambda op, device: None)
    registry, recipe = AmaxRegistry(), DelayedScaling(fp8_format=Format.E4M3)
    kept = pair()
    registry.register("k", *kept)
    for _ in range(3):
        update(registry, recipe)
    assert world["native"] == [1, 1, 1] and FakeGraph.made == []


def test_pairs_without_slots_capture_nothing(world):
    registry, recipe = AmaxRegistry(), DelayedScaling(fp8_format=Format.E4M3)
    empty = pair(0)
    registry.register("k", *empty)
    for _ in range(3):
        update(registry, recipe)
    assert world["native"] == [1, 1, 1] and FakeGraph.made == []
