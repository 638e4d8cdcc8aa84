"""Single-process multi-device FP8 training: several devices in one autocast. Two modules on two
devices updated at one autocast exit each on its own device, one device against the same model
split over two (bit for bit), and a stack of te modules split by ``accelerate.dispatch_model``
trained for 20 FP8 steps and then run for FP8 inference, with its state on the owner devices.

The scenario is upstream issue #3124 (``shared/seeds/000``): ``accelerate.dispatch_model`` puts
TE modules on ``cuda:1`` while ``cuda:0`` stays current, and FP8 training must run there, keep
its state there and leave the caller's current device alone. Every test asserts where outputs,
gradients and FP8 state landed and that the current device and the forward device guard
(``guard_depth()``) came back unchanged: a wrong-device launch can "work" by accident.

Runs on CPU: the CPU run of the 20-step training and inference scenario. The rest needs two GPUs
in one process (and ``accelerate`` for ``dispatch_model``) and skips with the reason elsewhere;
it runs on the GPU machine through qa/L0_pytorch_gpu/test.sh. Shared helpers:
multi_device_fp8_helpers.py.
"""

import pytest
import torch
import torch.nn.functional as F
from multi_device_fp8_helpers import (
    BF16,
    CPU,
    CUDA0,
    CUDA1,
    FFN,
    HIDDEN,
    TOKENS,
    accelerate,
    clean_state,  # noqa: F401 (autouse fixture)
    cpu_input,
    current_device,
    fp8_tensors,
    make_linear,
    module_quantizers,
    needs_accelerate,
    quantizer_tensors,
    recorded_updates_fixture,  # noqa: F401 (the recorded_updates fixture)
    two_gpus,
)
from utils import bitwise_equal

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

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
