"""CustomRecipe: roles each slot is asked with, the factory contract, factories that reproduce
the built-in recipes bit for bit, and the plain-PyTorch reference current-scaling quantizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
)
from transformer_engine.pytorch.custom_recipes.quantizer_factories import (
    current_scaling_factory,
    delayed_scaling_factory,
)
from transformer_engine.pytorch.custom_recipes.reference_current_scaling import (
    CurrentScalingQuantizerRef,
)
from transformer_engine.pytorch.quantization import (
    CustomRecipeState,
    DelayedScalingRequest,
    FP8GlobalStateManager,
    QuantizerRole,
    RecipeState,
    check_recipe_support,
    get_align_size_for_quantization,
)
from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer


# ------------------------------------------------------------------ roles and requests
def test_quantizer_role_str_and_frozen():
    assert str(QuantizerRole()) == "QuantizerRole()"
    assert str(QuantizerRole("linear", "weight", "qkv")) == (
        "module_type=linear|tensor_type=weight|name=qkv"
    )
    assert str(QuantizerRole(tensor_type="input")) == "tensor_type=input"
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantizerRole().name = "x"
    with pytest.raises(TypeError, match="module_type"):
        QuantizerRole(module_type=3)


def test_delayed_scaling_request_defaults_and_checks():
    r = DelayedScalingRequest()
    assert (r.fp8_format, r.margin, r.amax_history_len) == (Format.HYBRID, 0, 1024)
    assert (r.amax_compute_algo, r.scaling_factor_compute_algo, r.reduce_amax) == (
        "max",
        None,
        True,
    )
    assert r == DelayedScalingRequest() and hash(r) == hash(DelayedScalingRequest())
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScalingRequest(amax_history_len=0)
    assert te.QuantizerRole is QuantizerRole and te.DelayedScalingRequest is DelayedScalingRequest


# ------------------------------------------------------------------ the recipe
def test_custom_recipe_fields_and_checks():
    r = CustomRecipe(qfactory=current_scaling_factory)
    assert (r.fp8_format, r.fp8_dpa, r.fp8_mha, r.quantization_alignment) == (
        Format.HYBRID,
        False,
        False,
        128,
    )
    assert r.custom() and not r.delayed() and not DelayedScaling.custom()
    with pytest.raises(ValueError, match="must be positive"):
        CustomRecipe(qfactory=current_scaling_factory, quantization_alignment=0)
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe(qfactory="not callable")
    with pytest.raises(ValueError, match="must be positive"):
        r.quantization_alignment = -4
    check_recipe_support(r)  # accepted


def test_alignment_does_not_call_the_factory():
    def factory(role):
        raise AssertionError("called")

    assert get_align_size_for_quantization(CustomRecipe(factory, quantization_alignment=64)) == 64


# ------------------------------------------------------------------ the factory contract
def _state(factory, roles, mode="forward"):
    return RecipeState.create(
        CustomRecipe(qfactory=factory),
        mode=mode,
        num_quantizers=len(roles),
        device="cpu",
        roles=roles,
    )


def test_factory_answers_are_checked():
    role = [QuantizerRole("linear", "input")]
    with pytest.raises(ValueError, match="returned None"):
        _state(lambda r: None, role)
    with pytest.raises(TypeError, match="return a Quantizer"):
        _state(lambda r: 3, role)
    answers = iter([DelayedScalingRequest(), DelayedScalingRequest(margin=1)])
    with pytest.raises(ValueError, match="different DelayedScalingRequests"):
        _state(lambda r: next(answers), role * 2)
    with pytest.raises(ValueError, match="2 quantizer roles"):
        RecipeState.create(
            CustomRecipe(current_scaling_factory),
            mode="forward",
            num_quantizers=3,
            device="cpu",
            roles=role * 2,
        )


def test_missing_roles_warn_and_ask_with_a_bare_role():
    seen = []

    def factory(role):
        seen.append(role)
        return current_scaling_factory(role)

    with pytest.warns(UserWarning, match="no quantizer roles"):
        state = RecipeState.create(
            CustomRecipe(factory), mode="forward", num_quantizers=2, device="cpu"
        )
    assert isinstance(state, CustomRecipeState)
    assert seen == [QuantizerRole(), QuantizerRole()]


def test_quantizers_are_used_as_returned_and_requests_share_delayed_state():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    answers = {"input": q, "weight": DelayedScalingRequest(amax_history_len=4)}
    state = _state(
        lambda r: answers[r.tensor_type] if r else DelayedScalingRequest(amax_history_len=4),
        [QuantizerRole("linear", "input"), QuantizerRole("linear", "weight"), None],
    )
    quantizers = state.make_quantizers()
    assert quantizers[0] is q
    inner = state.delayed_scaling_state()
    assert inner.amax_history.shape == (4, 3) and inner.scale.shape == (3,)
    # the delayed quantizers view the inner state: a cast records its amax in history row 0
    quantizers[1].quantize(torch.tensor([[-5.0, 2.0]]))
    assert inner.amax_history[0].tolist() == [0.0, 5.0, 0.0]


def test_linear_asks_one_role_per_slot():
    seen = []

    def factory(role):
        seen.append(role)
        return current_scaling_factory(role)

    m = te.Linear(32, 32, device="cpu", name="proj")
    with te.autocast(enabled=True, recipe=CustomRecipe(factory)):
        m(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert seen == [
        QuantizerRole("linear", "input", "proj"),
        QuantizerRole("linear", "weight", "proj"),
        None,
        QuantizerRole("linear", "grad_output", "proj"),
        None,
    ]
    assert seen.count(None) == 2


def test_layernorm_mlp_roles_name_the_two_gemms():
    seen = []
    m = te.LayerNormMLP(32, 64, device="cpu", name="mlp")
    with te.autocast(
        enabled=True, recipe=CustomRecipe(lambda r: seen.append(r) or current_scaling_factory(r))
    ):
        m(torch.randn(16, 32))
    names = {r.name for r in seen if r is not None}
    assert names == {"mlp.fc1", "mlp.fc2"} and len(seen) == 10 and seen.count(None) == 4


# ------------------------------------------------------------------ same bits as built-ins
def _train(recipe, cls, device):
    torch.manual_seed(0)
    m = cls(32, 64, device=device)
    outs = []
    for _ in range(2):
        x = torch.randn(16, 32, device=device, requires_grad=True)
        with te.autocast(enabled=True, recipe=recipe):
            y = m(x)
        (y * torch.linspace(-1, 1, y.shape[-1], device=device)).sum().backward()
        outs += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
    return m, outs


CASES = [
    (Float8CurrentScaling, current_scaling_factory),
    (DelayedScaling, delayed_scaling_factory),
]


def _check_same_bits(builtin, factory, cls, device):
    _, expected = _train(builtin(), cls, device)
    m, got = _train(CustomRecipe(qfactory=factory), cls, device)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    return m


@pytest.mark.parametrize("builtin, factory", CASES, ids=["current", "delayed"])
@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP, te.ops.Linear])
def test_factories_match_builtin_recipes_bit_for_bit(builtin, factory, cls):
    m = _check_same_bits(builtin, factory, cls, "cpu")
    if builtin is DelayedScaling and cls is not te.ops.Linear:
        # the delayed part was registered and updated: scales moved off their initial 1
        state = m.fp8_meta["scaling_fwd"].delayed_scaling_state()
        assert (state.scale[:2] != 1).all() and (state.amax_history[:, :2] > 0).any()


@needs_cuda
@pytest.mark.parametrize("builtin, factory", CASES, ids=["current", "delayed"])
@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP])
def test_factories_match_builtin_recipes_bit_for_bit_gpu(builtin, factory, cls):
    _check_same_bits(builtin, factory, cls, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP])
def test_backward_only_delayed_requests_are_registered_and_updated(cls):
    """A factory asking for delayed scaling on the grad-output slots only: the module's
    backward state joins the amax registry and is updated each backward (scale = E5M2 max /
    amax), and state_dict() refuses it as for any delayed request."""

    def factory(role):
        if role is not None and role.tensor_type == "grad_output":
            return DelayedScalingRequest(amax_history_len=4)
        return Float8CurrentScalingQuantizer(torch.float8_e4m3fn)

    FP8GlobalStateManager.reset()
    m = cls(32, 32, device="cpu")
    for step in range(3):
        with te.autocast(enabled=True, recipe=CustomRecipe(factory)):
            y = m(torch.randn(16, 32, generator=torch.Generator().manual_seed(step)))
        (y * 3.0).sum().backward()
    state = m.fp8_meta["scaling_bwd"].delayed_scaling_state()
    # the slot of the module output's gradient (3 everywhere): GRAD_OUTPUT1, or FC2's GRAD_OUTPUT2
    slot = 2 if cls is te.LayerNormMLP else 0
    assert state.scale[slot] == torch.tensor(57344.0) / torch.tensor(3.0)
    assert state.amax_history[0, slot] == 0.0 and state.amax_history[-1, slot] == 3.0
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        m.state_dict()


# ------------------------------------------------------------------ checkpoints
def test_checkpoints_stateless_custom_saves_nothing_delayed_refuses():
    m = te.Linear(32, 32, device="cpu")
    with te.autocast(enabled=True, recipe=CustomRecipe(current_scaling_factory)):
        m(torch.randn(16, 32))
    assert m.get_extra_state().numel() == 0  # an empty uint8 tensor: no state to restore
    m.state_dict()
    with te.autocast(enabled=True, recipe=CustomRecipe(delayed_scaling_factory)):
        m(torch.randn(16, 32))
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        m.state_dict()


# ------------------------------------------------------------------ reference quantizer
def _hand_cast(x: torch.Tensor, fp8_dtype, fp8_max: float):
    """Current scaling by hand, in float64 where exact: scale = fp8_max / max|x|."""
    amax = x.double().abs().max().item()
    scale = torch.tensor(fp8_max / amax, dtype=torch.float32)
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_quantizer_scale_is_one_ieee_division(fp8_dtype):
    """``scale = fp8_max / amax`` rounded once (float32 division), as the library's cast: over
    many amaxes, the same scale_inv and bytes (a reciprocal times fp8_max, rounded twice, is
    one ulp off for about a quarter of them)."""
    fp8_max = torch.finfo(fp8_dtype).max
    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        x = torch.randn(4, 8, generator=gen) * torch.rand(1, generator=gen).item() * 10
        ref = CurrentScalingQuantizerRef(fp8_dtype).quantize(x)
        scale = torch.tensor([fp8_max], dtype=torch.float32) / x.abs().amax().reshape(1)
        assert torch.equal(ref._scale_inv, torch.ones(1) / scale)
        lib = Float8CurrentScalingQuantizer(fp8_dtype).quantize(x)
        assert torch.equal(ref._scale_inv, lib._scale_inv) and torch.equal(ref._data, lib._data)


@pytest.mark.parametrize(
    "fp8_dtype, fp8_max", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)]
)
@pytest.mark.parametrize("pow2", [False, True])
def test_reference_quantizer_matches_hand_formula_and_library(fp8_dtype, fp8_max, pow2):
    torch.manual_seed(1)
    x = torch.randn(32, 48) * 7
    x[3, 5] = float("nan")
    ref = CurrentScalingQuantizerRef(fp8_dtype, force_pow_2_scales=pow2).quantize(x)
    lib = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2).quantize(x)
    assert torch.equal(ref._data, lib._data) and torch.equal(ref._scale_inv, lib._scale_inv)
    assert torch.equal(ref._transpose, lib._transpose)
    if not pow2:
        finite = torch.where(torch.isnan(x), 0.0, x)
        data, scale = _hand_cast(finite, fp8_dtype, fp8_max)
        data = torch.where(torch.isnan(x), torch.tensor(float("nan")), data.float()).to(fp8_dtype)
        assert torch.equal(
            ref._data.view(fp8_dtype).float().nan_to_num(), data.float().nan_to_num()
        )
        assert ref._scale_inv.item() == pytest.approx(1 / scale.item(), rel=1e-7)
    else:
        s = 1 / ref._scale_inv.item()
        assert s == 2.0 ** round(torch.tensor(s).log2().item())
