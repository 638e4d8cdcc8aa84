"""te.Linear FP8 state on CPU: FP8 parameters (quantized_model_init: Float8Tensor parameters,
the high-precision init value, an SGD step, use outside autocast) and delayed-scaling state over
several steps (the scale timeline, no update under no_grad, a changed recipe, calibration, the
state's device). The core numerics are in ``test_linear_numerics.py``."""

import fp8_oracle as oracle
import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import backward_recipe_state, fake_quant

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


def test_split_fp8_parameters_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"parameters_split=\('a', 'b'\) cannot be combined"):
        with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
            Linear(IN, OUT, parameters_split=("a", "b"), device="cpu")
    with pytest.raises(ValueError, match="fuse_qkv_params=True"):
        with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
            te.MultiheadAttention(32, 2, device="cpu")
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        mha = te.MultiheadAttention(32, 2, fuse_qkv_params=True, device="cpu")
    assert isinstance(mha.layernorm_qkv.weight if hasattr(mha, "layernorm_qkv") else
                      mha.qkv.weight, Float8Tensor)  # fmt: skip


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


@pytest.mark.parametrize("build", ["Linear", "LayerNormLinear", "LayerNormMLP", "ops.Linear"])
def test_clear_high_precision_init_val_drops_the_copy(build):
    """``clear_high_precision_init_val()`` drops the CPU copy: ``get`` returns None afterwards
    and nothing else keeps the tensor alive."""
    import gc
    import weakref

    ctor = {
        "Linear": lambda: te.Linear(IN, OUT, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(IN, OUT, device="cpu"),
        "LayerNormMLP": lambda: te.LayerNormMLP(IN, OUT, device="cpu"),
        "ops.Linear": lambda: te.ops.Linear(IN, OUT, device="cpu"),
    }[build]
    with te.quantized_model_init(recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        m = ctor()
    weights = [p for p in m.parameters() if isinstance(p, Float8Tensor)]
    assert weights, "the weights are FP8 parameters"
    for w in weights:
        init = w.get_high_precision_init_val()
        assert init is not None and init.shape == w.shape
        kept = weakref.ref(init)
        del init
        w.clear_high_precision_init_val()
        gc.collect()
        assert w.get_high_precision_init_val() is None
        assert kept() is None, "the CPU copy is still referenced"


@pytest.mark.parametrize(
    "built, run",
    [
        ("Float8CurrentScaling", "DelayedScaling"),
        ("DelayedScaling", "Float8CurrentScaling"),
        ("MXFP8BlockScaling", "DelayedScaling"),
    ],
)
def test_fp8_parameters_refuse_another_recipe(built, run):
    """FP8 weights belong to the recipe they were built for: a forward under another recipe
    class raises before the weight's quantizer is rebound; the same class with other fields
    runs."""
    from transformer_engine.common import recipe as R

    with te.quantized_model_init(recipe=getattr(R, built)()):
        m = te.Linear(IN, OUT, device="cpu")
    quantizer = m.weight._quantizer
    x = torch.randn(32, IN)
    with pytest.raises(RuntimeError, match=f"built for {built}.*recipe is {run}"):
        with te.autocast(recipe=getattr(R, run)()):
            m(x)
    assert m.weight._quantizer is quantizer, "nothing rebound"
    other = {"Float8CurrentScaling": {"use_power_2_scales": True}}.get(built, {})
    with te.autocast(recipe=getattr(R, built)(**other)):
        assert m(x).shape == (32, OUT)


def test_fp8_parameters_load_a_checkpoint_of_another_recipe():
    """The check belongs to the forward: loading a DelayedScaling checkpoint into a module whose
    FP8 weights were built for Float8CurrentScaling works (as upstream's set_extra_state), and
    the module then runs under its own recipe."""
    from transformer_engine.common.recipe import Float8CurrentScaling

    trained = te.Linear(IN, OUT, device="cpu")
    with te.autocast(recipe=DelayedScaling()):
        trained(torch.randn(8, IN)).sum().backward()
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        m = te.Linear(IN, OUT, device="cpu")
    m.load_state_dict(trained.state_dict())
    with te.autocast(recipe=Float8CurrentScaling()):
        assert m(torch.randn(8, IN)).shape == (8, OUT)
    with pytest.raises(RuntimeError, match="built for Float8CurrentScaling"):
        with te.autocast(recipe=DelayedScaling()):
            m(torch.randn(8, IN))


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
