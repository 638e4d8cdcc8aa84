"""Helpers shared by the single-process multi-device FP8 tests (test_multi_device_fp8_placement.py,
test_multi_device_fp8_training.py, test_multi_device_fp8_amax_reduction.py): the skip marks
(two GPUs in one process, ``accelerate``), the shapes and devices, the autouse ``clean_state``
fixture (fresh FP8 state, current device restored, no forward device guard left open), module and
FP8-state helpers, and the fixtures that record the registry's per-device fused updates
(``recorded_updates``) and fake a two-rank ``torch.distributed`` (``fake_world``).

A test file gets ``clean_state`` (and the other fixtures it uses) by importing it. The fixtures
that tests take as arguments are defined as ``<name>_fixture`` with ``name="<name>"``, so that
the import does not shadow the argument."""

from dataclasses import dataclass

import pytest
import torch
from utils import bitwise_equal

import transformer_engine.pytorch as te
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.device import exit_device, guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.quantization import amax_registry as _amax_registry
from transformer_engine.pytorch.quantization import update_graph as _update_graph

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


@pytest.fixture(name="recorded_updates")
def recorded_updates_fixture(monkeypatch):
    """Wrap the registry's per-device fused update: each call is recorded, with CPU snapshots
    of what it was given, and then runs for real. Updates stay native calls (a replayed
    update graph would bypass the recorder)."""
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
    monkeypatch.setattr(_update_graph, "GRAPH_SCALE_UPDATES", False)
    return calls


@pytest.fixture(name="fake_world")
def fake_world_fixture(monkeypatch):
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
