"""``HybridQuantizer``: a tensor's row-wise copy in one format, its column-wise copy in another,
and ``custom_recipes.quantizer_factory_zoo.mxfp8_fwd_nvfp4_bwd_factory``.

Oracles: the independent cast oracles (``mxfp8_oracle``, ``nvfp4_oracle``, ``utils.fake_quant``
for per-tensor FP8), float64 products of their values, the formats' own quantizers for the
bytes of each copy, and the built-in ``MXFP8BlockScaling`` recipe for the zoo factory's forward.
"""

from __future__ import annotations

import copy
import io
import warnings

import mxfp8_oracle
import nvfp4_oracle
import pytest
import torch
from tolerances import assert_close_by_table
from utils import current_scale, fake_quant, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import CustomRecipe, MXFP8BlockScaling
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo import (
    mxfp8_fwd_nvfp4_bwd_factory,
)
from transformer_engine.pytorch.quantization import DelayedScalingRequest, QuantizerRole
from transformer_engine.pytorch.quantized_tensor import prepare_for_saving, restore_from_saved
from transformer_engine.pytorch.tensor.hybrid_tensor import HybridQuantizedTensorStorage

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def mx_nv() -> te.HybridQuantizer:
    """MXFP8 row-wise, NVFP4 (no transform, no stochastic rounding) column-wise."""
    return te.HybridQuantizer(
        rowwise_quantizer=te.MXFP8Quantizer(E4M3), columnwise_quantizer=te.NVFP4Quantizer()
    )


def mx_nv_factory(role):
    """Forward operands hybrid, output gradients NVFP4, boundary slots MXFP8."""
    if role is not None and role.tensor_type in ("input", "weight"):
        return mx_nv()
    if role is not None and role.tensor_type == "grad_output":
        return te.NVFP4Quantizer()
    return te.MXFP8Quantizer(E4M3)


def per_tensor_factory(role):
    """Per-tensor FP8 both ways: E4M3 row-wise, E5M2 column-wise; E4M3 output gradients."""
    if role is not None and role.tensor_type in ("input", "weight"):
        return te.HybridQuantizer(
            rowwise_quantizer=te.Float8CurrentScalingQuantizer(E4M3),
            columnwise_quantizer=te.Float8CurrentScalingQuantizer(E5M2),
        )
    return te.Float8CurrentScalingQuantizer(E4M3)


def assert_nvfp4_values(got, expected):
    # The package divides by the global scale in float32, the oracle in float64.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def per_tensor(t, dtype):
    return fake_quant(t.float(), current_scale(t.float(), dtype), dtype)


# ------------------------------------------------------------------ the quantizer and storage
def test_each_copy_is_its_own_format():
    x = torch.randn(64, 32)
    q = mx_nv()
    t = q(x)
    assert isinstance(t, te.HybridQuantizedTensor) and t.shape == x.shape
    assert t.get_usages() == {"rowwise": True, "columnwise": True}
    row, col = t.rowwise_sub_storage, t.columnwise_sub_storage
    assert isinstance(row, te.MXFP8TensorStorage) and row.get_usages()["columnwise"] is False
    assert isinstance(col, te.NVFP4TensorStorage) and col.get_usages()["rowwise"] is False
    assert torch.equal(row.dequantize(dtype=torch.float64), mxfp8_oracle.oracle_dequantize(x, E4M3))
    # the hybrid's values are its row-wise copy's
    assert torch.equal(t.dequantize(dtype=torch.float64), row.dequantize(dtype=torch.float64))
    expected_col = nvfp4_oracle.oracle_dequantize(x, columnwise=True)
    assert_nvfp4_values(col.dequantize(dtype=torch.float64), expected_col)
    # the given quantizers are copied, not changed
    given = te.MXFP8Quantizer(E4M3)
    te.HybridQuantizer(rowwise_quantizer=given, columnwise_quantizer=te.NVFP4Quantizer())
    assert given.columnwise_usage is True and given.internal is False


