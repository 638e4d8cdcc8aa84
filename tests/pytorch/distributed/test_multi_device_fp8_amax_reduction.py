"""Single-process multi-device FP8: the ordered amax reduction across devices. The registry
gathers the amaxes of all devices in registration order, reduces them with one collective and
scatters each device its slices (checked with a mocked collective, including CPU entries
labelled as two devices), and sentinel values through real modules show the collective sees
them in registration order and applies MAX.

Runs on CPU (the CPU layouts); the layouts over ``cuda:1`` and ``cuda:0`` need two GPUs in one
process and skip with the reason elsewhere; they run on the GPU machine through
qa/L0_pytorch_gpu/test.sh. Shared helpers: multi_device_fp8_helpers.py.
"""

import pytest
import torch
from multi_device_fp8_helpers import (
    BF16,
    CPU,
    CUDA0,
    CUDA1,
    E4M3_MAX,
    GROUP,
    HIDDEN,
    TOKENS,
    clean_state,  # noqa: F401 (autouse fixture)
    cpu_input,
    current_device,
    fake_world_fixture,  # noqa: F401 (the fake_world fixture)
    make_linear,
    recorded_updates_fixture,  # noqa: F401 (the recorded_updates fixture)
    two_gpus,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState
from transformer_engine.pytorch.quantization import amax_registry as _amax_registry

# ---------------------------------------------------------------------------------------------
# 6. Ordered gather / reduce / scatter over devices with a mocked collective

SLOTS = (2, 3, 1, 2, 4)


@pytest.mark.parametrize(
    "layout", ["cpu", "cpu_labelled_as_two_devices", pytest.param("cuda1_cuda0", marks=two_gpus)]
)
def test_reduction_gathers_in_registration_order_and_scatters_each_device_its_slices(
    layout, monkeypatch, fake_world, recorded_updates
):
    ambient = current_device()  # CPU layouts must leave any CUDA device alone
    if layout == "cuda1_cuda0":
        torch.cuda.set_device(0)
        ambient = 0
        first, second = CUDA1, CUDA0  # the first registered device is not the current one
    else:
        first = second = CPU
    placements = [first, second, first, second, first]  # interleaved in registration order
    recipe = DelayedScaling(amax_history_len=3)
    states = [
        RecipeState.create(recipe, mode="forward", num_quantizers=n, device=d)
        for n, d in zip(SLOTS, placements)
    ]
    keys = list(placements)  # what the registry groups by
    if layout == "cpu_labelled_as_two_devices":
        # CPU has one device: label the entries as two, so that the registry's own grouping,
        # gather and scatter run as they do over two GPUs
        keys = [torch.device("cpu", i % 2) for i in range(len(states))]
        labels = {id(s.amax_history): k for s, k in zip(states, keys)}
        monkeypatch.setattr(
            _amax_registry._Entry,
            "device",
            property(lambda e: labels.get(id(e.amax_history), e.amax_history.device)),
        )
    total = sum(SLOTS)
    offsets = [sum(SLOTS[:i]) for i in range(len(SLOTS))]
    local = torch.arange(1, total + 1, dtype=torch.float32) * 10
    other = torch.where(torch.arange(total) % 2 == 0, 1000.0 + torch.arange(total), 0.5)
    fake_world["others"] = [other]

    with te.autocast(recipe=recipe, amax_reduction_group=GROUP):
        for state, offset, n in zip(states, offsets, SLOTS):
            meta = {"recipe": recipe, "fp8_group": GROUP, "scaling_fwd": state}
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
            state.amax_history[0].copy_(local[offset : offset + n])
        assert fake_world["calls"] == [] and recorded_updates == []

    # one collective: row 0 of every entry, in registration order, on the first registered
    # device, with the autocast's group
    (call,) = fake_world["calls"]
    assert call["group"] is GROUP
    assert torch.equal(call["received"], local)
    assert call["device"] == placements[0]
    if layout == "cuda1_cuda0":
        assert call["current_device"] == 0

    # one update per device (in order of first registration), each with exactly its slices
    reduced = torch.maximum(local, other)
    groups: dict = {}
    for position, key in enumerate(keys):
        groups.setdefault(key, []).append(position)
    assert len(recorded_updates) == len(groups)
    for update, positions in zip(recorded_updates, groups.values()):
        assert len(update.histories) == len(positions)
        for h, s, p in zip(update.histories, update.scales, positions):
            assert h is states[p].amax_history and s is states[p].scale
        expected = torch.cat([reduced[offsets[p] : offsets[p] + SLOTS[p]] for p in positions])
        assert torch.equal(update.buffer, expected)
        assert update.buffer_device == placements[positions[0]]
        update.assert_on_one_device()
        update.assert_matches_reference()

    # and every entry ended up with its own reduced amaxes
    for state, offset, n, device in zip(states, offsets, SLOTS, placements):
        mine = reduced[offset : offset + n]
        assert state.amax_history.device == device and state.scale.device == device
        assert torch.equal(state.amax_history[-1].cpu(), mine)
        assert torch.equal(state.scale.cpu(), torch.tensor(E4M3_MAX) / mine)
    assert current_device() == ambient


# ---------------------------------------------------------------------------------------------
# 7. Sentinels: the collective sees real modules in registration order and applies MAX


@pytest.mark.parametrize("placement", ["cpu", pytest.param("cuda", marks=two_gpus)])
def test_collective_receives_modules_in_registration_order_and_applies_max(placement, fake_world):
    if placement == "cuda":
        torch.cuda.set_device(0)
        devices = (CUDA1, CUDA0, CUDA1)
    else:
        devices = (CPU, CPU, CPU)
    built = [make_linear(d, HIDDEN, HIDDEN, seed=20 + i) for i, d in enumerate(devices)]
    run = built[::-1]  # registration follows the order of first use, not of construction
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)

    # the other rank's forward buffer: a sentinel above every local input amax in each
    # module's input slot, zeros elsewhere (so the local weight amaxes must survive the MAX)
    sentinels = [2.0 ** (10 + k) for k in range(len(run))]
    other = torch.zeros(3 * len(run))
    other[0::3] = torch.tensor(sentinels)
    fake_world["others"] = [other, None]

    def snapshot():
        return [
            {key: st.amax_history[0].detach().cpu().clone() for key, st in m.fp8_meta.items()
             if key in ("scaling_fwd", "scaling_bwd")}
            for m in run
        ]  # fmt: skip

    fake_world["snapshot"] = snapshot

    g = torch.Generator().manual_seed(8)
    x = cpu_input(g, TOKENS, HIDDEN, scale=3).to(devices[-1], BF16)
    inputs = []
    with te.autocast(recipe=recipe, amax_reduction_group=GROUP):
        h = x
        for module in run:
            h = h.to(module.weight.device)
            inputs.append(h)
            h = module(h)
        assert fake_world["calls"] == []
    y = h

    (forward,) = fake_world["calls"]
    assert forward["group"] is GROUP
    assert forward["device"] == run[0].weight.device  # the first registered module's device
    received = forward["received"]
    assert received.shape == (3 * len(run),)
    # exactly the modules' row 0, in registration order ...
    assert torch.equal(received, torch.cat([s["scaling_fwd"] for s in forward["snapshot"]]))
    # ... which are their own input and weight amaxes
    for k, (module, inp) in enumerate(zip(run, inputs)):
        assert received[3 * k].item() == inp.abs().max().float().item()
        assert received[3 * k + 1].item() == module.weight.abs().max().float().item()
        assert received[3 * k].item() < sentinels[k]

    for k, module in enumerate(run):
        state = module.fp8_meta["scaling_fwd"]
        device = module.weight.device
        assert state.scale.device == device and state.amax_history.device == device
        # MAX: the other rank's sentinel won the input slot, the local amax the weight slot
        assert state.amax_history[-1, 0].item() == sentinels[k]
        assert state.scale[0].item() == E4M3_MAX / sentinels[k]
        assert state.amax_history[-1, 1].item() == received[3 * k + 1].item()
        assert state.scale[1].item() != 1.0

    y.float().square().mean().backward()
    assert len(fake_world["calls"]) == 2, "one collective per direction per step"
    backward = fake_world["calls"][1]
    assert backward["group"] is GROUP
    assert backward["device"] == run[0].weight.device
    received = backward["received"]
    assert torch.equal(received, torch.cat([s["scaling_bwd"] for s in backward["snapshot"]]))
    assert received.shape == (2 * len(run),)
    assert bool((received[0::2] > 0).all()), "every module quantized its output gradient"
    for k, module in enumerate(run):
        state = module.fp8_meta["scaling_bwd"]
        assert state.scale.device == module.weight.device
        assert state.amax_history[-1, 0].item() == received[2 * k].item()
    if placement == "cuda":
        assert torch.cuda.current_device() == 0
    assert guard_depth() == 0
