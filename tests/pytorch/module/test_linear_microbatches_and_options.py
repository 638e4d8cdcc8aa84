"""te.Linear options on CPU, against plain PyTorch: weight caching across microbatches
(is_first_microbatch), return_bias, parameters_split, params_dtype and fused weight-gradient
accumulation into main_grad (fuse_wgrad_accumulation). The core numerics are in
``test_linear_numerics.py``."""

import fp8_oracle as oracle
import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import FP8_RECIPES, backward_recipe_state, fake_quant

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.linear import Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN, OUT = 64, 48


def fwd_state(module):
    return module.fp8_meta["scaling_fwd"]


def amax(t):
    return t.detach().float().abs().max()


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


@pytest.mark.parametrize("recipe", ["Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_block_scaled_cache_from_a_no_grad_pass_serves_the_backward(recipe, kind):
    """A weight cached by a no-grad pass (te.checkpoint's first pass, or inference) holds only
    the row-wise copy, which a block-scaled format cannot turn into the column-wise one dgrad
    reads: the training microbatch casts the weight again (same values: the weights did not
    change) instead of failing. Pipeline order: fwd mb1 (True), fwd mb2 (False), bwd mb2, bwd
    mb1; the same input gradients as without checkpointing."""
    from transformer_engine.common import recipe as R

    kwargs = {"Float8BlockScaling": {"w_block_scaling_dim": 1}}.get(recipe, {})
    make_recipe = lambda: getattr(R, recipe)(**kwargs)  # noqa: E731
    if recipe == "NVFP4BlockScaling":
        make_recipe = lambda: R.NVFP4BlockScaling(disable_stochastic_rounding=True)  # noqa: E731
    torch.manual_seed(7)
    m = getattr(te, kind)(128, 128, device="cpu")
    xs = [torch.randn(32, 128, requires_grad=True) for _ in range(2)]
    dy = torch.randn(32, 128)
    grads = {}
    for checkpointed in (True, False):
        ins = [x.detach().clone().requires_grad_() for x in xs]
        with te.autocast(recipe=make_recipe()):
            if checkpointed:
                ys = [te.checkpoint(m, x, is_first_microbatch=i == 0) for i, x in enumerate(ins)]
            else:
                ys = [m(x, is_first_microbatch=i == 0) for i, x in enumerate(ins)]
        ys[1].backward(dy)
        ys[0].backward(dy)
        grads[checkpointed] = [x.grad for x in ins]
        m.zero_grad(set_to_none=True)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


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
