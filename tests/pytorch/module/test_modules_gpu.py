"""Every module on cuda:1 while cuda:0 is current, and other multi-GPU placements; FP8 numerics
of te.Linear on one GPU (with a token count that is not a multiple of 16).

Skipped without CUDA (reason given); most tests need two GPUs in one process.
"""

import io

import pytest
import torch
from tolerances import assert_close_by_table
from utils import bitwise_equal, needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

pytestmark = needs_cuda
BF16 = torch.bfloat16
HIDDEN, FFN, TOKENS = 64, 128, 32


def build(name, device):
    torch.manual_seed(1234)
    if name == "Linear":
        return te.Linear(HIDDEN, FFN, device=device, params_dtype=BF16)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(HIDDEN, FFN, device=device, params_dtype=BF16)
    if name == "LayerNormMLP":
        return te.LayerNormMLP(HIDDEN, FFN, device=device, params_dtype=BF16)
    if name == "GroupedLinear":
        return te.GroupedLinear(2, HIDDEN, FFN, device=device, params_dtype=BF16)
    if name == "LayerNorm":
        return te.LayerNorm(HIDDEN, device=device, dtype=BF16)
    if name == "RMSNorm":
        return te.RMSNorm(HIDDEN, device=device, dtype=BF16)
    raise KeyError(name)


MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "LayerNorm", "RMSNorm"]


