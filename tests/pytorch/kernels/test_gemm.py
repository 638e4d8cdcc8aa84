"""general_gemm: FP8 (torch._scaled_mm), high-precision and mixed paths, and its validation.

FP8 results are compared twice, with the rows of tests/pytorch/tolerances.py: against a float64
GEMM of the dequantized operands (tight: only accumulation and output rounding differ; row
"fp8_dequantized", which on CPU is met with float32 accuracy since torch._scaled_mm there
accumulates exactly in float32) and against a float64 GEMM of the original high-precision
operands (quantization error; rows "e4m3" and "hybrid").
The CPU part runs everywhere; the GPU part at the end checks the same numerics on CUDA and where
outputs land, and skips without a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tolerances import GEMM_TOLERANCES, assert_close_by_table
from utils import current_device_unchanged, needs_cuda, needs_two_gpus

from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType, TE_DType_To_Torch, fp8_max
from transformer_engine.pytorch.cpp_extensions import Float8GemmOperand, general_gemm
from transformer_engine.pytorch.cpp_extensions import float8_gemm_operand as operand_module

E4M3, E5M2 = DType.kFloat8E4M3, DType.kFloat8E5M2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OUT_DTYPES = [BF16, FP16, FP32]
LAYOUTS = ["TN", "NN", "NT"]
# (A format, B format, tolerance row): E4M3 forward; HYBRID backward has an E5M2 gradient (B in
# dgrad and wgrad) against an E4M3 weight or input; the operand order is also tried reversed.
FORMATS = [(E4M3, E4M3, "e4m3"), (E4M3, E5M2, "hybrid"), (E5M2, E4M3, "hybrid")]
FORMAT_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]

# Logical operand shapes per layout: (A, B, out). M is deliberately not a multiple of 16.
SHAPES = {
    "TN": ((48, 64), (2, 5, 64), (2, 5, 48)),  # A = weight [N, K], B = input [..., K]
    "NN": ((64, 48), (2, 5, 64), (2, 5, 48)),  # A = weight [K, N], B = grad [..., K]
    "NT": ((2, 16, 48), (2, 16, 40), (40, 48)),  # A = input [.., N], B = grad [.., M], K = 32
}


def randn(shape, seed, scale=1.0, dtype=FP32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def fp8_operand(t, fp8_dtype, *, rowwise=True, columnwise=True, device=None):
    """A plain-tensor FP8 operand (current scaling: amax maps to the FP8 max) and the
    dequantized float32 values it holds. Quantized on CPU, then moved to ``device``."""
    device = device or t.device
    torch_fp8 = TE_DType_To_Torch[fp8_dtype]
    amax = t.abs().max().float().cpu() if t.numel() else torch.tensor(1.0)
    scale = fp8_max(torch_fp8) / amax.clamp_min(1e-12).reshape(1)
    q = ext.quantize(t.detach().cpu(), scale, fp8_dtype, with_transpose=True)
    operand = Float8GemmOperand(
        data=q.data.to(device) if rowwise else None,
        transpose=q.transpose.to(device) if columnwise else None,
        scale_inv=q.scale_inv.to(device),
    )
    return operand, (q.data.float() * q.scale_inv).to(device)


def reference_gemm(layout, a, b):
    """The layout's row-major meaning, in float64, returned as float32."""
    a, b = a.double(), b.double()
    if layout == "TN":
        out = b.reshape(-1, a.shape[1]) @ a.t()
        return out.reshape(*b.shape[:-1], a.shape[0]).float()
    if layout == "NN":
        out = b.reshape(-1, a.shape[0]) @ a
        return out.reshape(*b.shape[:-1], a.shape[1]).float()
    return (b.reshape(-1, b.shape[-1]).t() @ a.reshape(-1, a.shape[-1])).float()


def operands(layout, seed=0, device="cpu"):
    """High-precision A and B for ``layout``, the weight-like operand scaled to ~N(0, 1/K)."""
    a_shape, b_shape, _ = SHAPES[layout]
    k = a_shape[1] if layout == "TN" else a_shape[0] if layout == "NN" else 32
    a = randn(a_shape, seed, k**-0.5 if layout != "NT" else 1.0, device=device)
    b = randn(b_shape, seed + 1, 1.0 if layout != "NT" else k**-0.5, device=device)
    return a, b


def usage_for(layout):
    """(A rowwise, A columnwise, B rowwise, B columnwise): the buffers each layout reads."""
    return {
        "TN": (True, False, True, False),
        "NN": (False, True, True, False),
        "NT": (False, True, False, True),
    }[layout]


