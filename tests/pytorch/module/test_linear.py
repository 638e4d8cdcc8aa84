"""te.Linear on CPU: numerics against plain PyTorch (high precision, delayed and current
scaling), weight caching across microbatches, return_bias, parameters_split, fused weight-gradient
accumulation, FP8 parameters, delayed-scaling state over steps and torch.autocast.

Checkpoints, deferred initialization, the device guard under exceptions and argument errors are
in ``test_linear_state.py``.
"""

import warnings

import fp8_oracle as oracle
import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import FP8_RECIPES, backward_recipe_state, current_scale, fake_quant

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.tensor import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN, OUT = 64, 48


def fwd_state(module):
    return module.fp8_meta["scaling_fwd"]


def amax(t):
    return t.detach().float().abs().max()


def test_linear_is_exported_at_top_level():
    assert te.Linear is Linear


# ------------------------------------------------------------------------------------------
# Forward and backward against plain PyTorch


@pytest.mark.parametrize("shape", [(32,), (2, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_forward_and_backward_match_plain_pytorch(recipe, dtype, bias, shape):
    torch.manual_seed(1)
    m = Linear(IN, OUT, bias=bias, params_dtype=dtype, device="cpu")
    x = torch.randn(*shape, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, OUT, dtype=dtype)
    w = m.weight.detach().clone().requires_grad_()
    b = m.bias.detach().clone().requires_grad_() if bias else None
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w, b)
    y_ref.backward(dy)

    if recipe is None:
        y = m(x)
    else:
        with te.autocast(recipe=FP8_RECIPES[recipe]()):
            y = m(x)
            fwd_scale = fwd_state(m).scale.clone() if recipe == "delayed" else None
        bwd_scale = backward_recipe_state(m).scale.clone() if recipe == "delayed" else None
    y.backward(dy)

    assert y.shape == (*shape, OUT) and y.dtype == dtype
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert m.weight.grad.shape == (OUT, IN) and m.weight.grad.dtype == dtype
    if not bias:
        assert m.bias is None
        assert "bias" not in dict(m.named_parameters())

    if recipe is None:
        if dtype == torch.float32:
            torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(m.weight.grad, w.grad, rtol=1e-6, atol=1e-6)
        else:
            for actual, expected in ((y, y_ref), (x.grad, x_ref.grad), (m.weight.grad, w.grad)):
                assert_close_by_table(actual, expected, ("same_values", dtype))
    else:
        # against plain PyTorch on the original values: the FP8 rows of the table
        assert_close_by_table(y, y_ref, ("e4m3", dtype))
        assert_close_by_table(x.grad, x_ref.grad, ("hybrid", dtype))
        assert_close_by_table(m.weight.grad, w.grad, ("hybrid", dtype))
        # against the dequantized operands the GEMMs saw: tight
        if recipe == "delayed":
            # first step: every scale is still 1, forward E4M3 and gradient E5M2 (HYBRID)
            assert torch.equal(fwd_scale, torch.ones(3))
            assert torch.equal(bwd_scale, torch.ones(2))
            sx, sw, sdy = fwd_scale[0], fwd_scale[1], bwd_scale[0]
        else:
            sx, sw, sdy = (
                current_scale(x, E4M3),
                current_scale(m.weight, E4M3),
                current_scale(dy, E5M2),
            )
        xq = fake_quant(x, sx, E4M3).reshape(-1, IN)
        wq = fake_quant(m.weight, sw, E4M3)
        dyq = fake_quant(dy, sdy, E5M2).reshape(-1, OUT)
        y_deq = xq @ wq.t() + (m.bias.double() if bias else 0)
        assert_close_by_table(y, y_deq.reshape(*shape, OUT), ("fp8_dequantized", dtype))
        assert_close_by_table(x.grad, (dyq @ wq).reshape(*shape, IN), ("fp8_dequantized", dtype))
        assert_close_by_table(m.weight.grad, dyq.t() @ xq, ("fp8_dequantized", dtype))
    if bias:
        assert m.bias.grad.dtype == dtype
        assert_close_by_table(m.bias.grad, b.grad, ("same_values", dtype))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_inference_forward_needs_no_token_alignment(recipe):
    torch.manual_seed(2)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(10, IN)
    with torch.no_grad(), te.autocast(recipe=FP8_RECIPES[recipe]()):
        y = m(x)
    assert y.shape == (10, OUT)
    assert_close_by_table(y, F.linear(x, m.weight, m.bias), ("e4m3", torch.float32))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_with_a_frozen_weight(recipe):
    torch.manual_seed(19)
    m = Linear(IN, OUT, device="cpu")
    m.weight.requires_grad_(False)
    x = torch.randn(32, IN, requires_grad=True)
    dy = torch.randn(32, OUT)
    with te.autocast(recipe=FP8_RECIPES[recipe]()):
        y = m(x)
    y.backward(dy)
    assert m.weight.grad is None
    assert_close_by_table(x.grad, dy @ m.weight, ("hybrid", torch.float32))
    torch.testing.assert_close(m.bias.grad, dy.sum(0))


@pytest.mark.parametrize("recipe", [None, "current"])
def test_non_contiguous_input(recipe):
    torch.manual_seed(20)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(16, 2, IN).transpose(0, 1)
    assert not x.is_contiguous()
    with te.autocast(enabled=recipe is not None, recipe=FP8_RECIPES.get(recipe, DelayedScaling)()):
        y = m(x)
        y_contiguous = m(x.contiguous())
    assert torch.equal(y, y_contiguous)


def test_fp8_input_tensor_is_used_as_is():
    torch.manual_seed(21)
    m = Linear(IN, OUT, device="cpu")
    x = te.Float8CurrentScalingQuantizer(E4M3)(torch.randn(32, IN))
    with te.autocast(recipe=DelayedScaling()):
        y = m(x)
        assert fwd_state(m).amax_history[0, 0] == 0.0  # not cast again
    wq = fake_quant(m.weight, torch.ones(1), E4M3)
    expected = x.dequantize().double() @ wq.t() + m.bias.double()
    assert_close_by_table(y, expected, ("fp8_dequantized", torch.float32))


# ------------------------------------------------------------------------------------------
# is_first_microbatch


def test_is_first_microbatch_none_requantizes_every_call():
    torch.manual_seed(3)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN)
    outputs = []
    for step in range(2):
        with te.autocast(recipe=DelayedScaling()):
            outputs.append(m(x, is_first_microbatch=None))
            # the weight was cast this call: its amax slot holds this weight's amax
            assert fwd_state(m).amax_history[0, 1] == amax(m.weight), step
            assert fwd_state(m).amax_history[0, 0] == amax(x), step
        assert m._fp8_workspaces == {}
        if step == 0:
            with torch.no_grad():
                m.weight.mul_(0.5)  # within the range the weight's delayed scale covers
    # the second call saw the halved weight
    assert_close_by_table(outputs[1], F.linear(x, m.weight, m.bias), ("e4m3", torch.float32))
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-2)


