"""te.Linear, LayerNormLinear, LayerNormMLP, GroupedLinear and te.ops.Linear under
NVFP4BlockScaling (emulated GEMMs).

Linear without RHT and stochastic rounding is held to an exact oracle: the float64 product of
its operands as the hand-written loop oracle (``nvfp4_oracle``) casts them (fprop: row-wise x
and the 16x16-block W; dgrad: row-wise dy and W's column-wise copy, the transpose of the same
blocks; wgrad: the column-wise copies of dy and x, blocks along the tokens). Only float32
accumulation differs: rtol 1e-5.

The default recipe (RHT, stochastic rounding of gradients, 2-D weights) is held to a float64 run
of the same parameters with NVFP4's tolerance: each E2M1 element is within a quarter of its
block's scale step (about 17% of the block amax at worst, ~8% RMS), so products and gradients
are within 0.3 relative in norm.
"""

import warnings

import pytest
import torch
from nvfp4_oracle import oracle_dequantize
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import NVFP4BlockScaling
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

TOL = 0.3


@pytest.fixture(autouse=True)
def _quiet_emulation_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="NVFP4BlockScaling: GEMMs run by exact")
        yield


def _close_in_norm(got, ref, tol=TOL):
    return torch.linalg.norm(got.double() - ref) <= tol * torch.linalg.norm(ref)


def test_linear_forward_backward_exact_oracle():
    torch.manual_seed(0)
    m = te.Linear(64, 96, bias=True, params_dtype=torch.float32, device="cpu")
    x = torch.randn(2, 24, 64, requires_grad=True)
    g = torch.randn(2, 24, 96)
    recipe = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)
    with te.autocast(recipe=recipe):
        y = m(x)
    y.backward(g)
    x2, g2, w = x.detach().reshape(48, 64), g.reshape(48, 96), m.weight.detach()
    w_ref = oracle_dequantize(w, two_d=True)
    y_ref = oracle_dequantize(x2) @ w_ref.t() + m.bias.double()
    dx_ref = oracle_dequantize(g2) @ w_ref
    dw_ref = oracle_dequantize(g2, columnwise=True).t() @ oracle_dequantize(x2, columnwise=True)
    for got, ref in ((y.reshape(48, 96), y_ref), (x.grad.reshape(48, 64), dx_ref),
                     (m.weight.grad, dw_ref)):  # fmt: skip
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.allclose(m.bias.grad.double(), g2.double().sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp", "grouped"])
def test_modules_within_nvfp4_tolerance_of_float64(kind):
    torch.manual_seed(1)
    x = torch.randn(64, 64, requires_grad=True)
    if kind == "linear":
        m = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    elif kind == "layernorm_linear":
        m = te.LayerNormLinear(64, 96, params_dtype=torch.float32, device="cpu")
    elif kind == "layernorm_mlp":
        m = te.LayerNormMLP(64, 128, params_dtype=torch.float32, device="cpu")
    else:
        m = te.GroupedLinear(2, 64, 96, params_dtype=torch.float32, device="cpu")
    p = {n: t.detach().double().clone().requires_grad_(True) for n, t in m.named_parameters()}
    with te.autocast(recipe=NVFP4BlockScaling()):
        y = m(x, [32, 32]) if kind == "grouped" else m(x)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    if kind == "linear":
        y_ref, weight = xr @ p["weight"].t() + p["bias"], "weight"
    elif kind == "grouped":
        halves = xr.split(32)
        y_ref = torch.cat([h @ p[f"weight{i}"].t() + p[f"bias{i}"] for i, h in enumerate(halves)])
        weight = "weight1"
    else:
        h = torch.nn.functional.layer_norm(
            xr, (64,), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5
        )
        if kind == "layernorm_linear":
            y_ref, weight = h @ p["weight"].t() + p["bias"], "weight"
        else:
            a = torch.nn.functional.gelu(
                h @ p["fc1_weight"].t() + p["fc1_bias"], approximate="tanh"
            )
            y_ref, weight = a @ p["fc2_weight"].t() + p["fc2_bias"], "fc2_weight"
    assert _close_in_norm(y.detach(), y_ref.detach())
    y_ref.backward(g.double())
    assert _close_in_norm(x.grad, xr.grad)
    assert _close_in_norm(dict(m.named_parameters())[weight].grad, p[weight].grad)


def test_ops_linear_trains():
    torch.manual_seed(2)
    op = te.ops.Linear(64, 96, device="cpu", dtype=torch.float32)
    x = torch.randn(32, 64, requires_grad=True)
    w = op.weight.detach().double()
    with te.autocast(recipe=NVFP4BlockScaling()):
        y = op(x)
    g = torch.randn_like(y)
    y.backward(g)
    assert _close_in_norm(y.detach(), x.detach().double() @ w.t())
    assert _close_in_norm(x.grad, g.double() @ w)
    assert _close_in_norm(op.weight.grad, g.double().t() @ x.detach().double())


def test_quantizers_per_slot_and_checkpoint_round_trip():
    m = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    x = torch.randn(32, 64)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    with te.autocast(recipe=recipe):
        y = m(x)
    fwd, bwd = m.quantizers["scaling_fwd"], m.quantizers["scaling_bwd"]
    assert {type(q).__name__ for q in fwd + bwd} == {"NVFP4Quantizer"}
    assert [(q.with_rht, q.with_2d_quantization) for q in fwd[:2]] == [(True, False), (False, True)]
    assert all(q.with_rht and q.with_post_rht_amax and not q.stochastic_rounding for q in bwd)
    other = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    other.load_state_dict(m.state_dict())
    with te.autocast(recipe=recipe):
        assert torch.equal(other(x), y)


def test_quantized_model_init_weights():
    recipe = NVFP4BlockScaling()
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    assert isinstance(m.weight, QuantizedTensor) and type(m.weight).__name__ == "NVFP4Tensor"
    x = torch.randn(32, 64)
    with te.autocast(recipe=recipe):
        y = m(x)
    y.sum().backward()
    ref = x.double() @ m.weight.dequantize().double().t() + m.bias.double()
    assert _close_in_norm(y.detach(), ref)
    assert m.weight.grad is not None
    other = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    other.load_state_dict(m.state_dict())
    assert torch.equal(other.weight.detach(), m.weight.dequantize().detach())


@pytest.mark.parametrize(
    "field, value",
    [
        ("nvfp4_4over6", "weights"),
        ("row_scaled_activation", True),
        ("fp8_dpa", True),
        ("fp8_mha", True),
    ],
)
def test_unbuilt_options_raise_when_used(field, value):
    recipe = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)
    setattr(recipe, field, value)
    m = te.Linear(32, 32, device="cpu")
    with pytest.raises(NotImplementedError, match=field):
        with te.autocast(recipe=recipe):
            m(torch.randn(16, 32))


@needs_cuda
def test_linear_on_cuda_matches_cpu():
    torch.manual_seed(3)
    cpu = te.Linear(128, 128, params_dtype=torch.float32, device="cpu")
    gpu = te.Linear(128, 128, params_dtype=torch.float32, device="cuda:0")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(64, 128)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    with te.autocast(recipe=recipe):
        y_cpu, y_gpu = cpu(x), gpu(x.cuda())
    ref = y_cpu.double()
    assert torch.allclose(y_gpu.double().cpu(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
