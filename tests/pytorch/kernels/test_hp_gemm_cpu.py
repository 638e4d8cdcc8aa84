"""16-bit GEMMs on CPUs without 16-bit matrix math (cpp_extensions.hp_gemm_cpu): float32
math, one rounding, through every high-precision GEMM of the linear core and general_gemm.

The route is forced on and off through ``hp_gemm_cpu.NATIVE_16BIT_GEMM``, so both run on any
CPU. The oracle is float64 rounded once to the output dtype; inputs are small integers times
powers of two, so every float32 product and sum is exact and the rounded result must match
bit for bit (a second rounding, or 16-bit accumulation, would show)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_engine.pytorch as te
from transformer_engine.pytorch.cpp_extensions import general_gemm, hp_gemm_cpu

HALF_DTYPES = (torch.bfloat16, torch.float16)


class MatmulDtypes(TorchDispatchMode):
    """Records the operand dtype of every matrix product dispatched while active."""

    OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.OPS):
            self.dtypes.append(args[1].dtype)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def float32_route(monkeypatch):
    """The float32 route for both 16-bit dtypes, whatever this CPU has."""
    for dtype in HALF_DTYPES:
        monkeypatch.setitem(hp_gemm_cpu.NATIVE_16BIT_GEMM, dtype, False)


def exact_values(shape, seed, dtype):
    """Integers in [-15, 15] times 2**-4: exact in every 16-bit dtype; a product of two has at
    most 8 significant bits and sums of a few hundred stay exact in float32."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-15, 16, shape, generator=g).double() / 16).to(dtype)


def once_rounded(value64: torch.Tensor, dtype) -> torch.Tensor:
    return value64.to(dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_linear_and_matmul_round_once(float32_route, dtype):
    x, w = exact_values((37, 200), 0, dtype), exact_values((24, 200), 1, dtype)
    b = exact_values((24,), 2, dtype) / 3  # not a multiple of 2**-4: the sum needs rounding
    assert hp_gemm_cpu.runs_in_float32(x, w)
    oracle = once_rounded(x.double() @ w.double().t() + b.double(), dtype)
    out = hp_gemm_cpu.linear(x, w, b)
    assert out.dtype == dtype and torch.equal(out, oracle)
    assert torch.equal(
        hp_gemm_cpu.linear(x, w, None), once_rounded(x.double() @ w.double().t(), dtype)
    )
    assert torch.equal(
        hp_gemm_cpu.matmul(x, w.t()), once_rounded(x.double() @ w.double().t(), dtype)
    )


def test_route_holds_under_cpu_autocast(float32_route):
    """torch.autocast("cpu") would cast the float32 operands back to BF16; the route keeps
    them float32."""
    x, w = exact_values((8, 32), 12, torch.bfloat16), exact_values((16, 32), 13, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes() as seen:
        out = hp_gemm_cpu.linear(x, w, None)
        hp_gemm_cpu.matmul(x, w.t())
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back on
    assert seen.dtypes == [torch.float32] * 2
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x.double() @ w.double().t()).bfloat16())


def test_product_and_bias_are_rounded_together(float32_route):
    # 1 + 2**-8 is a BF16 tie: alone it rounds to 1, so adding the bias 2**-8 afterwards gives
    # 1 again; rounded once with the bias, the sum 1 + 2**-7 is a BF16 number.
    x = torch.tensor([[1.0, 2.0**-8]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8], dtype=torch.bfloat16)
    assert hp_gemm_cpu.linear(x, w, b).item() == 1 + 2.0**-7


def test_route_applies_only_to_cpu_16bit_pairs(float32_route):
    x32 = torch.ones(4, 4)
    assert not hp_gemm_cpu.runs_in_float32(x32, x32)
    assert not hp_gemm_cpu.runs_in_float32(x32.bfloat16(), x32.half())
    assert not hp_gemm_cpu.runs_in_float32(x32.bfloat16(), x32.bfloat16().to("meta"))
    # Mixed dtypes keep torch's own behaviour (its error, here).
    with pytest.raises(RuntimeError):
        hp_gemm_cpu.linear(x32.bfloat16(), x32.half(), None)


