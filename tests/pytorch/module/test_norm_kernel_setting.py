"""``NVTE_NORM_KERNELS``: which kernels run te.LayerNorm / te.RMSNorm (and the norms of the
LayerNorm* modules) on CUDA. ``auto`` (the default) runs the package's kernels for the
high-precision forward and the backward, ``native`` also lets them write the FP8 output,
``torch`` keeps PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch
from utils import count_calls

import transformer_engine.pytorch as te
from transformer_engine.common.native import native_module
from transformer_engine.pytorch.cpp_extensions import norm_kernels
from transformer_engine.pytorch.functional import _fused_norms


@pytest.mark.parametrize(
    "value,expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("native", "native"),
                       ("torch", "torch")],
)  # fmt: skip
def test_setting_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("NVTE_NORM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("NVTE_NORM_KERNELS", value)
    assert _fused_norms._norm_kernels_setting() == expected


def test_unknown_setting_names_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv("NVTE_NORM_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"NVTE_NORM_KERNELS='fast'.*'auto'.*'native'.*'torch'"):
        _fused_norms._norm_kernels_setting()


def _calls(monkeypatch):
    return count_calls(monkeypatch, norm_kernels, forward="norm_forward_prevalidated",
                       backward="norm_backward_prevalidated")  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or native_module() is None,
    reason="needs a CUDA GPU and the native library; runs on the GPU machine",
)
@pytest.mark.parametrize("hidden,expected", [(16384, 1), (16392, 0)])
def test_auto_keeps_pytorch_kernels_past_16384_features(monkeypatch, hidden, expected):
    """Rows longer than 16384 go to PyTorch's kernels under ``auto`` (the package's looped
    kernels are slower there); ``native`` still takes them."""
    calls = _calls(monkeypatch)
    layer = te.LayerNorm(hidden, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(4, hidden, device="cuda").to(torch.bfloat16).requires_grad_(True)
    layer(x).sum().backward()
    assert calls == {"forward": expected, "backward": expected}
    monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", True)
    layer(x).sum().backward()
    assert calls == {"forward": expected + 1, "backward": expected + 1}


@pytest.mark.skipif(
    not torch.cuda.is_available() or native_module() is None,
    reason="needs a CUDA GPU and the native library; runs on the GPU machine",
)
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("native", [True, False], ids=["auto", "torch"])
def test_default_runs_the_package_kernels_on_cuda(monkeypatch, kind, native):
    """The module's output and gradients agree with a float64 run either way; the package's
    kernels run forward and backward by default and not with the torch setting; a forward
    without autograd gives the same bits."""
    monkeypatch.setattr(_fused_norms, "use_native_high_precision_norms", native)
    calls = _calls(monkeypatch)
    torch.manual_seed(0)
    layer = getattr(te, kind)(1024, device="cuda", params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.add_(torch.randn_like(layer.weight) * 0.1)
    x = (torch.randn(64, 1024, device="cuda") * 2 + 1).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    assert calls == ({"forward": 1, "backward": 1} if native else {"forward": 0, "backward": 0})
    with torch.no_grad():  # inference: the training forward's kernels and bits
        assert torch.equal(layer(x), y)

    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    if kind == "LayerNorm":
        b64 = layer.bias.detach().double().requires_grad_(True)
        ref = torch.nn.functional.layer_norm(x64, (1024,), w64, b64, layer.eps)
    else:
        ref = torch.nn.functional.rms_norm(x64, (1024,), w64, layer.eps)
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2**-6, atol=2**-6)
    # A sum over 64 rows of bf16-rounded terms.
    torch.testing.assert_close(layer.weight.grad.double(), w64.grad, rtol=2**-6, atol=0.05)


@pytest.mark.skipif(
    not torch.cuda.is_available() or native_module() is None,
    reason="needs a CUDA GPU and the native library; runs on the GPU machine",
)
@pytest.mark.parametrize("native", [False, True], ids=["auto", "native"])
def test_float32_input_takes_the_package_kernels_only_with_native(monkeypatch, native):
    """``auto`` gives the package's kernels the 16-bit inputs it was measured on; float32 input
    keeps PyTorch's unless NVTE_NORM_KERNELS=native."""
    monkeypatch.setattr(_fused_norms, "use_native_norm_kernels", native)
    calls = _calls(monkeypatch)
    layer = te.LayerNorm(256, device="cuda", params_dtype=torch.float32)
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert calls == ({"forward": 1, "backward": 1} if native else {"forward": 0, "backward": 0})
    ref = torch.nn.functional.layer_norm(x.detach(), (256,), layer.weight, layer.bias, layer.eps)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
