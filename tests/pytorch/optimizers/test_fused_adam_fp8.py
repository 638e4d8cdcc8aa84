"""te.optimizers.FusedAdam on FP8 weights (Float8Tensor parameters from te.quantized_model_init
with delayed scaling): without master weights the weight is stepped on its dequantized value and
re-quantized, with master weights it receives the float32 master quantized. The oracle is
torch.optim.AdamW in float64; FP8 results are held to one E4M3 rounding of it."""

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.optimizers import FusedAdam
from transformer_engine.pytorch.tensor import Float8Tensor


def torch_adamw(start, grads, lr, weight_decay):
    """torch.optim.AdamW in float64 from ``start`` (a list of tensors), one list of grads a step."""
    params = [torch.nn.Parameter(p.double()) for p in start]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.double()
        opt.step()
    return [p.detach() for p in params]


def fp8_linear(**init_kwargs):
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling(), **init_kwargs):
        return te.Linear(32, 16, params_dtype=torch.bfloat16, device="cpu")


def fp8_close(got, ref, scale_inv):
    """Within one E4M3 rounding: half an ulp is 2**-4 relative for normal values, and the
    subnormal half step 2**-10 (times the tensor's scale_inv) below them."""
    err = (got.double() - ref.double()).abs()
    return bool((err <= 2**-4 * ref.double().abs() + 2**-10 * scale_inv + 1e-7).all())


def test_fp8_weight_without_master_weights():
    linear = fp8_linear()
    weight = linear.weight
    assert isinstance(weight, Float8Tensor)
    start = weight.dequantize(dtype=torch.float32).detach().clone()
    opt = FusedAdam([weight], lr=1e-2)
    ref = torch.nn.Parameter(start.double())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        grad = torch.randn(16, 32).bfloat16()
        # The oracle steps from the weight's current (quantized) value with float64 moments.
        with torch.no_grad():
            ref.copy_(weight.dequantize(dtype=torch.float32).double())
        weight.grad = grad.clone()
        ref.grad = grad.double()
        opt.step()
        ref_opt.step()
        assert isinstance(weight, Float8Tensor)
        value = weight.dequantize(dtype=torch.float32)
        assert fp8_close(value, ref.detach(), float(weight._scale_inv))
    moved = weight.dequantize(dtype=torch.float32) != start
    assert moved.float().mean() > 0.5
    # The moments are float32 values of the float64 oracle's (the same gradients).
    torch.testing.assert_close(opt.state[weight]["exp_avg"].double(), ref_opt.state[ref]["exp_avg"],
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_fp8_weight_with_master_weights():
    linear = fp8_linear()
    weight, bias = linear.weight, linear.bias
    start = weight.dequantize(dtype=torch.float32).detach().clone()
    start_bias = bias.detach().float().clone()
    opt = FusedAdam([weight, bias], lr=1e-2, master_weights=True, weight_decay=0.01)
    grads = [[torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()] for _ in range(3)]
    for w_grad, b_grad in grads:
        weight.grad, bias.grad = w_grad.clone(), b_grad.clone()
        opt.step()
    ref = torch_adamw([start, start_bias], grads, lr=1e-2, weight_decay=0.01)
    assert isinstance(weight, Float8Tensor)
    master = opt.state[weight]["master_param"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master.double(), ref[0], rtol=1e-5, atol=1e-6)
    # The weight is the master quantized (not stepped on its own rounded value).
    assert fp8_close(weight.dequantize(dtype=torch.float32), master, float(weight._scale_inv))
    assert not torch.equal(weight.dequantize(dtype=torch.float32), start)
    # The bfloat16 bias: its float32 master rounded.
    eps = torch.finfo(torch.bfloat16).eps
    assert ((bias.double() - ref[1]).abs() <= eps * ref[1].abs()).all()


def test_fp8_master_starts_from_preserved_init_value():
    linear = fp8_linear(preserve_high_precision_init_val=True)
    weight = linear.weight
    init = weight.get_high_precision_init_val().clone()
    assert not torch.equal(init.float(), weight.dequantize(dtype=torch.float32))
    opt = FusedAdam([weight], lr=0.0, master_weights=True)
    weight.grad = torch.zeros(16, 32, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(opt.state[weight]["master_param"], init.float())
    assert weight.get_high_precision_init_val() is None, "the CPU copy is released"
