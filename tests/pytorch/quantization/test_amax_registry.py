"""The amax registry: per-device grouping, ordered reduction, and the update it drives.

Several devices are faked with ``cpu`` and ``meta`` tensors; the per-device update and the
collective are replaced by recorders, so these tests run anywhere.
"""

import fp8_oracle as oracle
import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.quantization import amax_registry
from transformer_engine.pytorch.quantization.amax_registry import AmaxRegistry


def pair(device, slots=3, length=4, fill=0.0):
    history = torch.full((length, slots), fill, dtype=torch.float32, device=device)
    scale = torch.ones(slots, dtype=torch.float32, device=device)
    return history, scale


def register_three_pairs(registry):
    """Pairs of 2, 1 and 2 slots registered under "k"; row 0 of pair i holds i + 1."""
    pairs = [pair("cpu", slots=2), pair("cpu", slots=1), pair("cpu", slots=2)]
    for i, (history, scale) in enumerate(pairs):
        registry.register("k", history, scale)
        history[0] = float(i + 1)
    return pairs


@pytest.fixture
def recorded_updates(monkeypatch):
    calls = []

    def record(histories, scales, fp8_dtype, margin, algo, reduction_buffer):
        calls.append(
            dict(histories=histories, scales=scales, fp8_dtype=fp8_dtype, margin=margin,
                 algo=algo, reduction_buffer=reduction_buffer)
        )  # fmt: skip

    monkeypatch.setattr(amax_registry, "_fused_update", record)
    return calls


@pytest.fixture
def fake_distributed(monkeypatch):
    """Pretend torch.distributed runs with 2 ranks; the collective is a recorder applying MAX
    against a second rank whose amaxes are given by ``state['other']``."""
    state = {"calls": [], "other": None}

    def all_reduce_max(buffer, group):
        state["calls"].append((buffer.clone(), group))
        if state["other"] is not None:
            buffer.copy_(torch.maximum(buffer, state["other"].to(buffer.device)))

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(amax_registry, "_all_reduce_max", all_reduce_max)
    return state


def test_without_reduction_each_device_is_updated_alone_in_registration_order(recorded_updates):
    registry = AmaxRegistry()
    a, b, c, d = pair("cpu"), pair("meta"), pair("cpu", slots=2), pair("meta", slots=5)
    for p in (a, b, c, d):
        registry.register("forward_k", *p)
    registry.reduce_and_update("forward_k", DelayedScaling(), forward=True)

    assert [call["histories"][0].device.type for call in recorded_updates] == ["cpu", "meta"]
    cpu_call, meta_call = recorded_updates
    assert [h is x for h, x in zip(cpu_call["histories"], (a[0], c[0]))] == [True, True]
    assert [s is x for s, x in zip(cpu_call["scales"], (a[1], c[1]))] == [True, True]
    assert [h is x for h, x in zip(meta_call["histories"], (b[0], d[0]))] == [True, True]
    for call in recorded_updates:
        # the registry passes the live tensors: nothing gathered, nothing copied across devices
        assert call["reduction_buffer"] is None
        assert {t.device for t in call["histories"] + call["scales"]} == {
            call["histories"][0].device
        }


def test_directions_use_their_own_format_and_the_recipe_margin(recorded_updates):
    registry = AmaxRegistry()
    kept_1 = pair("cpu")  # the registry holds pairs weakly
    registry.register("k", *kept_1)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, margin=2, amax_compute_algo="most_recent")
    registry.reduce_and_update("k", recipe, forward=True)
    registry.reduce_and_update("k", recipe, forward=False)
    assert [c["fp8_dtype"] for c in recorded_updates] == [torch.float8_e4m3fn, torch.float8_e5m2]
    assert {c["margin"] for c in recorded_updates} == {2}
    assert {c["algo"] for c in recorded_updates} == {"most_recent"}


