"""te.Linear on CPU: deferred initialization, device moves of the FP8 state, checkpoints, the
device guard under exceptions, and argument errors. Numerics are in ``test_linear_numerics.py``,
``test_linear_microbatches_and_options.py`` and ``test_linear_fp8_params_and_scaling.py``."""

import fp8_oracle as oracle
import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import FP8_RECIPES, current_scale, fake_quant, materialization_device

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.module import linear as linear_module
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.tensor import Float8Tensor

IN, OUT = 64, 48
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_step(module, x, recipe=None, optimizer=None):
    with te.autocast(recipe=recipe or DelayedScaling()):
        y = module(x)
    y.float().pow(2).mean().backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return y


def fp8_state(module):
    return {
        key: (module.fp8_meta[key].scale, module.fp8_meta[key].amax_history)
        for key in ("scaling_fwd", "scaling_bwd")
    }


def trained_linear(steps=3, seed=0):
    torch.manual_seed(seed)
    m = Linear(IN, OUT, device="cpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for step in range(steps):
        fp8_step(m, (step + 1) * torch.randn(32, IN), optimizer=opt)
    return m


# ------------------------------------------------------------------------------------------
# Deferred initialization


def test_meta_module_holds_no_storage():
    m = Linear(IN, OUT, device="meta")
    params = dict(m.named_parameters())
    assert set(params) == {"weight", "bias"}
    for p in params.values():
        assert p.is_meta and isinstance(p, torch.nn.Parameter)
    assert params["weight"].shape == (OUT, IN) and params["bias"].shape == (OUT,)
    assert all(b.is_meta for b in m.buffers())
    assert "scaling_fwd" not in m.fp8_meta and m.get_fp8_meta_tensors() is None


@pytest.mark.parametrize("via_to_empty", [True, False], ids=["to_empty", "straight"])
def test_reset_parameters_materializes_on_the_to_empty_or_default_device(via_to_empty):
    """to_empty(device=...) decides; without it, the current CUDA device, else the CPU."""
    torch.manual_seed(0)
    m = Linear(256, 128, device="meta")
    if via_to_empty:
        m.to_empty(device="cpu")
    m.reset_parameters()
    device = torch.device("cpu") if via_to_empty else materialization_device()
    for name, p in m.named_parameters():
        assert p.device == device, name
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert abs(m.weight.std().item() - 0.023) < 0.002
    assert abs(m.weight.mean().item()) < 0.002
    assert torch.count_nonzero(m.bias) == 0
    # usable in FP8 afterwards, its state on the parameters' device
    x = torch.randn(32, 256, device=device)
    y = fp8_step(m, x)
    assert y.shape == (32, 128)
    assert m.fp8_meta["scaling_fwd"].scale.device == device


def test_reset_parameters_is_reproducible_under_manual_seed():
    torch.manual_seed(123)
    eager = Linear(IN, OUT, device=materialization_device())  # where reset_parameters() puts it
    torch.manual_seed(123)
    deferred = Linear(IN, OUT, device="meta")
    deferred.reset_parameters()
    assert torch.equal(eager.weight, deferred.weight)
    assert torch.equal(eager.bias, deferred.bias)
    torch.manual_seed(7)
    a = Linear(IN, OUT, device="cpu")
    b = Linear(IN, OUT, device="cpu")
    assert not torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_init_method_is_honoured(device):
    calls = []

    def init(weight):
        calls.append(tuple(weight.shape))
        torch.nn.init.constant_(weight, 0.25)

    m = Linear(IN, OUT, init_method=init, device=device)
    if device == "meta":
        assert calls == []  # deferred: nothing ran yet
        m.reset_parameters()
    assert calls == [(OUT, IN)]
    assert torch.equal(m.weight.cpu(), torch.full((OUT, IN), 0.25))
    assert torch.count_nonzero(m.bias) == 0


def test_get_rng_state_tracker_is_used_or_refused():
    forks = []

    class Tracker:
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            return torch.random.fork_rng()

    try:
        m = Linear(IN, OUT, get_rng_state_tracker=Tracker, rng_tracker_name="my-rng", device="meta")
        m.reset_parameters()
    except NotImplementedError as err:
        assert "get_rng_state_tracker" in str(err)
    else:
        # the initialization ran inside tracker.fork(rng_tracker_name)
        assert forks and set(forks) == {"my-rng"}


def test_quantized_model_init_with_meta_device_quantizes_on_materialization():
    with te.quantized_model_init(recipe=DelayedScaling()):
        m = Linear(IN, OUT, device="meta")
    assert m.weight.is_meta
    m.reset_parameters()
    assert isinstance(m.weight, Float8Tensor) and isinstance(m.weight, torch.nn.Parameter)
    device = materialization_device()  # the current CUDA device, else the CPU
    assert m.weight.device == device
    assert m.fp8_meta["scaling_fwd"].scale.device == device
    y = fp8_step(m, torch.randn(32, IN, device=device))
    assert torch.isfinite(y).all()


# ------------------------------------------------------------------------------------------
# Device moves of the FP8 state


def test_to_meta_drops_workspaces_and_refuses_forward_until_rematerialized():
    torch.manual_seed(1)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN)
    with te.autocast(recipe=DelayedScaling()):
        m(x, is_first_microbatch=True)
    assert "weight" in m._fp8_workspaces
    m.to("meta")
    assert m.weight.is_meta and m.bias.is_meta
    assert m._fp8_workspaces == {}
    assert m.get_fp8_meta_tensors() is None
    with pytest.raises(ValueError, match="meta"):
        m(torch.randn(32, IN))
    with pytest.raises(ValueError, match="meta"):
        m(torch.randn(32, IN, device="meta"))
    m.to_empty(device="cpu")
    m.reset_parameters()
    y = fp8_step(m, x)
    assert torch.isfinite(y).all()
    for key, (scale, history) in fp8_state(m).items():
        assert scale.device == history.device == torch.device("cpu"), key
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 2


