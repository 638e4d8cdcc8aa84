"""The norm that writes FC1's FP8 input itself (``te.LayerNormLinear``, ``te.LayerNormMLP``,
te.ops ``LayerNorm``/``RMSNorm`` + ``Linear``), on with the package's norm kernels
(``NVTE_NORM_KERNELS=native``; the tests set the switch).

Under a per-tensor FP8 recipe the norm kernel casts its output with the GEMM's input quantizer
in its own pass (on CUDA; elsewhere the norm runs, then the cast), so no high-precision copy of
the norm's output exists. The oracle is the same module with that fusion switched off (the norm
in the activation dtype, then the GEMM's own cast): outputs, every gradient and the FP8 scaling
state must be bitwise equal over two steps, since the FP8 bytes are by construction those of
"norm, then cast".
"""

from __future__ import annotations

import copy

import pytest
import torch
from utils import autocast_by_name

import transformer_engine.pytorch as te
from transformer_engine.pytorch.functional import _fused_norms
from transformer_engine.pytorch.module import _fused_norm, layernorm_linear, layernorm_mlp

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = [("LayerNorm", False), ("RMSNorm", False), ("LayerNorm", True)]


def _unfused(monkeypatch):
    for module in (layernorm_linear, layernorm_mlp):
        monkeypatch.setattr(module, "apply_norm_fp8", lambda *args, **kwargs: None)


def _spy(monkeypatch):
    calls = []
    for module in (layernorm_linear, layernorm_mlp):
        original = module.apply_norm_fp8

        def spy(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(module, "apply_norm_fp8", spy)
    return calls


def _make(kind, normalization, zero_centered_gamma, device):
    torch.manual_seed(1234)
    common = dict(
        eps=1e-5, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
        params_dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    if kind == "linear":
        module = te.LayerNormLinear(64, 48, **common)
    else:
        module = te.LayerNormMLP(64, 128, activation="gelu", **common)
    with torch.no_grad():  # parameters away from their init values: gamma and beta matter
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


def _steps(module, recipe, device):
    """Two forward + backward steps on a [4, 8, 64] input; everything to compare, on the CPU."""
    gen = torch.Generator().manual_seed(7)
    results = []
    for _ in range(2):
        x = torch.randn(4, 8, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
        x.requires_grad_(True)
        with autocast_by_name(recipe):
            y = module(x)
        dy = torch.randn(y.shape, generator=gen).to(device=device, dtype=y.dtype)
        y.backward(dy)
        results += [y.detach(), x.grad]
        results += [p.grad.clone() for p in module.parameters()]
        for p in module.parameters():
            p.grad = None
    for key in ("scaling_fwd", "scaling_bwd"):
        state = module.fp8_meta.get(key) if hasattr(module, "fp8_meta") else None
        for name in ("amax_history", "scale"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                results.append(value.clone())
    return [t.cpu() for t in results]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("normalization,zero_centered_gamma", CASES)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fused_norm_matches_norm_then_cast(
    monkeypatch, kind, normalization, zero_centered_gamma, recipe, device
):
    monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", True)
    fused = _make(kind, normalization, zero_centered_gamma, device)
    reference = copy.deepcopy(fused)
    calls = _spy(monkeypatch)
    got = _steps(fused, recipe, device)
    assert calls and all(calls), "the fused norm did not run"
    for module in (layernorm_linear, layernorm_mlp):  # the spies go, the native switch stays
        monkeypatch.setattr(module, "apply_norm_fp8", _fused_norm.apply_norm_fp8)
    _unfused(monkeypatch)
    expected = _steps(reference, recipe, device)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(a.dtype)), (
            f"result {i} differs: max |diff| {(a.double() - b.double()).abs().max().item()}"
        )


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_no_fusion_by_default(monkeypatch, kind):
    """Without the package's norm kernels the modules keep norm-then-cast."""
    calls = _spy(monkeypatch)
    module = _make(kind, "LayerNorm", False, "cpu")
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name("delayed"):
        module(x).float().sum().backward()
    assert calls and not any(calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_ops_norm_writes_the_linear_input(monkeypatch, norm, recipe, device):
    """te.ops: the norm followed by a linear, with the norm writing FP8 and without, bitwise."""
    results = []
    for native in (True, False):
        monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", native)
        torch.manual_seed(3)
        model = te.ops.Sequential(
            getattr(te.ops, norm)(64, device=device, dtype=torch.bfloat16),
            te.ops.Linear(64, 32, device=device, dtype=torch.bfloat16),
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
        x = x.to(device=device, dtype=torch.bfloat16).requires_grad_(True)
        with autocast_by_name(recipe):
            y = model(x)
        y.float().square().sum().backward()
        results.append([y.detach(), x.grad, *[p.grad for p in model.parameters()]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_no_fusion_where_the_norm_output_is_needed(monkeypatch, kind):
    """``return_layernorm_output`` returns the norm's high-precision output: no fusion."""
    monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", True)
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    if kind == "linear":
        module = te.LayerNormLinear(64, 48, return_layernorm_output=True, device="cpu")
    else:
        module = te.LayerNormMLP(64, 128, return_layernorm_output=True, device="cpu")
    x = torch.randn(16, 64, requires_grad=True)
    with autocast_by_name("delayed"):
        out, ln_out = module(x)
    out.sum().backward()
    assert not any(calls)
    assert ln_out.dtype == torch.float32 and ln_out.shape == (16, 64)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fused_norm_saves_no_row_wise_copy(monkeypatch, kind):
    """The FP8 norm output the GEMM keeps for its weight gradient holds only the transposed
    bytes (the row-wise ones go after the forward GEMM, as with the GEMM's own cast)."""
    monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", True)
    torch.manual_seed(0)
    module = _make(kind, "LayerNorm", False, "cpu")
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast_by_name("delayed"):
            y = module(x)
    fp8 = [t for t in saved if hasattr(t, "_transpose") and getattr(t, "_data", None) is None]
    row_wise = [t for t in saved if getattr(t, "_data", None) is not None and t.shape == (32, 64)]
    assert fp8, "no column-wise-only FP8 tensor saved"
    assert not row_wise, "the norm's FP8 output was saved with its row-wise bytes"
    y.float().sum().backward()
