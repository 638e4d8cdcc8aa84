"""te.ops FP8 producer fusions of the activations: ``ForwardActivationCast`` (the activation
writes the next ``BasicLinear``'s FP8 input) and ``BackwardActivationCast`` (the activation's
backward writes the previous linear's FP8 output gradient and the ``Bias`` gradient).

Checked for every activation te.ops offers, delayed and current scaling, CPU and CUDA:

* the plan holds the fused operations under FP8, and not without it;
* with float32 activations the fused ``Sequential`` has the bits of the same operations with
  these two fusions switched off (the other fusions stay on in both runs): outputs, input and
  parameter gradients over two steps, and the delayed-scaling scales and amax histories. On
  CUDA the first linear's bias gradient is the one exception, compared to float32 rounding:
  the kernel sums row tiles first (docs/ops.md);
* in BF16 the FP8 input the activation writes for the linear is the oracle's cast of the
  float32 activation values (fp8_oracle.py, activations written from their formulas in
  utils.py), and the whole step stays within FP8 error of the unfused one (the chain rounds
  the activation to BF16 before casting, the fusion does not);
* the high-precision activation (forward and backward) is never computed, and the bytes kept
  for backward are no more than the unfused chain's.
"""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch
from fusion_harness import fuser_of, fusions_off, plan, run, saved
from utils import (
    REFERENCE_ACTIVATIONS,
    autocast_by_name,
    bitwise_equal,
    count_calls,
    current_scale,
    needs_cuda,
)

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.basic import activation as activation_module
from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear, is_produced_input
from transformer_engine.pytorch.ops.fused import (
    BackwardActivationCast,
    ForwardActivationCast,
    fuse_backward_activation_cast,
    fuse_forward_activation_cast,
)

IN, FFN, OUT, TOKENS = 32, 64, 48, 32
ACTIVATIONS = {
    "gelu": ops.GELU,
    "geglu": ops.GEGLU,
    "qgelu": ops.QGELU,
    "qgeglu": ops.QGEGLU,
    "relu": ops.ReLU,
    "reglu": ops.ReGLU,
    "srelu": ops.SReLU,
    "sreglu": ops.SReGLU,
    "silu": ops.SiLU,
    "swiglu": ops.SwiGLU,
    "clamped_swiglu": ops.ClampedSwiGLU,
}
GATED = {"geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"}
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
RECIPES = ["delayed", "current"]
FUSIONS = (fuse_forward_activation_cast, fuse_backward_activation_cast)  # switched off to compare


def build(name, device, dtype, *, fc1_bias=True, seed=5):
    """``Linear(IN, FFN[*2]) -> act -> Linear(FFN, OUT)`` with non-zero biases."""
    torch.manual_seed(seed)
    width = 2 * FFN if name in GATED else FFN
    fc1 = ops.Linear(IN, width, bias=fc1_bias, device=device, dtype=dtype)
    fc2 = ops.Linear(FFN, OUT, device=device, dtype=dtype)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            if p.dim() == 1:
                p.normal_()  # a zero bias would hide a missing bias gradient
    return ops.Sequential(fc1, ACTIVATIONS[name](), fc2)


def fused_and_unfused(monkeypatch, name, device, dtype, recipe, shape=(TOKENS, IN), **kw):
    torch.manual_seed(11)
    x = torch.randn(shape, device=device, dtype=dtype)
    dy = torch.randn(*shape[:-1], OUT, device=device, dtype=dtype)
    fused_model = build(name, device, dtype, **kw)
    fused = run(fused_model, x, dy, recipe)
    with fusions_off(monkeypatch, *FUSIONS):
        unfused_model = build(name, device, dtype, **kw)
        unfused = run(unfused_model, x, dy, recipe)
        assert not any(
            type(op) in (ForwardActivationCast, BackwardActivationCast)
            for op, _ in fuser_of(unfused_model)._forward_ops
            + fuser_of(unfused_model)._backward_ops
        )
    return fused, unfused, fuser_of(fused_model)


# -- the plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_holds_the_fused_operations_under_fp8(recipe):
    model = build("gelu", "cpu", torch.float32)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    with autocast_by_name(recipe):
        model(x).sum().backward()
    fuser = fuser_of(model)
    # basic ops: 0 BasicLinear, 1 Bias, 2 GELU, 3 BasicLinear, 4 Bias
    assert plan(fuser, "forward") == [
        ("ForwardLinearBiasActivation", [0, 1]),
        ("ForwardActivationCast", [2]),
        ("ForwardLinearBiasActivation", [3, 4]),
    ]
    assert plan(fuser, "backward") == [
        ("BackwardActivationCast", [0, 1, 2]),
        ("BackwardLinearBias", [3, 4]),
    ]


def test_plan_without_fp8_is_unchanged():
    model = build("gelu", "cpu", torch.float32)
    model(torch.randn(TOKENS, IN, requires_grad=True)).sum().backward()
    fuser = fuser_of(model)
    names = [n for n, _ in plan(fuser, "forward") + plan(fuser, "backward")]
    assert "ForwardActivationCast" not in names and "BackwardActivationCast" not in names
    assert plan(fuser, "forward")[0] == ("ForwardLinearBiasActivation", [0, 1, 2])


def test_plan_without_bias_and_with_a_trailing_activation():
    # BasicLinear, act, BasicLinear, act: the last activation has no linear after it
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.BasicLinear(IN, FFN, device="cpu"),
        ops.ReLU(),
        ops.BasicLinear(FFN, FFN, device="cpu"),
        ops.SiLU(),
    )
    with autocast_by_name("delayed"):
        model(torch.randn(TOKENS, IN, requires_grad=True)).sum().backward()
    fuser = fuser_of(model)
    assert plan(fuser, "forward") == [
        ("BasicLinear", [0]),
        ("ForwardActivationCast", [1]),
        ("BasicLinear", [2]),
        ("SiLU", [3]),
    ]
    assert plan(fuser, "backward") == [
        ("BackwardActivationCast", [0, 1]),
        ("BackwardActivationCast", [2, 3]),
    ]


