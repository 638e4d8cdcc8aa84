"""The CPU FP8 GEMM: an exact float32 emulation of ``torch._scaled_mm`` (cpp_extensions.fp8_gemm_cpu).

Two oracles, both independent of the emulation:

* float64: the GEMM of the FP8 values (exact in float64) times the float64 scale product, plus
  the bias. The emulation's only roundings are the float32 accumulation (the products of two
  FP8 values are exact), the scale multiply, the bias add and the output rounding, so every
  element must lie within a rigorous bound of the float64 value: ``(K + 3) * 2**-24`` times the
  sum of the absolute products (plus the bias magnitude), and one output ulp more for BF16/FP16.
* ``torch._scaled_mm`` itself, called as general_gemm calls it on CUDA (and on CPUs where oneDNN
  compiles FP8): both are within that bound of float64, so they differ by at most twice the
  bound (plus one output ulp); only the order of the float32 accumulation tells them apart.
  Where oneDNN refuses a format pair on this CPU, that comparison skips with the reason.

Every test here forces the emulation (``SCALED_MM_IS_NATIVE_ON_CPU = False``), so it is checked
on every machine, once with its GEMM in oneDNN's BF16 math mode (where the CPU has it) and once in
plain float32; test_gemm_fp8.py checks whichever path this CPU takes. Two more tests pin when the
process-wide BF16 mode is set: only around the GEMM, and never while another thread runs.

Where no sum is rounded (one nonzero product per output element) the emulation is exact, which
is checked bitwise over every pair of finite E4M3 x E5M2 values.
"""

from __future__ import annotations

import threading

import pytest
import torch
from utils import needs_cuda

from transformer_engine.pytorch.cpp_extensions import (
    Float8GemmOperand,
    fp8_gemm_cpu,
    gemm,
    general_gemm,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LAYOUTS = ["TN", "NN", "NT"]
FORMATS = [(E4, E4), (E4, E5), (E5, E4)]  # (A, B): forward, and HYBRID backward either way
M, K, N = 24, 64, 48  # M deliberately not a multiple of 16
# Mantissa bits and smallest normal exponent of each output dtype, for its ulp.
_FLOAT_BITS = {BF16: (7, -126), FP16: (10, -14), FP32: (23, -126)}


def fp8_values(shape, fp8_dtype, seed):
    """Random FP8 values spread over the format's range (normal and a few subnormal)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-8, 6, shape, generator=g).float())
    return (torch.randn(shape, generator=g) * magnitude).to(fp8_dtype)


def scale_inv(value):
    # Not a power of two: the scale product and its multiply round, as with delayed scaling.
    return torch.tensor([value], dtype=FP32)


def operands(layout, a_dtype, b_dtype, seed=0):
    """``(A, B, X [M, K], Y [N, K])``: the operands of ``layout`` holding the values of the
    row-major ``X @ Y^T`` the layout means (module docstring of gemm.py)."""
    x = fp8_values((M, K), b_dtype, seed)
    y = fp8_values((N, K), a_dtype, seed + 1)
    sa, sb = scale_inv(0.0123), scale_inv(3.7)

    def operand(values, columnwise_values, s):
        return Float8GemmOperand(data=values, transpose=columnwise_values.contiguous(), scale_inv=s)

    if layout == "TN":  # A = y [N, K], B = x [M, K]
        a, b = operand(y, y.t(), sa), operand(x, x.t(), sb)
    elif layout == "NN":  # A = [K, N] (its transpose is y), B = x [M, K]
        a, b = operand(y.t().contiguous(), y, sa), operand(x, x.t(), sb)
    else:  # "NT": A = [K, N] (transpose y), B = [K, M] (transpose x)
        a, b = operand(y.t().contiguous(), y, sa), operand(x.t().contiguous(), x, sb)
    return a, b, x, y


def float64_oracle(x, y, sx, sy, bias):
    """(exact value, rigorous bound of the emulation's float32 error) in float64."""
    xd, yd = x.double(), y.double()
    scale = sx.double() * sy.double()
    exact = (xd @ yd.t()) * scale
    magnitude = (xd.abs() @ yd.abs().t()) * scale
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    return exact, (x.shape[1] + 3) * 2.0**-24 * magnitude


def ulp(values, dtype):
    """One unit in the last place of ``dtype`` at each ``|value|`` (float64)."""
    bits, min_exp = _FLOAT_BITS[dtype]
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0**min_exp)))
    return torch.exp2(exponent - bits)