def test_is_first_microbatch_true_caches_and_false_reuses_the_cached_weight():
    torch.manual_seed(4)
    m = Linear(IN, OUT, device="cpu")
    w0 = m.weight.detach().clone()
    x1 = torch.randn(32, IN)
    x2 = (2 * torch.randn(32, IN)).requires_grad_()
    dy = torch.randn(32, OUT)

    with te.autocast(recipe=DelayedScaling()):
        m(x1, is_first_microbatch=True)
    cached = m._fp8_workspaces["weight"]
    cached_bytes = cached._data.clone()
    # cast with the weight slot's scale at that time (1.0 on the first step)
    assert torch.equal(cached_bytes, oracle.cast_bytes(w0, 1.0, E4M3))
    weight_scale = fwd_state(m).scale[1].clone()
    assert weight_scale != 1.0

    with torch.no_grad():
        m.weight.add_(0.5)  # a re-cast would see very different values
    with te.autocast(recipe=DelayedScaling()):
        input_scale = fwd_state(m).scale[0].clone()
        y2 = m(x2, is_first_microbatch=False)
        row0 = fwd_state(m).amax_history[0].clone()
    assert row0[1] == 0.0  # no weight cast on this call
    assert row0[0] == amax(x2)  # the input was cast
    assert m._fp8_workspaces["weight"] is cached
    assert torch.equal(cached._data, cached_bytes)
    assert fwd_state(m).scale[1] == weight_scale  # the weight's scale was not updated

    w_cached = cached.dequantize().double()
    assert torch.equal(w_cached, fake_quant(w0, torch.ones(1), E4M3))
    xq = fake_quant(x2, input_scale, E4M3)
    expected = xq @ w_cached.t() + m.bias.double()
    assert_close_by_table(y2, expected, ("fp8_dequantized", torch.float32))
    assert (y2 - F.linear(x2, m.weight, m.bias)).abs().max() > 1.0

    # backward uses the cached weight as well (its transposed copy)
    bwd_scale = backward_recipe_state(m).scale[0].clone()
    y2.backward(dy)
    dyq = fake_quant(dy, bwd_scale, E5M2)
    assert_close_by_table(x2.grad, dyq @ w_cached, ("fp8_dequantized", torch.float32))