def test_dtype_move_keeps_the_fp8_state():
    m = trained_linear(steps=2)
    before = {k: (s.clone(), h.clone()) for k, (s, h) in fp8_state(m).items()}
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    for key, (scale, history) in fp8_state(m).items():
        assert torch.equal(scale, before[key][0]) and torch.equal(history, before[key][1])
        assert scale.dtype == torch.float32
    y = fp8_step(m, torch.randn(32, IN, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------
# Checkpoints


def assert_same_fp8_state(a, b):
    for key in ("scaling_fwd", "scaling_bwd"):
        sa, sb = a.fp8_meta[key], b.fp8_meta[key]
        assert torch.equal(sa.scale, sb.scale), key
        assert torch.equal(sa.amax_history, sb.amax_history), key
        assert sb.scale.device == sb.amax_history.device == b.weight.device


def test_state_dict_round_trip_restores_weights_and_fp8_state_bitwise():
    src = trained_linear()
    assert not torch.equal(src.fp8_meta["scaling_fwd"].scale, torch.ones(3))
    assert not torch.equal(src.fp8_meta["scaling_bwd"].scale, torch.ones(2))
    dst = Linear(IN, OUT, device="cpu")
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    assert_same_fp8_state(src, dst)
    # and both continue identically: the loaded state is what the quantizers use
    x = 3 * torch.randn(32, IN)
    y_src, y_dst = fp8_step(src, x), fp8_step(dst, x)
    assert torch.equal(y_src, y_dst)
    assert torch.equal(src.weight.grad, dst.weight.grad)
    assert_same_fp8_state(src, dst)


def test_state_dict_is_a_snapshot():
    m = trained_linear(steps=2)
    sd = m.state_dict()
    fresh = Linear(IN, OUT, device="cpu")
    fresh.load_state_dict(sd)
    expected = {k: (s.clone(), h.clone()) for k, (s, h) in fp8_state(m).items()}
    fp8_step(m, 10 * torch.randn(32, IN))  # moves the live state on
    late = Linear(IN, OUT, device="cpu")
    late.load_state_dict(sd)
    for key, (scale, history) in fp8_state(late).items():
        assert torch.equal(scale, expected[key][0]), key
        assert torch.equal(history, expected[key][1]), key


def test_torch_save_and_weights_only_load(tmp_path):
    src = trained_linear()
    path = tmp_path / "linear.pt"
    torch.save(src.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    dst = Linear(IN, OUT, device="cpu")
    dst.load_state_dict(sd)
    assert torch.equal(dst.weight, src.weight)
    assert_same_fp8_state(src, dst)


def test_state_dict_of_a_module_that_never_ran_fp8_loads_cleanly(tmp_path):
    torch.manual_seed(2)
    src = Linear(IN, OUT, device="cpu")
    src(torch.randn(4, IN))
    path = tmp_path / "plain.pt"
    torch.save(src.state_dict(), path)
    dst = Linear(IN, OUT, device="cpu")
    dst.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(dst.weight, src.weight)
    assert "scaling_fwd" not in dst.fp8_meta


def test_current_scaling_checkpoint_round_trip(tmp_path):
    torch.manual_seed(3)
    src = Linear(IN, OUT, device="cpu")
    fp8_step(src, torch.randn(32, IN), recipe=Float8CurrentScaling())
    path = tmp_path / "current.pt"
    torch.save(src.state_dict(), path)
    dst = Linear(IN, OUT, device="cpu")
    dst.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(dst.weight, src.weight)
    x = torch.randn(32, IN)
    with te.autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(src(x), dst(x))


def test_loading_into_a_module_with_fp8_parameters_uses_the_checkpoint_scales(tmp_path):
    src = trained_linear()
    path = tmp_path / "linear.pt"
    torch.save(src.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    with te.quantized_model_init(recipe=DelayedScaling()):
        dst = Linear(IN, OUT, device="cpu")
    dst.load_state_dict(sd)
    assert isinstance(dst.weight, Float8Tensor) and isinstance(dst.weight, torch.nn.Parameter)
    assert_same_fp8_state(src, dst)
    weight_scale = src.fp8_meta["scaling_fwd"].scale[1].reshape(1)
    assert weight_scale != 1.0
    expected = oracle.cast_bytes(src.weight, weight_scale, torch.float8_e4m3fn)
    assert torch.equal(dst.weight._data, expected)
    torch.testing.assert_close(dst.weight._scale_inv, oracle.reciprocal(weight_scale))
    assert torch.equal(dst.bias, src.bias) and not isinstance(dst.bias, Float8Tensor)
    # trains on from there
    y = fp8_step(dst, torch.randn(32, IN))
    assert torch.isfinite(y).all() and dst.weight.grad is not None


def test_fp8_parameter_module_round_trip(tmp_path):
    torch.manual_seed(4)
    with te.quantized_model_init(recipe=DelayedScaling()):
        src = Linear(IN, OUT, device="cpu")
        dst = Linear(IN, OUT, device="cpu")
    opt = torch.optim.SGD(src.parameters(), lr=1e-3)
    for _ in range(2):
        fp8_step(src, torch.randn(32, IN), optimizer=opt)
    path = tmp_path / "fp8_params.pt"
    torch.save(src.state_dict(), path)
    dst.load_state_dict(torch.load(path, weights_only=True))
    assert isinstance(dst.weight, Float8Tensor)
    torch.testing.assert_close(dst.weight.dequantize(), src.weight.dequantize())
    assert_same_fp8_state(src, dst)


# ------------------------------------------------------------------------------------------
# The device guard and exceptions inside forward


def test_guard_depth_is_zero_after_forward_and_backward():
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = m(x)
        assert guard_depth() == 0
    y.sum().backward()
    assert guard_depth() == 0
    with torch.no_grad():
        m(x)
    assert guard_depth() == 0


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_exception_inside_forward_leaves_the_state_as_it_was(monkeypatch, recipe):
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(32, IN, requires_grad=True)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    manager = FP8GlobalStateManager
    outside = manager.get_autocast_state()
    with te.autocast(enabled=recipe is not None, recipe=FP8_RECIPES.get(recipe, DelayedScaling)()):
        inside = manager.get_autocast_state()
        registry = len(manager.quantization_state.amax_registry)
        first = manager.quantization_state.is_first_fp8_module
        assert first
        with monkeypatch.context() as patch:
            patch.setattr(linear_module, "linear", boom)
            with pytest.raises(RuntimeError, match="boom"):
                m(x)
        assert guard_depth() == 0
        assert manager.get_autocast_state() == inside
        assert len(manager.quantization_state.amax_registry) == registry
        assert manager.quantization_state.is_first_fp8_module == first
        # the next module is still the first one: its backward updates the backward scales
        y = m(x)
    assert manager.get_autocast_state() == outside
    y.sum().backward()
    assert guard_depth() == 0
    if recipe == "delayed":
        assert m.fp8_meta["scaling_bwd"].scale[0] != 1.0


def test_exception_escaping_autocast_restores_everything(monkeypatch):
    m = Linear(IN, OUT, device="cpu")
    monkeypatch.setattr(linear_module, "linear", lambda *a, **k: 1 / 0)
    before = FP8GlobalStateManager.get_autocast_state()
    with pytest.raises(ZeroDivisionError):
        with te.autocast(recipe=DelayedScaling()):
            m(torch.randn(32, IN))
    assert guard_depth() == 0
    assert FP8GlobalStateManager.get_autocast_state() == before
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 0
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0


def test_exceptions_raised_during_preparation_close_the_guard():
    m = Linear(IN, OUT, device="cpu")
    with pytest.raises(TypeError):
        m(torch.randn(32, IN, dtype=torch.bfloat16))
    assert guard_depth() == 0
    odd = Linear(IN, 40, device="cpu")  # FP8 GEMMs refuse out_features=40 in preparation
    with te.autocast(recipe=DelayedScaling()):
        first = FP8GlobalStateManager.quantization_state.is_first_fp8_module
        with pytest.raises(ValueError, match="out_features"):
            odd(torch.randn(10, IN, requires_grad=True))
        assert guard_depth() == 0
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module == first
        assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 0


# ------------------------------------------------------------------------------------------
# Errors


def test_wrong_feature_size():
    m = Linear(IN, OUT, device="cpu")
    with pytest.raises(ValueError, match=r"last dimension is 63.*in_features=64"):
        m(torch.randn(4, IN - 1))


@pytest.mark.parametrize(
    "make, name",
    [(lambda: Linear(IN, OUT, device="cpu"), "in_features"),
     (lambda: te.LayerNormLinear(IN, OUT, device="cpu"), "in_features"),
     (lambda: te.LayerNormMLP(IN, OUT, device="cpu"), "hidden_size")],
)  # fmt: skip
def test_a_0d_input_is_refused_with_the_feature_size(make, name):
    with pytest.raises(ValueError, match=rf"input is 0-d.* {name}={IN} features.*\({IN},\)"):
        make()(torch.tensor(1.0))


def test_input_dtype_must_match_params_dtype():
    m = Linear(IN, OUT, device="cpu")
    with pytest.raises(TypeError, match=r"bfloat16.*float32"):
        m(torch.randn(4, IN, dtype=torch.bfloat16))
    m16 = Linear(IN, OUT, params_dtype=torch.bfloat16, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        m16(torch.randn(4, IN))


def test_meta_input_to_a_materialized_module():
    m = Linear(IN, OUT, device="cpu")
    with pytest.raises(ValueError, match=r"meta tensor.*cpu"):
        m(torch.randn(4, IN, device="meta"))


def test_materialized_input_to_a_meta_module():
    m = Linear(IN, OUT, device="meta")
    with pytest.raises(ValueError, match=r"meta device.*reset_parameters"):
        m(torch.randn(4, IN))
    with te.autocast(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="meta"):
            m(torch.randn(32, IN))


def test_tensor_parallel_size_without_a_group_refuses_the_forward():
    m = Linear(IN, OUT, tp_size=2, parallel_mode="row", device="cpu")
    assert m.weight.shape == (OUT, IN // 2) and m.weight.partition_dim == 1
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        m(torch.randn(4, IN // 2))


@pytest.mark.parametrize("flag", ["ub_overlap_ag", "ub_overlap_rs", "ub_bulk_wgrad"])
def test_comm_overlap_flags_need_a_layer_name(flag):
    with pytest.raises(ValueError, match="need ub_name"):
        Linear(IN, OUT, device="cpu", **{flag: True})
    # without tensor and sequence parallelism they pipeline nothing (as upstream)
    assert Linear(IN, OUT, device="cpu", ub_name="qkv", **{flag: True}).comm_overlap is None


def test_symmetric_all_reduce_is_named_as_not_built():
    with pytest.raises(NotImplementedError, match="symmetric_ar_type"):
        Linear(IN, OUT, device="cpu", symmetric_ar_type="two_shot")


def test_parallel_mode_must_be_known():
    with pytest.raises(ValueError, match=r"parallel_mode='diagonal'"):
        Linear(IN, OUT, parallel_mode="diagonal", device="cpu")
    for mode in (None, "column", "row"):
        Linear(IN, OUT, parallel_mode=mode, device="cpu")


@pytest.mark.parametrize(
    "split, match",
    [
        ({"a": 16, "b": 16}, r"sum to 32.*out_features=48"),
        (("a", "b", "c", "d", "e"), "out_features=48"),
        ((), "out_features"),
    ],
    ids=["dict-sum", "tuple-uneven", "empty"],
)
def test_parameters_split_sizes_must_sum_to_out_features(split, match):
    with pytest.raises(ValueError, match=match):
        Linear(IN, OUT, parameters_split=split, device="cpu")


def test_parameters_split_with_fp8_parameters_is_refused():
    with te.quantized_model_init(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="parameters_split"):
            Linear(IN, OUT, parameters_split=("a", "b"), device="cpu")


@pytest.mark.parametrize(
    "in_features, out_features, name", [(24, 32, "in_features"), (32, 24, "out_features")]
)
def test_fp8_needs_features_multiple_of_16(in_features, out_features, name):
    m = Linear(in_features, out_features, device="cpu")
    with te.autocast(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match=name):
            m(torch.randn(32, in_features))
    assert guard_depth() == 0
    m(torch.randn(32, in_features))  # fine outside FP8


def test_fp8_training_takes_any_token_count():
    # 10 tokens: the weight-gradient GEMM reduces over a K that is not a multiple of 16.
    torch.manual_seed(3)
    m = Linear(IN, OUT, device="cpu")
    x = torch.randn(2, 5, IN, requires_grad=True)
    dy = torch.randn(2, 5, OUT)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = m(x)
    y.backward(dy)
    assert guard_depth() == 0
    w = m.weight.detach()
    # against float32 on the original values: the FP8 rows of the table
    assert_close_by_table(y, F.linear(x.detach(), w, m.bias.detach()), ("e4m3", torch.float32))
    assert_close_by_table(m.weight.grad, dy.reshape(-1, OUT).t() @ x.detach().reshape(-1, IN),
                          ("hybrid", torch.float32))  # fmt: skip
    assert_close_by_table(x.grad, dy @ w, ("hybrid", torch.float32))
    # against the dequantized operands the GEMMs saw (independent oracle): tight
    xq = fake_quant(x.detach(), current_scale(x.detach(), E4M3), E4M3).reshape(-1, IN)
    dyq = fake_quant(dy, current_scale(dy, E5M2), E5M2).reshape(-1, OUT)
    assert_close_by_table(m.weight.grad, dyq.t() @ xq, ("fp8_dequantized", torch.float32))


@pytest.mark.parametrize("features", [(0, OUT), (IN, -1), (IN, 2.0)])
def test_feature_counts_must_be_positive_ints(features):
    with pytest.raises(ValueError, match="must be a positive int"):
        Linear(*features, device="cpu")


def test_cached_fp8_weight_from_another_device_is_not_reused():
    """Parameters swapped to another device without module.to() (as accelerate does) must not
    reuse an FP8 weight cached on the old device."""
    from transformer_engine.common.recipe import DelayedScaling

    layer = Linear(IN, OUT, device="cpu")
    x = torch.randn(16, IN)
    with te.autocast(recipe=DelayedScaling()):
        layer(x, is_first_microbatch=True)
    cached = layer._fp8_workspaces["weight"]
    cached_device = cached.device
    # simulate the swap: the cached workspace now claims another device
    cached.__dict__["_fake_device"] = torch.device("meta")
    type_device = type(cached).device
    try:
        type(cached).device = property(
            lambda self: self.__dict__.get("_fake_device", type_device.fget(self))
        )
        with te.autocast(recipe=DelayedScaling()):
            layer(x, is_first_microbatch=False)
        assert layer._fp8_workspaces.get("weight") is not cached
    finally:
        type(cached).device = type_device
    assert cached_device == torch.device("cpu")