def test_reduction_buffer_layout_and_max_on_one_device(recorded_updates, fake_distributed):
    registry = AmaxRegistry()
    pairs = [pair("cpu", slots=2), pair("cpu", slots=3), pair("cpu", slots=1)]
    for i, p in enumerate(pairs):
        registry.register("forward_k", *p)
        p[0][0] = torch.arange(1, p[0].shape[1] + 1, dtype=torch.float32) * (10**i)
    fake_distributed["other"] = torch.tensor([5.0, 0.5, 9.0, 9.0, 9.0, 3.0])
    group = object()
    registry.reduce_and_update("forward_k", DelayedScaling(), forward=True, group=group)

    ((sent, sent_group),) = fake_distributed["calls"]
    assert sent_group is group
    # row 0 of every history, concatenated in registration order
    assert torch.equal(sent, torch.tensor([1.0, 2.0, 10.0, 20.0, 30.0, 100.0]))
    (call,) = recorded_updates
    assert torch.equal(call["reduction_buffer"], torch.tensor([5.0, 2.0, 10.0, 20.0, 30.0, 100.0]))
    assert [h is p[0] for h, p in zip(call["histories"], pairs)] == [True, True, True]


def test_reduction_scatters_each_device_its_own_slices(
    monkeypatch, recorded_updates, fake_distributed
):
    # Two real "devices" are not available on CPU; fake a second one by making .to() of the
    # gathered buffer observable: entries on cpu only, but the grouping is forced to two groups.
    registry = AmaxRegistry()
    pairs = register_three_pairs(registry)
    fake_device = torch.device("meta")
    monkeypatch.setattr(
        registry, "device_groups", lambda key: [(torch.device("cpu"), [0, 2]), (fake_device, [1])]
    )
    registry.reduce_and_update("k", DelayedScaling(), forward=True)
    cpu_call, meta_call = recorded_updates
    assert torch.equal(cpu_call["reduction_buffer"], torch.tensor([1.0, 1.0, 3.0, 3.0]))
    assert meta_call["reduction_buffer"].device.type == "meta"
    assert meta_call["reduction_buffer"].shape == (1,)
    assert [h is pairs[1][0] for h in meta_call["histories"]] == [True]


def test_no_reduction_when_the_recipe_says_so(recorded_updates, fake_distributed):
    registry = AmaxRegistry()
    kept_2 = pair("cpu")  # the registry holds pairs weakly
    registry.register("k", *kept_2)
    registry.reduce_and_update("k", DelayedScaling(reduce_amax=False), forward=True)
    assert fake_distributed["calls"] == []
    assert recorded_updates[0]["reduction_buffer"] is None


def test_replacing_an_entry_rebuilds_the_device_grouping(recorded_updates):
    registry = AmaxRegistry()
    kept_3 = pair("cpu")  # the registry holds pairs weakly
    registry.register("k", *kept_3)
    kept_4 = pair("cpu")  # the registry holds pairs weakly
    registry.register("k", *kept_4)
    assert [d.type for d, _ in registry.device_groups("k")] == ["cpu"]
    moved = pair("meta")
    registry.replace("k", 1, *moved)
    assert [(d.type, pos) for d, pos in registry.device_groups("k")] == [
        ("cpu", [0]),
        ("meta", [1]),
    ]
    assert registry.entry("k", 1)[0] is moved[0]


def test_bad_registrations_are_refused():
    registry = AmaxRegistry()
    with pytest.raises(ValueError, match="scale is on meta but amax_history is on cpu"):
        registry.register("k", torch.zeros(2, 3), torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"scale must be a float32 tensor of shape \(3,\)"):
        registry.register("k", torch.zeros(2, 3), torch.ones(4))
    with pytest.raises(ValueError, match="amax_history must be a float32"):
        registry.register("k", torch.zeros(3), torch.ones(3))
    kept_5 = pair("cpu")  # the registry holds pairs weakly
    registry.register("k", *kept_5)
    with pytest.raises(ValueError, match="has 3 slots; the replacement has 4"):
        registry.replace("k", 0, *pair("cpu", slots=4))
    with pytest.raises(KeyError):
        registry.replace("k", 5, *pair("cpu"))
    assert len(registry) == 1


