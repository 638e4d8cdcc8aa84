"""te.optimizers on CUDA: the foreach steps against torch's optimizers, a FusedAdam step
captured in a CUDA graph against eager steps, FP8 weights, and parameters on a non-current
device."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.optimizers import (
    FusedAdam,
    FusedSGD,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (cuda:1 while cuda:0 is current)"
)


def _params(device, dtype=torch.float32, shapes=((64, 33), (257,), (5, 7, 3))):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device) for p in params]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch_adam_on_cuda(adam_w_mode):
    start = _params("cuda")
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    ref = [torch.nn.Parameter(p.double()) for p in start]
    opt = FusedAdam(ours, lr=3e-3, weight_decay=0.05, adam_w_mode=adam_w_mode)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = ref_cls(ref, lr=3e-3, weight_decay=0.05)
    for step in range(6):
        for a, b, g in zip(ours, ref, _grads(start, step)):
            a.grad, b.grad = g.clone(), g.double()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_params_with_master_weights_follow_a_float32_run():
    start = _params("cuda")
    ours = [torch.nn.Parameter(p.bfloat16()) for p in start]
    ref = [torch.nn.Parameter(p.bfloat16().double()) for p in start]
    opt = FusedAdam(ours, lr=1e-2, master_weights=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    for step in range(5):
        for a, b, g in zip(ours, ref, _grads(start, step)):
            a.grad, b.grad = g.bfloat16(), g.bfloat16().double()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        master = opt.get_unscaled_state(a, "master_param")
        torch.testing.assert_close(master.double(), b.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(a.detach(), master.bfloat16())


def test_captured_step_replays_like_eager_steps():
    start = _params("cuda")
    eager = [torch.nn.Parameter(p.clone()) for p in start]
    graphed = [torch.nn.Parameter(p.clone()) for p in start]
    eager_opt = FusedAdam(eager, lr=1e-2, weight_decay=0.01)
    opt = FusedAdam(graphed, lr=1e-2, weight_decay=0.01, capturable=True)
    for p in graphed:
        p.grad = torch.zeros_like(p)
    # Warm up on a side stream (state created, then reset to the eager optimizer's start).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        for p, s in zip(graphed, start):
            p.copy_(s)
            opt.state[p]["exp_avg"].zero_()
            opt.state[p]["exp_avg_sq"].zero_()
        opt.param_groups[0]["step"].zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in range(5):
        grads = _grads(start, step)
        for p, q, g in zip(graphed, eager, grads):
            p.grad.copy_(g)
            q.grad = g.clone()
        graph.replay()
        eager_opt.step()
    torch.cuda.synchronize()
    assert float(opt.param_groups[0]["step"]) == 5.0
    for p, q in zip(graphed, eager):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_capturable_step_with_an_inf_gradient_changes_nothing():
    start = _params("cuda")
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = FusedAdam(params, lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    for p, g in zip(params, _grads(start, 0)):
        p.grad = g * 1024.0
    opt.step(grad_scaler=scaler)
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    for p, g in zip(params, _grads(start, 1)):
        p.grad = g * 1024.0
    params[1].grad[3] = float("inf")
    opt.step(grad_scaler=scaler)
    assert float(opt.param_groups[0]["step"]) == 1.0
    for p, b, m in zip(params, before, moments):
        assert torch.equal(p.detach(), b)
        assert torch.equal(opt.state[p]["exp_avg"], m)


def test_fp8_weights_train_with_master_weights():
    fp8 = recipe.DelayedScaling()
    with te.quantized_model_init(enabled=True, recipe=fp8):
        layer = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
    opt = FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(16, 32, device="cuda")
    losses = []
    for _ in range(8):
        with te.autocast(enabled=True, recipe=fp8):
            out = layer(x)
        loss = (out.float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert isinstance(layer.weight, te.Float8Tensor)
    master = opt.get_unscaled_state(layer.weight, "master_param")
    assert master.dtype == torch.float32
    # The weight is its master quantized: within E4M3's half-ulp (2**-4 relative).
    torch.testing.assert_close(
        layer.weight.dequantize(dtype=torch.float32), master, rtol=2**-4, atol=1e-3
    )
    assert losses[-1] < losses[0]


@two_gpus
def test_parameters_on_a_non_current_device():
    torch.cuda.set_device(0)
    start = _params("cuda:1")
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    ref = [torch.nn.Parameter(p.clone()) for p in start]
    opt = FusedAdam(ours, lr=1e-2, capturable=True)
    sgd = FusedSGD([torch.nn.Parameter(p.clone()) for p in start], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    for step in range(3):
        for a, b, g in zip(ours, ref, _grads(start, step)):
            a.grad, b.grad = g.clone(), g.clone()
        for p, g in zip(sgd.param_groups[0]["params"], _grads(start, step)):
            p.grad = g
        opt.step()
        ref_opt.step()
        sgd.step()
    assert opt.param_groups[0]["step"].device == torch.device("cuda:1")
    for a, b in zip(ours, ref):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.cuda.current_device() == 0


def test_megatron_style_norm_and_clip():
    grads = [g.bfloat16() for g in _grads(_params("cuda"), 0)]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    norm, per = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], True)
    expected = torch.stack([g.double().norm() for g in grads])
    torch.testing.assert_close(per.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm.double(), expected.norm().reshape(1), rtol=1e-6, atol=0)
    clipped = [g.clone() for g in grads]
    multi_tensor_applier(multi_tensor_scale, flag, [clipped, clipped], 0.5)
    for c, g in zip(clipped, grads):
        assert torch.equal(c, (g.float() * 0.5).bfloat16())
    assert int(flag) == 0
    grads[0][0, 0] = float("nan")
    multi_tensor_applier(multi_tensor_scale, flag, [grads, clipped], 0.5)
    assert int(flag) == 1
