"""general_gemm's validation: every refusal happens before any work, with a message that names
the problem (an FP8 N that is not a multiple of 16, K mismatch, meta tensors, devices that
differ, ``out`` shape and dtype, argument and FP8 operand errors), and a refused call leaves
``out`` untouched. An FP8 K that is not a multiple of 16 is accepted (zero-padded for
``torch._scaled_mm``) and checked against float64."""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import (
    BF16,
    E4M3,
    E5M2,
    FP32,
    LAYOUTS,
    SHAPES,
    fp8_operand,
    operands,
    randn,
    reference_gemm,
)
from tolerances import assert_close_by_table

from transformer_engine.pytorch.cpp_extensions import fp8_gemm_cpu, general_gemm

# ---------------------------------------------------------------------------------------------
# Validation: every refusal happens before any work, with a message that names the problem
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "a_shape", "b_shape", "message"),
    [
        ("TN", (24, 32), (32, 32), r"N \(the output's last dimension\) to be a multiple of 16, got N=24"),
        ("NN", (16, 24), (32, 16), "N .* multiple of 16, got N=24"),
        ("NT", (2, 8, 24), (2, 8, 16), "N .* multiple of 16, got N=24"),
    ],
)  # fmt: skip
def test_fp8_n_must_be_a_multiple_of_16(layout, a_shape, b_shape, message):
    qa, _ = fp8_operand(randn(a_shape, 0), E4M3)
    qb, _ = fp8_operand(randn(b_shape, 1), E4M3)
    with pytest.raises(ValueError, match=message):
        general_gemm(qa, qb, layout=layout)


# K = 24, not a multiple of 16: in NT (wgrad) K is the token count (3 * 8 here).
K_NOT_16 = [("TN", (16, 24), (32, 24)), ("NN", (24, 16), (32, 24)), ("NT", (3, 8, 16), (3, 8, 16))]


@pytest.mark.parametrize(("layout", "a_shape", "b_shape"), K_NOT_16)
def test_fp8_k_need_not_be_a_multiple_of_16(layout, a_shape, b_shape):
    qa, da = fp8_operand(randn(a_shape, 0), E4M3)
    qb, db = fp8_operand(randn(b_shape, 1), E5M2)
    out = general_gemm(qa, qb, FP32, layout=layout)[0]
    assert_close_by_table(out, reference_gemm(layout, da, db), ("fp8_dequantized", FP32))