# ---------------------------------------------------------------------------------------------
# FP8 x FP8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("a_fmt", "b_fmt", "row"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_gemm_matches_dequantized_and_original(layout, a_fmt, b_fmt, row, out_dtype):
    a, b = operands(layout)
    qa, da = fp8_operand(a, a_fmt)
    qb, db = fp8_operand(b, b_fmt)
    out, bias_grad, gelu_input, extra = general_gemm(qa, qb, out_dtype, layout=layout)
    assert (bias_grad, gelu_input, extra) == (None, None, None)
    assert out.dtype == out_dtype
    assert out.shape == SHAPES[layout][2]
    assert_close_by_table(out, reference_gemm(layout, da, db), ("fp8_dequantized", out_dtype))
    assert_close_by_table(out, reference_gemm(layout, a, b), (row, out_dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_gemm_reads_only_the_buffers_its_layout_needs(layout):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    full = general_gemm(qa, qb, FP32, layout=layout)[0]
    a_row, a_col, b_row, b_col = usage_for(layout)
    # Only the needed buffers present: same result.
    qa_min, _ = fp8_operand(a, E4M3, rowwise=a_row, columnwise=a_col)
    qb_min, _ = fp8_operand(b, E5M2, rowwise=b_row, columnwise=b_col)
    assert torch.equal(general_gemm(qa_min, qb_min, FP32, layout=layout)[0], full)
    # The unused buffers poisoned: still the same result (they are never read).
    poisoned = []
    for op, row, col in ((qa, a_row, a_col), (qb, b_row, b_col)):
        p = op
        if not row:
            p = p._replace(
                data=torch.full_like(op.data.view(torch.uint8), 0x7E).view(op.data.dtype)
            )
        if not col:
            p = p._replace(
                transpose=torch.full_like(op.transpose.view(torch.uint8), 0x7E).view(op.data.dtype)
            )
        poisoned.append(p)
    assert torch.equal(general_gemm(*poisoned, FP32, layout=layout)[0], full)


@pytest.mark.parametrize(
    ("layout", "operand", "usage"),
    [
        ("TN", "A", "rowwise"),
        ("TN", "B", "rowwise"),
        ("NN", "A", "columnwise"),
        ("NN", "B", "rowwise"),
        ("NT", "A", "columnwise"),
        ("NT", "B", "columnwise"),
    ],
)
def test_fp8_gemm_missing_buffer_names_the_usage(layout, operand, usage):
    a, b = operands(layout)
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    field = "data" if usage == "rowwise" else "transpose"
    if operand == "A":
        qa = qa._replace(**{field: None})
    else:
        qb = qb._replace(**{field: None})
    if usage == "rowwise":
        message = f"{operand} has no rowwise FP8 data .*quantize it with rowwise usage"
    else:
        message = (
            f"{operand} has no columnwise \\(transposed\\) FP8 data.*quantize it with "
            "columnwise usage"
        )
    with pytest.raises(ValueError, match=message):
        general_gemm(qa, qb, layout=layout)


def test_fp8_gemm_without_any_buffer_is_refused():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3, rowwise=False, columnwise=False)
    qb, _ = fp8_operand(b, E4M3)
    with pytest.raises(ValueError, match="A holds no data"):
        general_gemm(qa, qb)


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_non_tn_devices_serve_columnwise_usage_from_rowwise_data(layout, monkeypatch):
    # Data-center Blackwell keeps no transposed copy; data is transposed on the fly (exact).
    a, b = operands(layout)
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E5M2)
    expected = general_gemm(qa, qb, FP32, layout=layout)[0]
    qa_row, _ = fp8_operand(a, E4M3, columnwise=False)
    qb_row, _ = fp8_operand(b, E5M2, columnwise=False)
    monkeypatch.setattr(operand_module, "is_non_tn_fp8_gemm_supported", lambda device: True)
    assert torch.equal(general_gemm(qa_row, qb_row, FP32, layout=layout)[0], expected)


def test_fp8_transpose_only_operand_has_its_logical_shape():
    # A B quantized for wgrad only (no row-wise data) still gives the right output shape.
    a, b = operands("NT")
    qa, da = fp8_operand(a, E4M3, rowwise=False)
    qb, db = fp8_operand(b, E5M2, rowwise=False)
    out = general_gemm(qa, qb, FP32, layout="NT")[0]
    assert out.shape == (40, 48)
    assert_close_by_table(out, reference_gemm("NT", da, db), ("fp8_dequantized", FP32))