def assert_within(actual, expected, bound, dtype):
    # A narrow output adds one rounding of at most half an ulp; a full ulp (at the magnitude
    # plus the bound, in case the float32 value sits in the next binade) covers it.
    allowed = bound + (0 if dtype == FP32 else ulp(expected.abs() + bound, dtype))
    error = (actual.double() - expected).abs()
    worst = (error - allowed).max().item()
    assert worst <= 0, f"error exceeds the float32 accumulation bound by {worst:.3g}"


def old_scaled_mm_path(x, y, sx, sy, bias, out_dtype):
    """general_gemm's torch._scaled_mm path (CUDA; the CPU before the emulation): a same-dtype
    BF16/FP16 bias fused, any other bias added in float32 before the one rounding."""
    fused = bias is not None and out_dtype in (BF16, FP16) and bias.dtype == out_dtype
    mm_dtype = out_dtype if fused or bias is None else FP32
    product = torch._scaled_mm(
        x, y.t(), scale_a=sx, scale_b=sy, bias=bias if fused else None, out_dtype=mm_dtype
    )
    if bias is not None and not fused:
        product = product + bias.float()
    return product.to(out_dtype)


BIASES = ["none", "same", "fp32"]


BF16_MATH_AVAILABLE = fp8_gemm_cpu._onednn_has_bf16_math()


@pytest.fixture(autouse=True, params=["bf16_math", "float32_math"])
def emulated(request, monkeypatch):
    """Every test runs the emulation with its GEMM in oneDNN's BF16 math mode (where this CPU
    has it) and in plain float32: both must meet the same float32-accumulation oracles."""
    if request.param == "bf16_math" and not BF16_MATH_AVAILABLE:
        pytest.skip("oneDNN has no BF16 math mode on this CPU / torch")
    monkeypatch.setattr(fp8_gemm_cpu, "SCALED_MM_IS_NATIVE_ON_CPU", False)
    monkeypatch.setattr(fp8_gemm_cpu, "USE_BF16_MATH", request.param == "bf16_math")
    monkeypatch.setattr(fp8_gemm_cpu, "BF16_MATH_SETTING", "auto")  # whatever the environment


def scaled_mm_or_skip(*args):
    try:
        return old_scaled_mm_path(*args)
    except RuntimeError as error:  # oneDNN without a kernel for this pair on this CPU
        pytest.skip(f"torch._scaled_mm refuses this case on this CPU: {str(error)[:120]}")


def make_bias(kind, out_dtype):
    if kind == "none":
        return None
    values = torch.randn(N, generator=torch.Generator().manual_seed(5)) * 30
    return values.to(out_dtype if kind == "same" else FP32)


