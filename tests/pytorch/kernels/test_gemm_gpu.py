"""general_gemm on CUDA: the same numerics as the CPU tests (FP8, high precision and mixed), with
the rows of tests/pytorch/tolerances.py, including a wgrad GEMM whose K (the token count) is not
a multiple of 16; outputs land on the operands' device, and a GEMM on a second GPU while the
first is current leaves the current device unchanged. Skips without a GPU
(two GPUs for the second-device test) through marks; runs on the GPU machine through
qa/L0_pytorch_gpu/test.sh."""

from __future__ import annotations

import warnings

import pytest
import torch
from gemm_helpers import (
    BF16,
    E4M3,
    E5M2,
    FORMAT_IDS,
    FORMATS,
    FP16,
    FP32,
    LAYOUTS,
    OUT_DTYPES,
    SHAPES,
    fp8_operand,
    operands,
    randn,
    reference_gemm,
)
from tolerances import assert_close_by_table
from utils import current_device_unchanged, needs_cuda, needs_two_gpus

from transformer_engine.pytorch.cpp_extensions import Float8GemmOperand, general_gemm

# ---------------------------------------------------------------------------------------------
# GPU: same numerics on CUDA, outputs on the operands' device, current device unchanged
# ---------------------------------------------------------------------------------------------


def gpu_devices():
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def fp8_row(split: bool) -> str:
    """Tolerance row of a GPU FP8 GEMM against its dequantized operands."""
    return "fp8_dequantized" if split else "fp8_dequantized_fast_accum"


@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["fast_accum", "split_accum"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("a_fmt", "b_fmt", "row"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_fp8_gemm_matches_cpu_and_references(layout, a_fmt, b_fmt, row, out_dtype, split):
    a, b = operands(layout)
    qa_cpu, da = fp8_operand(a, a_fmt)
    qb_cpu, db = fp8_operand(b, b_fmt)
    device = torch.device("cuda", 0)
    qa, _ = fp8_operand(a, a_fmt, device=device)
    qb, _ = fp8_operand(b, b_fmt, device=device)
    with current_device_unchanged():
        out = general_gemm(qa, qb, out_dtype, layout=layout, use_split_accumulator=split)[0]
    assert out.device == device and out.dtype == out_dtype
    cpu = general_gemm(qa_cpu, qb_cpu, out_dtype, layout=layout)[0]
    assert_close_by_table(out.cpu(), cpu, (fp8_row(split), out_dtype))
    assert_close_by_table(out.cpu(), reference_gemm(layout, da, db), (fp8_row(split), out_dtype))
    assert_close_by_table(out.cpu(), reference_gemm(layout, a, b), (row, out_dtype))


@needs_cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_gpu_fp8_bias_accumulate_alpha(out_dtype):
    device = torch.device("cuda", 0)
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3, device=device)
    qb, db = fp8_operand(b, E4M3, device=device)
    expected = reference_gemm("TN", da, db).cpu()
    for bias_dtype in OUT_DTYPES:
        bias = randn((48,), 5, dtype=bias_dtype, device=device)
        out = general_gemm(qa, qb, out_dtype, bias=bias, alpha=0.5)[0]
        assert_close_by_table(
            out.cpu(),
            0.5 * expected + bias.float().cpu(),
            ("fp8_dequantized_fast_accum", out_dtype),
        )
    acc = randn((2, 5, 48), 6, dtype=out_dtype, device=device)
    before = acc.float().cpu()
    general_gemm(qa, qb, out=acc, accumulate=True, use_split_accumulator=True)
    assert_close_by_table(acc.cpu(), before + expected, ("fp8_dequantized", out_dtype))


@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["fast_accum", "split_accum"])
@pytest.mark.parametrize("k", [8, 24, 40, 1000])
def test_gpu_fp8_wgrad_gemm_takes_any_token_count(k, split):
    # NT (wgrad): K is the token count. Not a multiple of 16, it is zero-padded for
    # torch._scaled_mm; the result has the numerics of every other FP8 GEMM: against the CPU
    # emulation of the same FP8 bytes and the float64 GEMM of the dequantized operands.
    a = randn((k, 48), 0)  # the input [K, N]
    b = randn((k, 40), 1, k**-0.5)  # the output gradient [K, M]
    qa_cpu, da = fp8_operand(a, E4M3)
    qb_cpu, db = fp8_operand(b, E5M2)
    device = torch.device("cuda", 0)
    qa, _ = fp8_operand(a, E4M3, device=device)
    qb, _ = fp8_operand(b, E5M2, device=device)
    with current_device_unchanged():
        out = general_gemm(qa, qb, FP32, layout="NT", use_split_accumulator=split)[0]
    assert out.device == device and out.shape == (40, 48)
    cpu = general_gemm(qa_cpu, qb_cpu, FP32, layout="NT")[0]
    assert_close_by_table(out.cpu(), cpu, (fp8_row(split), FP32))
    assert_close_by_table(out.cpu(), reference_gemm("NT", da, db), (fp8_row(split), FP32))

    # Small integers with unit scales: every product and partial sum is exact in float32, so
    # with full float32 accumulation the CUDA result, the CPU emulation and the float64 GEMM
    # agree bit for bit (a nonzero padding byte, or a missed row of K, would show).
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-3, 4, (k, 40), generator=g).float()
    y = torch.randint(-3, 4, (k, 48), generator=g).float()

    def integer_operand(values, dev):
        fp8 = values.to(torch.float8_e4m3fn)
        return Float8GemmOperand(
            data=fp8.to(dev),
            transpose=fp8.t().contiguous().to(dev),
            scale_inv=torch.ones(1, device=dev),
        )

    exact = (x.double().t() @ y.double()).float()
    for dev in (device, torch.device("cpu")):
        got = general_gemm(
            integer_operand(y, dev), integer_operand(x, dev), FP32, layout="NT",
            use_split_accumulator=True,
        )[0]  # fmt: skip
        assert torch.equal(got.cpu(), exact), dev


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_high_precision_gemm(layout, dtype):
    a, b = operands(layout, device="cuda:0")
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    with current_device_unchanged():
        out = general_gemm(a_hp, b_hp, layout=layout)[0]
    assert out.device == a.device
    expected = reference_gemm(layout, a_hp.cpu(), b_hp.cpu())
    assert_close_by_table(out.cpu(), expected, ("same_values", dtype))


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_output_lands_on_each_operand_device(layout):
    # Every visible GPU, with cuda:0 current throughout: the GEMM runs where its operands are.
    a, b = operands(layout)
    qa_cpu, da = fp8_operand(a, E4M3)
    qb_cpu, db = fp8_operand(b, E5M2)
    expected = reference_gemm(layout, da, db)
    with torch.cuda.device(0):
        for device in gpu_devices():
            qa, _ = fp8_operand(a, E4M3, device=device)
            qb, _ = fp8_operand(b, E5M2, device=device)
            main_grad = torch.zeros(SHAPES[layout][2], device=device)
            with current_device_unchanged():
                out = general_gemm(qa, qb, FP32, layout=layout)[0]
                general_gemm(qa, qb, layout=layout, out=main_grad, accumulate=True)
                hp = general_gemm(a.to(device), b.to(device), layout=layout)[0]
            assert torch.cuda.current_device() == 0
            assert out.device == device and main_grad.device == device and hp.device == device
            torch.cuda.synchronize(device)
            assert_close_by_table(out.cpu(), expected, ("fp8_dequantized_fast_accum", FP32))
            assert_close_by_table(main_grad.cpu(), expected, ("fp8_dequantized_fast_accum", FP32))