def call(module, x):
    if isinstance(module, te.GroupedLinear):
        return module(x, [TOKENS // 2, TOKENS // 2])
    return module(x)


def train(name, device, recipe, steps=3):
    """Steps of forward+backward in FP8; returns everything that should land on ``device``."""
    FP8GlobalStateManager.reset()
    module = build(name, device)
    g = torch.Generator().manual_seed(7)
    outs = []
    for _ in range(steps):
        x = (torch.randn(TOKENS, HIDDEN, generator=g) * 3).to(device, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = call(module, x)
        y.float().square().sum().backward()
        outs += [y.detach(), x.grad]
    grads = [p.grad for p in module.parameters()]
    fp8_state = []
    for key in ("scaling_fwd", "scaling_bwd"):
        st = getattr(module, "fp8_meta", {}).get(key)
        if st is not None and hasattr(st, "scale"):
            fp8_state += [st.scale, st.amax_history]
    return outs, grads, fp8_state


@needs_two_gpus
@pytest.mark.parametrize(
    "recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"]
)
@pytest.mark.parametrize("name", MODULES)
def test_module_on_cuda1_while_cuda0_is_current(name, recipe):
    torch.cuda.set_device(0)
    outs, grads, state = train(name, "cuda:1", recipe)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert guard_depth() == 0
    for t in outs + grads + state:
        assert t.device == torch.device("cuda:1")
    if name not in ("LayerNorm", "RMSNorm") and isinstance(recipe, DelayedScaling):
        assert state and not torch.equal(state[0].cpu(), torch.ones_like(state[0].cpu()))
    # bitwise the same as the run made with cuda:1 current
    torch.cuda.set_device(1)
    try:
        ref_outs, ref_grads, ref_state = train(name, "cuda:1", recipe)
    finally:
        torch.cuda.set_device(0)
    for a, b in zip(outs + grads + state, ref_outs + ref_grads + ref_state):
        assert bitwise_equal(a, b)


@needs_two_gpus
def test_two_modules_on_two_gpus_in_one_autocast():
    torch.cuda.set_device(0)
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    first = te.Linear(HIDDEN, FFN, device="cuda:0", params_dtype=BF16)
    second = te.Linear(FFN, HIDDEN, device="cuda:1", params_dtype=BF16)
    x = torch.randn(TOKENS, HIDDEN, device="cuda:0", dtype=BF16, requires_grad=True)
    for _ in range(2):
        with te.autocast(recipe=DelayedScaling()):
            h = first(x)
            y = second(h.to("cuda:1"))
        y.float().sum().backward()
    assert torch.cuda.current_device() == 0
    assert first.fp8_meta["scaling_fwd"].scale.device == torch.device("cuda:0")
    assert second.fp8_meta["scaling_fwd"].scale.device == torch.device("cuda:1")
    for module in (first, second):
        assert not torch.equal(module.fp8_meta["scaling_fwd"].scale[:2].cpu(), torch.ones(2))
        assert not torch.equal(module.fp8_meta["scaling_bwd"].scale[:1].cpu(), torch.ones(1))
    assert x.grad.device == torch.device("cuda:0")


@needs_two_gpus
def test_checkpoint_saved_on_cuda0_loads_onto_cuda1():
    torch.cuda.set_device(0)
    _, _, _ = train("Linear", "cuda:0", DelayedScaling())
    FP8GlobalStateManager.reset()
    saved = build("Linear", "cuda:0")
    x = torch.randn(TOKENS, HIDDEN, device="cuda:0", dtype=BF16, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        saved(x).float().sum().backward()
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    state_dict = torch.load(buffer, weights_only=True)
    loaded = build("Linear", "cuda:1")
    loaded.load_state_dict(state_dict)
    for key in ("scaling_fwd", "scaling_bwd"):
        a, b = saved.fp8_meta[key], loaded.fp8_meta[key]
        assert b.scale.device == torch.device("cuda:1")
        assert b.amax_history.device == torch.device("cuda:1")
        assert torch.equal(a.scale.cpu(), b.scale.cpu())
        assert torch.equal(a.amax_history.cpu(), b.amax_history.cpu())
    assert loaded.weight.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0


@needs_two_gpus
def test_quantized_model_init_on_cuda1():
    torch.cuda.set_device(0)
    FP8GlobalStateManager.reset()
    with te.quantized_model_init(recipe=DelayedScaling()):
        module = te.Linear(HIDDEN, FFN, device="cuda:1", params_dtype=BF16)
    assert isinstance(module.weight, te.Float8Tensor)
    assert module.weight.device == torch.device("cuda:1")
    assert module.weight._data.device == torch.device("cuda:1")
    assert module.fp8_meta["scaling_fwd"].scale.device == torch.device("cuda:1")
    x = torch.randn(TOKENS, HIDDEN, device="cuda:1", dtype=BF16, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = module(x)
    y.float().sum().backward()
    assert y.device == torch.device("cuda:1") and module.weight.grad.device == torch.device(
        "cuda:1"
    )
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"]
)
def test_linear_fp8_numerics_on_gpu(recipe):
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    module = te.Linear(256, 512, device="cuda:0", params_dtype=BF16)
    x = torch.randn(128, 256, device="cuda:0", dtype=BF16)
    reference = torch.nn.functional.linear(x.float(), module.weight.float(), module.bias.float())
    with te.autocast(recipe=recipe):
        for _ in range(2):  # delayed scaling needs one step to calibrate its scales
            y = module(x)
    error = (y.float() - reference).norm() / reference.norm()
    assert error < 0.05, error


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"]
)
def test_linear_fp8_any_token_count_on_gpu(recipe):
    """200 tokens, not a multiple of 16: the weight-gradient GEMM's K is zero-padded on CUDA.
    Against the same module on the CPU (the same FP8 bytes, the GEMMs emulated there) and plain
    float32 PyTorch on the original values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 25, 256, generator=g)
    dy = torch.randn(8, 25, 512, generator=g)
    torch.manual_seed(0)
    cpu = te.Linear(256, 512, device="cpu")
    results = {}
    for device in ("cpu", "cuda:0"):
        FP8GlobalStateManager.reset()
        module = cpu if device == "cpu" else te.Linear(256, 512, device=device)
        with torch.no_grad():
            for p, q in zip(module.parameters(), cpu.parameters()):
                p.copy_(q)
        x_in = x.clone().to(device).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = module(x_in)
        y.backward(dy.to(device))
        results[device] = [t.detach().cpu() for t in (y, x_in.grad, module.weight.grad)]
        results[device].append(module.bias.grad.cpu())
    (y, dx, dw, db), (y_cpu, dx_cpu, dw_cpu, db_cpu) = results["cuda:0"], results["cpu"]
    # fprop runs with fast accumulation, dgrad and wgrad with split accumulation (the recipe's)
    assert_close_by_table(y, y_cpu, ("fp8_dequantized_fast_accum", torch.float32))
    assert_close_by_table(dx, dx_cpu, ("fp8_dequantized", torch.float32))
    assert_close_by_table(dw, dw_cpu, ("fp8_dequantized", torch.float32))
    assert_close_by_table(db, db_cpu, ("same_values", torch.float32))
    w, b = cpu.weight.detach(), cpu.bias.detach()
    rows_x, rows_dy = x.reshape(200, 256), dy.reshape(200, 512)
    assert_close_by_table(y, torch.nn.functional.linear(x, w, b), ("e4m3", torch.float32))
    assert_close_by_table(dx, dy @ w, ("hybrid", torch.float32))
    assert_close_by_table(dw, rows_dy.t() @ rows_x, ("hybrid", torch.float32))
