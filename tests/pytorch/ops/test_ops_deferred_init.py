"""Deferred initialization of te.ops (the upstream bug of seeds/001: a fuser handing autograd
the stale meta Parameter after the first forward replaced it).

For BasicLinear, Bias, LayerNorm, RMSNorm, te.ops.Linear and a Sequential of them, built on
``meta``: no storage; the first forward materializes onto the input's device; the backward
gives gradients on that device for the live parameters; an optimizer built afterwards trains
exactly ``module.parameters()``; ``parameters()`` never yields a meta tensor again;
``reset_parameters()`` on the op, on ``Sequential`` and on ``te.ops.Linear`` works. All of it in
high precision and in FP8 (DelayedScaling, Float8CurrentScaling, and FP8 weights under
``te.quantized_model_init``). The GPU section (skipped without CUDA) does the same on cuda:1
while cuda:0 is current.
"""

import pytest
import torch
from utils import FP8_RECIPES, autocast_by_name, materialization_device, needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fuser import OperationFuser
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

HIDDEN, FFN, TOKENS = 32, 64, 16


def build(name, device, dtype=torch.float32):
    kw = {"device": device, "dtype": dtype}
    if name == "BasicLinear":
        return ops.BasicLinear(HIDDEN, FFN, **kw)
    if name == "Bias":
        return ops.Bias(HIDDEN, **kw)
    if name == "LayerNorm":
        return ops.LayerNorm(HIDDEN, **kw)
    if name == "RMSNorm":
        return ops.RMSNorm(HIDDEN, **kw)
    if name == "Linear":
        return ops.Linear(HIDDEN, FFN, **kw)
    if name == "Linear-nobias":
        return ops.Linear(HIDDEN, FFN, bias=False, **kw)
    if name == "Sequential":
        return ops.Sequential(
            ops.LayerNorm(HIDDEN, **kw),
            ops.Linear(HIDDEN, FFN, **kw),
            ops.GELU(),
            ops.BasicLinear(FFN, HIDDEN, **kw),
            ops.Bias(HIDDEN, **kw),
        )
    raise KeyError(name)


NAMES = ["BasicLinear", "Bias", "LayerNorm", "RMSNorm", "Linear", "Linear-nobias", "Sequential"]
WITH_FP8_WEIGHTS = ["BasicLinear", "Linear", "Sequential"]
CASES = [(name, recipe, False) for name in NAMES for recipe in (None, "delayed", "current")] + [
    (name, recipe, True) for name in WITH_FP8_WEIGHTS for recipe in ("delayed", "current")
]
CASE_IDS = [f"{n}-{r}{'-fp8weights' if q else ''}" for n, r, q in CASES]


def build_case(name, recipe, fp8_weights, device="meta"):
    if not fp8_weights:
        return build(name, device)
    with te.quantized_model_init(recipe=FP8_RECIPES[recipe]()):
        return build(name, device)


def basic_ops(module):
    if isinstance(module, ops.Sequential):
        return [b for m in module for b in (m.basic_ops if m.is_fused_op else [m])]
    return list(module.basic_ops) if module.is_fused_op else [module]


def check_live(module, device, recipe=None):
    """Every parameter materialized on ``device``, yielded once, aliases resolved, state there."""
    params = list(module.parameters())
    assert params and all(not p.is_meta and p.device == device for p in params)
    assert all(isinstance(p, torch.nn.Parameter) for p in params)
    assert len({id(p) for p in params}) == len(params)
    owned = [p for op in basic_ops(module) for p in op.parameters()]
    assert [id(p) for p in params] == [id(p) for p in owned]
    for m in module.modules():
        if isinstance(m, ops.Linear):
            assert m.weight is m.basic_ops[0].weight
            assert m.bias is (m.basic_ops[1].bias if len(m.basic_ops) > 1 else None)
    if recipe is not None:
        for op in basic_ops(module):
            for mode in ("forward", "backward"):
                state = op.recipe_state(mode)
                assert state is None or state.device == device