def test_is_first_microbatch_false_without_a_cache_casts_and_caches():
    torch.manual_seed(5)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN)
    with te.autocast(recipe=DelayedScaling()):
        y = m(x, is_first_microbatch=False)
        assert fwd_state(m).amax_history[0, 1] == amax(m.weight)
    assert "weight" in m._fp8_workspaces
    assert_close_by_table(y, F.linear(x, m.weight, m.bias), ("e4m3", torch.float32))


def test_cached_weight_from_inference_serves_a_training_microbatch():
    torch.manual_seed(6)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        m(x, is_first_microbatch=True)
    with te.autocast(recipe=DelayedScaling()):
        y = m(x, is_first_microbatch=False)
    dy = torch.randn(32, OUT)
    y.backward(dy)
    assert_close_by_table(x.grad, dy @ m.weight.detach(), ("hybrid", torch.float32))


# ------------------------------------------------------------------------------------------
# return_bias, parameters_split, params_dtype


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_return_bias_returns_the_bias_without_adding_it(recipe):
    torch.manual_seed(7)
    m = Linear(IN, OUT, return_bias=True, device="cpu")
    with torch.no_grad():
        m.bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 16, IN)
    with te.autocast(enabled=recipe is not None, recipe=FP8_RECIPES.get(recipe, DelayedScaling)()):
        out, b = m(x)
    assert b.dtype == torch.float32 and b.shape == (OUT,)
    assert torch.equal(b, m.bias)
    if recipe is None:
        torch.testing.assert_close(out, F.linear(x, m.weight), rtol=1e-6, atol=1e-6)
    else:
        assert_close_by_table(out, F.linear(x, m.weight), ("e4m3", torch.float32))
    # the returned bias is the parameter: its gradient reaches m.bias
    (out + b).sum().backward()
    assert torch.equal(m.bias.grad, torch.full((OUT,), 32.0))
    assert m.weight.grad is not None


def test_return_bias_with_bf16_params():
    m = Linear(IN, OUT, return_bias=True, params_dtype=torch.bfloat16, device="cpu")
    out, b = m(torch.randn(4, IN, dtype=torch.bfloat16))
    assert out.dtype == b.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", [None, "delayed"])
@pytest.mark.parametrize(
    "split, names, rows",
    [
        (("query_", "key_", "value_"), ["query", "key", "value"], [16, 16, 16]),
        ({"a": 16, "b": 32}, ["a", "b"], [16, 32]),
    ],
    ids=["tuple", "dict"],
)
def test_parameters_split(split, names, rows, recipe):
    torch.manual_seed(8)
    m = Linear(IN, OUT, parameters_split=split, device="cpu")
    params = dict(m.named_parameters())
    expected_names = {f"{n}_{kind}" for n in names for kind in ("weight", "bias")}
    assert set(params) == expected_names
    for n, r in zip(names, rows):
        assert params[f"{n}_weight"].shape == (r, IN)
        assert params[f"{n}_bias"].shape == (r,)
    with torch.no_grad():
        for n in names:
            params[f"{n}_bias"].uniform_(-1.0, 1.0)
    weight = torch.cat([params[f"{n}_weight"] for n in names]).detach()
    bias = torch.cat([params[f"{n}_bias"] for n in names]).detach()

    x = torch.randn(32, IN)
    dy = torch.randn(32, OUT)
    with te.autocast(enabled=recipe is not None, recipe=DelayedScaling()):
        y = m(x)
    y.backward(dy)

    # the same layer unsplit, with the same values
    whole = Linear(IN, OUT, device="cpu")
    with torch.no_grad():
        whole.weight.copy_(weight)
        whole.bias.copy_(bias)
    with te.autocast(enabled=recipe is not None, recipe=DelayedScaling()):
        y_whole = whole(x)
    y_whole.backward(dy)
    assert torch.equal(y, y_whole)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    for n, lo, hi in zip(names, offsets, offsets[1:]):
        assert torch.equal(params[f"{n}_weight"].grad, whole.weight.grad[lo:hi])
        assert torch.equal(params[f"{n}_bias"].grad, whole.bias.grad[lo:hi])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_params_dtype(dtype):
    m = Linear(IN, OUT, params_dtype=dtype, device="cpu")
    assert m.weight.dtype == dtype and m.bias.dtype == dtype
    y = m(torch.randn(4, IN, dtype=dtype))
    assert y.dtype == dtype