@pytest.mark.parametrize(("layout", "a_shape", "b_shape"), K_NOT_16)
def test_fp8_k_is_zero_padded_for_scaled_mm(layout, a_shape, b_shape, monkeypatch):
    # The torch._scaled_mm path (CUDA; here the CPU's oneDNN kernel, forced) gets both
    # operands zero-padded along K to 32, and the product is unchanged.
    monkeypatch.setattr(fp8_gemm_cpu, "SCALED_MM_IS_NATIVE_ON_CPU", True)
    seen = []
    real = torch._scaled_mm

    def spy(x, y, **kwargs):
        seen.append((x.clone(), y.t().clone()))
        return real(x, y, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    qa, da = fp8_operand(randn(a_shape, 0), E4M3)
    qb, db = fp8_operand(randn(b_shape, 1), E4M3)
    try:
        out = general_gemm(qa, qb, FP32, layout=layout, use_split_accumulator=True)[0]
    except RuntimeError as error:  # oneDNN without an FP8 kernel on this CPU
        pytest.skip(f"torch._scaled_mm refuses FP8 on this CPU: {str(error)[:120]}")
    ((x, y),) = seen
    assert x.shape[1] == y.shape[1] == 32
    assert not x[:, 24:].view(torch.uint8).any() and not y[:, 24:].view(torch.uint8).any()
    assert_close_by_table(out, reference_gemm(layout, da, db), ("fp8_dequantized", FP32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_mismatch(layout):
    a_shape, b_shape, _ = SHAPES[layout]
    b_shape = (*b_shape[:-1], b_shape[-1] + 16) if layout != "NT" else (3, 16, 40)
    a, b = randn(a_shape, 0), randn(b_shape, 1)
    with pytest.raises(ValueError, match="K mismatch"):
        general_gemm(a, b, layout=layout)
    with pytest.raises(ValueError, match="K mismatch"):
        general_gemm(fp8_operand(a, E4M3)[0], fp8_operand(b, E4M3)[0], layout=layout)


@pytest.mark.parametrize("where", ["A", "B", "A.data", "B.transpose", "scale_inv", "bias", "out"])
def test_meta_tensors_are_refused(where):
    a, b = operands("NT")
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    bias = torch.zeros(48)
    out = torch.zeros(40, 48, dtype=BF16)
    if where == "A":
        a_arg, b_arg = a.to("meta"), b
    elif where == "B":
        a_arg, b_arg = a, b.to("meta")
    else:
        a_arg, b_arg = qa, qb
        if where == "A.data":
            a_arg = qa._replace(data=qa.data.to("meta"))
        elif where == "B.transpose":
            b_arg = qb._replace(transpose=qb.transpose.to("meta"))
        elif where == "scale_inv":
            a_arg = qa._replace(scale_inv=qa.scale_inv.to("meta"))
        elif where == "bias":
            bias = bias.to("meta")
        else:
            out = out.to("meta")
    with pytest.raises(ValueError, match="meta tensor and holds no data"):
        general_gemm(a_arg, b_arg, layout="NT", bias=bias, out=out)


def test_device_mismatch_names_both_devices(monkeypatch):
    # A second real device is tested in the GPU section; here a fake device type stands in so
    # that the check itself runs on every machine.
    class FakeDevice:
        type = "cuda"
        index = 1

        def __eq__(self, other):
            return isinstance(other, FakeDevice)

        def __str__(self):
            return "cuda:1"

    a, b = operands("TN")
    a_view = a.as_subclass(_TensorOn)
    a_view.fake_device = FakeDevice()
    with pytest.raises(ValueError, match=r"A is on cuda:1 but B is on cpu; move A to cpu"):
        general_gemm(a_view, b)


class _TensorOn(torch.Tensor):
    """A CPU tensor that reports another device (for the device check only)."""

    @property
    def device(self):
        return self.fake_device


def test_out_shape_and_dtype():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    with pytest.raises(ValueError, match=r"out has shape \(10, 48\); expected \(2, 5, 48\)"):
        general_gemm(qa, qb, out=torch.zeros(10, 48, dtype=BF16))
    with pytest.raises(
        TypeError, match="out has dtype torch.float32; expected one of torch.bfloat16"
    ):
        general_gemm(qa, qb, BF16, out=torch.zeros(2, 5, 48))
    with pytest.raises(ValueError, match="out must be contiguous"):
        general_gemm(qa, qb, FP32, out=torch.zeros(2, 48, 5).transpose(1, 2))


def test_refused_calls_leave_out_untouched():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    out = torch.full((2, 5, 48), 7.0)
    with pytest.raises(ValueError, match=r"bias has shape \(47,\); expected \(48,\)"):
        general_gemm(qa, qb, out=out, bias=torch.zeros(47), accumulate=True)
    assert torch.equal(out, torch.full((2, 5, 48), 7.0))


def test_argument_errors():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    with pytest.raises(ValueError, match="layout='TT' is not supported"):
        general_gemm(qa, qb, layout="TT")
    with pytest.raises(TypeError, match="out_dtype=torch.float8_e4m3fn is not supported"):
        general_gemm(qa, qb, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="accumulate=True adds into out, so out must be given"):
        general_gemm(qa, qb, accumulate=True)
    with pytest.raises(NotImplementedError, match="wgrad layout NT only, not TN"):
        general_gemm(qa, qb, grad=True, bias=torch.zeros(48))
    with pytest.raises(NotImplementedError, match="gelu=True"):
        general_gemm(qa, qb, gelu=True)
    with pytest.raises(NotImplementedError, match="ub_type='AG'"):
        general_gemm(qa, qb, ub_type="AG")
    with pytest.raises(ValueError, match="beta=0.5 scales the old out, but accumulate=False"):
        general_gemm(qa, qb, beta=0.5)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        general_gemm(qa, qb, alpha=torch.tensor(2.0))
    with pytest.raises(TypeError, match="A is torch.bfloat16 but B is torch.float32"):
        general_gemm(a.to(BF16), b)
    with pytest.raises(TypeError, match="B has dtype torch.int32"):
        general_gemm(a, b.to(torch.int32))
    with pytest.raises(TypeError, match="A must be a torch.Tensor, got list"):
        general_gemm([[1.0]], b)
    with pytest.raises(ValueError, match="layout 'TN' needs a 2-D A"):
        general_gemm(a.reshape(2, 24, 64), b)
    with pytest.raises(TypeError, match="bias has dtype torch.int64"):
        general_gemm(qa, qb, bias=torch.zeros(48, dtype=torch.int64))


def test_fp8_operand_errors():
    a, b = operands("TN")
    qb, _ = fp8_operand(b, E4M3)
    both_e5m2 = (fp8_operand(a, E5M2)[0], fp8_operand(b, E5M2)[0])
    with pytest.raises(ValueError, match="A and B are both E5M2"):
        general_gemm(*both_e5m2)
    qa, _ = fp8_operand(a, E4M3)
    with pytest.raises(TypeError, match="A.scale_inv must be float32"):
        general_gemm(qa._replace(scale_inv=qa.scale_inv.double()), qb)
    with pytest.raises(ValueError, match=r"A.transpose has shape \(63, 48\).*stale"):
        general_gemm(qa._replace(transpose=qa.transpose[:-1]), qb)
    with pytest.raises(TypeError, match="A.data has dtype torch.float32"):
        general_gemm(qa._replace(data=qa.data.float()), qb)
    # uint8 bytes say nothing about their format: the interface hands over typed values.
    with pytest.raises(TypeError, match="A.transpose has dtype torch.uint8"):
        general_gemm(qa._replace(transpose=qa.transpose.view(torch.uint8)), qb)
    with pytest.raises(TypeError, match="A.transpose is torch.float8_e5m2 but A.data is"):
        general_gemm(qa._replace(transpose=qa.transpose.view(torch.float8_e5m2)), qb)
