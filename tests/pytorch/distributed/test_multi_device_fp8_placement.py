"""Single-process multi-device FP8: a module or operation on a device that is not the current
one. A te.Linear trained on ``cuda:1`` while ``cuda:0`` is current, te.ops.BasicLinear there
(built on ``cuda:1`` or on meta), and the forward device guard released when forward preparation
raises.

The scenario is upstream issue #3124 (``shared/seeds/000``): ``accelerate.dispatch_model`` puts
TE modules on ``cuda:1`` while ``cuda:0`` stays current, and FP8 training must run there, keep
its state there and leave the caller's current device alone. Every test asserts where outputs,
gradients and FP8 state landed and that the current device and the forward device guard
(``guard_depth()``) came back unchanged: a wrong-device launch can "work" by accident.

Runs on CPU: the guard cleanup when forward preparation raises. The rest needs two GPUs in one
process and skips with the reason elsewhere; it runs on the GPU machine through
qa/L0_pytorch_gpu/test.sh. Shared helpers: multi_device_fp8_helpers.py.
"""

import pytest
import torch
from multi_device_fp8_helpers import (
    BF16,
    CPU,
    CUDA0,
    CUDA1,
    FFN,
    HIDDEN,
    TOKENS,
    clean_state,  # noqa: F401 (autouse fixture)
    cpu_input,
    current_device,
    fp8_tensors,
    make_linear,
    module_quantizers,
    quantizer_tensors,
    two_gpus,
)
from utils import bitwise_equal

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.device import device_guard, guard_depth
from transformer_engine.pytorch.module import linear as linear_module
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

# ---------------------------------------------------------------------------------------------
# 1. A module on a device that is not the current one


def _train_linear(device, steps=3):
    """FP8 (delayed scaling) steps of one te.Linear; returns outputs, input grads and module."""
    FP8GlobalStateManager.reset()
    module = make_linear(device, HIDDEN, FFN, seed=1)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    g = torch.Generator().manual_seed(7)
    outs = []
    for step in range(steps):
        x = cpu_input(g, TOKENS, HIDDEN, scale=1 + step).to(device, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = module(x)
            row0 = module.fp8_meta["scaling_fwd"].amax_history[0]
            # the casts of this forward wrote their amaxes into the state on the module's device
            assert bool((row0[:2] > 0).all()), row0
        y.float().square().mean().backward()
        outs += [y.detach(), x.grad]
    return outs, module


@two_gpus
def test_linear_on_a_non_current_device_runs_fp8_there(monkeypatch):
    torch.cuda.set_device(0)
    seen = []
    original = linear_module.linear

    def recording_linear_forward(*args, **kwargs):
        seen.append((torch.cuda.current_device(), guard_depth()))
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_module, "linear", recording_linear_forward)
    outs, module = _train_linear("cuda:1")
    torch.cuda.synchronize(CUDA1)

    assert torch.cuda.current_device() == 0
    assert guard_depth() == 0
    # the GEMMs ran with the input's device current, inside exactly one guarded region
    assert seen == [(1, 1)] * 3
    for t in outs:
        assert t.device == CUDA1
    for name, p in module.named_parameters():
        assert p.device == CUDA1 and p.grad is not None and p.grad.device == CUDA1, name
    for name, t in fp8_tensors(module).items():
        assert t.device == CUDA1, name
    for t in quantizer_tensors(module_quantizers(module)):
        assert t.device == CUDA1
    state = fp8_tensors(module)
    # delayed scaling really ran: forward (input, weight) and backward (grad output) scales moved
    assert bool((state["scaling_fwd.scale"][:2] != 1).all())
    assert bool(state["scaling_bwd.scale"][0] != 1)

    # bit for bit what the same run gives with cuda:1 current
    torch.cuda.set_device(1)
    try:
        ref_outs, ref_module = _train_linear("cuda:1")
    finally:
        torch.cuda.set_device(0)
    for a, b in zip(outs, ref_outs):
        assert bitwise_equal(a, b)
    for (name, a), b in zip(module.named_parameters(), ref_module.parameters()):
        assert bitwise_equal(a.grad, b.grad), name
    for name, t in fp8_tensors(ref_module).items():
        assert bitwise_equal(state[name], t), name


# ---------------------------------------------------------------------------------------------
# 2. The guard is released when forward preparation raises