@pytest.mark.parametrize("bias_kind", BIASES)
@pytest.mark.parametrize("out_dtype", [FP32, BF16, FP16], ids=str)
@pytest.mark.parametrize(("a_dtype", "b_dtype"), FORMATS, ids=["e4xe4", "e4xe5", "e5xe4"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_fp8_gemm_against_float64_and_scaled_mm(layout, a_dtype, b_dtype, out_dtype, bias_kind):
    a, b, x, y = operands(layout, a_dtype, b_dtype)
    bias = make_bias(bias_kind, out_dtype)
    out = general_gemm(a, b, out_dtype, layout=layout, bias=bias)[0]
    assert out.dtype == out_dtype and out.shape == (M, N)

    exact, bound = float64_oracle(x, y, b.scale_inv, a.scale_inv, bias)
    assert_within(out, exact, bound, out_dtype)
    scaled_mm = scaled_mm_or_skip(x, y, b.scale_inv, a.scale_inv, bias, out_dtype)
    assert_within(scaled_mm, exact, bound, out_dtype)  # the oracle holds for _scaled_mm too
    assert_within(out, scaled_mm.double(), 2 * bound, out_dtype)


@pytest.mark.parametrize("out_dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_fp8_gemm_accumulates_into_out(layout, out_dtype):
    # accumulate=True: the product stays float32 and is added to out before one rounding.
    a, b, x, y = operands(layout, E4, E5, seed=3)
    before = (torch.randn(M, N, generator=torch.Generator().manual_seed(4)) * 100).to(out_dtype)
    out = before.clone()
    general_gemm(a, b, layout=layout, out=out, accumulate=True, alpha=0.5)
    exact, bound = float64_oracle(x, y, b.scale_inv * 0.5, a.scale_inv, None)
    exact = exact + before.double()
    bound = bound + 2.0**-24 * exact.abs()  # the float32 add into out
    assert_within(out, exact, bound, out_dtype)
    scaled_mm = scaled_mm_or_skip(x, y, b.scale_inv * 0.5, a.scale_inv, None, FP32)
    assert_within(out, before.double() + scaled_mm.double(), 2 * bound, out_dtype)


def test_every_single_product_is_exact():
    # One nonzero product per output element: no accumulation rounding, so the float32
    # emulation must equal the float64 product rounded once, bitwise, for every pair of finite
    # E4M3 and E5M2 values (power-of-two scales, so the scale multiply is exact too).
    e4 = torch.arange(256, dtype=torch.uint8).view(E4)
    e5 = torch.arange(256, dtype=torch.uint8).view(E5)
    e4, e5 = e4[e4.float().isfinite()], e5[e5.float().isfinite()]
    x = torch.zeros(e4.numel(), 16, dtype=E4)
    y = torch.zeros(256, 16, dtype=E5)  # N padded to a multiple of 16 with zero rows
    x[:, 3], y[: e5.numel(), 3] = e4, e5
    sx, sy = scale_inv(2.0**-3), scale_inv(2.0**5)
    a = Float8GemmOperand(data=y, transpose=None, scale_inv=sy)
    b = Float8GemmOperand(data=x, transpose=None, scale_inv=sx)
    out = general_gemm(a, b, FP32)[0][:, : e5.numel()]
    expected = (e4.double()[:, None] * e5.double()[None, :] * 2.0**2).float()
    # Value equality (a zero product's sign depends on the zeros added to it, as in any GEMM).
    assert torch.equal(out, expected)


def test_zero_reduction_gives_the_bias():
    a = Float8GemmOperand(data=torch.zeros(N, 0, dtype=E4), transpose=None, scale_inv=scale_inv(2))
    b = Float8GemmOperand(data=torch.zeros(M, 0, dtype=E4), transpose=None, scale_inv=scale_inv(3))
    bias = torch.randn(N).to(BF16)
    out = general_gemm(a, b, BF16, bias=bias)[0]
    assert torch.equal(out, bias.expand(M, N))


def test_emulated_cpu_path_does_not_call_scaled_mm(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU path")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    a, b, x, y = operands("TN", E4, E4)
    general_gemm(a, b, BF16)
    gemm.fp8_gemm_prevalidated(a, b, BF16, layout="TN")


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_path_keeps_scaled_mm(layout, monkeypatch):
    # The GPU path is unchanged: torch._scaled_mm runs, the CPU emulation never does.
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU emulation ran on a CUDA tensor")

    monkeypatch.setattr(fp8_gemm_cpu, "fp8_gemm_emulated", refuse)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b, x, y = operands(layout, E4, E5)
    move = lambda o: Float8GemmOperand(*(t.cuda() if t is not None else None for t in o))  # noqa: E731
    out = general_gemm(move(a), move(b), FP32, layout=layout)[0]
    assert calls and out.device.type == "cuda"
    expected = real(x.cuda(), y.cuda().t(), scale_a=b.scale_inv.cuda(), scale_b=a.scale_inv.cuda(),
                    out_dtype=FP32, use_fast_accum=True)  # fmt: skip
    assert torch.equal(out, expected)


@pytest.mark.parametrize("amx_fp16", [True, False])
def test_scaled_mm_is_kept_only_where_onednn_compiles_fp8(amx_fp16, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert fp8_gemm_cpu._onednn_compiles_fp8() is amx_fp16
    # An ISA cap may exclude AMX-FP16; without the private query torch may drop, emulate.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert fp8_gemm_cpu._onednn_compiles_fp8() is False
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delattr(torch.cpu, "_is_amx_fp16_supported", raising=False)
    assert fp8_gemm_cpu._onednn_compiles_fp8() is False


def test_native_route_calls_scaled_mm(monkeypatch):
    # Where oneDNN compiles FP8 the CPU keeps torch._scaled_mm (faster there than float32).
    monkeypatch.setattr(fp8_gemm_cpu, "SCALED_MM_IS_NATIVE_ON_CPU", True)
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or torch.ones(M, N))
    a, b, x, y = operands("TN", E4, E4)
    general_gemm(a, b, FP32)
    assert calls == [1]


def precision_seen_by_the_gemm(monkeypatch, raise_inside=False):
    """Runs the emulated product of two small FP8 operands with ``torch.mm`` replaced by a
    wrapper that records oneDNN's float32 math mode at the moment of the call."""
    seen = []
    plain_mm = torch.mm

    def recording_mm(*args, **kwargs):
        seen.append(torch.backends.mkldnn.matmul.fp32_precision)
        if raise_inside:
            raise RuntimeError("GEMM failed")
        return plain_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    x, y = fp8_values((M, K), E4, 7), fp8_values((N, K), E5, 8)
    fp8_gemm_cpu.fp8_gemm_emulated(x, y, scale_inv(1.0), scale_inv(1.0), bias=None, out_dtype=FP32)
    return seen


def test_bf16_math_mode_is_set_only_around_the_gemm(monkeypatch):
    # One Python thread: the mode is BF16 during the GEMM (where available) and restored after,
    # also when the GEMM raises. (One thread whatever earlier tests of the process left running:
    # torch.compile starts tqdm's monitor thread, which lives on.)
    monkeypatch.setattr(fp8_gemm_cpu.threading, "active_count", lambda: 1)
    before = torch.backends.mkldnn.matmul.fp32_precision
    expected = "bf16" if fp8_gemm_cpu.USE_BF16_MATH else before
    assert precision_seen_by_the_gemm(monkeypatch) == [expected]
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with pytest.raises(RuntimeError, match="GEMM failed"):
        precision_seen_by_the_gemm(monkeypatch, raise_inside=True)
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_bf16_math_mode_is_not_set_while_another_thread_runs(monkeypatch):
    # The mode is process-wide: with a second Python thread alive (which could run a float32
    # matmul of its own meanwhile), the GEMM keeps plain float32 math.
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        before = torch.backends.mkldnn.matmul.fp32_precision
        assert precision_seen_by_the_gemm(monkeypatch) == [before]
    finally:
        release.set()
        other.join()


def test_bf16_math_setting_always_ignores_other_threads(monkeypatch):
    # NVTE_CPU_GEMM_BF16_MATH=1: the user vouches for the other threads (a progress bar's).
    if not BF16_MATH_AVAILABLE:
        pytest.skip("oneDNN has no BF16 math mode on this CPU / torch")
    monkeypatch.setattr(fp8_gemm_cpu, "USE_BF16_MATH", True)
    monkeypatch.setattr(fp8_gemm_cpu, "BF16_MATH_SETTING", "1")
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert precision_seen_by_the_gemm(monkeypatch) == ["bf16"]
    finally:
        release.set()
        other.join()


@pytest.mark.parametrize(
    ("value", "setting"), [("", "auto"), ("AUTO", "auto"), (" 1", "1"), ("0", "0")]
)
def test_bf16_math_setting_is_read_from_the_environment(value, setting, monkeypatch):
    monkeypatch.setenv("NVTE_CPU_GEMM_BF16_MATH", value)
    assert fp8_gemm_cpu._bf16_math_setting() == setting
    monkeypatch.setenv("NVTE_CPU_GEMM_BF16_MATH", "yes")
    with pytest.raises(ValueError, match="NVTE_CPU_GEMM_BF16_MATH='yes'"):
        fp8_gemm_cpu._bf16_math_setting()


def test_bf16_math_setting_never_keeps_float32_math(monkeypatch):
    # NVTE_CPU_GEMM_BF16_MATH=0: plain float32 even in a one-thread process.
    monkeypatch.setattr(fp8_gemm_cpu, "USE_BF16_MATH", True)
    monkeypatch.setattr(fp8_gemm_cpu, "BF16_MATH_SETTING", "0")
    assert precision_seen_by_the_gemm(monkeypatch) == [torch.backends.mkldnn.matmul.fp32_precision]
