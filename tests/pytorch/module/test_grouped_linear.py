"""GroupedLinear on CPU: per-group forward and backward against F.linear in float64 (high
precision, delayed and current scaling; FP32 and BF16), empty groups, the backward scale
update running once after every group's backward, weight caching, main_grad fusion, deferred
init, FP8 parameters and errors.

Tolerances come from tests/pytorch/tolerances.py: "same_values" (FP32) or "bf16" (BF16, against
float64 of the BF16 values) in high precision; "e4m3" forward and "hybrid" backward in FP8.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table, table_keys
from utils import (
    RECIPES_WITH_HIGH_PRECISION,
    backward_recipe_state,
    make_recipe,
    materialization_device,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

DTYPES = [torch.float32, torch.bfloat16]
SPLITS = [32, 0, 48, 16]  # group 1 is empty
# Row counts that are not multiples of 16 (in FP8 the weight-gradient GEMMs reduce over them).
ODD_SPLITS = [10, 0, 23, 7]


def build(num_gemms=4, in_features=64, out_features=48, seed=0, **kwargs):
    """A module with weights ~ N(0, 1/in_features) and biases ~ N(0, 0.04)."""
    module = GroupedLinear(num_gemms, in_features, out_features, device="cpu", **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / math.sqrt(in_features) if p.dim() == 2 else 0.2 * noise)
    return module


def reference(module, x, splits):
    """float64 leaf parameters, and the output group by group with F.linear."""
    params = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    outs = []
    for i, group in enumerate(x.split(splits)):
        outs.append(F.linear(group, params[f"weight{i}"], params.get(f"bias{i}")))
    return torch.cat(outs), params


def step(module, x, dy, recipe, splits, **kwargs):
    x = x.detach().clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x, splits, **kwargs)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(dy)
    return out, x.grad


# --- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [SPLITS, ODD_SPLITS], ids=["aligned", "odd"])
@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits_as_tensor", [False, True])
def test_matches_reference(recipe_name, dtype, splits_as_tensor, sizes):
    module = build(params_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    rows = sum(sizes)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    dy = torch.randn(rows, 48, generator=g).to(dtype)
    splits = torch.tensor(sizes) if splits_as_tensor else sizes
    y, dx = step(module, x, dy, make_recipe(recipe_name), splits)

    x_ref = x.double().requires_grad_()
    y_ref, params = reference(module, x_ref, sizes)
    y_ref.backward(dy.double())
    fwd_key, bwd_key = table_keys(recipe_name, dtype)
    assert y.shape == (rows, 48) and y.dtype == dtype and y.device.type == "cpu"
    assert_close_by_table(y, y_ref, fwd_key)
    assert_close_by_table(dx, x_ref.grad, bwd_key)
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        if name.endswith("1"):  # the empty group: zero gradients
            assert torch.equal(p.grad, torch.zeros_like(p)), name
        else:
            assert_close_by_table(p.grad, params[name].grad, bwd_key)


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
def test_leading_dimensions_and_return_bias(recipe_name):
    module = build(num_gemms=2, in_features=32, out_features=32, return_bias=True)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    with te.autocast(enabled=recipe_name != "high_precision", recipe=make_recipe(recipe_name)):
        y, biases = module(x, [48, 16])
    assert y.shape == (4, 16, 32)
    assert isinstance(biases, list) and len(biases) == 2
    assert all(b is getattr(module, f"bias{i}") for i, b in enumerate(biases))
    y_ref, _ = reference(module, x.reshape(-1, 32).double(), [48, 16])
    offsets = torch.cat([module.bias0.expand(48, 32), module.bias1.expand(16, 32)]).double()
    fwd_key, _ = table_keys(recipe_name, torch.float32)
    assert_close_by_table(y.reshape(-1, 32), y_ref - offsets, fwd_key)


def test_all_groups_empty_but_one_and_no_bias():
    module = build(num_gemms=3, bias=False)
    assert [n for n, _ in module.named_parameters()] == ["weight0", "weight1", "weight2"]
    assert module.bias0.numel() == 0  # upstream: an empty tensor
    x = torch.randn(16, 64, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = module(x, [0, 16, 0])
    y.sum().backward()
    assert torch.equal(module.weight0.grad, torch.zeros_like(module.weight0))
    assert module.weight1.grad.abs().sum() > 0
    empty = module(torch.randn(0, 64), [0, 0, 0])  # no rows at all
    assert empty.shape == (0, 48)


# --- the backward scale update ---------------------------------------------------------------------
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_backward_update_runs_once_after_every_group(monkeypatch, input_requires_grad):
    """The first module of the region updates the backward scales once, after the grad output
    of every group was quantized, whatever order autograd runs the groups' backwards in."""
    module = build()
    seen = []
    update = FP8GlobalStateManager.reduce_and_update_fp8_tensors.__func__

    def recording(cls, forward=True):
        if not forward:
            seen.append(backward_recipe_state(module).amax_history[0].clone())
        update(cls, forward)

    monkeypatch.setattr(
        FP8GlobalStateManager, "reduce_and_update_fp8_tensors", classmethod(recording)
    )
    x = torch.randn(sum(SPLITS), 64, requires_grad=input_requires_grad)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = module(x, SPLITS)
    y.backward(torch.randn_like(y), retain_graph=True)
    assert len(seen) == 1
    grad_output_slots = [2 * i for i, m in enumerate(SPLITS) if m]
    for slot in range(backward_recipe_state(module).num_quantizers):
        assert (seen[0][slot] > 0) == (slot in grad_output_slots), (slot, seen[0])
    scale = backward_recipe_state(module).scale
    assert all((scale[s] != 1) == (s in grad_output_slots) for s in range(scale.numel()))
    y.backward(torch.randn_like(y))  # a retained graph: the countdown re-armed
    assert len(seen) == 2


