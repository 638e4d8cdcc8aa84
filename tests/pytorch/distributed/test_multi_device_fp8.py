"""Single-process multi-device FP8: modules and operations on a device that is not the current
one, several devices in one autocast, and the ordered amax reduction across them.

The scenario is upstream issue #3124 (``shared/seeds/000``): ``accelerate.dispatch_model`` puts
TE modules on ``cuda:1`` while ``cuda:0`` stays current, and FP8 training must run there, keep
its state there and leave the caller's current device alone. Every test asserts where outputs,
gradients and FP8 state landed and that the current device and the forward device guard
(``guard_depth()``) came back unchanged: a wrong-device launch can "work" by accident.

Runs on CPU: the guard cleanup when forward preparation raises, the gather/reduce/scatter
bookkeeping with a mocked collective (including CPU entries labelled as two devices), the
sentinel check of order and MAX through real modules, and the CPU run of the 20-step training
and inference scenario. The rest needs two GPUs in one process (and ``accelerate`` for
``dispatch_model``) and skips with the reason elsewhere; it runs on the GPU machine through
qa/L0_pytorch_gpu/test.sh.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from utils import bitwise_equal

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.device import device_guard, exit_device, guard_depth
from transformer_engine.pytorch.module import linear as linear_module
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState
from transformer_engine.pytorch.quantization import amax_registry as _amax_registry

try:
    import accelerate
except ImportError as error:
    accelerate = None
    _ACCELERATE_REASON = (
        f"needs the accelerate package (import failed: {error}); runs where it is installed, "
        "on the 2 x H200 machine through qa/L0_pytorch_gpu/test.sh"
    )
else:
    _ACCELERATE_REASON = ""


def _two_gpus_reason() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return (
            f"needs two CUDA GPUs in one process (found {count}); runs on the 2 x H200 machine "
            "through qa/L0_pytorch_gpu/test.sh"
        )
    available, reason = te.is_fp8_available(return_reason=True)
    return "" if available else f"FP8 is not available on these GPUs: {reason}"


_TWO_GPUS_REASON = _two_gpus_reason()
two_gpus = pytest.mark.skipif(bool(_TWO_GPUS_REASON), reason=_TWO_GPUS_REASON)
needs_accelerate = pytest.mark.skipif(accelerate is None, reason=_ACCELERATE_REASON)

BF16 = torch.bfloat16
HIDDEN, FFN, TOKENS = 64, 128, 32
CPU = torch.device("cpu")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
E4M3_MAX = 448.0
GROUP = object()  # stands for a process group; the fake collective checks it is passed through


@pytest.fixture(autouse=True)
def clean_state():
    FP8GlobalStateManager.reset()
    previous = torch.cuda.current_device() if torch.cuda.is_available() else None
    yield
    leaked = guard_depth()
    while guard_depth():  # keep a leak from spilling into the tests after this one
        exit_device()
    FP8GlobalStateManager.reset()
    if previous is not None:
        torch.cuda.set_device(previous)
    assert leaked == 0, f"{leaked} forward device guard(s) left open"


# ---------------------------------------------------------------------------------------------
# Helpers


def current_device():
    """The current CUDA device index; ``None`` without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def make_linear(device, in_features: int, out_features: int, seed: int) -> te.Linear:
    """A BF16 ``te.Linear`` whose parameters come from a CPU generator, so that it holds the
    same values on whichever device it is built."""
    module = te.Linear(in_features, out_features, params_dtype=BF16, device=device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module


def fp8_tensors(module) -> dict[str, torch.Tensor]:
    """Scale and amax history of both directions of a module's delayed-scaling state."""
    out = {}
    for key in ("scaling_fwd", "scaling_bwd"):
        state = module.fp8_meta[key]
        out[f"{key}.scale"] = state.scale
        out[f"{key}.amax_history"] = state.amax_history
    return out


def quantizer_tensors(quantizers) -> list[torch.Tensor]:
    """The scale and amax views every delayed-scaling quantizer casts with."""
    return [t for q in quantizers for t in (q.scale, q.amax)]


def module_quantizers(module) -> list:
    return module.quantizers["scaling_fwd"] + module.quantizers["scaling_bwd"]


def cpu_input(generator, *shape, scale=1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


@dataclass
class UpdateCall:
    """One per-device fused update as the registry issued it."""

    histories: list
    scales: list
    histories_before: list
    scales_before: list
    buffer: torch.Tensor | None  # CPU copy of the reduction buffer it received
    buffer_device: torch.device | None
    fp8_dtype: torch.dtype
    margin: float
    algo: str

    @property
    def device(self) -> torch.device:
        return self.histories[0].device

    def assert_on_one_device(self) -> None:
        devices = {t.device for t in self.histories + self.scales}
        assert devices == {self.device}, f"one update mixed devices {devices}"
        if self.buffer_device is not None:
            assert self.buffer_device == self.device

    def assert_matches_reference(self) -> None:
        """The update left exactly what the reference update computes from its inputs."""
        histories = [h.clone() for h in self.histories_before]
        scales = [s.clone() for s in self.scales_before]
        reference.delayed_scaling_update(
            histories, scales, self.fp8_dtype, self.margin, self.algo, self.buffer
        )
        for live, expected in zip(self.histories + self.scales, histories + scales):
            assert bitwise_equal(live, expected)


@pytest.fixture
def recorded_updates(monkeypatch):
    """Wrap the registry's per-device fused update: each call is recorded, with CPU snapshots
    of what it was given, and then runs for real."""
    calls: list[UpdateCall] = []
    original = _amax_registry._fused_update

    def record(histories, scales, fp8_dtype, margin, algo, reduction_buffer):
        calls.append(
            UpdateCall(
                histories=list(histories),
                scales=list(scales),
                histories_before=[h.detach().cpu().clone() for h in histories],
                scales_before=[s.detach().cpu().clone() for s in scales],
                buffer=None if reduction_buffer is None else reduction_buffer.detach().cpu(),
                buffer_device=None if reduction_buffer is None else reduction_buffer.device,
                fp8_dtype=fp8_dtype,
                margin=margin,
                algo=algo,
            )
        )
        original(histories, scales, fp8_dtype, margin, algo, reduction_buffer)

    monkeypatch.setattr(_amax_registry, "_fused_update", record)
    return calls


@pytest.fixture
def fake_world(monkeypatch):
    """``torch.distributed`` "initialized" with two ranks. The collective records what it
    receives (a CPU copy, its device, the group, the current device and, when
    ``world["snapshot"]`` is set, what that callable returns at that moment), then applies MAX
    with the other rank's buffer: ``world["others"][i]`` for the i-th call (missing or ``None``:
    the other rank sent zeros)."""
    world = {"calls": [], "others": [], "snapshot": None}

    def all_reduce_max(buffer, group):
        call = {
            "received": buffer.detach().cpu().clone(),
            "device": buffer.device,
            "group": group,
            "current_device": current_device(),
        }
        if world["snapshot"] is not None:
            call["snapshot"] = world["snapshot"]()
        index = len(world["calls"])
        world["calls"].append(call)
        if index < len(world["others"]) and world["others"][index] is not None:
            buffer.copy_(torch.maximum(buffer, world["others"][index].to(buffer.device)))

    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(_amax_registry, "_all_reduce_max", all_reduce_max)
    return world


# ---------------------------------------------------------------------------------------------
# 1. A module on a device that is not the current one


def _train_linear(device, steps=3):
    """FP8 (delayed scaling) steps of one te.Linear; returns outputs, input grads and module."""
    FP8GlobalStateManager.reset()
    module = make_linear(device, HIDDEN, FFN, seed=1)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    g = torch.Generator().manual_seed(7)
    outs = []
    for step in range(steps):
        x = cpu_input(g, TOKENS, HIDDEN, scale=1 + step).to(device, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = module(x)
            row0 = module.fp8_meta["scaling_fwd"].amax_history[0]
            # the casts of this forward wrote their amaxes into the state on the module's device
            assert bool((row0[:2] > 0).all()), row0
        y.float().square().mean().backward()
        outs += [y.detach(), x.grad]
    return outs, module


@two_gpus
def test_linear_on_a_non_current_device_runs_fp8_there(monkeypatch):
    torch.cuda.set_device(0)
    seen = []
    original = linear_module.linear

    def recording_linear_forward(*args, **kwargs):
        seen.append((torch.cuda.current_device(), guard_depth()))
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_module, "linear", recording_linear_forward)
    outs, module = _train_linear("cuda:1")
    torch.cuda.synchronize(CUDA1)

    assert torch.cuda.current_device() == 0
    assert guard_depth() == 0
    # the GEMMs ran with the input's device current, inside exactly one guarded region
    assert seen == [(1, 1)] * 3
    for t in outs:
        assert t.device == CUDA1
    for name, p in module.named_parameters():
        assert p.device == CUDA1 and p.grad is not None and p.grad.device == CUDA1, name
    for name, t in fp8_tensors(module).items():
        assert t.device == CUDA1, name
    for t in quantizer_tensors(module_quantizers(module)):
        assert t.device == CUDA1
    state = fp8_tensors(module)
    # delayed scaling really ran: forward (input, weight) and backward (grad output) scales moved
    assert bool((state["scaling_fwd.scale"][:2] != 1).all())
    assert bool(state["scaling_bwd.scale"][0] != 1)

    # bit for bit what the same run gives with cuda:1 current
    torch.cuda.set_device(1)
    try:
        ref_outs, ref_module = _train_linear("cuda:1")
    finally:
        torch.cuda.set_device(0)
    for a, b in zip(outs, ref_outs):
        assert bitwise_equal(a, b)
    for (name, a), b in zip(module.named_parameters(), ref_module.parameters()):
        assert bitwise_equal(a.grad, b.grad), name
    for name, t in fp8_tensors(ref_module).items():
        assert bitwise_equal(state[name], t), name


# ---------------------------------------------------------------------------------------------
# 2. The guard is released when forward preparation raises


def _injected_failure(name: str, inside: list):
    def fail(*args, **kwargs):
        inside.append((guard_depth(), current_device()))
        raise RuntimeError(f"injected failure in {name}")

    return fail


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:1", marks=two_gpus)])
@pytest.mark.parametrize(
    "failure",
    ["init_fp8_metadata", "set_activation_dtype", "input_dtype_mismatch", "ops_reset_recipe_state"],
)
def test_guard_is_released_when_forward_preparation_raises(device, failure):
    on_gpu = device != "cpu"
    if on_gpu:
        torch.cuda.set_device(0)
    ambient = 0 if on_gpu else current_device()  # CPU runs must leave any CUDA device alone
    device = torch.device(device)
    inside: list = []
    g = torch.Generator().manual_seed(3)
    x = cpu_input(g, TOKENS, HIDDEN).to(device, BF16)
    if failure == "ops_reset_recipe_state":
        module = te.ops.BasicLinear(HIDDEN, HIDDEN, device=device, dtype=BF16)
        module.reset_recipe_state = _injected_failure(failure, inside)
        expected = pytest.raises(RuntimeError, match="injected failure")
    elif failure == "input_dtype_mismatch":
        module = make_linear(device, HIDDEN, HIDDEN, seed=3)
        x = x.float()  # BF16 parameters, FP32 input, no torch.autocast: set_activation_dtype
        expected = pytest.raises(TypeError, match="does not match parameter")
    else:
        module = make_linear(device, HIDDEN, HIDDEN, seed=3)
        setattr(module, failure, _injected_failure(failure, inside))
        expected = pytest.raises(RuntimeError, match="injected failure")

    # inside an enclosing guarded region, as when an outer forward calls this module
    anchor = CUDA0 if on_gpu else CPU
    with device_guard(anchor):
        with expected:
            with te.autocast(recipe=DelayedScaling()):
                module(x)
        assert guard_depth() == 1, "only the enclosing region may still be open"
        assert current_device() == ambient
    assert guard_depth() == 0
    assert current_device() == ambient
    if failure != "input_dtype_mismatch":
        # the failure happened inside the module's own guard, with the input's device current
        assert inside == [(2, 1 if on_gpu else ambient)]

    # the module is not left broken: an FP8 step afterwards runs on its device
    if failure == "ops_reset_recipe_state":
        del module.reset_recipe_state
    elif failure != "input_dtype_mismatch":
        delattr(module, failure)
    x = x.to(BF16).requires_grad_(True)
    with te.autocast(recipe=DelayedScaling()):
        y = module(x)
    y.float().sum().backward()
    assert y.device == device and x.grad.device == device
    assert module.weight.grad.device == device
    assert guard_depth() == 0
    assert current_device() == ambient


# ---------------------------------------------------------------------------------------------
# 3. te.ops.BasicLinear on a device that is not the current one


@two_gpus
@pytest.mark.parametrize("built_on", ["cuda:1", "meta"])
def test_basic_linear_op_on_a_non_current_device(built_on, monkeypatch):
    torch.cuda.set_device(0)
    seen = []
    original_forward = te.ops.BasicLinear.op_forward
    original_backward = te.ops.BasicLinear.op_backward

    def op_forward(self, ctx, input_, **kwargs):
        seen.append(("forward", torch.cuda.current_device(), guard_depth()))
        return original_forward(self, ctx, input_, **kwargs)

    def op_backward(self, ctx, grad_output):
        seen.append(("backward", torch.cuda.current_device()))
        return original_backward(self, ctx, grad_output)

    monkeypatch.setattr(te.ops.BasicLinear, "op_forward", op_forward)
    monkeypatch.setattr(te.ops.BasicLinear, "op_backward", op_backward)

    op = te.ops.BasicLinear(HIDDEN, FFN, device=built_on, dtype=BF16)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    g = torch.Generator().manual_seed(11)
    for step in range(3):
        x = cpu_input(g, TOKENS, HIDDEN, scale=1 + step).to(CUDA1, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = op(x)
            forward_state = op.recipe_state("forward")
            # recipe state made on the parameters' device, and the casts wrote into it there
            assert forward_state.device == CUDA1
            assert bool((forward_state.amax_history[0] > 0).all())
        y.float().square().mean().backward()
        assert torch.cuda.current_device() == 0
        assert guard_depth() == 0
        assert y.device == CUDA1 and x.grad.device == CUDA1
        assert op.weight.grad.device == CUDA1

    # a meta weight is materialized onto the input's device, not the current one
    assert op.weight.device == CUDA1
    for mode in ("forward", "backward"):
        state = op.recipe_state(mode)
        assert state.scale.device == CUDA1 and state.amax_history.device == CUDA1, mode
        assert bool((state.scale[:1] != 1).all()), f"{mode} scales were never updated"
        count = op.num_quantizers(mode)
        for t in quantizer_tensors([op.get_quantizer(mode, i) for i in range(count)]):
            assert t.device == CUDA1
    assert [s for s in seen if s[0] == "forward"] == [("forward", 1, 1)] * 3
    assert [s for s in seen if s[0] == "backward"] == [("backward", 1)] * 3


# ---------------------------------------------------------------------------------------------
# 4. Two modules on two devices in one autocast


@two_gpus
def test_two_modules_on_two_devices_are_updated_at_one_exit_each_on_its_device(
    recorded_updates,
):
    torch.cuda.set_device(0)
    first = make_linear("cuda:1", HIDDEN, FFN, seed=1)  # registered first, not current
    second = make_linear("cuda:0", FFN, HIDDEN, seed=2)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        recorded_updates.clear()
        x = cpu_input(g, TOKENS, HIDDEN, scale=2 + step).to(CUDA1, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            h = first(x)
            y = second(h.to(CUDA0))
            assert recorded_updates == [], "nothing is updated before the autocast exits"
        # one update per device at the exit, in the order the devices were first registered,
        # each holding only its own device's tensors
        assert [c.device for c in recorded_updates] == [CUDA1, CUDA0]
        for call, module in zip(recorded_updates, (first, second)):
            state = module.fp8_meta["scaling_fwd"]
            assert call.histories == [state.amax_history] and call.scales == [state.scale]
            assert call.histories[0] is state.amax_history and call.scales[0] is state.scale
            assert call.buffer is None and call.fp8_dtype == torch.float8_e4m3fn
            call.assert_on_one_device()
            call.assert_matches_reference()

        recorded_updates.clear()
        y.float().square().mean().backward()
        assert [c.device for c in recorded_updates] == [CUDA1, CUDA0]
        for call, module in zip(recorded_updates, (first, second)):
            state = module.fp8_meta["scaling_bwd"]
            assert call.histories[0] is state.amax_history and call.scales[0] is state.scale
            assert call.fp8_dtype == torch.float8_e5m2
            call.assert_on_one_device()
            call.assert_matches_reference()

        assert torch.cuda.current_device() == 0
        assert guard_depth() == 0
        assert y.device == CUDA0 and x.grad.device == CUDA1

    for module, device in ((first, CUDA1), (second, CUDA0)):
        for name, t in fp8_tensors(module).items():
            assert t.device == device, name
        for t in quantizer_tensors(module_quantizers(module)):
            assert t.device == device
        for p in module.parameters():
            assert p.grad.device == device
        assert bool((module.fp8_meta["scaling_fwd"].scale[:2] != 1).all())
        assert bool(module.fp8_meta["scaling_bwd"].scale[0] != 1)


# ---------------------------------------------------------------------------------------------
# 5. One device against the same model split over two, bit for bit


def _run_stack(devices, steps=4):
    """Train a chain of te.Linear on ``devices`` (one per layer); returns what must agree."""
    FP8GlobalStateManager.reset()
    layers = [make_linear(d, HIDDEN, HIDDEN, seed=10 + i) for i, d in enumerate(devices)]
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    g = torch.Generator().manual_seed(99)
    record = []
    for step in range(steps):
        x = cpu_input(g, TOKENS, HIDDEN, scale=1 + step).to(devices[0], BF16)
        x.requires_grad_(True)
        with te.autocast(recipe=recipe):
            h = x
            for i, layer in enumerate(layers):
                h = layer(h.to(layer.weight.device))
                if i + 1 < len(layers):
                    h = F.gelu(h)
        loss = h.float().square().mean()
        loss.backward()
        for p in params:
            assert p.grad.device == p.device
        record += [h.detach(), loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        assert torch.cuda.current_device() == 0
        assert guard_depth() == 0
    record += [p.detach() for p in params]
    for layer in layers:
        record += list(fp8_tensors(layer).values())
    return layers, record


@two_gpus
def test_split_model_matches_the_single_device_model_bitwise():
    torch.cuda.set_device(0)
    split = (CUDA0, CUDA1, CUDA1, CUDA0)
    _, single_record = _run_stack((CUDA0,) * len(split))
    layers, split_record = _run_stack(split)
    assert len(single_record) == len(split_record)
    for i, (a, b) in enumerate(zip(single_record, split_record)):
        assert bitwise_equal(a, b), f"record entry {i} differs"
    for layer, device in zip(layers, split):
        for name, t in fp8_tensors(layer).items():
            assert t.device == device, name
        for p in layer.parameters():
            assert p.device == device
    assert torch.cuda.current_device() == 0


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


# ---------------------------------------------------------------------------------------------
# A stack of te modules split by accelerate.dispatch_model: 20 FP8 training steps, then FP8
# inference under torch.no_grad()


class _Block(torch.nn.Module):
    """A small transformer-like layer of te modules: norm + QKV, output projection, MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = te.LayerNormLinear(HIDDEN, 3 * HIDDEN, params_dtype=BF16, device="cpu")
        self.proj = te.Linear(HIDDEN, HIDDEN, params_dtype=BF16, device="cpu")
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=BF16, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.mlp(x)


class _Stack(torch.nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block() for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


DEVICE_MAP = {"layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1}


def _te_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)]


@pytest.mark.parametrize(
    "placement", ["cpu", pytest.param("dispatch_model", marks=[needs_accelerate, two_gpus])]
)
def test_dispatched_stack_trains_20_fp8_steps_then_infers_with_state_on_owner_devices(
    placement,
):
    torch.manual_seed(0)
    model = _Stack()  # built on the CPU, as a checkpoint is loaded before dispatch
    if placement == "dispatch_model":
        torch.cuda.set_device(0)
        model = accelerate.dispatch_model(model, device_map=DEVICE_MAP)
        input_device, ambient = CUDA0, 0
    else:
        input_device, ambient = CPU, current_device()
    for name, p in model.named_parameters():
        if placement == "dispatch_model":
            prefix = ".".join(name.split(".")[:2])
            assert p.device == torch.device("cuda", DEVICE_MAP[prefix]), name
        else:
            assert p.device == CPU, name

    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    x = cpu_input(g, 2, TOKENS // 2, HIDDEN).to(input_device, BF16)
    losses = []
    for _ in range(20):
        with te.autocast(recipe=recipe):
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        assert out.device == input_device
        assert current_device() == ambient
        assert guard_depth() == 0
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses

    modules = _te_modules(model)
    assert len(modules) == 3 * len(model.layers)
    devices_used = set()
    for module in modules:
        owner = next(module.parameters()).device
        devices_used.add(owner)
        for name, t in fp8_tensors(module).items():
            assert t.device == owner, f"{type(module).__name__} {name} on {t.device}, not {owner}"
        for t in quantizer_tensors(module_quantizers(module)):
            assert t.device == owner, type(module).__name__
        for p in module.parameters():
            assert p.device == owner
        assert bool((module.fp8_meta["scaling_fwd"].scale != 1).any()), "forward never updated"
        assert bool((module.fp8_meta["scaling_bwd"].scale != 1).any()), "backward never updated"
    if placement == "dispatch_model":
        assert devices_used == {CUDA0, CUDA1}

    # FP8 inference: under torch.no_grad() the autocast exit updates no scale
    before = [{k: t.detach().clone() for k, t in fp8_tensors(m).items()} for m in modules]
    with torch.no_grad(), te.autocast(recipe=recipe):
        out = model(x)
    assert out.device == input_device and not out.requires_grad
    assert bool(torch.isfinite(out.float()).all())
    for module, saved in zip(modules, before):
        now = fp8_tensors(module)
        for key in ("scaling_fwd.scale", "scaling_bwd.scale", "scaling_bwd.amax_history"):
            assert bitwise_equal(now[key], saved[key]), f"{type(module).__name__} {key} changed"
        # only row 0 (this step's amaxes) may change: the history did not roll
        fwd, saved_fwd = now["scaling_fwd.amax_history"], saved["scaling_fwd.amax_history"]
        assert bitwise_equal(fwd[1:], saved_fwd[1:])
        for t in now.values():
            assert t.device == next(module.parameters()).device
    assert current_device() == ambient
    assert guard_depth() == 0