@needs_cuda
@needs_two_gpus
def test_gpu_second_device_while_first_is_current():
    a, b = operands("NN")
    qa_cpu, da = fp8_operand(a, E4M3)
    qb_cpu, db = fp8_operand(b, E5M2)
    dev1 = torch.device("cuda", 1)
    qa, _ = fp8_operand(a, E4M3, device=dev1)
    qb, _ = fp8_operand(b, E5M2, device=dev1)
    bias = torch.zeros(48, dtype=BF16, device=dev1)
    torch.cuda.set_device(0)
    with current_device_unchanged():
        out = general_gemm(qa, qb, layout="NN", bias=bias)[0]
    assert torch.cuda.current_device() == 0
    assert out.device == dev1
    torch.cuda.synchronize(dev1)
    assert_close_by_table(
        out.cpu(), reference_gemm("NN", da, db), ("fp8_dequantized_fast_accum", BF16)
    )
    # An operand on the other GPU is refused, naming both devices, before any launch.
    qa0, _ = fp8_operand(a, E4M3, device="cuda:0")
    with pytest.raises(ValueError, match="A.data is on cuda:0 but B.data is on cuda:1"):
        general_gemm(qa0, qb, layout="NN")
    with pytest.raises(ValueError, match="out is on cuda:0 but B.data is on cuda:1"):
        general_gemm(qa, qb, layout="NN", out=torch.empty(2, 5, 48, dtype=BF16, device="cuda:0"))


@needs_cuda
def test_gpu_device_mismatch_with_cpu():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3, device="cuda:0")
    qb, _ = fp8_operand(b, E4M3)
    with pytest.raises(ValueError, match="A.data is on cuda:0 but B.data is on cpu"):
        general_gemm(qa, qb)
    with pytest.raises(ValueError, match="A is on cpu but B is on cuda:0"):
        general_gemm(a, b.cuda())


@needs_cuda
def test_gpu_mixed_gemm():
    a, b = operands("TN", device="cuda:0")
    qa, da = fp8_operand(a, E4M3)
    with warnings.catch_warnings():
        # Without the native build, dequantize on CUDA warns once and runs the reference.
        warnings.simplefilter("ignore", RuntimeWarning)
        out = general_gemm(qa, b.to(BF16))[0]
    assert out.device == b.device
    expected = reference_gemm("TN", da.to(BF16).cpu(), b.to(BF16).cpu())
    assert_close_by_table(out.cpu(), expected, ("same_values", BF16))