def test_delayed_scaling_state_registered_and_updated():
    module = build()
    x = torch.randn(sum(SPLITS), 64, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = module(x, SPLITS)
    assert FP8GlobalStateManager.get_buffer_info() in module.fp8_meta
    y.backward(torch.randn_like(y))
    fwd = module.fp8_meta["scaling_fwd"]
    assert fwd.num_quantizers == 12 and backward_recipe_state(module).num_quantizers == 8
    used = {3 * i + 1 for i in range(4)} | {3 * i for i, m in enumerate(SPLITS) if m}
    for slot in range(12):  # the empty group's weight was still quantized, its input not
        assert (fwd.scale[slot] != 1) == (slot in used), (slot, fwd.scale)


def test_no_flag_read_outside_fp8_or_without_grad():
    module = build()
    with te.autocast(recipe=DelayedScaling()):
        with torch.no_grad():
            module(torch.randn(sum(SPLITS), 64), SPLITS)
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module


# --- weight caching and main_grad ------------------------------------------------------------------
def test_is_first_microbatch_reuses_cached_fp8_weights():
    module = build(num_gemms=2)
    x, recipe = torch.randn(32, 64), DelayedScaling()
    with te.autocast(recipe=recipe):
        module(x, [16, 16], is_first_microbatch=True)
    cached = [module._fp8_workspaces[f"weight{i}"] for i in range(2)]
    with te.autocast(recipe=recipe):
        module(x, [16, 16], is_first_microbatch=False)
        history = module.fp8_meta["scaling_fwd"].amax_history
        assert history[0, 0] > 0 and history[0, 3] > 0  # inputs quantized
        assert history[0, 1] == 0 and history[0, 4] == 0  # weights reused
    assert [module._fp8_workspaces[f"weight{i}"] for i in range(2)] == cached


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
def test_fuse_wgrad_accumulation_into_main_grad(recipe_name):
    module = build(num_gemms=2, fuse_wgrad_accumulation=True)
    for i in range(2):
        w = getattr(module, f"weight{i}")
        w.main_grad = torch.full(w.shape, 7.0)
    g = torch.Generator().manual_seed(2)
    expected = [torch.zeros(48, 64, dtype=torch.float64) for _ in range(2)]
    for first in (True, False):
        x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 48, generator=g)
        step(module, x, dy, make_recipe(recipe_name), [16, 16], is_first_microbatch=first)
        for i in range(2):
            rows = slice(16 * i, 16 * (i + 1))
            expected[i] += dy[rows].double().t() @ x[rows].double()
    _, bwd_key = table_keys(recipe_name, torch.float32)
    for i in range(2):
        w = getattr(module, f"weight{i}")
        assert w.grad is None and w.main_grad.dtype == torch.float32
        assert_close_by_table(w.main_grad, expected[i], bwd_key)


