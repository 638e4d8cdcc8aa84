"""te.ops basic operations on CPU: each forward and backward against plain PyTorch, in high
precision (tight) and, for the operations with quantizers, in FP8 with DelayedScaling and
Float8CurrentScaling (within tests/pytorch/tolerances.py).

Fusions, Sequential and the FP8 state machinery are in ``test_fusible_ops_fuser.py``; deferred
initialization in ``test_ops_deferred_init.py``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import REFERENCE_ACTIVATIONS, autocast_by_name, current_scale, fake_quant

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.tensor import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN, OUT = 64, 48


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-6, atol=1e-6)
    else:
        assert_close_by_table(actual, expected, ("same_values", dtype))


# ------------------------------------------------------------------------------------------
# BasicLinear


# (2, 5): 10 tokens, not a multiple of 16 (the FP8 weight-gradient GEMM reduces over them)
@pytest.mark.parametrize("shape", [(32,), (2, 16), (2, 5)], ids=["2d", "3d", "10_tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_basic_linear_matches_plain_pytorch(recipe, dtype, shape):
    torch.manual_seed(1)
    op = ops.BasicLinear(IN, OUT, device="cpu", dtype=dtype)
    x = torch.randn(*shape, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, OUT, dtype=dtype)
    w_ref, x_ref = leaf(op.weight), leaf(x)
    F.linear(x_ref, w_ref).backward(dy)
    with autocast_by_name(recipe):
        y = op(x)
        state = op.recipe_state("forward")
        fwd_scale = state.scale.clone() if recipe == "delayed" else None
    y.backward(dy)
    assert y.shape == (*shape, OUT) and y.dtype == dtype and x.grad.dtype == dtype
    assert op.weight.grad.shape == (OUT, IN) and op.weight.grad.dtype == dtype
    if recipe is None:
        assert state is None
        close(y, F.linear(x_ref, w_ref), dtype)
        close(x.grad, x_ref.grad, dtype)
        close(op.weight.grad, w_ref.grad, dtype)
        return
    assert state.device == torch.device("cpu")
    assert_close_by_table(y, F.linear(x_ref, w_ref), ("e4m3", dtype))
    assert_close_by_table(x.grad, x_ref.grad, ("hybrid", dtype))
    assert_close_by_table(op.weight.grad, w_ref.grad, ("hybrid", dtype))
    # against the dequantized operands the GEMMs saw: tight
    if recipe == "delayed":
        assert torch.equal(fwd_scale, torch.ones(2))  # first step: scales are still 1
        sx = sw = sdy = torch.ones(1)
    else:
        sx, sw, sdy = (
            current_scale(x, E4M3),
            current_scale(op.weight, E4M3),
            current_scale(dy, E5M2),
        )
    xq = fake_quant(x, sx, E4M3).reshape(-1, IN)
    wq = fake_quant(op.weight, sw, E4M3)
    dyq = fake_quant(dy, sdy, E5M2).reshape(-1, OUT)
    assert_close_by_table(y, (xq @ wq.t()).reshape(*shape, OUT), ("fp8_dequantized", dtype))
    assert_close_by_table(x.grad, (dyq @ wq).reshape(*shape, IN), ("fp8_dequantized", dtype))
    assert_close_by_table(op.weight.grad, dyq.t() @ xq, ("fp8_dequantized", dtype))


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_basic_linear_frozen_weight_and_input_without_grad(recipe):
    torch.manual_seed(2)
    op = ops.BasicLinear(IN, OUT, device="cpu")
    op.weight.requires_grad_(False)
    x = torch.randn(32, IN, requires_grad=True)
    with autocast_by_name(recipe):
        y = op(x)
    y.sum().backward()
    assert op.weight.grad is None and x.grad.shape == x.shape
    # weight trainable, input not: only the weight gradient
    op.weight.requires_grad_(True)
    x2 = torch.randn(32, IN)
    with autocast_by_name(recipe):
        y2 = op(x2)
    y2.sum().backward()
    assert op.weight.grad is not None


def test_basic_linear_casts_the_input_to_the_weight_dtype():
    torch.manual_seed(3)
    op = ops.BasicLinear(IN, OUT, device="cpu", dtype=torch.float32)
    x = torch.randn(8, IN, dtype=torch.bfloat16, requires_grad=True)
    y = op(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    close(y, F.linear(x.float(), op.weight), torch.float32)


def test_basic_linear_under_torch_autocast():
    torch.manual_seed(4)
    op = ops.BasicLinear(IN, OUT, device="cpu")
    x = torch.randn(16, IN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = op(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert op.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    expected = F.linear(x.bfloat16(), op.weight.bfloat16())
    assert_close_by_table(y, expected, ("same_values", torch.bfloat16))


def test_basic_linear_accumulates_into_main_grad():
    torch.manual_seed(5)
    op = ops.BasicLinear(IN, OUT, device="cpu", accumulate_into_main_grad=True)
    op.weight.main_grad = torch.ones(OUT, IN)
    x = torch.randn(16, IN)
    dy = torch.randn(16, OUT)
    op(x).backward(dy)
    assert op.weight.grad is None
    torch.testing.assert_close(op.weight.main_grad, 1 + dy.t() @ x, rtol=1e-5, atol=1e-5)


def test_basic_linear_init_is_kaiming_uniform_like_torch_linear():
    torch.manual_seed(6)
    op = ops.BasicLinear(IN, OUT, device="cpu")
    torch.manual_seed(6)
    ref = torch.nn.Linear(IN, OUT, bias=False)
    assert torch.equal(op.weight, ref.weight)
    assert op.weight.abs().max() <= 1 / math.sqrt(IN)


def test_basic_linear_argument_errors():
    # tensor parallelism needs a process group (tests/pytorch/distributed runs it over gloo)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ops.BasicLinear(IN, OUT, device="cpu", tensor_parallel_mode="column")
    with pytest.raises(ValueError, match="tensor_parallel_mode='diagonal'"):
        ops.BasicLinear(IN, OUT, device="cpu", tensor_parallel_mode="diagonal")
    with pytest.raises(ValueError, match="comm_name"):
        ops.BasicLinear(IN, OUT, device="cpu", userbuffers_options={"method": "ring_exchange"})
    # without tensor and sequence parallelism the overlap has nothing to pipeline
    ub_op = ops.BasicLinear(IN, OUT, device="cpu", userbuffers_options={"comm_name": "qkv"})
    assert ub_op._parallelism.overlap is None
    # without a mode, sequence parallelism has nothing to split: the op is the plain one
    plain_op = ops.BasicLinear(IN, OUT, device="cpu", sequence_parallel=True)
    assert plain_op.sequence_parallel is False and plain_op.weight.shape == (OUT, IN)
    with pytest.raises(ValueError, match="in_features"):
        ops.BasicLinear(0, OUT, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        ops.BasicLinear(IN, OUT, device="cpu", dtype=torch.int32)
    op = ops.BasicLinear(IN, OUT, device="cpu")
    with pytest.raises(ValueError, match="in_features=64"):
        op(torch.randn(4, IN + 1))
    with pytest.raises(ValueError, match="multiple of 16"), autocast_by_name("current"):
        ops.BasicLinear(IN, 40, device="cpu")(torch.randn(16, IN))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_basic_linear_fp8_inference_needs_no_token_alignment(recipe):
    torch.manual_seed(7)
    op = ops.BasicLinear(IN, OUT, device="cpu")
    x = torch.randn(10, IN)
    with torch.no_grad(), autocast_by_name(recipe):
        y = op(x)
    assert_close_by_table(y, F.linear(x, op.weight), ("e4m3", torch.float32))


# ------------------------------------------------------------------------------------------
# Bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bias_matches_plain_pytorch(dtype):
    torch.manual_seed(8)
    op = ops.Bias(OUT, device="cpu", dtype=dtype)
    assert torch.equal(op.bias, torch.zeros(OUT, dtype=dtype))
    with torch.no_grad():
        op.bias.normal_()
    x = torch.randn(2, 5, OUT, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 5, OUT, dtype=dtype)
    b_ref, x_ref = leaf(op.bias), leaf(x)
    (x_ref + b_ref).backward(dy)
    y = op(x)
    y.backward(dy)
    assert torch.equal(y, x_ref + b_ref)
    assert torch.equal(x.grad, dy)
    close(op.bias.grad, b_ref.grad, dtype)
    with pytest.raises(ValueError, match="size=48"):
        op(torch.randn(3, OUT + 1, dtype=dtype))


# ------------------------------------------------------------------------------------------
# Activations (plain PyTorch references, independent of functional/activation.py)


# operation name -> (operation, the plain-PyTorch reference of the module activation it computes)
ACTIVATIONS = {
    name: (getattr(ops, name), REFERENCE_ACTIVATIONS[activation])
    for name, activation in [
        ("GELU", "gelu"), ("GEGLU", "geglu"), ("GLU", "glu"), ("QGELU", "qgelu"),
        ("QuickGELU", "qgelu"), ("QGEGLU", "qgeglu"), ("ReLU", "relu"), ("ReGLU", "reglu"),
        ("SReLU", "srelu"), ("SReGLU", "sreglu"), ("SiLU", "silu"), ("SwiGLU", "swiglu"),
        ("ClampedSwiGLU", "clamped_swiglu"),
    ]
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_plain_pytorch(name, dtype):
    torch.manual_seed(9)
    cls, reference_fn = ACTIVATIONS[name]
    op = cls()
    x = (torch.randn(3, 8, 32) * 4).to(dtype).requires_grad_(True)
    dy = torch.randn(3, 8, 16 if name.endswith("GLU") else 32).to(dtype)
    x_ref = leaf(x.double())
    y_ref = reference_fn(x_ref)
    y_ref.backward(dy.double())
    y = op(x)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and y.shape == y_ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-5, atol=1e-5)
    else:
        # one BF16 rounding of float32 math against float64
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_activation_cache_quantized_input(recipe):
    torch.manual_seed(10)
    exact, cached = ops.GELU(), ops.GELU(cache_quantized_input=True)
    x = torch.randn(16, 32, requires_grad=True)
    x2 = leaf(x)
    dy = torch.randn(16, 32)
    with autocast_by_name(recipe):
        y, y2 = exact(x), cached(x2)
    (y * dy).sum().backward()
    (y2 * dy).sum().backward()
    assert torch.equal(y, y2)  # the forward is exact either way
    assert_close_by_table(x2.grad, x.grad, ("e4m3", torch.float32))


def test_gated_activation_needs_an_even_size():
    with pytest.raises(ValueError, match="even"):
        ops.SwiGLU()(torch.randn(4, 31))


# ------------------------------------------------------------------------------------------
# Shape, scale, dropout, extra inputs/outputs, normalization


def test_identity_reshape_constant_scale():
    torch.manual_seed(11)
    x = torch.randn(4, 6, requires_grad=True)
    dy = torch.randn(4, 6)
    y = ops.Identity()(x)
    y.backward(dy)
    assert torch.equal(y, x) and torch.equal(x.grad, dy)

    x.grad = None
    y = ops.Reshape((2, -1, 3))(x)
    assert y.shape == (2, 4, 3) and torch.equal(y, x.reshape(2, 4, 3))
    y.backward(dy.reshape(2, 4, 3))
    assert torch.equal(x.grad, dy)

    x.grad = None
    y = ops.ConstantScale(-2.5)(x)
    y.backward(dy)
    assert torch.equal(y, x * -2.5) and torch.equal(x.grad, dy * -2.5)
    with pytest.raises(ValueError, match="more than one -1"):
        ops.Reshape((-1, -1))


def test_dropout():
    torch.manual_seed(12)
    op = ops.Dropout(0.5)
    x = (torch.rand(64, 64) + 1).requires_grad_(True)
    dy = torch.randn(64, 64)
    y = op(x)
    y.backward(dy)
    kept = y != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(y[kept], 2 * x[kept])
    torch.testing.assert_close(x.grad, dy * kept * 2)
    op.eval()
    assert torch.equal(op(x), x)
    with pytest.raises(ValueError, match="p=1.0"):
        ops.Dropout(1.0)


def test_add_extra_input_and_make_extra_output():
    torch.manual_seed(13)
    x = torch.randn(4, 8, requires_grad=True)
    residual = torch.randn(4, 8, requires_grad=True)
    dy = torch.randn(4, 8)
    y = ops.AddExtraInput()(x, residual)
    y.backward(dy)
    assert torch.equal(y, x + residual)
    assert torch.equal(x.grad, dy) and torch.equal(residual.grad, dy)

    x.grad = None
    out, branch = ops.MakeExtraOutput()(x)
    assert torch.equal(out, x) and torch.equal(branch, x)
    d_branch = torch.randn(4, 8)
    torch.autograd.backward([out, branch], [dy, d_branch])
    torch.testing.assert_close(x.grad, dy + d_branch)
    with pytest.raises(ValueError, match="extra inputs"):
        ops.AddExtraInput()(x)


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_normalization_matches_plain_pytorch(kind, zero_centered_gamma):
    torch.manual_seed(14)
    op = getattr(ops, kind)(32, eps=1e-5, device="cpu", zero_centered_gamma=zero_centered_gamma)
    start = 0.0 if zero_centered_gamma else 1.0
    assert torch.equal(op.weight, torch.full((32,), start))
    with torch.no_grad():
        for p in op.parameters():
            p.normal_()
    x = torch.randn(2, 7, 32, requires_grad=True)
    dy = torch.randn(2, 7, 32)
    params = {n: leaf(p) for n, p in op.named_parameters()}
    x_ref = leaf(x)
    gamma = params["weight"] + 1 if zero_centered_gamma else params["weight"]
    if kind == "LayerNorm":
        y_ref = F.layer_norm(x_ref, (32,), gamma, params["bias"], 1e-5)
    else:
        y_ref = x_ref * torch.rsqrt(x_ref.square().mean(-1, keepdim=True) + 1e-5) * gamma
    y_ref.backward(dy)
    y = op(x)
    y.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, p in op.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Quantize


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_quantize_forward_and_backward(recipe):
    torch.manual_seed(15)
    op = ops.Quantize(forward=True, backward=True)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 64)
    with autocast_by_name(recipe):
        y = op(x)
    assert isinstance(y, Float8Tensor) and y.dtype == torch.float32
    sx = torch.ones(1) if recipe == "delayed" else current_scale(x, E4M3)
    torch.testing.assert_close(y.dequantize().double(), fake_quant(x, sx, E4M3))
    y.backward(dy)
    assert isinstance(x.grad, Float8Tensor)
    sdy = torch.ones(1) if recipe == "delayed" else current_scale(dy, E5M2)
    torch.testing.assert_close(x.grad.dequantize().double(), fake_quant(dy, sdy, E5M2))
    if recipe == "delayed":
        assert op.recipe_state("forward").amax_history.shape[1] == 1


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_quantize_leaves_the_gradient_alone_under_a_backward_override(override):
    """A recipe with ``backward_override`` runs the whole backward in high precision: the
    Quantize op's gradient cast is off, so the gradient passes through unchanged."""
    op = ops.Quantize(forward=False, backward=True)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 32) * 3
    with te.autocast(recipe=Float8CurrentScaling(backward_override=override)):
        y = op(x)
    y.backward(dy)
    assert type(x.grad) is torch.Tensor and torch.equal(x.grad, dy)


def test_quantize_is_the_identity_outside_autocast():
    op = ops.Quantize(forward=True, backward=True)
    x = torch.randn(4, 16, requires_grad=True)
    y = op(x)
    assert type(y) is torch.Tensor and torch.equal(y, x)
    y.sum().backward()
    assert type(x.grad) is torch.Tensor and torch.equal(x.grad, torch.ones(4, 16))
    assert (
        op.num_quantizers("forward") == 1
        and ops.Quantize(forward=False).num_quantizers("forward") == 0
    )


def test_quantized_input_feeds_the_linear_as_is():
    torch.manual_seed(16)
    model = ops.Sequential(ops.Quantize(), ops.BasicLinear(IN, OUT, device="cpu"))
    x = torch.randn(32, IN, requires_grad=True)
    linear = model[1]
    with autocast_by_name("delayed"):
        y = model(x)
        # the linear did not cast its input again: its input amax slot stays empty
        assert linear.recipe_state("forward").amax_history[0, 0] == 0.0
        assert model[0].recipe_state("forward").amax_history[0, 0] == x.abs().max()
    y.sum().backward()
    assert_close_by_table(y, F.linear(x, linear.weight), ("e4m3", torch.float32))
    assert x.grad.shape == x.shape
