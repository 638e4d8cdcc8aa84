"""LayerNormLinear and LayerNormMLP on CPU: forward and backward against the same computation
in plain PyTorch (float64, on the module's parameter values), in high precision and in FP8
(delayed and current scaling), plus the module contract (tuples, parameter splits, weight
caching, main_grad fusion, deferred init, FP8 parameters, recipe state, errors).

Tolerances come from tests/pytorch/tolerances.py: high precision FP32 ("same_values"), BF16
modules against the float64 reference of their BF16 values ("bf16": intermediates such as the
norm output are rounded to BF16), FP8 forward ("e4m3") and backward ("hybrid": E5M2 gradients
with E4M3 weights and inputs, the default HYBRID format).
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table, table_keys
from utils import (
    RECIPES_WITH_HIGH_PRECISION,
    REFERENCE_ACTIVATIONS,
    clamped_swiglu,
    make_recipe,
    materialization_device,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

SEED = 1  # the numeric checks passed for seeds 0..49 (FP8 included) when they were written
TOKENS = 64  # the K of the weight-gradient GEMMs: fewer tokens make FP8 wgrad errors spikier
DTYPES = [torch.float32, torch.bfloat16]
ACTIVATION_NAMES = [
    "gelu", "geglu", "glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu",
    "swiglu", "clamped_swiglu",
]  # fmt: skip


# --- the plain-PyTorch reference (float64) ------------------------------------------------------


def reference_params(module):
    """float64 leaf copies of the module's parameters (FP8 ones dequantized)."""
    out = {}
    for name, p in module.named_parameters():
        value = p.dequantize() if isinstance(p, QuantizedTensor) else p
        out[name] = value.detach().double().requires_grad_()
    return out


def reference_norm(module, params, x):
    gamma = params["layer_norm_weight"] + (1 if module.zero_centered_gamma else 0)
    if module.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, params["layer_norm_bias"], module.eps)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + module.eps) * gamma


def reference_layernorm_linear(module, params, x):
    ln = reference_norm(module, params, x)
    if "weight" in params:
        weight, bias = params["weight"], params.get("bias")
    else:
        weight = torch.cat([params[f"{n}_weight"] for n in module.sizes])
        bias = torch.cat([params[f"{n}_bias"] for n in module.sizes]) if module.use_bias else None
    return F.linear(ln, weight, bias), ln


def reference_layernorm_mlp(module, params, x, activation):
    ln = reference_norm(module, params, x)
    h = F.linear(ln, params["fc1_weight"], params.get("fc1_bias"))
    act = REFERENCE_ACTIVATIONS[activation](h)
    return F.linear(act, params["fc2_weight"], params.get("fc2_bias")), ln


