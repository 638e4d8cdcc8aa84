"""Helpers shared by the test files under tests/pytorch: skip markers, recipes by name, device
helpers, bitwise comparisons, plain-PyTorch reference activations, and what an FP8 GEMM sees of
its operands. Tolerances have their own table in ``tolerances.py``.

Test files import these as a top-level module (``from utils import needs_cuda``):
tests/pytorch/conftest.py puts this folder on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import subprocess
import warnings
from pathlib import Path

import fp8_oracle as oracle
import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

REPO_ROOT = Path(__file__).resolve().parents[2]

# --- skip markers --------------------------------------------------------------------------------
# GPU tests skip on CPU machines with the reason; qa/L0_pytorch_gpu/test.sh runs them on GPUs.
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; runs on the GPU machine through qa/L0_pytorch_gpu/test.sh",
)
# device_count() is 0 without CUDA, so this also skips where there is no GPU at all.
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs in one process; runs on the GPU machine",
)


# --- recipes by name -----------------------------------------------------------------------------
# Tests parametrize over names (readable test ids) and build a fresh recipe per test.
FP8_RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}
RECIPES_WITH_HIGH_PRECISION = {"high_precision": None, **FP8_RECIPES}


def make_recipe(name: str | None):
    """A new recipe for ``name``; ``None`` for ``None`` or ``"high_precision"`` (no FP8)."""
    if name is None or name == "high_precision":
        return None
    return FP8_RECIPES[name]()


def autocast_by_name(name: str | None):
    """``te.autocast`` with the recipe ``name``, disabled for ``None``/``"high_precision"``."""
    recipe = make_recipe(name)
    return te.autocast(enabled=recipe is not None, recipe=recipe)


def backward_recipe_state(module):
    """The module's backward (gradient) scaling state."""
    return module.fp8_meta["scaling_bwd"]


# --- devices -------------------------------------------------------------------------------------
def materialization_device() -> torch.device:
    """Where a deferred (meta) module is expected to materialize: the current CUDA device, or
    the CPU without CUDA. Written out here, independently of transformer_engine.pytorch.device."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def current_device_unchanged():
    """Asserts that the block leaves the current CUDA device as it found it."""
    before = torch.cuda.current_device()
    yield
    assert torch.cuda.current_device() == before


# --- bitwise comparisons -------------------------------------------------------------------------
# Bit patterns compare exactly where values cannot: NaN == NaN, -0.0 != 0.0, FP8 payloads.
def count_calls(monkeypatch, module, **functions: str) -> dict[str, int]:
    """Wraps ``module``'s functions so that each call is counted: ``functions`` maps a label to
    an attribute name; returns ``{label: calls}``, updated as the wrapped functions run (the
    originals still do the work; ``monkeypatch`` restores them)."""
    calls = dict.fromkeys(functions, 0)
    for label, name in functions.items():
        original = getattr(module, name)

        def counting(*args, _label=label, _original=original, **kwargs):
            calls[_label] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return calls


def uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8, on its own device (FP8 data, raw buffers)."""
    return t.contiguous().view(torch.uint8)


def cpu_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8, copied to the CPU: compares a GPU result with a CPU one."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def float32_bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns (int32) of ``t``'s values, converted to float32 first."""
    return t.float().contiguous().view(torch.int32)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes, wherever the two tensors live."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(cpu_bytes(a).reshape(-1), cpu_bytes(b).reshape(-1))


# --- what an FP8 GEMM sees -----------------------------------------------------------------------
def fake_quant(t, scale, fp8_dtype):
    """What an FP8 GEMM sees of ``t`` cast with ``scale``: dequantized values (float64), from
    the independent oracle (fp8_oracle.py), not the reference the CPU path itself runs."""
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(1)
    data = oracle.cast_bytes(t, scale, fp8_dtype)
    return oracle.dequantize(data, oracle.reciprocal(scale), torch.float32, fp8_dtype).double()


def current_scale(t, fp8_dtype):
    """Current scaling's scale for ``t``."""
    return oracle.scale_from_amax(oracle.amax(t), fp8_dtype)


# --- plain-PyTorch reference activations ---------------------------------------------------------
# Written from the formulas, independently of the package's activation code; keyed by the
# activation names modules accept (``LayerNormMLP(activation=...)``).
def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def first_half_gated(act):
    """``act(a) * b`` for the two halves ``a, b`` of the last dimension."""

    def gated(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b

    return gated


def clamped_swiglu(x, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + glu_linear_offset)


REFERENCE_ACTIVATIONS = {
    "gelu": gelu_tanh,
    "geglu": first_half_gated(gelu_tanh),
    "glu": first_half_gated(torch.sigmoid),
    "qgelu": quick_gelu,
    "qgeglu": first_half_gated(quick_gelu),
    "relu": F.relu,
    "reglu": first_half_gated(F.relu),
    "srelu": lambda x: F.relu(x) ** 2,
    "sreglu": first_half_gated(lambda x: F.relu(x) ** 2),
    "silu": F.silu,
    "swiglu": first_half_gated(F.silu),
    "clamped_swiglu": clamped_swiglu,
}


# --- what is still alive ------------------------------------------------------------------------
def live_cpu_tensors_on(addresses) -> list[torch.Tensor]:
    """Every live CPU tensor (of at least one element) whose memory starts at one of
    ``addresses``: whether something still holds a buffer, seen through the objects Python can
    reach."""
    addresses = set(addresses)
    found = []
    with warnings.catch_warnings():  # isinstance touches deprecated module attributes
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel() > 0:
                try:
                    address = obj.untyped_storage().data_ptr()
                except RuntimeError:
                    # a wrapper subclass (a quantized tensor) has no storage of its own; the
                    # plain tensors holding its bytes are in gc's list themselves
                    continue
                if address in addresses:
                    found.append(obj)
    return found


# --- subprocesses --------------------------------------------------------------------------------
def describe_process(proc: subprocess.CompletedProcess, stderr_chars: int = 4000) -> str:
    """Exit code and output of a finished process, for assertion messages; of stderr only the
    last ``stderr_chars`` characters (a traceback ends there; warnings before it can be long)."""
    stderr = proc.stderr[-stderr_chars:]
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{stderr}"