def test_native_route_is_torchs(monkeypatch):
    monkeypatch.setitem(hp_gemm_cpu.NATIVE_16BIT_GEMM, torch.bfloat16, True)
    x, w = exact_values((8, 32), 3, torch.bfloat16), exact_values((16, 32), 4, torch.bfloat16)
    assert not hp_gemm_cpu.runs_in_float32(x, w)
    with MatmulDtypes() as seen:
        out = hp_gemm_cpu.linear(x, w, None)
        hp_gemm_cpu.matmul(x, w.t())
    assert seen.dtypes == [torch.bfloat16] * 2
    assert torch.equal(out, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_general_gemm_high_precision_rounds_once(float32_route, layout):
    dtype = torch.bfloat16
    m, k, n = 33, 160, 48
    if layout == "TN":
        a, b = exact_values((n, k), 5, dtype), exact_values((m, k), 6, dtype)
        oracle64 = b.double() @ a.double().t()
    elif layout == "NN":
        a, b = exact_values((k, n), 5, dtype), exact_values((m, k), 6, dtype)
        oracle64 = b.double() @ a.double()
    else:
        a, b = exact_values((k, n), 5, dtype), exact_values((k, m), 6, dtype)
        oracle64 = b.double().t() @ a.double()
    bias = exact_values((oracle64.shape[1],), 7, dtype) / 3
    out = general_gemm(a, b, layout=layout, bias=bias, alpha=0.75)[0]
    assert out.dtype == dtype
    assert torch.equal(out, once_rounded(0.75 * oracle64 + bias.double(), dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_module_step_on_float32_route(float32_route, dtype, module):
    """A te module's forward and backward GEMMs take the route: te.Linear's output and
    gradients equal the exact oracle bit for bit; LayerNormMLP's step agrees with float64."""
    torch.manual_seed(0)
    if module == "Linear":
        layer = te.Linear(96, 40, params_dtype=dtype, device="cpu")
        with torch.no_grad():
            layer.weight.copy_(exact_values((40, 96), 8, dtype))
            layer.bias.copy_(exact_values((40,), 9, dtype) / 3)
        x = exact_values((3, 11, 96), 10, dtype).requires_grad_()
        dy = exact_values((3, 11, 40), 11, dtype)
        with MatmulDtypes() as seen:
            y = layer(x)
            y.backward(dy)
        assert seen.dtypes == [torch.float32] * 3  # fprop, dgrad, wgrad
        w64, x64, dy64 = layer.weight.double(), x.detach().double(), dy.double()
        assert torch.equal(y, once_rounded(x64 @ w64.t() + layer.bias.double(), dtype))
        assert torch.equal(x.grad, once_rounded(dy64 @ w64, dtype))
        dw64 = dy64.reshape(-1, 40).t() @ x64.reshape(-1, 96)
        assert torch.equal(layer.weight.grad, once_rounded(dw64, dtype))
        return
    layer = te.LayerNormMLP(64, 128, params_dtype=dtype, device="cpu")
    ref = te.LayerNormMLP(64, 128, params_dtype=torch.float64, device="cpu")
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()}, strict=False)
    x = torch.randn(50, 64, dtype=dtype, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    with MatmulDtypes() as seen:
        layer(x).float().square().sum().backward()
    assert seen.dtypes == [torch.float32] * 6
    ref(x64).square().sum().backward()
    tol = {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(layer.fc1_weight.grad.double(), ref.fc1_weight.grad, **tol)


def test_general_gemm_float32_product_ignores_autocast():
    """A float32 output (or accumulation) is computed in float32 even inside a CPU autocast
    region, which would otherwise run torch.mm in BF16; the compute dtype is general_gemm's,
    as with upstream's C++ GEMM."""
    a = exact_values((24, 200), 14, torch.bfloat16)
    b = exact_values((40, 200), 15, torch.bfloat16)
    b = b + 2.0**-12  # BF16 can hold b, not the products' sums: a BF16 product would round
    oracle = b.double() @ a.double().t()
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes() as seen:
        out = general_gemm(a, b, torch.float32, layout="TN")[0]
        acc = torch.ones(40, 24)
        general_gemm(a, b, torch.float32, layout="TN", out=acc, accumulate=True)
    assert seen.dtypes == [torch.float32] * 2
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(acc.double(), oracle + 1, atol=1e-4, rtol=1e-6)