def test_real_update_on_cpu_follows_the_independent_model():
    # On CPU the update runs the reference, so the expected values come from the oracle's
    # plain-Python model instead.
    registry = AmaxRegistry()
    pairs = [pair("cpu", slots=2, length=3), pair("cpu", slots=1, length=3)]
    expected = [(h.clone(), s.clone()) for h, s in pairs]
    for (h, s), (eh, _) in zip(pairs, expected):
        registry.register("k", h, s)
        h[0] = torch.linspace(1, 2, h.shape[1])
        eh[0] = torch.linspace(1, 2, h.shape[1])
    registry.reduce_and_update("k", DelayedScaling(margin=1), forward=False)
    model = [(eh.tolist(), es.tolist()) for eh, es in expected]
    oracle.delayed_scaling_update_model(
        [m[0] for m in model], [m[1] for m in model], 57344.0, margin=1, algo="max"
    )
    for (h, s), (mh, ms) in zip(pairs, model):
        assert torch.equal(h, torch.tensor(mh)) and torch.equal(s, torch.tensor(ms))
    assert pairs[0][1][0].item() == 57344.0 / 1.0 / 2  # fp8_max / amax / 2**margin


def test_callable_algorithms_take_the_python_path():
    registry = AmaxRegistry()
    h, s = pair("cpu", slots=2, length=2)
    registry.register("k", h, s)
    h[0] = torch.tensor([2.0, 0.0])
    recipe = DelayedScaling(
        amax_compute_algo=lambda history: history.sum(dim=0),
        scaling_factor_compute_algo=lambda amax, scale, fp8_max, recipe: scale * 3,
    )
    registry.reduce_and_update("k", recipe, forward=True)
    assert torch.equal(s, torch.tensor([3.0, 3.0]))
    # the Python path rolls even a zero amax (upstream's behaviour for this path)
    assert torch.equal(h, torch.tensor([[0.0, 0.0], [2.0, 0.0]]))


@pytest.mark.parametrize("forced", [False, True], ids=["fused", "NVTE_UNFUSED_FP8_UPDATE=1"])
def test_unfused_update_env_var_takes_the_python_path(monkeypatch, forced):
    """NVTE_UNFUSED_FP8_UPDATE=1 sends the built-in algorithms down upstream's Python path, which
    rolls a slot whose new amax is 0; the fused update leaves that slot as it is (rule 2). The
    reading of the variable itself: test_unfused_update_env_var_is_read_at_import."""
    monkeypatch.setattr(amax_registry, "UNFUSED_UPDATE", forced)  # the variable, read at import
    registry = AmaxRegistry()
    h, s = pair("cpu", slots=2, length=2)
    h[1] = torch.tensor([4.0, 8.0])
    registry.register("k", h, s)
    h[0] = torch.tensor([2.0, 0.0])
    registry.reduce_and_update("k", DelayedScaling(amax_compute_algo="max"), forward=True)
    # slot 0: candidate max(4, 2) = 4, rolled either way; slot 1: amax 0
    assert s[0].item() == 448.0 / 4.0
    slot1 = [[0.0], [0.0]] if forced else [[0.0], [8.0]]
    assert torch.equal(h, torch.tensor([[0.0, slot1[0][0]], [2.0, slot1[1][0]]]))
    assert s[1].item() == (448.0 / 8.0 if forced else 1.0)


def test_unregistered_positions_are_tombstones(recorded_updates, fake_distributed):
    registry = AmaxRegistry()
    pairs = register_three_pairs(registry)
    registry.unregister("k", 1)
    assert len(registry) == 2
    assert registry.device_groups("k") == [(torch.device("cpu"), [0, 2])]
    registry.reduce_and_update("k", DelayedScaling(), forward=True)
    ((sent, _),) = fake_distributed["calls"]
    assert torch.equal(sent, torch.tensor([1.0, 1.0, 3.0, 3.0]))  # the retired pair is skipped
    (call,) = recorded_updates
    assert [h is p[0] for h, p in zip(call["histories"], (pairs[0], pairs[2]))] == [True, True]
    with pytest.raises(KeyError):
        registry.unregister("k", 1)
    with pytest.raises(KeyError):
        registry.replace("k", 1, *pair("cpu", slots=1))


def test_a_changed_recipe_moves_the_pair_to_its_new_key():
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState

    FP8GlobalStateManager.reset()
    try:
        old, new = DelayedScaling(margin=0), DelayedScaling(margin=1)
        meta = {"recipe": old, "fp8_group": None}
        meta["scaling_fwd"] = RecipeState.create(
            old, mode="forward", num_quantizers=2, device="cpu"
        )
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
        meta["recipe"] = new
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
        registry = FP8GlobalStateManager.quantization_state.amax_registry
        assert len(registry) == 1
        key, _ = meta["buffer_index_and_autocast_key"][True]
        assert key.forward and key.recipe is new and key.group is None
        assert registry.keys() == [key], "the old key, left without pairs, is dropped"
    finally:
        FP8GlobalStateManager.reset()