def data(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(device, dtype)
    return x


def out_features(module):
    return FFN if isinstance(module, (ops.BasicLinear, ops.Linear)) else HIDDEN


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_meta_construction_holds_no_storage(name):
    m = build(name, "meta")
    params = list(m.parameters())
    assert params and all(p.is_meta and isinstance(p, torch.nn.Parameter) for p in params)
    assert all(op._fp8_metas is None for op in basic_ops(m))


@pytest.mark.parametrize("name, recipe, fp8_weights", CASES, ids=CASE_IDS)
def test_first_forward_materializes_and_backward_reaches_the_live_parameters(
    name, recipe, fp8_weights
):
    m = build_case(name, recipe, fp8_weights)
    x = data("cpu").requires_grad_(True)
    with autocast_by_name(recipe):
        y = m(x)
    y.backward(torch.ones_like(y))
    cpu = torch.device("cpu")
    assert y.device == cpu and x.grad.device == cpu and x.grad.shape == x.shape
    check_live(m, cpu, recipe)
    for p in m.parameters():
        assert p.grad is not None and p.grad.device == cpu and p.grad.shape == p.shape
    if fp8_weights:
        linear = next(op for op in basic_ops(m) if isinstance(op, ops.BasicLinear))
        assert isinstance(linear.weight, te.Float8Tensor)
        assert linear.recipe_state("forward").device == cpu


@pytest.mark.parametrize("name, recipe, fp8_weights", CASES, ids=CASE_IDS)
def test_optimizer_built_after_materialization_trains_the_live_parameters(
    name, recipe, fp8_weights
):
    m = build_case(name, recipe, fp8_weights)
    x = data("cpu")
    with torch.no_grad(), autocast_by_name(recipe):
        m(x)  # materializes
    params = list(m.parameters())
    before = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
    target = torch.randn(TOKENS, out_features(m), generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        with autocast_by_name(recipe):
            loss = torch.nn.functional.mse_loss(m(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in held] == [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert all(not torch.equal(b, p.detach().float()) for b, p in zip(before, params))
    check_live(m, torch.device("cpu"), recipe)


@pytest.mark.parametrize("name", NAMES)
def test_reset_parameters_materializes_like_eager_construction(name):
    # without a device, reset_parameters() materializes onto the current CUDA device when CUDA
    # is available, else the CPU; eager construction on that device draws the same values
    default = materialization_device()
    torch.manual_seed(7)
    eager = build(name, str(default))
    torch.manual_seed(7)
    deferred = build(name, "meta")
    deferred.reset_parameters()
    check_live(deferred, default)
    for a, b in zip(eager.parameters(), deferred.parameters()):
        assert torch.equal(a, b)
    # the first forward materializes onto the input's device the values eager construction there draws
    torch.manual_seed(7)
    eager_cpu = build(name, "cpu")
    torch.manual_seed(7)
    on_first_forward = build(name, "meta")
    x = data("cpu")
    torch.manual_seed(7)
    on_first_forward(x)
    for a, b in zip(eager_cpu.parameters(), on_first_forward.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_reset_parameters_of_a_materialized_module_keeps_the_parameters(name):
    torch.manual_seed(8)
    m = build(name, "cpu")
    params = list(m.parameters())
    expected = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    torch.manual_seed(8)
    m.reset_parameters()
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    for p, e in zip(params, expected):
        assert torch.equal(p, e)


@pytest.mark.parametrize("name", NAMES)
def test_to_empty_then_reset_parameters(name):
    torch.manual_seed(9)
    eager = build(name, "cpu")
    m = build(name, "meta").to_empty(device="cpu")
    torch.manual_seed(9)
    m.reset_parameters()
    for a, b in zip(eager.parameters(), m.parameters()):
        assert torch.equal(a, b)
    m(data("cpu")).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_reset_parameters_with_an_explicit_device():
    m = ops.Linear(HIDDEN, FFN, device="meta")
    m.reset_parameters(device="cpu")
    check_live(m, torch.device("cpu"))
    with pytest.raises(ValueError, match="meta device"):
        ops.Bias(4, device="meta").reset_parameters(device="meta")


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_fuser_made_before_materialization_hands_autograd_the_live_parameters(recipe):
    """Upstream cached the parameters when the fuser was made; here nothing is cached."""
    linear, norm = ops.Linear(HIDDEN, FFN, device="meta"), ops.RMSNorm(HIDDEN, device="meta")
    fuser = OperationFuser([norm, linear])
    x = data("cpu").requires_grad_(True)
    with autocast_by_name(recipe):
        y = fuser(x)
    y.sum().backward()  # upstream: "expected device meta but got cpu"
    for p in (*norm.parameters(), *linear.parameters()):
        assert p.device.type == "cpu" and p.grad is not None
    model = build("Sequential", "meta")
    model._get_module_groups()  # fusers made while everything is meta
    with autocast_by_name(recipe):
        model(x).sum().backward()
    check_live(model, torch.device("cpu"), recipe)


def test_linear_weight_and_bias_follow_the_basic_ops():
    m = ops.Linear(HIDDEN, FFN, device="meta")
    m(data("cpu"))
    assert dict(m.named_parameters()).keys() == {"basic_ops.0.weight", "basic_ops.1.bias"}
    new_weight = torch.nn.Parameter(torch.zeros(FFN, HIDDEN))
    m.weight = new_weight
    assert m.basic_ops[0].weight is new_weight and m.weight is new_weight
    assert "weight" not in m._parameters
    # upstream code replaces an alias with register_parameter: it sets the basic op's too
    other_bias = torch.nn.Parameter(torch.zeros(FFN))
    m.register_parameter("bias", other_bias)
    assert m.basic_ops[1].bias is other_bias and "bias" not in m._parameters
    m.register_parameter("extra", torch.nn.Parameter(torch.ones(1)))  # other names as usual
    assert "extra" in m._parameters
    del m._parameters["extra"]
    y = m(data("cpu"))
    assert torch.equal(y, m.bias.expand(TOKENS, FFN))
    with pytest.raises(ValueError, match="bias=False"):
        ops.Linear(HIDDEN, FFN, bias=False, device="cpu").bias = torch.nn.Parameter(
            torch.zeros(FFN)
        )
    keys = {k for k in m.state_dict() if not k.endswith("._extra_state")}
    assert keys == {"basic_ops.0.weight", "basic_ops.1.bias"}


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_moving_back_to_meta_rematerializes_on_the_next_forward(recipe):
    m = build("Sequential", "meta")
    x = data("cpu")
    with autocast_by_name(recipe):
        m(x).sum().backward()
    m.to("meta")
    assert all(p.is_meta for p in m.parameters())
    with autocast_by_name(recipe):
        m(x).sum().backward()
    check_live(m, torch.device("cpu"), recipe)
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in m.parameters())


def test_first_forward_in_inference_mode_makes_trainable_parameters():
    m = build("Sequential", "meta")
    with torch.inference_mode():
        m(data("cpu"))
    assert all(not p.is_inference() for p in m.parameters())
    m(data("cpu")).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_weights_keep_their_high_precision_init_values(recipe):
    with te.quantized_model_init(
        recipe=FP8_RECIPES[recipe](), preserve_high_precision_init_val=True
    ):
        m = ops.BasicLinear(HIDDEN, FFN, device="meta")
    with pytest.warns(UserWarning, match="dequantized"):
        m(data("cpu"))  # outside autocast the FP8 weight is dequantized; still materializes
    weight = m.weight
    assert isinstance(weight, te.Float8Tensor) and weight.device.type == "cpu"
    init = weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and init.shape == (FFN, HIDDEN)
    torch.testing.assert_close(weight.dequantize(), init, rtol=0.125, atol=1e-2)


# ------------------------------------------------------------------------------------------
# GPU: cuda:1 while cuda:0 is current

GPU_CASES = [
    c
    for c in CASES
    if c[0] in ("BasicLinear", "Bias", "Linear", "LayerNorm", "RMSNorm", "Sequential")
]
GPU_IDS = [f"{n}-{r}{'-fp8weights' if q else ''}" for n, r, q in GPU_CASES]


def gpu_train(name, recipe, fp8_weights, device, current, steps=3, dtype=torch.bfloat16):
    """Meta build, first-forward materialization and training steps on ``device`` while
    ``current`` is the current device; returns what must land on ``device``."""
    FP8GlobalStateManager.reset()
    torch.cuda.set_device(current)
    torch.manual_seed(11)
    if fp8_weights:
        with te.quantized_model_init(recipe=FP8_RECIPES[recipe]()):
            m = build(name, "meta", dtype)
    else:
        m = build(name, "meta", dtype)
    x = (data("cpu") * 3).to(device, dtype).requires_grad_(True)
    outputs = []
    optimizer = None
    for _ in range(steps):
        with autocast_by_name(recipe):
            y = m(x)
        assert torch.cuda.current_device() == current
        y.float().square().mean().backward()
        assert torch.cuda.current_device() == current
        if optimizer is None:
            optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
        outputs.append(y.detach().float().cpu())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize(device)
    return m, x, outputs


@needs_two_gpus
@pytest.mark.parametrize("name, recipe, fp8_weights", GPU_CASES, ids=GPU_IDS)
def test_gpu_meta_ops_on_cuda1_while_cuda0_is_current(name, recipe, fp8_weights):
    dev1 = torch.device("cuda", 1)
    m, x, _ = gpu_train(name, recipe, fp8_weights, dev1, current=0)
    assert torch.cuda.current_device() == 0
    check_live(m, dev1, recipe)
    assert x.grad.device == dev1
    for p in m.parameters():
        assert p.grad is not None and p.grad.device == dev1
    for op in basic_ops(m):
        for mode in ("forward", "backward"):
            state = op.recipe_state(mode)
            if state is not None:
                assert state.device == dev1
                for t in vars(state).values():
                    if isinstance(t, torch.Tensor):
                        assert t.device == dev1


@needs_two_gpus
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_gpu_sequential_on_cuda1_is_bitwise_equal_whatever_device_is_current(recipe):
    dev1 = torch.device("cuda", 1)
    m0, x0, out0 = gpu_train("Sequential", recipe, False, dev1, current=0)
    m1, x1, out1 = gpu_train("Sequential", recipe, False, dev1, current=1)
    torch.cuda.set_device(0)
    for a, b in zip(out0, out1):
        assert torch.equal(a, b)
    assert torch.equal(x0.grad, x1.grad)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a.detach().float(), b.detach().float())
        assert torch.equal(a.grad, b.grad)


@needs_two_gpus
def test_gpu_input_on_another_device_than_the_parameters_is_refused():
    torch.cuda.set_device(0)
    m = build("Linear", "meta")
    m(torch.randn(TOKENS, HIDDEN, device="cuda:1"))
    with pytest.raises(ValueError, match=r"cuda:1.*cuda:0|cuda:0.*cuda:1"):
        m(torch.randn(TOKENS, HIDDEN, device="cuda:0"))
    assert torch.cuda.current_device() == 0


@needs_cuda
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_gpu_meta_ops_materialize_on_the_input_device(recipe):
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    m, x, _ = gpu_train("Sequential", recipe, False, device, current=0, steps=2)
    check_live(m, device, recipe)
    assert torch.cuda.current_device() == 0


@needs_two_gpus
def test_gpu_checkpoint_written_on_cuda0_loads_next_to_parameters_on_cuda1():
    torch.cuda.set_device(0)
    src = build("Sequential", "cuda:0")
    with autocast_by_name("delayed"):
        src(data("cuda:0")).sum().backward()
    dst = build("Sequential", "meta")
    dst.load_state_dict(src.state_dict(), assign=True)
    dst.to("cuda:1")
    with autocast_by_name("delayed"):
        dst(data("cuda:1")).sum().backward()
    assert torch.cuda.current_device() == 0
    check_live(dst, torch.device("cuda", 1), "delayed")