# --- deferred init and FP8 parameters ----------------------------------------------------------------
def test_deferred_init():
    module = GroupedLinear(3, 32, 16, device="meta")
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    module.reset_parameters()
    for name, p in module.named_parameters():
        assert p.device.type == "cpu", name
        if name.startswith("bias"):
            assert torch.equal(p, torch.zeros_like(p))
        else:
            assert 0.01 < p.std().item() < 0.04  # N(0, 0.023)
    assert module(torch.randn(8, 32), [4, 0, 4]).shape == (8, 16)

    direct = GroupedLinear(2, 32, 16, device="meta")
    direct.reset_parameters()  # the current CUDA device, else the CPU
    assert all(p.device == materialization_device() for p in direct.parameters())


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_parameters_under_quantized_model_init(recipe_name):
    recipe = make_recipe(recipe_name)
    with te.quantized_model_init(recipe=recipe):
        module = GroupedLinear(3, 32, 32, device="cpu")
    for name, p in module.named_parameters():
        assert isinstance(p, QuantizedTensor) == name.startswith("weight"), name
    x = torch.randn(48, 32)
    y, _ = step(module, x, torch.randn(48, 32), recipe, [16, 16, 16])
    params = {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p).detach().double()
              for n, p in module.named_parameters()}  # fmt: skip
    y_ref = torch.cat([
        F.linear(g, params[f"weight{i}"], params[f"bias{i}"])
        for i, g in enumerate(x.double().split(16))
    ])  # fmt: skip
    assert_close_by_table(y, y_ref, ("e4m3", torch.float32))
    assert all(getattr(module, f"weight{i}").grad is not None for i in range(3))
    with pytest.warns(UserWarning, match="dequantized"):
        y_hp = module(x, [16, 16, 16])
    assert_close_by_table(y_hp, y_ref, ("same_values", torch.float32))


@pytest.mark.parametrize("recipe_name", list(RECIPES_WITH_HIGH_PRECISION))
def test_torch_autocast_bf16_with_fp32_params(recipe_name):
    module = build(num_gemms=2)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        with te.autocast(enabled=recipe_name != "high_precision", recipe=make_recipe(recipe_name)):
            y = module(x, [16, 16])
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in module.parameters())


def test_overwrite_main_grad():
    module = build(num_gemms=2, fuse_wgrad_accumulation=True)
    for i in range(2):
        w = getattr(module, f"weight{i}")
        w.main_grad, w.overwrite_main_grad = torch.full(w.shape, 7.0), True
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    step(module, x, dy, None, [16, 16])  # is_first_microbatch=None would accumulate
    for i in range(2):
        rows = slice(16 * i, 16 * (i + 1))
        expected = dy[rows].double().t() @ x[rows].double()
        assert_close_by_table(
            module.get_parameter(f"weight{i}").main_grad, expected, ("same_values", torch.float32)
        )