def test_rowwise_dequantized_source():
    x = torch.randn(32, 64)
    q = te.HybridQuantizer(
        rowwise_quantizer=te.MXFP8Quantizer(E4M3), columnwise_quantizer=te.NVFP4Quantizer(),
        columnwise_source="rowwise_dequantized",
    )  # fmt: skip
    q.set_usage(rowwise=False, columnwise=True)  # the row-wise copy is still made as the source
    t = q(x)
    assert t.get_usages() == {"rowwise": False, "columnwise": True}
    rounded = mxfp8_oracle.oracle_dequantize(x, E4M3).float()
    expected = nvfp4_oracle.oracle_dequantize(rounded, columnwise=True)
    assert_nvfp4_values(t.columnwise_sub_storage.dequantize(dtype=torch.float64), expected)
    with pytest.raises(ValueError, match="columnwise_source='transposed'"):
        te.HybridQuantizer(
            rowwise_quantizer=te.MXFP8Quantizer(E4M3), columnwise_quantizer=te.NVFP4Quantizer(),
            columnwise_source="transposed",
        )  # fmt: skip


def test_refuses_requests_and_nesting():
    with pytest.raises(TypeError, match="DelayedScalingRequest cannot be nested"):
        te.HybridQuantizer(
            rowwise_quantizer=DelayedScalingRequest(), columnwise_quantizer=te.NVFP4Quantizer()
        )
    with pytest.raises(TypeError, match="columnwise_quantizer is a HybridQuantizer"):
        te.HybridQuantizer(rowwise_quantizer=te.NVFP4Quantizer(), columnwise_quantizer=mx_nv())


def test_usages_saving_and_missing_copies():
    x = torch.randn(32, 32)
    q = mx_nv()
    q.internal = True
    s = q(x)
    assert type(s) is HybridQuantizedTensorStorage
    values = s.dequantize(dtype=torch.float64)
    col_values = s.columnwise_sub_storage.dequantize(dtype=torch.float64)
    tensors, objects = prepare_for_saving(s)
    assert all(t is None or isinstance(t, torch.Tensor) for t in tensors)
    assert s.get_usages() == {"rowwise": False, "columnwise": False}  # handed out
    (back,) = restore_from_saved(objects, tensors)
    assert torch.equal(back.dequantize(dtype=torch.float64), values)
    assert torch.equal(back.columnwise_sub_storage.dequantize(dtype=torch.float64), col_values)
    back.update_usage(rowwise_usage=False)
    assert back.get_usages() == {"rowwise": False, "columnwise": True}
    # the values now come from the column-wise (NVFP4) copy
    assert torch.equal(back.dequantize(dtype=torch.float64), col_values)
    with pytest.raises(RuntimeError, match="quantize it again with rowwise usage"):
        back.update_usage(rowwise_usage=True)
    with pytest.raises(ValueError, match="both be False"):
        back.update_usage(columnwise_usage=False)
    with pytest.raises(ValueError, match="holds no rowwise copy"):
        general_gemm(back, back, torch.float32, layout="TN")


def test_in_place_update_and_tensor_behaviour():
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    q = mx_nv()
    t = q.make_empty(x.shape, dtype=torch.float32, device="cpu")
    t.quantize_(x)
    fresh = q(x)
    for name in ("rowwise_sub_storage", "columnwise_sub_storage"):
        assert torch.equal(
            getattr(t, name).dequantize(dtype=torch.float64),
            getattr(fresh, name).dequantize(dtype=torch.float64),
        )
    t.copy_(y)  # a copy into a quantized tensor quantizes both copies again
    assert torch.equal(t.dequantize(dtype=torch.float64), mxfp8_oracle.oracle_dequantize(y, E4M3))
    d = t.detach()
    assert isinstance(d, te.HybridQuantizedTensor)
    assert d.rowwise_sub_storage is t.rowwise_sub_storage
    moved = t.to("cpu", copy=True)
    assert isinstance(moved, te.HybridQuantizedTensor)
    assert moved.rowwise_sub_storage is not t.rowwise_sub_storage
    assert torch.equal(moved.dequantize(), t.dequantize())
    # any other operation runs on the (row-wise) values
    with warnings.catch_warnings():  # the high-precision fallback warns once per op
        warnings.simplefilter("ignore")
        assert torch.equal(t + 1, t.dequantize() + 1)


