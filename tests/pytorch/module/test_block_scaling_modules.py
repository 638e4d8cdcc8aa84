"""te.Linear, LayerNormLinear, LayerNormMLP and GroupedLinear under Float8BlockScaling.

Linear is held to an exact oracle: the float64 product of its operands as the float64 loop
oracle (``block_scaling_oracle``) casts them (x and dy in 1x128 tiles, W in 128x128 blocks;
wgrad from the column-wise tiles along the tokens). The only difference left is the float32
accumulation of K exact products, hence ``rtol = atol / max = 1e-5``.

The composed modules are held to a plain float64 run of the same parameters with a bound
derived from the cast: each E4M3 operand is within 2^-4 relative of its input (plus subnormal
steps), so every GEMM output is within ``(2 * 2^-4 + 2^-8) * (|a| @ |b|)`` of the exact
product; chained GEMMs (MLP) and the FP8 gradient widen this, so the bound used is
``0.25 * (|a| @ |b|) + 1e-3`` per element (outputs), and 0.25 relative in norm (gradients).
"""

import pytest
import torch
from block_scaling_oracle import oracle_dequantize
from utils import needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling

E4M3 = torch.float8_e4m3fn


def _dq(a, two_d):
    return oracle_dequantize(a, E4M3, two_d=two_d, pow2=True)


def test_linear_forward_backward_exact_oracle():
    torch.manual_seed(0)
    m = te.Linear(256, 128, bias=True, params_dtype=torch.float32, device="cpu")
    x = torch.randn(2, 48, 256, requires_grad=True)
    g = torch.randn(2, 48, 128)
    with te.autocast(recipe=Float8BlockScaling()):
        y = m(x)
    y.backward(g)
    x2, g2, w = x.detach().reshape(96, 256), g.reshape(96, 128), m.weight.detach()
    y_ref = _dq(x2, False) @ _dq(w, True).t() + m.bias.detach().double()
    dx_ref = _dq(g2, False) @ _dq(w.t(), True).t()
    dw_ref = _dq(g2.t(), False) @ _dq(x2.t(), False).t()
    for got, ref in ((y.reshape(96, 128), y_ref), (x.grad.reshape(96, 256), dx_ref),
                     (m.weight.grad, dw_ref)):  # fmt: skip
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.allclose(m.bias.grad.double(), g2.double().sum(0), rtol=1e-5, atol=1e-4)


def _plain_bound(got, ref, scale):
    return bool(((got.double() - ref).abs() <= 0.25 * scale + 1e-3).all())


