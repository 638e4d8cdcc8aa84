"""CPU tests of Float8Tensor as a parameter and under autograd: an optimizer step on an FP8
parameter, torch.save/torch.load, deepcopy and the ``data`` setter, module moves and
materialization, and the straight-through gradients of quantize and dequantize."""

from __future__ import annotations

import copy
import io
import warnings

import fp8_oracle as oracle
import pytest
import torch
from float8_tensor_helpers import E4M3, E5M2, expected_bytes, fp8_param, sample
from utils import float32_bits

from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Tensor
from transformer_engine.pytorch.tensor.float8_tensor import _make_float8_tensor_in_reduce_ex


def test_optimizer_step_on_an_fp8_parameter():
    y, state = fp8_param()
    p = torch.nn.Parameter(y)
    assert isinstance(p, Float8Tensor) and isinstance(p, torch.nn.Parameter)
    opt = torch.optim.SGD([p], lr=0.5)
    p.grad = sample(seed=7)
    state.amax_history.zero_()
    expected = p.dequantize().detach() - 0.5 * p.grad
    data_ptr = p._data.data_ptr()
    opt.step()
    assert isinstance(p, Float8Tensor) and p._data.data_ptr() == data_ptr
    assert torch.equal(p._data, expected_bytes(expected, 2.0))
    assert torch.equal(p._transpose, oracle.transpose_last_dim_first(p._data))
    assert state.amax_history[0, 1] == oracle.amax(expected)[0]


def test_save_and_load_round_trip_bitwise():
    y, _ = fp8_param((4, 16))
    cols = Float8CurrentScalingQuantizer(E5M2, rowwise=False)
    with torch.no_grad():
        c = cols(sample((4, 16), torch.bfloat16))
    for weights_only in (False, True):
        buf = io.BytesIO()
        torch.save({"y": y, "c": c, "p": torch.nn.Parameter(y)}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=weights_only)
        for key, src in (("y", y), ("c", c), ("p", y)):
            out = loaded[key]
            assert isinstance(out, Float8Tensor) and out.dtype == src.dtype
            assert out._fp8_dtype == src._fp8_dtype and out.shape == src.shape
            for a, b in ((out._data, src._data), (out._transpose, src._transpose)):
                assert (a is None and b is None) or torch.equal(a, b)
            assert torch.equal(float32_bits(out._scale_inv), float32_bits(src._scale_inv))
            assert out._quantizer is None
    assert _make_float8_tensor_in_reduce_ex in torch.serialization.get_safe_globals()


def test_deepcopy_and_data_setter():
    y, _ = fp8_param()
    p = torch.nn.Parameter(y)
    d = copy.deepcopy(p)
    assert isinstance(d, Float8Tensor) and isinstance(d, torch.nn.Parameter) and d.requires_grad
    assert torch.equal(d._data, p._data) and d._data.data_ptr() != p._data.data_ptr()
    other, _ = fp8_param(seed=3)
    p.data = other
    assert p._data is other._data and p._scale_inv is other._scale_inv
    x = sample(seed=6)
    p.data = x
    assert torch.equal(p._data, expected_bytes(x, 2.0))
    with pytest.raises(ValueError, match="shape"):
        p.data = torch.zeros(3)


def test_module_moves_and_materialization():
    y, _ = fp8_param()
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(y)
    m.to("meta")
    assert isinstance(m.w, Float8Tensor) and m.w.is_meta and m.w._data.is_meta
    m.to_empty(device="cpu")
    assert isinstance(m.w, Float8Tensor) and m.w.device.type == "cpu"
    assert isinstance(m.w, torch.nn.Parameter)
    with torch.no_grad():
        m.w.copy_(sample())
    m.half()
    assert isinstance(m.w, Float8Tensor) and m.w.dtype == torch.float16


# ---------------------------------------------------------------------- autograd


def test_quantize_is_straight_through():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = sample().requires_grad_()
    y = q(x)
    assert y.requires_grad and y.grad_fn is not None
    g = sample(seed=11)
    y.dequantize().backward(g)
    assert torch.equal(x.grad, g)


def test_quantize_with_another_nominal_dtype():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = sample().requires_grad_()
    y = q(x, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.dequantize().dtype == torch.bfloat16
    y.dequantize().float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(TypeError, match="dtype"):
        q(x, dtype=torch.int8)


def test_dequantize_and_fallback_ops_are_differentiable():
    y, _ = fp8_param()
    p = torch.nn.Parameter(y)
    p.dequantize(dtype=torch.bfloat16).float().sum().backward()
    assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32
    assert torch.equal(p.grad, torch.ones(4, 8))
    p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (p * 3).sum().backward()
    assert torch.equal(p.grad, torch.full((4, 8), 3.0))
    p.grad = None
    p.view(32).dequantize().sum().backward()
    assert torch.equal(p.grad, torch.ones(4, 8))