def test_params_dtype_defaults_to_torch_default_dtype():
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m = Linear(IN, OUT, device="cpu")
    finally:
        torch.set_default_dtype(saved)
    assert m.weight.dtype == torch.float64 and m.bias.dtype == torch.float64
    x = torch.randn(4, IN, dtype=torch.float64)
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias))


# ------------------------------------------------------------------------------------------
# fuse_wgrad_accumulation


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_fuse_wgrad_accumulation_into_main_grad(recipe, params_dtype):
    torch.manual_seed(9)
    m = Linear(IN, OUT, fuse_wgrad_accumulation=True, params_dtype=params_dtype, device="cpu")
    m.weight.main_grad = torch.full((OUT, IN), 7.0, dtype=torch.float32)  # stale values
    xs = [torch.randn(32, IN, dtype=params_dtype) for _ in range(3)]
    dys = [torch.randn(32, OUT, dtype=params_dtype) for _ in range(3)]

    def step(x, dy, first):
        with te.autocast(enabled=recipe is not None, recipe=DelayedScaling()):
            y = m(x, is_first_microbatch=first)
            x_scale = fwd_state(m).scale[0].clone() if recipe else None  # updated only at exit
        dy_scale = backward_recipe_state(m).scale[0].clone() if recipe else None
        y.backward(dy)
        if recipe is None:
            return dy.double().t() @ x.double()
        return fake_quant(dy, dy_scale, E5M2).t() @ fake_quant(x, x_scale, E4M3)

    expected = step(xs[0], dys[0], True)  # the first microbatch overwrites main_grad
    assert m.weight.main_grad.dtype == torch.float32
    assert m.weight.grad is None
    row = ("fp8_dequantized", torch.float32) if recipe else ("same_values", torch.float32)
    assert_close_by_table(m.weight.main_grad, expected, row)
    expected = expected + step(xs[1], dys[1], False)  # later ones accumulate
    assert_close_by_table(m.weight.main_grad, expected, row)
    expected = expected + step(xs[2], dys[2], None)  # so does a call without caching
    assert_close_by_table(m.weight.main_grad, expected, row)
    assert m.weight.grad is None
    assert m.bias.grad is not None


def test_fuse_wgrad_accumulation_honours_overwrite_main_grad():
    torch.manual_seed(10)
    m = Linear(IN, OUT, fuse_wgrad_accumulation=True, device="cpu")
    m.weight.main_grad = torch.full((OUT, IN), 7.0)
    m.weight.overwrite_main_grad = True
    x, dy = torch.randn(32, IN), torch.randn(32, OUT)
    m(x).backward(dy)  # is_first_microbatch=None would accumulate; the attribute overwrites
    assert_close_by_table(m.weight.main_grad, dy.t() @ x, ("same_values", torch.float32))


# ------------------------------------------------------------------------------------------
# FP8 parameters (quantized_model_init)


def make_fp8_param_linear(**kwargs):
    with te.quantized_model_init(recipe=DelayedScaling(), **kwargs):
        return Linear(IN, OUT, device="cpu")


def test_fp8_parameters_are_float8_tensor_parameters():
    torch.manual_seed(11)
    m = make_fp8_param_linear()
    w = m.weight
    assert isinstance(w, Float8Tensor)
    assert isinstance(w, torch.nn.Parameter)
    assert w.requires_grad and w.dtype == torch.float32 and w.device.type == "cpu"
    assert w.shape == (OUT, IN)
    assert not isinstance(m.bias, Float8Tensor) and m.bias.dtype == torch.float32
    assert 0.018 < w.dequantize().std().item() < 0.028  # N(0, 0.023) init
    assert fwd_state(m).scale.device == w.device
    # the init cast went through the weight slot (scale 1.0): its amax was recorded
    recorded = fwd_state(m).amax_history[0, 1]
    torch.testing.assert_close(recorded, amax(w.dequantize()), rtol=2**-4, atol=0)


def test_fp8_parameters_preserve_high_precision_init_val():
    torch.manual_seed(11)
    m = make_fp8_param_linear(preserve_high_precision_init_val=True)
    w = m.weight
    # quantized at init with the weight slot's scale (1.0) from the kept values
    init = w.get_high_precision_init_val()
    assert init.shape == (OUT, IN)
    assert 0.018 < init.std().item() < 0.028
    assert init.device.type == "cpu" and init.dtype == torch.float32
    assert torch.equal(w._data, oracle.cast_bytes(init, 1.0, E4M3))