def _injected_failure(name: str, inside: list):
    def fail(*args, **kwargs):
        inside.append((guard_depth(), current_device()))
        raise RuntimeError(f"injected failure in {name}")

    return fail


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:1", marks=two_gpus)])
@pytest.mark.parametrize(
    "failure",
    ["init_fp8_metadata", "set_activation_dtype", "input_dtype_mismatch", "ops_reset_recipe_state"],
)
def test_guard_is_released_when_forward_preparation_raises(device, failure):
    on_gpu = device != "cpu"
    if on_gpu:
        torch.cuda.set_device(0)
    ambient = 0 if on_gpu else current_device()  # CPU runs must leave any CUDA device alone
    device = torch.device(device)
    inside: list = []
    g = torch.Generator().manual_seed(3)
    x = cpu_input(g, TOKENS, HIDDEN).to(device, BF16)
    if failure == "ops_reset_recipe_state":
        module = te.ops.BasicLinear(HIDDEN, HIDDEN, device=device, dtype=BF16)
        module.reset_recipe_state = _injected_failure(failure, inside)
        expected = pytest.raises(RuntimeError, match="injected failure")
    elif failure == "input_dtype_mismatch":
        module = make_linear(device, HIDDEN, HIDDEN, seed=3)
        x = x.float()  # BF16 parameters, FP32 input, no torch.autocast: set_activation_dtype
        expected = pytest.raises(TypeError, match="does not match parameter")
    else:
        module = make_linear(device, HIDDEN, HIDDEN, seed=3)
        setattr(module, failure, _injected_failure(failure, inside))
        expected = pytest.raises(RuntimeError, match="injected failure")

    # inside an enclosing guarded region, as when an outer forward calls this module
    anchor = CUDA0 if on_gpu else CPU
    with device_guard(anchor):
        with expected:
            with te.autocast(recipe=DelayedScaling()):
                module(x)
        assert guard_depth() == 1, "only the enclosing region may still be open"
        assert current_device() == ambient
    assert guard_depth() == 0
    assert current_device() == ambient
    if failure != "input_dtype_mismatch":
        # the failure happened inside the module's own guard, with the input's device current
        assert inside == [(2, 1 if on_gpu else ambient)]

    # the module is not left broken: an FP8 step afterwards runs on its device
    if failure == "ops_reset_recipe_state":
        del module.reset_recipe_state
    elif failure != "input_dtype_mismatch":
        delattr(module, failure)
    x = x.to(BF16).requires_grad_(True)
    with te.autocast(recipe=DelayedScaling()):
        y = module(x)
    y.float().sum().backward()
    assert y.device == device and x.grad.device == device
    assert module.weight.grad.device == device
    assert guard_depth() == 0
    assert current_device() == ambient


# ---------------------------------------------------------------------------------------------
# 3. te.ops.BasicLinear on a device that is not the current one


@two_gpus
@pytest.mark.parametrize("built_on", ["cuda:1", "meta"])
def test_basic_linear_op_on_a_non_current_device(built_on, monkeypatch):
    torch.cuda.set_device(0)
    seen = []
    original_forward = te.ops.BasicLinear.op_forward
    original_backward = te.ops.BasicLinear.op_backward

    def op_forward(self, ctx, input_, **kwargs):
        seen.append(("forward", torch.cuda.current_device(), guard_depth()))
        return original_forward(self, ctx, input_, **kwargs)

    def op_backward(self, ctx, grad_output):
        seen.append(("backward", torch.cuda.current_device()))
        return original_backward(self, ctx, grad_output)

    monkeypatch.setattr(te.ops.BasicLinear, "op_forward", op_forward)
    monkeypatch.setattr(te.ops.BasicLinear, "op_backward", op_backward)

    op = te.ops.BasicLinear(HIDDEN, FFN, device=built_on, dtype=BF16)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    g = torch.Generator().manual_seed(11)
    for step in range(3):
        x = cpu_input(g, TOKENS, HIDDEN, scale=1 + step).to(CUDA1, BF16).requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = op(x)
            forward_state = op.recipe_state("forward")
            # recipe state made on the parameters' device, and the casts wrote into it there
            assert forward_state.device == CUDA1
            assert bool((forward_state.amax_history[0] > 0).all())
        y.float().square().mean().backward()
        assert torch.cuda.current_device() == 0
        assert guard_depth() == 0
        assert y.device == CUDA1 and x.grad.device == CUDA1
        assert op.weight.grad.device == CUDA1

    # a meta weight is materialized onto the input's device, not the current one
    assert op.weight.device == CUDA1
    for mode in ("forward", "backward"):
        state = op.recipe_state(mode)
        assert state.scale.device == CUDA1 and state.amax_history.device == CUDA1, mode
        assert bool((state.scale[:1] != 1).all()), f"{mode} scales were never updated"
        count = op.num_quantizers(mode)
        for t in quantizer_tensors([op.get_quantizer(mode, i) for i in range(count)]):
            assert t.device == CUDA1
    assert [s for s in seen if s[0] == "forward"] == [("forward", 1, 1)] * 3
    assert [s for s in seen if s[0] == "backward"] == [("backward", 1)] * 3