# ------------------------------------------------------------------ GEMMs read their copy
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_gemm_reads_the_copy_of_its_layout(layout):
    torch.manual_seed(0)
    a, b = torch.randn(32, 64), torch.randn(32, 64)
    if layout == "NN":  # A [K, N], B [M, K]
        a, b = torch.randn(32, 64), torch.randn(48, 32)
    qa, qb = mx_nv()(a), mx_nv()(b)
    out = general_gemm(qa, qb, torch.float32, layout=layout)[0]
    mx = mxfp8_oracle.oracle_dequantize
    nv = nvfp4_oracle.oracle_dequantize
    if layout == "TN":  # y = B A^T, both row-wise (MXFP8)
        ref = mx(b, E4M3) @ mx(a, E4M3).T
    elif layout == "NN":  # dx = B A: B row-wise (MXFP8), A column-wise (NVFP4)
        ref = mx(b, E4M3) @ nv(a, columnwise=True)
    else:  # dW = B^T A, both column-wise (NVFP4)
        ref = nv(b, columnwise=True).T @ nv(a, columnwise=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _linear_oracle(x, w, dy, fwd, bwd_x, bwd_w, bwd_dy):
    """float64 forward, input and weight gradients of ``x @ w^T`` from each copy's values."""
    y = fwd(x) @ fwd(w).T
    dx = bwd_dy(dy, False) @ bwd_w(w)
    dw = bwd_dy(dy, True).T @ bwd_x(x)
    return y, dx, dw


def _run_linear(factory, device, x, dy):
    torch.manual_seed(3)
    layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32, device=device)
    x = x.to(device).requires_grad_()
    with te.autocast(recipe=CustomRecipe(qfactory=factory)):
        y = layer(x)
    y.backward(dy.to(device))
    return layer.weight.detach().cpu(), y.detach().cpu(), x.grad.cpu(), layer.weight.grad.cpu()


def test_linear_computes_forward_and_backward_in_their_formats():
    torch.manual_seed(0)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    w, y, dx, dw = _run_linear(mx_nv_factory, "cpu", x, dy)
    mx = lambda t: mxfp8_oracle.oracle_dequantize(t, E4M3)  # noqa: E731
    nv_col = lambda t: nvfp4_oracle.oracle_dequantize(t, columnwise=True)  # noqa: E731
    ref = _linear_oracle(
        x, w, dy, mx, nv_col, nv_col,
        lambda g, col: nvfp4_oracle.oracle_dequantize(g, columnwise=col),
    )  # fmt: skip
    for got, expected in zip((y, dx, dw), ref):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _check_per_tensor_linear(device):
    torch.manual_seed(0)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    w, y, dx, dw = _run_linear(per_tensor_factory, device, x, dy)
    ref = _linear_oracle(
        x, w, dy, lambda t: per_tensor(t, E4M3), lambda t: per_tensor(t, E5M2),
        lambda t: per_tensor(t, E5M2), lambda g, col: per_tensor(g, E4M3),
    )  # fmt: skip
    for got, expected in zip((y, dx, dw), ref):
        if device == "cpu":  # the CPU's FP8 GEMM adds in float32
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        else:  # cuBLAS adds in the tensor cores' reduced-precision accumulator
            key = ("fp8_dequantized_fast_accum", torch.float32)
            assert_close_by_table(got.double(), expected, key)


def test_per_tensor_copies_take_the_fp8_gemm():
    _check_per_tensor_linear("cpu")


@needs_cuda
def test_per_tensor_copies_take_the_fp8_gemm_gpu():
    _check_per_tensor_linear("cuda")


# ------------------------------------------------------------------ the zoo factory
def test_zoo_factory_slots():
    def role(tensor_type):
        return QuantizerRole(module_type="linear", tensor_type=tensor_type)

    for tensor_type in ("input", "weight"):
        q = mxfp8_fwd_nvfp4_bwd_factory(role(tensor_type))
        assert isinstance(q, te.HybridQuantizer)
        assert isinstance(q.rowwise_quantizer, te.MXFP8Quantizer)
        assert isinstance(q.columnwise_quantizer, te.NVFP4Quantizer)
    assert mxfp8_fwd_nvfp4_bwd_factory(role("weight")).columnwise_quantizer.with_2d_quantization
    assert mxfp8_fwd_nvfp4_bwd_factory(role("input")).columnwise_quantizer.with_rht
    grad = mxfp8_fwd_nvfp4_bwd_factory(role("grad_output"))
    assert isinstance(grad, te.NVFP4Quantizer) and grad.stochastic_rounding
    assert isinstance(mxfp8_fwd_nvfp4_bwd_factory(None), te.MXFP8Quantizer)


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_zoo_factory_forward_is_mxfp8_and_it_trains(module):
    torch.manual_seed(0)
    make = {
        "Linear": lambda: te.Linear(128, 64, params_dtype=torch.bfloat16, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(
            128, 64, params_dtype=torch.bfloat16, device="cpu"
        ),
        "LayerNormMLP": lambda: te.LayerNormMLP(
            128, 256, params_dtype=torch.bfloat16, device="cpu"
        ),
    }[module]
    layer = make()
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=MXFP8BlockScaling()):
        y_mxfp8 = layer(x)
    with te.autocast(recipe=CustomRecipe(qfactory=mxfp8_fwd_nvfp4_bwd_factory)):
        y = layer(x)
    assert torch.equal(y, y_mxfp8)
    y.float().square().sum().backward()
    # the NVFP4 backward against the high-precision one: close in direction, not in bits
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    x_hp = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    layer(x_hp).float().square().sum().backward()
    hp = [x_hp.grad] + [p.grad for p in layer.parameters()]
    for g, ref in zip(grads, hp):
        assert torch.isfinite(g).all()
        cos = torch.nn.functional.cosine_similarity(g.flatten().float(), ref.flatten().float(), 0)
        assert cos > 0.9