def test_fp8_parameters_forward_backward_and_sgd_step():
    torch.manual_seed(12)
    m = make_fp8_param_linear()
    x = torch.randn(32, IN, requires_grad=True)
    dy = torch.randn(32, OUT)
    w_before = m.weight.dequantize().detach().double()
    bytes_before = m.weight._data.clone()
    with te.autocast(recipe=DelayedScaling()):
        x_scale = fwd_state(m).scale[0].clone()
        y = m(x)
    xq = fake_quant(x, x_scale, E4M3)
    assert_close_by_table(
        y, xq @ w_before.t() + m.bias.double(), ("fp8_dequantized", torch.float32)
    )
    dy_scale = backward_recipe_state(m).scale[0].clone()
    y.backward(dy)
    dyq = fake_quant(dy, dy_scale, E5M2)
    assert type(m.weight.grad) is torch.Tensor
    assert m.weight.grad.shape == (OUT, IN) and m.weight.grad.dtype == torch.float32
    assert_close_by_table(m.weight.grad, dyq.t() @ xq, ("fp8_dequantized", torch.float32))
    assert_close_by_table(x.grad, dyq @ w_before, ("fp8_dequantized", torch.float32))

    lr = 1e-3  # keeps the new values inside the range the weight's delayed scale covers
    grad = m.weight.grad.clone()
    torch.optim.SGD(m.parameters(), lr=lr).step()
    assert isinstance(m.weight, Float8Tensor) and isinstance(m.weight, torch.nn.Parameter)
    assert not torch.equal(m.weight._data, bytes_before)
    new_scale = fwd_state(m).scale[1].reshape(1)
    expected = oracle.cast_bytes(w_before.float() - lr * grad, new_scale, E4M3)
    assert torch.equal(m.weight._data, expected)  # re-cast with the new scale
    torch.testing.assert_close(m.weight._scale_inv, oracle.reciprocal(new_scale))
    assert_close_by_table(
        m.weight.dequantize(), w_before.float() - lr * grad, ("e4m3", torch.float32)
    )


def test_fp8_parameters_outside_autocast_warn_and_compute_dequantized():
    torch.manual_seed(13)
    m = make_fp8_param_linear()
    x = torch.randn(8, IN, requires_grad=True)
    with pytest.warns(UserWarning, match="dequantized"):
        y = m(x)
    assert torch.equal(y, F.linear(x, m.weight.dequantize(), m.bias))
    y.sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (OUT, IN)
    torch.testing.assert_close(m.weight.grad, torch.ones(8, OUT).t() @ x.detach())


# ------------------------------------------------------------------------------------------
# Delayed scaling over several steps


def test_delayed_scaling_scales_follow_the_iteration_timeline():
    torch.manual_seed(14)
    recipe = DelayedScaling()
    m = Linear(IN, OUT, device="cpu")
    w_amax = amax(m.weight)
    x_amaxes, dy_amaxes = [], []
    for step in range(3):
        x = (step + 1) * torch.randn(32, IN)
        dy = (3 - step) * torch.randn(32, OUT)
        x_amaxes.append(amax(x))
        dy_amaxes.append(amax(dy))
        fwd_before = fwd_state(m).scale.clone() if step else torch.ones(3)
        bwd_before = backward_recipe_state(m).scale.clone() if step else torch.ones(2)
        with te.autocast(recipe=recipe):
            y = m(x.requires_grad_())
            assert torch.equal(fwd_state(m).scale, fwd_before)  # no update inside the region
        # forward scales updated at exit, from the history maxima (amax_compute_algo="max")
        fwd = fwd_state(m).scale
        assert fwd[0] == torch.tensor(448.0) / max(x_amaxes)
        assert fwd[1] == torch.tensor(448.0) / w_amax
        assert fwd[2] == 1.0  # the output slot is never cast
        # backward ones wait for backward
        assert torch.equal(backward_recipe_state(m).scale, bwd_before)
        y.backward(dy)
        bwd = backward_recipe_state(m).scale
        assert bwd[0] == torch.tensor(57344.0) / max(dy_amaxes)
        assert bwd[1] == 1.0
        assert fwd_state(m).scale.device == m.weight.device
        assert backward_recipe_state(m).amax_history.device == m.weight.device
    # one registry entry per direction, however many steps ran
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 2


