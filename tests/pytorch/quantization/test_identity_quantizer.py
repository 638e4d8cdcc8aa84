"""``IdentityQuantizer`` and ``custom_recipes.quantizer_factories.high_precision_factory``: the
"do not quantize this slot" answer of a ``CustomRecipe`` factory.

Oracles: the input tensor itself, plain ``torch.nn.functional`` layers on cloned parameters, and
the independent FP8 cast oracle (``utils.fake_quant``) for the mixed case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from utils import current_scale, fake_quant, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import CustomRecipe
from transformer_engine.pytorch.cpp_extensions.gemm import fp8_gemm_prevalidated
from transformer_engine.pytorch.custom_recipes.quantizer_factories import (
    current_scaling_factory,
    high_precision_factory,
)
from transformer_engine.pytorch.quantization import QuantizerRole, RecipeState
from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer


# ------------------------------------------------------------------ the quantizer
def test_result_is_the_input_itself():
    x = torch.randn(4, 8)
    q = IdentityQuantizer()
    assert torch.equal(q.quantize(x), x)
    assert q.quantize_impl(x) is x  # no copy when no cast is needed
    q.internal = True
    assert q.quantize(x) is x


def test_dtype_casts_and_is_checked():
    x = torch.randn(4, 8)
    assert torch.equal(IdentityQuantizer(dtype=torch.bfloat16).quantize_impl(x), x.bfloat16())
    # no quantizer dtype: the call's nominal dtype, else the input's
    assert IdentityQuantizer().quantize_impl(x, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        IdentityQuantizer(dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="torch.int32"):
        IdentityQuantizer().quantize_impl(torch.ones(2, dtype=torch.int32))


def test_quantized_input_gives_its_high_precision_values():
    x = torch.randn(16, 16)
    x_fp8 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(x)
    got = IdentityQuantizer().quantize_impl(x_fp8)
    assert type(got) is torch.Tensor
    expected = fake_quant(x, current_scale(x, torch.float8_e4m3fn), torch.float8_e4m3fn)
    assert torch.equal(got.double(), expected)


def test_gradient_passes_straight_through():
    x = torch.randn(4, 8, requires_grad=True)
    IdentityQuantizer().quantize(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 8))


def test_update_quantized_honours_the_noop_flag():
    q = IdentityQuantizer()
    dst, src = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    assert q.update_quantized(src, dst, noop_flag=torch.ones(1)) is dst
    assert torch.equal(dst, torch.zeros(3))
    q.update_quantized(src, dst, noop_flag=torch.zeros(1))
    assert torch.equal(dst, src)
    dst.zero_()
    q.update_quantized(src, dst)
    assert torch.equal(dst, src)


def test_make_empty_needs_a_device():
    q = IdentityQuantizer(dtype=torch.bfloat16)
    t = q.make_empty((2, 3), device="cpu")
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and type(t) is torch.Tensor
    with pytest.raises(ValueError, match="device=None"):
        q.make_empty((2, 3))


# ------------------------------------------------------------------ the factory
def test_factory_answers_identity_for_every_role():
    for role in (None, QuantizerRole(), QuantizerRole("linear", "grad_output", "fc1")):
        assert isinstance(high_precision_factory(role), IdentityQuantizer)
    state = RecipeState.create(
        CustomRecipe(qfactory=high_precision_factory),
        mode="forward",
        num_quantizers=3,
        device="cpu",
        roles=[QuantizerRole("linear", "input"), QuantizerRole("linear", "weight"), None],
    )
    quantizers = state.make_quantizers()
    assert all(isinstance(q, IdentityQuantizer) for q in quantizers)
    assert state.delayed_scaling_state() is None  # nothing to register or checkpoint


# ------------------------------------------------------------------ inside modules
def _train_linear(device, dtype, factory):
    torch.manual_seed(0)
    m = te.Linear(32, 48, device=device, params_dtype=dtype)
    x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(16, 48, device=device, dtype=dtype)
    w, b = (p.detach().clone().requires_grad_() for p in (m.weight, m.bias))
    with te.autocast(enabled=True, recipe=CustomRecipe(qfactory=factory)):
        y = m(x)
    y.backward(dy)
    return m, x, dy, w, b, y


def _check_equals_plain_linear(device, dtype):
    m, x, dy, w, b, y = _train_linear(device, dtype, high_precision_factory)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w, b)
    y_ref.backward(dy)
    assert y.dtype == dtype
    for got, expected in ((y, y_ref), (x.grad, x_ref.grad), (m.weight.grad, w.grad)):
        assert torch.equal(got, expected)
    assert torch.equal(m.bias.grad, b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_high_precision_factory_is_plain_linear(dtype):
    _check_equals_plain_linear("cpu", dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_high_precision_factory_is_plain_linear_gpu(dtype):
    _check_equals_plain_linear(torch.device("cuda", torch.cuda.current_device()), dtype)


def _input_in_high_precision(role):
    if role is not None and role.tensor_type == "input":
        return IdentityQuantizer()
    return current_scaling_factory(role)


def test_mixed_slots_quantize_only_the_weight():
    """Input left in high precision, weight current-scaled: y = x @ fake_quant(W)^T + b."""
    m, x, dy, w, b, y = _train_linear("cpu", torch.float32, _input_in_high_precision)
    e4m3 = torch.float8_e4m3fn
    w_seen = fake_quant(w.detach(), current_scale(w.detach(), e4m3), e4m3)
    expected = x.detach().double() @ w_seen.t() + b.detach().double()
    torch.testing.assert_close(y.detach().double(), expected, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------ the other modules
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])


def _factory_run(module, x, dy, factory):
    x = x.detach().clone().requires_grad_()
    with te.autocast(enabled=True, recipe=CustomRecipe(qfactory=factory)):
        y = module(x)
    y.backward(dy)
    return y, x.grad


def _plain_run(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y, x.grad


def _check_grads(module, params, got, expected, tol):
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **tol)
    for p, ref in zip(module.parameters(), params):
        torch.testing.assert_close(p.grad, ref.grad, **tol)


F32_TOL = {"rtol": 1e-5, "atol": 1e-5}


@DEVICES
def test_layernorm_linear_with_high_precision_factory_is_plain_math(device):
    torch.manual_seed(1)
    m = te.LayerNormLinear(32, 48, device=device)
    x, dy = torch.randn(16, 32, device=device), torch.randn(16, 48, device=device)
    gamma, beta, w, b = (p.detach().clone().requires_grad_() for p in m.parameters())
    got = _factory_run(m, x, dy, high_precision_factory)
    expected = _plain_run(
        lambda t: F.linear(F.layer_norm(t, (32,), gamma, beta, 1e-5), w, b), x, dy
    )
    _check_grads(m, (gamma, beta, w, b), got, expected, F32_TOL)


def _plain_mlp(gamma, beta, w1, b1, w2, b2):
    def mlp(t):
        h = F.linear(F.layer_norm(t, (32,), gamma, beta, 1e-5), w1, b1)
        return F.linear(F.gelu(h, approximate="tanh"), w2, b2)

    return mlp


@pytest.mark.parametrize("factory", [high_precision_factory, _input_in_high_precision])
@DEVICES
def test_layernorm_mlp_with_identity_quantizers(factory, device):
    """All slots identity: the plain MLP. Inputs identity, weights and grads FP8: every GEMM
    input (so FC2's, the activation's output) stays in high precision, so the fused
    activation-to-FP8 path is not taken; the weights are seen through the FP8 cast."""
    torch.manual_seed(2)
    m = te.LayerNormMLP(32, 64, device=device)
    x, dy = torch.randn(16, 32, device=device), torch.randn(16, 32, device=device)
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    got = _factory_run(m, x, dy, factory)
    if factory is high_precision_factory:
        expected = _plain_run(_plain_mlp(*params), x, dy)
        _check_grads(m, params, got, expected, F32_TOL)
        return
    e4m3 = torch.float8_e4m3fn
    gamma, beta, w1, b1, w2, b2 = (p.detach() for p in params)
    # fake_quant computes on the CPU: the oracle's weights go back to the module's device.
    w1_seen, w2_seen = (
        fake_quant(w, current_scale(w, e4m3), e4m3).float().to(w.device) for w in (w1, w2)
    )
    y_ref = _plain_mlp(gamma, beta, w1_seen, b1, w2_seen, b2)(x)
    torch.testing.assert_close(got[0].detach(), y_ref, **F32_TOL)
    assert torch.isfinite(got[1]).all() and all(p.grad is not None for p in m.parameters())


@DEVICES
def test_ops_linear_with_high_precision_factory_is_plain_linear(device):
    torch.manual_seed(3)
    op = te.ops.Linear(32, 48, device=device)
    x, dy = torch.randn(16, 32, device=device), torch.randn(16, 48, device=device)
    w, b = (p.detach().clone().requires_grad_() for p in (op.weight, op.bias))
    got = _factory_run(op, x, dy, high_precision_factory)
    expected = _plain_run(lambda t: F.linear(t, w, b), x, dy)
    _check_grads(op, (w, b), got, expected, F32_TOL)


@DEVICES
def test_cached_weight_across_microbatches(device):
    """is_first_microbatch caches the weight as the quantizer left it (the plain tensor); the
    later microbatch reads the cache and still gives plain F.linear."""
    torch.manual_seed(4)
    m = te.Linear(32, 48, device=device)
    x = torch.randn(16, 32, device=device)
    with te.autocast(enabled=True, recipe=CustomRecipe(qfactory=high_precision_factory)):
        y1 = m(x, is_first_microbatch=True)
        y2 = m(x, is_first_microbatch=False)
    expected = F.linear(x, m.weight.detach(), m.bias.detach())
    assert torch.equal(y1.detach(), expected) and torch.equal(y2.detach(), expected)


# ------------------------------------------------------------------ the GEMM entry
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_prevalidated_gemm_takes_plain_and_mixed_operands(layout):
    """The linear core's unvalidated FP8 GEMM sends a plain operand to the general GEMM."""
    torch.manual_seed(5)
    a, b = torch.randn(32, 32, dtype=torch.float64), torch.randn(32, 32, dtype=torch.float64)
    e4m3 = torch.float8_e4m3fn
    a_seen = fake_quant(a, current_scale(a, e4m3), e4m3)
    product = {"TN": lambda x, y: y @ x.t(), "NN": lambda x, y: y @ x, "NT": lambda x, y: y.t() @ x}
    got = fp8_gemm_prevalidated(a.float(), b.float(), torch.float32, layout=layout)
    torch.testing.assert_close(got.double(), product[layout](a, b), rtol=1e-5, atol=1e-5)
    a_fp8 = Float8CurrentScalingQuantizer(e4m3).quantize(a.float())
    got = fp8_gemm_prevalidated(a_fp8, b.float(), torch.float32, layout=layout)
    torch.testing.assert_close(got.double(), product[layout](a_seen, b), rtol=1e-5, atol=1e-5)