def test_ops_linear_microbatches_and_hybrid_parameters():
    torch.manual_seed(0)
    recipe = CustomRecipe(qfactory=mx_nv_factory)
    x = torch.randn(32, 64)
    # te.ops: same numbers as te.Linear on the same weight
    op = te.ops.Linear(64, 32, bias=False, device="cpu", dtype=torch.float32)
    layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(op.weight)
    with te.autocast(recipe=recipe):
        assert torch.equal(op(x), layer(x))
    # a weight cast cached at the first microbatch is reused by the later ones
    with te.autocast(recipe=recipe):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.add_(1.0)  # not seen: the cached copies are used
        assert torch.equal(layer(x, is_first_microbatch=False), first)
    # hybrid parameters: an optimizer step re-quantizes both copies from the updated values
    with te.quantized_model_init(enabled=True, recipe=recipe):
        q_layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32, device="cpu")
    assert isinstance(q_layer.weight, te.HybridQuantizedTensor)
    before = q_layer.weight.dequantize().detach().clone()
    with te.autocast(recipe=recipe):
        q_layer(x).sum().backward()
    grad = q_layer.weight.grad.clone()
    torch.optim.SGD(q_layer.parameters(), lr=0.5).step()
    updated = (before - 0.5 * grad).float()
    w = q_layer.weight
    assert torch.equal(
        w.rowwise_sub_storage.dequantize(dtype=torch.float64),
        mxfp8_oracle.oracle_dequantize(updated, E4M3),
    )
    assert_nvfp4_values(
        w.columnwise_sub_storage.dequantize(dtype=torch.float64),
        nvfp4_oracle.oracle_dequantize(updated, columnwise=True),
    )


def test_hybrid_parameters_copy_and_pickle():
    recipe = CustomRecipe(qfactory=mx_nv_factory)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32, device="cpu")
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)["weight"]
    for copied in (copy.deepcopy(layer).weight, loaded):
        assert isinstance(copied, te.HybridQuantizedTensor)
        for name in ("rowwise_sub_storage", "columnwise_sub_storage"):
            mine, theirs = getattr(copied, name), getattr(layer.weight, name)
            assert mine is not theirs
            assert torch.equal(mine.dequantize(), theirs.dequantize())


def test_nvfp4_linear_fp8_dpa_factory():
    from transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo import (
        nvfp4_linear_fp8_dpa_factory as factory,
    )

    def role(module_type, tensor_type):
        return QuantizerRole(module_type=module_type, tensor_type=tensor_type)

    assert isinstance(factory(role("linear", "input")), te.NVFP4Quantizer)
    assert isinstance(factory(None), te.NVFP4Quantizer)
    for tensor_type, dtype in (("qkv", E4M3), ("s", E4M3), ("do", E5M2), ("dqkv", E5M2)):
        q = factory(role("dpa", tensor_type))
        assert isinstance(q, te.Float8CurrentScalingQuantizer)
        assert q.dtype == te.DType.cast(dtype)
    # a transformer layer trains with it: NVFP4 linears, FP8 attention
    recipe = CustomRecipe(qfactory=factory, fp8_dpa=True)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.float32, device="cpu")  # fmt: skip
    x = torch.randn(16, 2, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated attention and NVFP4 GEMMs are announced
        with te.autocast(recipe=recipe):
            out = layer(x)
        out.sum().backward()
    assert torch.isfinite(x.grad).all()
    attention = layer.self_attention.core_attention
    assert isinstance(attention.quantizers["scaling_fwd"][2], te.Float8CurrentScalingQuantizer)
    qkv = layer.self_attention.layernorm_qkv
    assert isinstance(qkv.quantizers["scaling_fwd"][0], te.NVFP4Quantizer)
