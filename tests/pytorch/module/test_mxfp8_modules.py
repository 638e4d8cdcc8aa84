"""te.Linear, LayerNormLinear and LayerNormMLP under MXFP8BlockScaling (emulated GEMMs).

Linear is held to an exact oracle: the float64 product of its operands as the float64 loop
oracle (``mxfp8_oracle``) casts them (fprop: row-wise x and W; dgrad: row-wise dy and W's
column-wise copy; wgrad: the column-wise copies of dy and x, blocks along the tokens; dy in
E5M2 under HYBRID). Only the float32 accumulation of exact products differs: rtol 1e-5.

The composed modules are held to a float64 run of the same parameters with the bound used for
Float8BlockScaling (each E4M3 operand within 2^-4 relative of its input): ``0.25 * (|a| @ |b|)
+ 1e-3`` per output element and 0.25 relative in norm for gradients.
"""

import warnings

import pytest
import torch
from mxfp8_oracle import oracle_dequantize
from utils import needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Format, MXFP8BlockScaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def _quiet_emulation_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="MXFP8BlockScaling: GEMMs run by exact")
        yield


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_linear_forward_backward_exact_oracle(fmt):
    torch.manual_seed(0)
    m = te.Linear(64, 96, bias=True, params_dtype=torch.float32, device="cpu")
    x = torch.randn(2, 24, 64, requires_grad=True)
    g = torch.randn(2, 24, 96)
    with te.autocast(recipe=MXFP8BlockScaling(fp8_format=fmt)):
        y = m(x)
    y.backward(g)
    gfp8 = E5M2 if fmt == Format.HYBRID else E4M3
    x2, g2, w = x.detach().reshape(48, 64), g.reshape(48, 96), m.weight.detach()
    y_ref = oracle_dequantize(x2, E4M3) @ oracle_dequantize(w, E4M3).t() + m.bias.double()
    dx_ref = oracle_dequantize(g2, gfp8) @ oracle_dequantize(w, E4M3, columnwise=True)
    dw_ref = oracle_dequantize(g2, gfp8, columnwise=True).t() @ oracle_dequantize(
        x2, E4M3, columnwise=True
    )
    for got, ref in ((y.reshape(48, 96), y_ref), (x.grad.reshape(48, 64), dx_ref),
                     (m.weight.grad, dw_ref)):  # fmt: skip
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.allclose(m.bias.grad.double(), g2.double().sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["layernorm_linear", "layernorm_mlp"])
def test_composed_modules_within_derived_bound(kind):
    torch.manual_seed(1)
    x = torch.randn(64, 64, requires_grad=True)
    if kind == "layernorm_linear":
        m = te.LayerNormLinear(64, 96, params_dtype=torch.float32, device="cpu")
    else:
        m = te.LayerNormMLP(64, 128, params_dtype=torch.float32, device="cpu")
    p = {n: t.detach().double().clone().requires_grad_(True) for n, t in m.named_parameters()}
    with te.autocast(recipe=MXFP8BlockScaling()):
        y = m(x)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    h = torch.nn.functional.layer_norm(
        xr, (64,), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5
    )
    if kind == "layernorm_linear":
        y_ref = h @ p["weight"].t() + p["bias"]
        scale = h.abs() @ p["weight"].abs().t()
        weight = "weight"
    else:
        a = torch.nn.functional.gelu(h @ p["fc1_weight"].t() + p["fc1_bias"], approximate="tanh")
        y_ref = a @ p["fc2_weight"].t() + p["fc2_bias"]
        scale = (a.abs() + 0.25 * (h.abs() @ p["fc1_weight"].abs().t())) @ p["fc2_weight"].abs().t()
        weight = "fc2_weight"
    assert ((y.detach().double() - y_ref).abs() <= 0.25 * scale.detach() + 1e-3).all()
    y_ref.backward(g.double())
    assert torch.linalg.norm(x.grad.double() - xr.grad) <= 0.25 * torch.linalg.norm(xr.grad)
    got = dict(m.named_parameters())[weight].grad.double()
    assert torch.linalg.norm(got - p[weight].grad) <= 0.25 * torch.linalg.norm(p[weight].grad)


def test_quantizers_and_checkpoint_round_trip():
    m = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    x = torch.randn(32, 64)
    recipe = MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True)
    with te.autocast(recipe=recipe):
        y = m(x)
    fwd, bwd = m.quantizers["scaling_fwd"], m.quantizers["scaling_bwd"]
    assert [type(q).__name__ for q in fwd + bwd] == ["MXFP8Quantizer"] * (len(fwd) + len(bwd))
    assert [q.with_2d_quantization for q in fwd] == [False, True, False]
    assert {q.dtype.name for q in bwd} == {"kFloat8E5M2"}
    other = te.Linear(64, 96, params_dtype=torch.float32, device="cpu")
    other.load_state_dict(m.state_dict())
    with te.autocast(recipe=recipe):
        assert torch.equal(other(x), y)


def test_meta_module_materializes_and_runs():
    m = te.Linear(64, 96, params_dtype=torch.float32, device="meta")
    m.to_empty(device="cpu")
    m.reset_parameters()
    with te.autocast(recipe=MXFP8BlockScaling()):
        assert m(torch.randn(16, 64)).shape == (16, 96)


@needs_cuda
def test_linear_on_cuda_matches_cpu():
    torch.manual_seed(2)
    cpu = te.Linear(128, 128, params_dtype=torch.float32, device="cpu")
    gpu = te.Linear(128, 128, params_dtype=torch.float32, device="cuda:0")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(64, 128)
    with te.autocast(recipe=MXFP8BlockScaling()):
        y_cpu, y_gpu = cpu(x), gpu(x.cuda())
    ref = y_cpu.double()
    assert torch.allclose(y_gpu.double().cpu(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_two_gpus
def test_modules_on_second_gpu_while_first_is_current():
    torch.manual_seed(3)
    for make in (
        lambda: te.Linear(128, 64, device="cuda:1"),
        lambda: te.LayerNormMLP(128, 128, device="cuda:1"),
    ):
        m = make()
        x = torch.randn(64, 128, device="cuda:1", requires_grad=True)
        with torch.cuda.device(0), te.autocast(recipe=MXFP8BlockScaling()):
            y = m(x)
            y.sum().backward()
            assert torch.cuda.current_device() == 0
        assert y.device == x.device and x.grad.device == x.device