def test_a_freed_pair_retires_its_position(recorded_updates, fake_distributed):
    registry = AmaxRegistry()
    pairs = register_three_pairs(registry)
    assert registry.device_groups("k") == [(torch.device("cpu"), [0, 1, 2])]  # cached
    freed = pairs.pop(1)
    del freed
    assert len(registry) == 2
    assert registry.device_groups("k") == [(torch.device("cpu"), [0, 2])]
    assert registry.entry("k", 1) == (None, None)
    registry.reduce_and_update("k", DelayedScaling(), forward=True)
    ((sent, _),) = fake_distributed["calls"]
    # the freed pair keeps its place, as zeros: every rank lays the buffer out the same way
    # whenever its garbage collector frees the module
    assert torch.equal(sent, torch.tensor([1.0, 1.0, 0.0, 3.0, 3.0]))
    (call,) = recorded_updates
    assert [h is p[0] for h, p in zip(call["histories"], pairs)] == [True, True]
    # a freed position can be pointed at its owner's new state (e.g. rebuilt after a move)
    new = pair("cpu", slots=1)
    registry.replace("k", 1, *new)
    assert len(registry) == 3 and registry.entry("k", 1)[0] is new[0]


def test_a_freed_module_is_neither_kept_alive_nor_updated(monkeypatch):
    import gc
    import weakref

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    updated = []
    monkeypatch.setattr(
        amax_registry, "_fused_update", lambda histories, *args: updated.append(len(histories))
    )
    recipe = DelayedScaling()
    kept, dropped = te.Linear(16, 16, device="cpu"), te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=recipe):
        kept(torch.randn(16, 16))
        dropped(torch.randn(16, 16))
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    assert len(registry) == 4 and updated == [2]  # forward and backward pairs of each
    history = weakref.ref(dropped.fp8_meta["scaling_fwd"].amax_history)
    del dropped
    gc.collect()
    assert history() is None and len(registry) == 2
    with te.autocast(recipe=recipe):
        kept(torch.randn(16, 16))
    assert updated == [2, 1]  # only the live module's pair
    FP8GlobalStateManager.reset()


def test_a_module_registers_anew_after_reset_clear_or_deep_copy():
    """Positions recorded in a module's fp8_meta belong to one registry: after
    FP8GlobalStateManager.reset() (a new registry), clear() or in a deep copy, the next FP8
    forward registers the module's own pairs (it had looked its old positions up: KeyError, or
    the copy took over the original's places)."""
    import copy

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    def forward(module):
        with te.autocast(recipe=DelayedScaling()):
            module(torch.randn(16, 32))

    def registered(module):
        registry = FP8GlobalStateManager.quantization_state.amax_registry
        histories = [
            registry.entry(k, p)[0]
            for k in registry.keys()
            for p in range(len(registry._entries[k]))
        ]
        return any(h is module.fp8_meta["scaling_fwd"].amax_history for h in histories)

    FP8GlobalStateManager.reset()
    module = te.Linear(32, 32, device="cpu")
    forward(module)
    FP8GlobalStateManager.reset()
    forward(module)
    assert registered(module) and len(FP8GlobalStateManager.quantization_state.amax_registry) == 2
    FP8GlobalStateManager.quantization_state.amax_registry.clear()
    forward(module)
    assert registered(module) and len(FP8GlobalStateManager.quantization_state.amax_registry) == 2
    twin = copy.deepcopy(module)
    forward(twin)
    assert registered(module) and registered(twin)
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 4
    FP8GlobalStateManager.reset()


def test_unfused_update_env_var_is_read_at_import():
    import subprocess
    import sys

    code = (
        "from transformer_engine.pytorch.quantization import amax_registry as a; "
        "print(a.UNFUSED_UPDATE)"
    )
    for value, expected in (("1", "True"), ("0", "False"), ("yes", "False")):
        env = {**__import__("os").environ, "NVTE_UNFUSED_FP8_UPDATE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == expected, out.stderr[-2000:]