def test_delayed_scaling_does_not_update_under_no_grad():
    torch.manual_seed(15)
    m = Linear(IN, OUT, device="cpu")
    for _ in range(3):
        with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
            m(torch.randn(32, IN))
    assert torch.equal(fwd_state(m).scale, torch.ones(3))
    assert torch.equal(backward_recipe_state(m).scale, torch.ones(2))
    assert torch.count_nonzero(fwd_state(m).amax_history[1:]) == 0  # never rolled


def test_a_changed_delayed_recipe_takes_effect_at_the_next_update():
    torch.manual_seed(17)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN)
    with te.autocast(recipe=DelayedScaling(margin=0)):
        m(x)
    assert fwd_state(m).scale[0] == torch.tensor(448.0) / amax(x)
    with te.autocast(recipe=DelayedScaling(margin=1)):
        m(x)
    assert m.fp8_meta["recipe"].margin == 1
    # margin 1 halves the scale: 448 * 2**-1 / amax
    assert fwd_state(m).scale[0] == torch.tensor(224.0) / amax(x)


def test_calibration_computes_in_high_precision_and_marks_the_checkpoint():
    torch.manual_seed(18)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN)
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        y = m(x)
    torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), rtol=1e-6, atol=1e-6)
    assert m.fp8_meta["fp8_checkpoint"]
    assert torch.equal(fwd_state(m).scale, torch.ones(3))  # no update without enabled=True
    assert m.state_dict()["_extra_state"] is not None


def test_recipe_state_lives_on_the_parameters_device():
    m = Linear(IN, OUT, device="cpu")
    with te.autocast(recipe=DelayedScaling()):
        m(torch.randn(32, IN))
    for state in (fwd_state(m), backward_recipe_state(m)):
        assert state.device == torch.device("cpu")
        assert state.scale.device == state.amax_history.device == torch.device("cpu")
    for quantizer in m.quantizers["scaling_fwd"] + m.quantizers["scaling_bwd"]:
        assert quantizer.scale.device == torch.device("cpu")


# ------------------------------------------------------------------------------------------
# torch.autocast


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_torch_autocast_bf16_with_fp32_params(recipe):
    torch.manual_seed(16)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        recipe_object = FP8_RECIPES.get(recipe, DelayedScaling)()
        with te.autocast(enabled=recipe is not None, recipe=recipe_object):
            y = m(x)
        y_ref = F.linear(x, m.weight, m.bias)
    assert y.dtype == torch.bfloat16
    if recipe is None:
        assert torch.equal(y, y_ref)
    else:
        assert_close_by_table(y, F.linear(x, m.weight, m.bias), ("e4m3", torch.bfloat16))
    y.float().sum().backward()
    assert m.weight.dtype == m.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32 and m.bias.grad.dtype == torch.float32


def test_no_warnings_in_the_plain_paths():
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x).sum().backward()
        with te.autocast(recipe=DelayedScaling()):
            y = m(x)
        y.sum().backward()


def test_fp8_frozen_weight_and_constant_input_still_train_the_bias():
    """Only the bias needs a gradient: backward must not try to quantize dy for no GEMM."""
    from transformer_engine.common.recipe import DelayedScaling as _Delayed

    layer = Linear(32, 48, device="cpu")
    layer.weight.requires_grad_(False)
    x = torch.randn(16, 32)
    with te.autocast(recipe=_Delayed()):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(layer.bias.grad, dy.sum(0))
    assert layer.weight.grad is None


@pytest.mark.parametrize(
    "bias, freeze_weight, fused",
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["bias+wgrad: fused", "no bias", "frozen weight: no transpose, separate sum"],
)
def test_backward_takes_the_bias_gradient_from_the_grad_output_cast(
    monkeypatch, bias, freeze_weight, fused
):
    from transformer_engine.pytorch.tensor._float8_quantizers import Float8Quantizer

    calls = []
    original = Float8Quantizer.quantize_with_dbias_impl

    def spy(self, tensor):
        calls.append(tuple(tensor.shape))
        return original(self, tensor)

    monkeypatch.setattr(Float8Quantizer, "quantize_with_dbias_impl", spy)
    torch.manual_seed(0)
    layer = te.Linear(32, 48, bias=bias, device="cpu")
    layer.weight.requires_grad_(not freeze_weight)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 48)
    with te.autocast(recipe=DelayedScaling()):
        y = layer(x)
    y.backward(dy)
    assert calls == ([(16, 48)] if fused else [])
    if bias:
        torch.testing.assert_close(layer.bias.grad, dy.sum(dim=0), rtol=1e-6, atol=1e-5)