@pytest.mark.parametrize("split", [False, True], ids=["fast_accum", "split_accum"])
def test_fp8_accumulation_modes_agree_on_cpu(split):
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    out = general_gemm(qa, qb, FP32, use_split_accumulator=split)[0]
    assert_close_by_table(out, reference_gemm("TN", da, db), ("fp8_dequantized", FP32))


def test_fp8_default_out_dtype_is_bf16():
    a, b = operands("TN")
    out = general_gemm(fp8_operand(a, E4M3)[0], fp8_operand(b, E4M3)[0])[0]
    assert out.dtype == BF16


@pytest.mark.parametrize("bias_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_fp8_bias_is_added_in_the_output(out_dtype, bias_dtype):
    # Any bias dtype works: a BF16/FP16 bias matching the output goes to torch._scaled_mm,
    # anything else is added in float32 before the single output rounding.
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    bias = randn((48,), 7, dtype=bias_dtype)
    out = general_gemm(qa, qb, out_dtype, bias=bias)[0]
    expected = reference_gemm("TN", da, db) + bias.float()
    assert out.dtype == out_dtype
    assert_close_by_table(out, expected, ("fp8_dequantized", out_dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_accumulate_into_fp32_main_grad(layout):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    main_grad = randn(SHAPES[layout][2], 3)
    before = main_grad.clone()
    out = general_gemm(qa, qb, FP32, layout=layout, out=main_grad, accumulate=True)[0]
    assert out is main_grad
    expected = before + reference_gemm(layout, da, db)
    assert_close_by_table(main_grad, expected, ("fp8_dequantized", FP32))
    # Accumulating twice adds twice.
    general_gemm(qa, qb, layout=layout, out=main_grad, accumulate=True)
    assert_close_by_table(
        main_grad, expected + reference_gemm(layout, da, db), ("fp8_dequantized", FP32)
    )


def test_fp8_accumulate_into_bf16_rounds_once():
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    out = randn(SHAPES["TN"][2], 4, dtype=BF16)
    before = out.clone()
    bias = randn((48,), 5)
    general_gemm(qa, qb, out=out, accumulate=True, bias=bias, alpha=0.5)
    expected = (before.double() + 0.5 * reference_gemm("TN", da, db).double() + bias.double()).to(
        BF16
    )
    # One rounding of the float32 sum: equal to the correctly rounded value, or one ulp off.
    assert_close_by_table(out, expected, ("fp8_dequantized", BF16))


def test_fp8_out_receives_the_result():
    a, b = operands("NN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    buffer = torch.full(SHAPES["NN"][2], float("nan"), dtype=FP16)
    out = general_gemm(qa, qb, layout="NN", out=buffer)[0]
    assert out is buffer and out.dtype == FP16  # out_dtype defaults to out.dtype
    assert_close_by_table(buffer, reference_gemm("NN", da, db), ("fp8_dequantized", FP16))


@pytest.mark.parametrize("alpha", [0.5, -3.0, 0.0])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_alpha_scales_the_product_not_the_bias(layout, alpha):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    n = SHAPES[layout][2][-1]
    bias = randn((n,), 9)
    out = general_gemm(qa, qb, FP32, layout=layout, alpha=alpha, bias=bias)[0]
    expected = alpha * reference_gemm(layout, da, db) + bias
    assert_close_by_table(out, expected, ("fp8_dequantized", FP32))


@pytest.mark.parametrize("m", [1, 3, 17, 0])
def test_fp8_m_needs_no_multiple_of_16(m):
    qa, da = fp8_operand(randn((16, 32), 0), E4M3)
    qb, db = fp8_operand(randn((m, 32), 1) if m else torch.ones(0, 32), E4M3)
    out = general_gemm(qa, qb, FP32)[0]
    assert out.shape == (m, 16)
    if m:
        assert_close_by_table(out, reference_gemm("TN", da, db), ("fp8_dequantized", FP32))


# ---------------------------------------------------------------------------------------------
# High precision and mixed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_high_precision_gemm(layout, dtype):
    a, b = operands(layout)
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    out = general_gemm(a_hp, b_hp, layout=layout)[0]
    assert out.dtype == dtype and out.shape == SHAPES[layout][2]
    assert_close_by_table(out, reference_gemm(layout, a_hp, b_hp), ("same_values", dtype))
    if dtype != FP32:
        row = "bf16" if dtype == BF16 else "fp16"
        assert_close_by_table(out, reference_gemm(layout, a, b), (row, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_high_precision_with_bias_alpha_and_fp32_out(layout):
    a, b = operands(layout)
    a_hp, b_hp = a.to(BF16), b.to(BF16)
    bias = randn((SHAPES[layout][2][-1],), 2, dtype=BF16)
    out = general_gemm(a_hp, b_hp, FP32, layout=layout, bias=bias, alpha=2.0)[0]
    assert out.dtype == FP32
    expected = 2.0 * reference_gemm(layout, a_hp, b_hp) + bias.float()
    # Float32 output: BF16 operands are upcast, so only float32 accumulation order differs.
    assert_close_by_table(out, expected, ("same_values", FP32))


def test_high_precision_accumulate_into_fp32():
    a, b = operands("NT")
    a_hp, b_hp = a.to(BF16), b.to(BF16)
    main_grad = randn((40, 48), 3)
    before = main_grad.clone()
    general_gemm(a_hp, b_hp, layout="NT", out=main_grad, accumulate=True)
    assert_close_by_table(
        main_grad, before + reference_gemm("NT", a_hp, b_hp), ("same_values", FP32)
    )


@pytest.mark.parametrize("fp8_side", ["A", "B"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_mixed_gemm_dequantizes_the_fp8_operand(layout, fp8_side, dtype):
    a, b = operands(layout)
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    if fp8_side == "A":
        # Only the columnwise copy for A in TN: mixed GEMMs read whichever buffer exists.
        qa, da = fp8_operand(a, E4M3, rowwise=layout != "TN")
        out = general_gemm(qa, b_hp, layout=layout)[0]
        expected = general_gemm(da.to(dtype), b_hp, layout=layout)[0]
    else:
        qb, db = fp8_operand(b, E5M2)
        out = general_gemm(a_hp, qb, layout=layout)[0]
        expected = general_gemm(a_hp, db.to(dtype), layout=layout)[0]
    assert out.dtype == dtype  # default: the high-precision operand's dtype
    assert torch.equal(out, expected)


def test_mixed_gemm_takes_shapes_fp8_gemms_cannot():
    # No multiple-of-16 rule once the FP8 operand is dequantized.
    qa, da = fp8_operand(randn((24, 20), 0), E4M3)
    b = randn((3, 20), 1, dtype=BF16)
    out = general_gemm(qa, b)[0]
    assert_close_by_table(out, reference_gemm("TN", da.to(BF16), b), ("same_values", BF16))


# ---------------------------------------------------------------------------------------------
# Validation: every refusal happens before any work, with a message that names the problem
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "a_shape", "b_shape", "message"),
    [
        ("TN", (16, 24), (32, 24), r"K \(the reduction dimension\) to be a multiple of 16, got K=24"),
        ("TN", (24, 32), (32, 32), r"N \(the output's last dimension\) to be a multiple of 16, got N=24"),
        ("NN", (24, 16), (32, 24), "K .* multiple of 16, got K=24"),
        ("NN", (16, 24), (32, 16), "N .* multiple of 16, got N=24"),
        ("NT", (3, 8, 16), (3, 8, 16), "K .* multiple of 16, got K=24"),  # K = 3 * 8 tokens
        ("NT", (2, 8, 24), (2, 8, 16), "N .* multiple of 16, got N=24"),
    ],
)  # fmt: skip
def test_fp8_dims_must_be_multiples_of_16(layout, a_shape, b_shape, message):
    qa, _ = fp8_operand(randn(a_shape, 0), E4M3)
    qb, _ = fp8_operand(randn(b_shape, 1), E4M3)
    with pytest.raises(ValueError, match=message):
        general_gemm(qa, qb, layout=layout)


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
    with pytest.raises(NotImplementedError, match="bias-gradient epilogue"):
        general_gemm(qa, qb, grad=True, bias=torch.zeros(48))
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


def test_tolerance_table_is_complete_for_gemm_tests():
    for out_dtype in OUT_DTYPES:
        for fmt in (
            "same_values",
            "fp8_dequantized",
            "fp8_dequantized_fast_accum",
            "e4m3",
            "hybrid",
        ):
            assert (fmt, out_dtype) in GEMM_TOLERANCES
    with pytest.raises(KeyError, match="no tolerance row"):
        assert_close_by_table(torch.zeros(1), torch.zeros(1), ("e2m1", FP32))


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