@pytest.mark.parametrize("kind", ["layernorm_linear", "layernorm_mlp", "grouped_linear"])
def test_composed_modules_within_derived_bound(kind):
    torch.manual_seed(1)
    x = torch.randn(64, 256, requires_grad=True)
    if kind == "layernorm_linear":
        m = te.LayerNormLinear(256, 128, params_dtype=torch.float32, device="cpu")
        run = m
    elif kind == "layernorm_mlp":
        m = te.LayerNormMLP(256, 256, params_dtype=torch.float32, device="cpu")
        run = m
    else:
        m = te.GroupedLinear(2, 256, 128, params_dtype=torch.float32, device="cpu")

        def run(inp):
            return m(inp, [32, 32])

    reference = {n: p.detach().double().clone() for n, p in m.named_parameters()}
    with te.autocast(recipe=Float8BlockScaling()):
        y = run(x)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double()
    if kind == "layernorm_linear":
        h = torch.nn.functional.layer_norm(
            xd, (256,), reference["layer_norm_weight"], reference["layer_norm_bias"], 1e-5
        )
        y_ref = h @ reference["weight"].t() + reference["bias"]
        scale = h.abs() @ reference["weight"].abs().t()
    elif kind == "layernorm_mlp":
        h = torch.nn.functional.layer_norm(
            xd, (256,), reference["layer_norm_weight"], reference["layer_norm_bias"], 1e-5
        )
        a = torch.nn.functional.gelu(h @ reference["fc1_weight"].t() + reference["fc1_bias"],
                                     approximate="tanh")  # fmt: skip
        y_ref = a @ reference["fc2_weight"].t() + reference["fc2_bias"]
        scale = (a.abs() + 0.25 * (h.abs() @ reference["fc1_weight"].abs().t())) @ reference[
            "fc2_weight"
        ].abs().t()
    else:
        ws = [reference["weight0"], reference["weight1"]]
        y_ref = torch.cat([xd[:32] @ ws[0].t(), xd[32:] @ ws[1].t()]) + torch.cat(
            [reference["bias0"].expand(32, -1), reference["bias1"].expand(32, -1)]
        )
        scale = torch.cat([xd[:32].abs() @ ws[0].abs().t(), xd[32:].abs() @ ws[1].abs().t()])
    assert _plain_bound(y.detach(), y_ref, scale)
    # Gradients: against float64 autograd of the same function, within 25% in norm.
    xr = xd.clone().requires_grad_(True)
    params = {n: p.clone().requires_grad_(True) for n, p in reference.items()}
    if kind == "grouped_linear":
        out = torch.cat([xr[:32] @ params["weight0"].t(), xr[32:] @ params["weight1"].t()])
    else:
        ln = torch.nn.functional.layer_norm(
            xr, (256,), params["layer_norm_weight"], params["layer_norm_bias"], 1e-5
        )
        if kind == "layernorm_linear":
            out = ln @ params["weight"].t()
        else:
            hidden = torch.nn.functional.gelu(
                ln @ params["fc1_weight"].t() + params["fc1_bias"], approximate="tanh"
            )
            out = hidden @ params["fc2_weight"].t()
    out.backward(g.double())
    assert torch.linalg.norm(x.grad.double() - xr.grad) <= 0.25 * torch.linalg.norm(xr.grad)
    weight = (
        "weight0"
        if kind == "grouped_linear"
        else "weight"
        if kind != "layernorm_mlp"
        else "fc2_weight"
    )
    got = dict(m.named_parameters())[weight].grad.double()
    assert torch.linalg.norm(got - params[weight].grad) <= 0.25 * torch.linalg.norm(
        params[weight].grad
    )


def test_quantizers_and_checkpoint_round_trip():
    m = te.Linear(256, 128, params_dtype=torch.float32, device="cpu")
    x = torch.randn(32, 256)
    recipe = Float8BlockScaling()
    with te.autocast(recipe=recipe):
        y = m(x)
    dims = [q.block_scaling_dim for q in m.quantizers["scaling_fwd"]]
    assert dims == [1, 2, 1]
    assert [q.block_scaling_dim for q in m.quantizers["scaling_bwd"]] == [1, 1]
    other = te.Linear(256, 128, params_dtype=torch.float32, device="cpu")
    other.load_state_dict(m.state_dict())
    with te.autocast(recipe=recipe):
        assert torch.equal(other(x), y)


def test_meta_module_materializes_and_runs():
    m = te.Linear(256, 128, params_dtype=torch.float32, device="meta")
    m.to_empty(device="cpu")
    m.reset_parameters()
    with te.autocast(recipe=Float8BlockScaling()):
        assert m(torch.randn(16, 256)).shape == (16, 128)


@needs_cuda
def test_linear_on_cuda_matches_cpu_oracle():
    torch.manual_seed(2)
    m = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda:0")
    x = torch.randn(128, 256, device="cuda:0", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=Float8BlockScaling()):
        y = m(x)
    y.float().sum().backward()
    w = m.weight.detach().float().cpu()
    ref = _dq(x.detach().float().cpu(), False) @ _dq(w, True).t() + m.bias.detach().double().cpu()
    assert torch.allclose(
        y.double().cpu(), ref, rtol=2.0**-7, atol=2.0**-7 * float(ref.abs().max())
    )
    assert x.grad is not None and torch.isfinite(x.grad).all()


@needs_two_gpus
def test_modules_on_second_gpu_while_first_is_current():
    torch.manual_seed(3)
    for make in (
        lambda: te.Linear(256, 128, device="cuda:1"),
        lambda: te.LayerNormMLP(256, 256, device="cuda:1"),
    ):
        m = make()
        x = torch.randn(64, 256, device="cuda:1", requires_grad=True)
        with torch.cuda.device(0), te.autocast(recipe=Float8BlockScaling()):
            y = m(x)
            y.sum().backward()
            assert torch.cuda.current_device() == 0
        assert y.device == x.device and x.grad.device == x.device