def test_delayed_scaling_checkpoint_round_trip(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    module = build(num_gemms=3)
    x = torch.randn(32, 64, requires_grad=True)
    step(module, x, torch.randn(32, 48), DelayedScaling(), [16, 0, 16])
    restored = build(num_gemms=3, seed=5)
    restored.load_state_dict(module.state_dict())
    for key in ("scaling_fwd", "scaling_bwd"):
        assert restored.fp8_meta[key].num_quantizers == module.fp8_meta[key].num_quantizers
        assert torch.equal(restored.fp8_meta[key].scale, module.fp8_meta[key].scale)
    with te.autocast(recipe=DelayedScaling()):
        torch.testing.assert_close(restored(x, [16, 0, 16]), module(x, [16, 0, 16]))


# --- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "splits, match",
    [
        ([16, 16], "2 entries but num_gemms=3"),
        ([16, 16, 8], "sum to 40"),
        ([16, 32, -16], "non-negative"),
        ([16.0, 16, 0], "ints"),
        (torch.tensor([16.0, 16.0, 0.0]), "integer tensor"),
        (torch.tensor([[16, 16, 0]]), "1-D"),
    ],
)
def test_m_splits_errors(splits, match):
    module = build(num_gemms=3)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(32, 64), splits)


def test_errors():
    module = build(num_gemms=2)
    with pytest.raises(ValueError, match="in_features=64"):
        module(torch.randn(32, 24), [16, 16])
    with pytest.raises(TypeError, match="quantized input"):
        module(te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(32, 64)), [16, 16])
    for kwargs, name in (
        ({"single_grouped_weight": True}, "single_grouped_weight"),
        ({"single_grouped_bias": True}, "single_grouped_bias"),
        ({"ub_overlap_rs": True}, "ub_overlap_rs"),
    ):
        with pytest.raises(NotImplementedError, match=name):
            GroupedLinear(2, 32, 32, device="cpu", **kwargs)
    with pytest.raises(ValueError, match="num_gemms"):
        GroupedLinear(0, 32, 32, device="cpu")


@pytest.mark.parametrize("in_features, out_features", [(24, 32), (32, 40)])
def test_fp8_needs_feature_sizes_multiple_of_16(in_features, out_features):
    module = build(num_gemms=2, in_features=in_features, out_features=out_features)
    x = torch.randn(32, in_features, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            module(x, [16, 16])
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module
    module(x, [16, 16])  # high precision has no such restriction


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_preallocated_out_and_dgrad_out_receive_the_results(recipe):
    def run(preallocated):
        FP8GlobalStateManager.reset()
        module = build(num_gemms=2)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 16, 64, generator=g).requires_grad_(True)
        dy = torch.randn(2, 16, 48, generator=g)
        out = torch.full((2, 16, 48), float("nan")) if preallocated else None
        dgrad_out = torch.full((2, 16, 64), float("nan")) if preallocated else None
        make = {"delayed": DelayedScaling, "current": Float8CurrentScaling}.get(recipe)
        with te.autocast(enabled=make is not None, recipe=make and make()):
            y = module(x, [16, 16], out=out, dgrad_out=dgrad_out)
        if preallocated:
            assert y is out
        y.backward(dy)
        grads = [p.grad for p in module.parameters()]
        return y.detach().clone(), x.grad, grads, dgrad_out

    y, dx, grads, dgrad_out = run(True)
    y_ref, dx_ref, grads_ref, _ = run(False)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert torch.equal(dgrad_out, dx_ref)  # the buffer holds the input gradient
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)


def test_preallocated_buffers_that_do_not_fit_are_refused_before_any_work():
    module = build(num_gemms=2)
    x = torch.randn(32, 64, requires_grad=True)
    cases = [
        (
            {"out": torch.empty(32, 47)},
            "out has shape \\(32, 47\\); this call produces \\(32, 48\\)",
        ),
        ({"out": torch.empty(32, 48, dtype=torch.bfloat16)}, "out is torch.bfloat16 on cpu"),
        ({"out": torch.empty(32, 48, requires_grad=True)}, "out requires grad"),
        ({"dgrad_out": torch.empty(32, 63)}, "dgrad_out must be a torch.float32 tensor of shape"),
        ({"dgrad_out": torch.empty(32, 64, dtype=torch.half)}, "dgrad_out must be"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            module(x, [16, 16], **kwargs)
        assert guard_depth() == 0