# --- helpers -------------------------------------------------------------------------------------
def randomize(module, seed=0):
    """Weights ~ N(0, 1/fan_in) (O(1) activations), norm and bias parameters off their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name == "layer_norm_weight":
                base = 0.0 if module.zero_centered_gamma else 1.0
                p.copy_(base + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    return module


def run(module, x, dy, recipe, **kwargs):
    """Forward in te.autocast (FP8 when recipe is given), then backward of ``out`` with ``dy``."""
    x = x.detach().clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x, **kwargs)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(dy)
    return out, x.grad


def check_against_reference(
    module, reference_fn, recipe_name, dtype, in_size, out_size, lead=(TOKENS // 16, 16)
):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(*lead, in_size, generator=g).to(dtype)
    dy = torch.randn(*lead, out_size, generator=g).to(dtype)
    params = reference_params(module)
    x_ref = x.double().requires_grad_()
    y_ref, _ = reference_fn(module, params, x_ref)
    y_ref.backward(dy.double())

    y, dx = run(module, x, dy, make_recipe(recipe_name))
    fwd_key, bwd_key = table_keys(recipe_name, dtype)
    assert y.dtype == dtype and y.device.type == "cpu" and y.shape == y_ref.shape
    assert_close_by_table(y, y_ref, fwd_key)
    assert_close_by_table(dx, x_ref.grad, bwd_key)
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert_close_by_table(p.grad, params[name].grad, bwd_key)


def state(module, direction="fwd"):
    return module.fp8_meta[f"scaling_{direction}"]


# --- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_linear_matches_reference(recipe_name, dtype, normalization, zero_centered_gamma):
    module = LayerNormLinear(
        64, 48, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
        params_dtype=dtype, device="cpu",
    )  # fmt: skip
    randomize(module)
    check_against_reference(module, reference_layernorm_linear, recipe_name, dtype, 64, 48)


GATED = ("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")


def dequantized(recipe, forward):
    """float64 values of a tensor after the module's first-step quantization (identity in high
    precision): a fresh quantizer of the recipe has the scale the module used at step one
    (delayed: 1; current: from the tensor's own amax)."""
    if recipe is None:
        return lambda t: t.detach().double()
    mode = "forward" if forward else "backward"
    quantizer = RecipeState.create(recipe, mode=mode, device="cpu").make_quantizers()[0]
    return lambda t: quantizer.quantize_impl(t.detach()).dequantize(dtype=torch.float32).double()


def check_mlp_stages(module, activation_ref, recipe_name, dtype, lead=(TOKENS // 16, 16)):
    """Every stage of the MLP against float64 on exactly the values the module fed it.

    The norm output, the activation's input and output and their gradients are captured, and
    each GEMM is recomputed in float64 from the module's own operands, quantized and
    dequantized as the module did (FP8) or as they are (high precision). Each comparison then
    spans one GEMM with known operands ("fp8_dequantized" / "same_values" rows). Comparing the
    whole FP8 chain with a high-precision reference instead compounds the quantization errors
    of up to four casts, which on heavy-tailed gated activations exceed one GEMM's table row.
    """
    captured = {}
    activation_fn = module.activation_fn

    def capturing(h):
        h.register_hook(lambda grad: captured.__setitem__("dh", grad))
        a = activation_fn(h)
        a.register_hook(lambda grad: captured.__setitem__("da", grad))
        captured["h"], captured["a"] = h.detach(), a.detach()
        return a

    module.activation_fn = capturing
    module.return_layernorm_output = True
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(*lead, module.hidden_size, generator=g).to(dtype)
    dy = torch.randn(*lead, module.hidden_size, generator=g).to(dtype)
    recipe = make_recipe(recipe_name)
    x_in = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y, ln_out = module(x_in)
    ln_out.register_hook(lambda grad: captured.__setitem__("d_ln", grad))
    y.backward(dy)
    gemm_key = ("same_values" if recipe is None else "fp8_dequantized", dtype)
    pointwise_key = ("same_values", dtype)
    fwd, bwd = dequantized(recipe, True), dequantized(recipe, False)
    p = reference_params(module)
    w1, w2 = fwd(module.fc1_weight), fwd(module.fc2_weight)
    ln, h, a = fwd(ln_out), captured["h"].double(), fwd(captured["a"])
    da, dh, dy_q = captured["da"].double(), bwd(captured["dh"]), bwd(dy)

    def tokens(t):
        return t.flatten(0, 1)

    x64 = x.double().requires_grad_()
    ln_ref = reference_norm(module, p, x64)
    assert_close_by_table(ln_out, ln_ref, pointwise_key)
    assert_close_by_table(captured["h"], F.linear(ln, w1, p["fc1_bias"]), gemm_key)
    h_leaf = h.clone().requires_grad_()
    a_ref = activation_ref(h_leaf)
    assert_close_by_table(captured["a"], a_ref, pointwise_key)
    assert_close_by_table(y, F.linear(a, w2, p["fc2_bias"]), gemm_key)

    assert_close_by_table(captured["da"], dy_q @ w2, gemm_key)
    assert_close_by_table(module.fc2_weight.grad, tokens(dy_q).t() @ tokens(a), gemm_key)
    assert_close_by_table(module.fc2_bias.grad, dy.double().sum((0, 1)), pointwise_key)
    (dh_ref,) = torch.autograd.grad(a_ref, h_leaf, da)
    assert_close_by_table(captured["dh"], dh_ref, pointwise_key)
    assert_close_by_table(module.fc1_weight.grad, tokens(dh).t() @ tokens(ln), gemm_key)
    assert_close_by_table(module.fc1_bias.grad, captured["dh"].double().sum((0, 1)), pointwise_key)
    norm_params = [p["layer_norm_weight"]]
    if module.normalization == "LayerNorm":
        norm_params.append(p["layer_norm_bias"])
    assert_close_by_table(captured["d_ln"], dh @ w1, gemm_key)
    grads = torch.autograd.grad(ln_ref, [x64, *norm_params], captured["d_ln"].double())
    assert_close_by_table(x_in.grad, grads[0], pointwise_key)
    assert_close_by_table(module.layer_norm_weight.grad, grads[1], pointwise_key)
    if module.normalization == "LayerNorm":
        assert_close_by_table(module.layer_norm_bias.grad, grads[2], pointwise_key)


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_layernorm_mlp_matches_reference(recipe_name, dtype, activation):
    module = LayerNormMLP(64, 32, activation=activation, params_dtype=dtype, device="cpu")
    randomize(module)
    fc1_rows = 64 if activation in GATED else 32
    assert module.fc1_weight.shape == (fc1_rows, 64) and module.fc2_weight.shape == (64, 32)
    check_mlp_stages(module, REFERENCE_ACTIVATIONS[activation], recipe_name, dtype)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_layernorm_mlp_end_to_end_in_float32(activation):
    """The whole chain at once (FP32 only: in BF16 a rounded pre-activation can cross a kink
    such as ReLU's, which the staged test above handles by feeding the module's own values)."""
    module = randomize(LayerNormMLP(64, 32, activation=activation, device="cpu"))

    def reference(m, params, x):
        return reference_layernorm_mlp(m, params, x, activation)

    check_against_reference(module, reference, "high_precision", torch.float32, 64, 64)


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp_zero_centered_gamma_and_clamp_parameters(recipe_name, normalization):
    params = {"limit": 0.5, "alpha": 1.0, "glu_linear_offset": 0.25}
    module = LayerNormMLP(
        64, 32, normalization=normalization, zero_centered_gamma=True,
        activation="clamped_swiglu", activation_params=params, device="cpu",
    )  # fmt: skip
    assert torch.equal(module.layer_norm_weight, torch.zeros(64))
    randomize(module)

    check_mlp_stages(module, lambda h: clamped_swiglu(h, **params), recipe_name, torch.float32)


# --- return tuples and parameter splits ----------------------------------------------------------
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("return_bias", [False, True])
@pytest.mark.parametrize("return_layernorm_output", [False, True])
def test_return_tuples(cls, return_bias, return_layernorm_output):
    kwargs = dict(
        return_bias=return_bias, return_layernorm_output=return_layernorm_output, device="cpu"
    )
    if cls == "LayerNormLinear":
        module = randomize(LayerNormLinear(32, 16, **kwargs))
        bias_name, reference_fn = "bias", reference_layernorm_linear
    else:
        module = randomize(LayerNormMLP(32, 16, **kwargs))
        bias_name = "fc2_bias"

        def reference_fn(m, p, x):
            return reference_layernorm_mlp(m, p, x, "gelu")

    x = torch.randn(4, 32, requires_grad=True)
    out = module(x)
    params = reference_params(module)
    y_ref, ln_ref = reference_fn(module, params, x.detach().double())
    expected_len = 1 + return_bias + return_layernorm_output
    if expected_len == 1:
        assert isinstance(out, torch.Tensor)
        out = (out,)
    assert isinstance(out, tuple) and len(out) == expected_len
    key = ("same_values", torch.float32)
    bias = getattr(module, bias_name)
    if return_bias:
        assert out[1] is not None and torch.equal(out[1], bias)
        assert_close_by_table(out[0], y_ref - bias.detach().double(), key)
    else:
        assert_close_by_table(out[0], y_ref, key)
    if return_layernorm_output:
        assert_close_by_table(out[-1], ln_ref, key)
        out[-1].sum().backward()  # the norm output is part of the graph
        assert x.grad is not None and module.layer_norm_weight.grad is not None


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("split", [("query_", "key_", "value_"), {"q": 16, "kv": 32}])
def test_layernorm_linear_parameters_split(recipe_name, split):
    module = randomize(LayerNormLinear(32, 48, parameters_split=split, device="cpu"))
    names = [n for n, _ in module.named_parameters()]
    prefixes = ["query", "key", "value"] if isinstance(split, tuple) else ["q", "kv"]
    # upstream's order: the norm's parameters, every split weight, then every split bias
    expected = ["layer_norm_weight", "layer_norm_bias"]
    expected += [f"{prefix}_weight" for prefix in prefixes] + [
        f"{prefix}_bias" for prefix in prefixes
    ]
    assert names == expected
    if isinstance(split, dict):
        assert module.kv_weight.shape == (32, 32) and module.q_bias.shape == (16,)
    check_against_reference(module, reference_layernorm_linear, recipe_name, torch.float32, 32, 48)


def test_no_bias():
    module = LayerNormLinear(32, 16, bias=False, normalization="RMSNorm", device="cpu")
    assert module.bias.numel() == 0 and module.layer_norm_bias is None
    assert [n for n, _ in module.named_parameters()] == ["layer_norm_weight", "weight"]
    mlp = LayerNormMLP(32, 16, bias=False, device="cpu")
    assert mlp.fc1_bias.numel() == 0 and mlp.fc2_bias.numel() == 0
    assert mlp(torch.randn(4, 32)).shape == (4, 32)


# --- weight caching and main_grad ------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_is_first_microbatch_reuses_cached_fp8_weight(cls):
    module = randomize(LayerNormLinear(32, 32, device="cpu") if cls == "LayerNormLinear" else
                       LayerNormMLP(32, 32, device="cpu"))  # fmt: skip
    weight_slots = {
        "LayerNormLinear": {"weight": 1},
        "LayerNormMLP": {"fc1_weight": 1, "fc2_weight": 4},
    }[cls]
    x = torch.randn(16, 32)
    recipe = DelayedScaling()
    with te.autocast(recipe=recipe):
        module(x, is_first_microbatch=True)
        history = state(module).amax_history
        for slot in weight_slots.values():
            assert history[0, slot] > 0
    cached = {key: module._fp8_workspaces[key] for key in weight_slots}
    with te.autocast(recipe=recipe):
        module(x, is_first_microbatch=False)
        history = state(module).amax_history
        assert history[0, 0] > 0  # the input was quantized ...
        for slot in weight_slots.values():
            assert history[0, slot] == 0  # ... the weights were not: the cached copies were used
    for key, value in cached.items():
        assert module._fp8_workspaces[key] is value
    with te.autocast(recipe=recipe):
        module(x)  # None: no caching, the workspaces are dropped
    assert not any(key in module._fp8_workspaces for key in weight_slots)


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_fuse_wgrad_accumulation_into_main_grad(recipe_name, cls):
    if cls == "LayerNormLinear":
        module = LayerNormLinear(32, 32, fuse_wgrad_accumulation=True, device="cpu")
        weights, reference_fn = ["weight"], reference_layernorm_linear
    else:
        module = LayerNormMLP(32, 32, fuse_wgrad_accumulation=True, device="cpu")
        weights = ["fc1_weight", "fc2_weight"]

        def reference_fn(m, p, x):
            return reference_layernorm_mlp(m, p, x, "gelu")

    randomize(module)
    for name in weights:
        getattr(module, name).main_grad = torch.full_like(getattr(module, name), 7.0)
    params = reference_params(module)
    g = torch.Generator().manual_seed(3)
    for first in (True, False):
        x, dy = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        run(module, x, dy, make_recipe(recipe_name), is_first_microbatch=first)
        y_ref, _ = reference_fn(module, params, x.double())
        y_ref.backward(dy.double())  # reference grads accumulate over both microbatches
    _, bwd_key = table_keys(recipe_name, torch.float32)
    for name in weights:
        weight = getattr(module, name)
        assert weight.grad is None and weight.main_grad.dtype == torch.float32
        # the first microbatch overwrote the 7s, the second accumulated
        assert_close_by_table(weight.main_grad, params[name].grad, bwd_key)


# --- deferred init, FP8 parameters, recipe state ----------------------------------------------------
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_deferred_init(cls, zero_centered_gamma):
    build = LayerNormLinear if cls == "LayerNormLinear" else LayerNormMLP
    module = build(32, 32, zero_centered_gamma=zero_centered_gamma, device="meta")
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    module.reset_parameters()
    gamma = 0.0 if zero_centered_gamma else 1.0
    for name, p in module.named_parameters():
        assert p.device.type == "cpu", name
        if name == "layer_norm_weight":
            assert torch.equal(p, torch.full_like(p, gamma))
        elif p.dim() == 1:
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert 0.01 < p.std().item() < 0.04, name  # N(0, 0.023)
    assert module(torch.randn(16, 32)).device.type == "cpu"

    direct = build(32, 32, device="meta")
    direct.reset_parameters()  # the current CUDA device, else the CPU
    assert all(p.device == materialization_device() for p in direct.parameters())
    assert torch.equal(direct.layer_norm_weight.cpu(), torch.ones(32))


def test_meta_module_refuses_to_run():
    module = LayerNormMLP(32, 32, device="meta")
    with pytest.raises(ValueError, match="meta"):
        module(torch.randn(16, 32))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_fp8_parameters_under_quantized_model_init(recipe_name, cls):
    recipe = make_recipe(recipe_name)
    with te.quantized_model_init(recipe=recipe):
        if cls == "LayerNormLinear":
            module = LayerNormLinear(32, 32, device="cpu")
            fp8_names, reference_fn = ["weight"], reference_layernorm_linear
        else:
            module = LayerNormMLP(32, 32, device="cpu")
            fp8_names = ["fc1_weight", "fc2_weight"]

            def reference_fn(m, p, x):
                return reference_layernorm_mlp(m, p, x, "gelu")

    for name, p in module.named_parameters():
        assert isinstance(p, QuantizedTensor) == (name in fp8_names), name
    x, dy = torch.randn(16, 32), torch.randn(16, 32)
    y, dx = run(module, x, dy, recipe)
    y_ref, _ = reference_fn(module, reference_params(module), x.double())
    assert_close_by_table(y, y_ref, ("e4m3", torch.float32))
    assert dx is not None and all(getattr(module, n).grad is not None for n in fp8_names)
    with pytest.warns(UserWarning, match="dequantized"):
        y_hp = module(x)  # outside te.autocast: dequantized weights, high-precision GEMMs
    assert_close_by_table(y_hp, y_ref, ("same_values", torch.float32))


@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_delayed_scaling_state_registered_and_updated(cls):
    """One step registers the state; forward scales update at autocast exit and backward
    scales at the end of the module's backward. FC1 (whose backward runs last) updates the
    backward scales, so FC2's grad-output slot is updated too."""
    if cls == "LayerNormLinear":
        module, used_fwd, used_bwd = LayerNormLinear(32, 32, device="cpu"), [0, 1], [0]
    else:
        module, used_fwd, used_bwd = LayerNormMLP(32, 32, device="cpu"), [0, 1, 3, 4], [0, 2]
    randomize(module)
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = module(x)
        assert torch.equal(state(module).scale, torch.ones_like(state(module).scale))
    assert FP8GlobalStateManager.get_buffer_info() in module.fp8_meta
    y.backward(torch.randn_like(y))
    for direction, used in (("fwd", used_fwd), ("bwd", used_bwd)):
        scale = state(module, direction).scale
        assert scale.device.type == "cpu"
        for slot in range(scale.numel()):
            assert (scale[slot] != 1) == (slot in used), (direction, slot, scale)
    assert len(state(module).scale) == (3 if cls == "LayerNormLinear" else 6)


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("cls", [LayerNormLinear, LayerNormMLP])
def test_torch_autocast_bf16_with_fp32_params(recipe_name, cls):
    module = randomize(cls(32, 32, device="cpu"))
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        with te.autocast(enabled=recipe_name != "high_precision", recipe=make_recipe(recipe_name)):
            y = module(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in module.parameters())


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("cls", [LayerNormLinear, LayerNormMLP])
def test_fp8_frozen_weights_inference_and_no_warnings(recipe_name, cls):
    module = randomize(cls(32, 32, device="cpu"))
    frozen = [p for name, p in module.named_parameters() if p.dim() == 2]
    for p in frozen:
        p.requires_grad_(False)
    x = torch.randn(16, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=make_recipe(recipe_name)):
            y = module(x)
        y.sum().backward()
        with torch.no_grad(), te.autocast(recipe=make_recipe(recipe_name)):
            assert module(torch.randn(10, 32)).shape == (10, 32)  # no token alignment needed
    assert all(p.grad is None for p in frozen)
    assert x.grad is not None and module.layer_norm_weight.grad is not None


# --- errors ---------------------------------------------------------------------------------------
def test_errors():
    with pytest.raises(ValueError, match="normalization"):
        LayerNormLinear(32, 32, normalization="BatchNorm", device="cpu")
    with pytest.raises(ValueError, match="normalization"):
        LayerNormMLP(32, 32, normalization="GroupNorm", device="cpu")
    with pytest.raises(ValueError, match="activation"):
        LayerNormMLP(32, 32, activation="tanh", device="cpu")
    with pytest.raises(ValueError, match="activation_params"):
        LayerNormMLP(32, 32, activation="gelu", activation_params={"limit": 1.0}, device="cpu")
    with pytest.raises(NotImplementedError, match="parallel_mode='row'"):
        LayerNormLinear(32, 32, parallel_mode="row", device="cpu")
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):  # no group yet
        LayerNormLinear(32, 32, tp_size=2, parallel_mode="column", device="cpu")(torch.randn(4, 32))
    with pytest.raises(ValueError, match="ffn_hidden_size=33 is not divisible by tp_size=2"):
        LayerNormMLP(32, 33, tp_size=2, set_parallel_mode=True, device="cpu")
    # upstream's fixed layer names (fc1, fc2): no ub_name; nothing pipelined without TP + SP
    assert LayerNormMLP(32, 32, ub_overlap_ag=True, device="cpu").comm_overlap is None
    with pytest.raises(ValueError, match="in_features=32"):
        LayerNormLinear(32, 32, device="cpu")(torch.randn(16, 24))
    with pytest.raises(ValueError, match="hidden_size=32"):
        LayerNormMLP(32, 32, device="cpu")(torch.randn(16, 24))


@pytest.mark.parametrize(
    "build",
    [
        lambda: LayerNormLinear(24, 32, device="cpu"),
        lambda: LayerNormLinear(32, 40, device="cpu"),
        lambda: LayerNormMLP(40, 32, device="cpu"),
        lambda: LayerNormMLP(32, 40, device="cpu"),
    ],
)
def test_fp8_needs_feature_sizes_multiple_of_16(build):
    module = build()
    hidden = module.in_features if isinstance(module, LayerNormLinear) else module.hidden_size
    x = torch.randn(16, hidden, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            module(x)
        # the failed forward handed the first-module flag back to the region
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module
    module(x)  # high precision has no such restriction


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_takes_any_token_count(recipe_name):
    # 12 and 8 tokens: the weight-gradient GEMMs reduce over counts not a multiple of 16.
    module = randomize(LayerNormLinear(32, 32, device="cpu"))
    check_against_reference(
        module, reference_layernorm_linear, recipe_name, torch.float32, 32, 32, lead=(3, 4)
    )
    module = randomize(LayerNormMLP(32, 32, device="cpu"))
    check_mlp_stages(module, REFERENCE_ACTIVATIONS["gelu"], recipe_name, torch.float32, (2, 4))