# -- bits against the unfused chain ----------------------------------------------------------


def assert_same(fused, unfused, *, device, loose=()):
    assert [n for n, _ in fused] == [n for n, _ in unfused]
    for (name, a), (_, b) in zip(fused, unfused):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if device == "cuda" and name in loose:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert bitwise_equal(a, b), f"{name}: {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_float32_bits_equal_the_unfused_chain(monkeypatch, name, recipe, device):
    fused, unfused, fuser = fused_and_unfused(monkeypatch, name, device, torch.float32, recipe)
    kinds = {type(op) for op, _ in fuser._forward_ops + fuser._backward_ops}
    assert {ForwardActivationCast, BackwardActivationCast} <= kinds
    # the first linear's bias gradient comes from the activation kernel's column sums
    assert_same(fused, unfused, device=device, loose=("0.basic_ops.1.bias",))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [TOKENS // 2, 5], ids=["aligned", "10_tokens"])
def test_float32_bits_with_3d_input_and_no_bias(monkeypatch, recipe, device, tokens):
    # 2 x 5 tokens: the weight-gradient GEMMs reduce over a count not a multiple of 16.
    fused, unfused, _ = fused_and_unfused(
        monkeypatch, "swiglu", device, torch.float32, recipe, shape=(2, tokens, IN),
        fc1_bias=False,
    )  # fmt: skip
    assert_same(fused, unfused, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["gelu", "swiglu", "srelu"])
def test_bfloat16_step_stays_within_fp8_error_of_the_unfused_chain(
    monkeypatch, name, recipe, device
):
    fused, unfused, _ = fused_and_unfused(monkeypatch, name, device, torch.bfloat16, recipe)
    for (key, a), (_, b) in zip(fused, unfused):
        if a is None or key.startswith(("scale", "amax")):
            continue
        # FP8 E4M3 keeps 3 mantissa bits: the two roundings may pick neighbouring codes
        scale = b.double().abs().max().clamp(min=1.0)
        assert (a.double() - b.double()).abs().max() <= 0.15 * scale, key


# -- what the activation writes --------------------------------------------------------------


def _captured_inputs(monkeypatch):
    """The FP8 storages the second linear receives from a producer."""
    seen = []
    original = BasicLinear.linear_forward

    def spy(self, ctx, input_, bias=None):
        if is_produced_input(input_):
            seen.append(input_)
        return original(self, ctx, input_, bias)

    monkeypatch.setattr(BasicLinear, "linear_forward", spy)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_bfloat16_fp8_input_is_the_cast_of_the_float32_activation(
    monkeypatch, name, recipe, device
):
    model = build(name, device, torch.bfloat16)
    torch.manual_seed(3)
    x = torch.randn(TOKENS, IN, device=device, dtype=torch.bfloat16)
    seen = _captured_inputs(monkeypatch)
    with torch.no_grad(), autocast_by_name(recipe):
        h = model[0](x)  # FC1 alone (no FP8 producer before it), the activation's input
        model(x)
    (act_q,) = seen
    values = REFERENCE_ACTIVATIONS[name](h.double()).float()
    fp8 = torch.float8_e4m3fn  # the forward format of both recipes' defaults (HYBRID/E4M3)
    scale = torch.ones(1) if recipe == "delayed" else current_scale(values.cpu(), fp8)
    expected = oracle.cast_bytes(values.cpu(), scale, fp8).view(torch.uint8).to(torch.int16)
    got = act_q._data.cpu().view(torch.uint8).to(torch.int16)
    assert got.shape == expected.shape
    # The package computes in float32 with libm / fused PyTorch kernels, the oracle in float64
    # rounded to float32 once: a value on an FP8 rounding boundary may land on the
    # neighbouring code (same sign, code +-1); anything else is a wrong byte.
    differ = got != expected
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {got.numel()} bytes differ"
    assert ((got - expected).abs()[differ] == 1).all()


# -- no high-precision activation, saved bytes -----------------------------------------------


def test_high_precision_activation_is_never_computed(monkeypatch):
    calls = count_calls(monkeypatch, activation_module, forward="activation_forward",
                        backward="activation_backward")  # fmt: skip
    model = build("geglu", "cpu", torch.bfloat16)
    x = torch.randn(TOKENS, IN, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name("current"):
        y = model(x)
    y.float().sum().backward()
    assert calls == {"forward": 0, "backward": 0}
    model(x).float().sum().backward()  # without FP8 the activation runs as before
    assert calls == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["gelu", "swiglu"])
def test_saved_bytes_are_no_more_than_unfused(monkeypatch, name, recipe):
    x = torch.randn(TOKENS, IN, dtype=torch.bfloat16, requires_grad=True)
    fused_bytes, kinds = saved(build(name, "cpu", torch.bfloat16), x, recipe)
    with fusions_off(monkeypatch, *FUSIONS):
        unfused_bytes, _ = saved(build(name, "cpu", torch.bfloat16), x, recipe)
    assert fused_bytes <= unfused_bytes
    # kept: FC1's FP8 input (transposed), FC1's output h in BF16 (the activation's backward
    # reads it), FC2's FP8 input (transposed); no BF16 copy of the activation's output
    high_precision = [shape for shape, dtype in kinds if dtype == torch.bfloat16]
    width = 2 * FFN if name in GATED else FFN
    assert high_precision == [(TOKENS, width)]
    assert (FFN, TOKENS) in [shape for shape, dtype in kinds if dtype == torch.uint8]
