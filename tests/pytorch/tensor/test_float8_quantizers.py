"""CPU tests of the FP8 quantizers: delayed scaling (Float8Quantizer) and current scaling
(Float8CurrentScalingQuantizer), the fused cast with the bias gradient (quantize_with_dbias_impl),
and the Quantizer base class's input validation.

Casts are compared bit for bit with tests/pytorch/fp8_oracle.py, which shares no code with
transformer_engine.pytorch.reference (the CPU path runs the reference through the kernel
wrappers, so comparing with it would compare the reference with itself). Delayed-scaling
quantizers are built the way the recipe state builds them: ``scale`` is a 0-d
view into a scale vector and ``amax`` a one-element view into row 0 of an amax
history, and the tests check that casts write into that storage.
"""

from __future__ import annotations

import math
import pickle
import warnings

import fp8_oracle as oracle
import pytest
import torch
from float8_tensor_helpers import E4M3, E5M2, HP, DelayedState, expected_bytes, fp8_param, sample
from utils import float32_bits, uint8_view

from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    QuantizedTensor,
    Quantizer,
)

# ---------------------------------------------------------------------- delayed scaling


@pytest.mark.parametrize("fp8", [E4M3, E5M2, DType.kFloat8E4M3, DType.kFloat8E5M2])
@pytest.mark.parametrize("in_dtype", HP)
def test_delayed_quantize_matches_the_oracle_bitwise(fp8, in_dtype):
    state = DelayedState(scale=0.75)
    q = state.quantizer(fp8=fp8)
    x = sample((3, 5, 16), in_dtype)
    with torch.no_grad():
        y = q(x)
    torch_fp8 = E4M3 if fp8 in (E4M3, DType.kFloat8E4M3) else E5M2
    ref = oracle.cast_bytes(x, 0.75, torch_fp8)
    assert isinstance(y, Float8Tensor) and isinstance(y, QuantizedTensor)
    assert y.dtype == in_dtype and y.shape == x.shape and y.device == x.device
    assert y._data.dtype == torch.uint8 and torch.equal(y._data, uint8_view(ref))
    assert y._transpose.dtype == torch.uint8
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(ref))
    assert y._transpose.shape == (16, 3, 5) and not y._transpose_invalid
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(0.75)))
    assert y._scale_inv.shape == (1,) and y._scale_inv.dtype == torch.float32
    assert y._fp8_dtype == DType.cast(torch_fp8) and isinstance(y._fp8_dtype, DType)
    assert y._dtype == in_dtype
    assert torch.equal(y.dequantize(), oracle.dequantize(ref, y._scale_inv, in_dtype, torch_fp8))


def test_delayed_amax_accumulates_into_the_recipe_state_views():
    state = DelayedState()
    q = state.quantizer(i=1)
    assert q.scale.data_ptr() == state.scale[1].data_ptr()
    assert q.amax.data_ptr() == state.amax_history[0][1].data_ptr()
    x1, x2 = sample(seed=1, scale=5.0), sample(seed=2, scale=0.5)
    with torch.no_grad():
        q(x1)
    assert state.amax_history[0, 1] == oracle.amax(x1)[0]
    others = state.amax_history.clone()
    others[0, 1] = 0
    assert torch.count_nonzero(others) == 0
    with torch.no_grad():
        q(x2)  # smaller amax: the maximum is kept (accumulation, not overwrite)
    assert state.amax_history[0, 1] == oracle.amax(x1)[0]
    x3 = sample(seed=3, scale=50.0)
    with torch.no_grad():
        q(x3)
    assert state.amax_history[0, 1] == oracle.amax(x3)[0]
    # A scale update in the recipe state is seen by the next cast (no copy was taken).
    state.scale[1] = 4.0
    with torch.no_grad():
        y = q(x1)
    assert y._scale_inv.item() == 0.25
    assert torch.equal(y._data, expected_bytes(x1, 4.0))
    # copy() and the tensor's own quantizer share scale and amax.
    c = q.copy()
    assert c.scale is q.scale and c.amax is q.amax
    assert y._quantizer is not q and y._quantizer.amax is q.amax


def test_delayed_constructor_validation():
    with pytest.raises(ValueError, match="one-element float32"):
        Float8Quantizer(torch.ones(2), torch.zeros(1), E4M3)
    with pytest.raises(ValueError, match="one-element float32"):
        Float8Quantizer(torch.ones(1), torch.zeros(1, dtype=torch.float16), E4M3)
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float16)
    with pytest.raises(ValueError, match=r"meta.*cpu|cpu.*meta"):
        Float8Quantizer(torch.ones(1), torch.zeros(1, device="meta"), E4M3)


def test_delayed_refuses_state_on_another_device_and_changes_nothing():
    q = Float8Quantizer(torch.ones((), device="meta"), torch.zeros(1, device="meta"), E4M3)
    with pytest.raises(ValueError, match="scale is a meta tensor"):
        with torch.no_grad():
            q(sample())
    y, _ = fp8_param()
    before = (y._data.clone(), y._transpose.clone(), y._scale_inv.clone())
    with pytest.raises(ValueError, match="meta"):
        q.update_quantized(sample(seed=4), y)
    for a, b in zip((y._data, y._transpose, y._scale_inv), before):
        assert torch.equal(a, b)


def test_delayed_calibrate_overwrites_amax_without_casting():
    state = DelayedState()
    state.amax_history[0, 1] = 100.0
    q = state.quantizer()
    x = sample(scale=0.1)
    q.calibrate(x)
    assert state.amax_history[0, 1] == oracle.amax(x)[0]


def test_create_tensor_from_data():
    state = DelayedState(scale=4.0)
    q = state.quantizer()
    raw = expected_bytes(sample(), 4.0)
    t = q.create_tensor_from_data(raw.view(E4M3), fake_dtype=torch.bfloat16)
    assert isinstance(t, Float8Tensor) and t.dtype == torch.bfloat16
    assert torch.equal(t._data, raw) and t._scale_inv.item() == 0.25
    assert torch.equal(t._transpose, oracle.transpose_last_dim_first(uint8_view(raw)))
    s = q.create_tensor_from_data(raw, internal=True)
    assert type(s) is Float8TensorStorage and q.internal is False
    with pytest.raises(TypeError, match="uint8"):
        q.create_tensor_from_data(torch.zeros(2, 2))


# ---------------------------------------------------------------------- current scaling


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("in_dtype", HP)
@pytest.mark.parametrize("epsilon,pow2", [(0.0, False), (0.0, True), (1e3, False), (1e3, True)])
def test_current_scaling_matches_the_oracle_bitwise(fp8, in_dtype, epsilon, pow2):
    q = Float8CurrentScalingQuantizer(fp8, amax_epsilon=epsilon, force_pow_2_scales=pow2)
    x = sample((6, 16), in_dtype, scale=7.0)
    with torch.no_grad():
        y = q(x)
    scale = oracle.scale_from_amax(oracle.amax(x), fp8, epsilon, pow2)
    ref = oracle.cast_bytes(x, scale, fp8)
    assert torch.equal(y._data, uint8_view(ref))
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(ref))
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(scale)))
    if epsilon:
        assert y._scale_inv.item() > oracle.amax(x).item() / (448 if fp8 is E4M3 else 57344)
    if pow2:
        assert math.log2(y._scale_inv.item()).is_integer()


def test_current_scaling_of_zeros_uses_scale_one():
    q = Float8CurrentScalingQuantizer(E4M3)
    with torch.no_grad():
        y = q(torch.zeros(4, 4))
    assert y._scale_inv.item() == 1.0 and torch.count_nonzero(y._data) == 0


def test_current_scaling_has_no_side_effects_and_warns_on_deprecated_args():
    scale, amax = torch.full((1,), 3.0), torch.full((1,), 7.0)
    with pytest.warns(DeprecationWarning, match="scale"):
        q = Float8CurrentScalingQuantizer(E4M3, "cuda:5", scale=scale)
    with pytest.warns(DeprecationWarning, match="amax"):
        Float8CurrentScalingQuantizer(E4M3, amax=amax)
    with pytest.warns(DeprecationWarning, match="use_existing_amax"):
        Float8CurrentScalingQuantizer(E4M3, use_existing_amax=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Float8CurrentScalingQuantizer(E4M3, None)
    x = sample()
    with torch.no_grad():
        y = q(x)  # the (ignored) device argument does not matter: the input's device is used
    assert y.device == x.device
    assert scale.item() == 3.0 and amax.item() == 7.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_current_scaling_rejects_bad_epsilon(bad):
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=bad)


def test_current_scaling_amax_reduction_is_a_max_all_reduce_over_the_group(monkeypatch):
    calls = []
    group = object()

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append((tensor.clone(), op, group))
        tensor.fill_(1000.0)

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    q = Float8CurrentScalingQuantizer(
        E4M3, with_amax_reduction=True, amax_reduction_group=group
    )  # fmt: skip
    x = sample(scale=1.0)
    with torch.no_grad():
        y = q(x)
    assert len(calls) == 1
    local_amax, op, used_group = calls[0]
    assert op == torch.distributed.ReduceOp.MAX and used_group is group
    assert torch.equal(local_amax, oracle.amax(x))
    scale = oracle.scale_from_amax(torch.tensor([1000.0]), E4M3)
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(scale)))
    assert torch.equal(y._data, oracle.cast_bytes(x, scale, E4M3))
    # The produced tensor re-quantizes locally, and pickling drops the group.
    assert y._quantizer.with_amax_reduction is False and y._quantizer.amax_reduction_group is None
    assert pickle.loads(pickle.dumps(q)).amax_reduction_group is None
    assert q.amax_reduction_group is group


def test_current_scaling_quantizers_compare_and_hash_by_their_settings():
    # Upstream's current-scaling quantizer is a value quantizer: equal settings, equal quantizers.
    a = Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=True, amax_epsilon=1e-3)
    b = Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=True, amax_epsilon=1e-3)
    assert a is not b and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.copy() == a
    for other in (
        Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True, amax_epsilon=1e-3),
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=1e-3),
        Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=True),
        Float8CurrentScalingQuantizer(
            E4M3, force_pow_2_scales=True, amax_epsilon=1e-3, columnwise=False
        ),
        Float8CurrentScalingQuantizer(
            E4M3, force_pow_2_scales=True, amax_epsilon=1e-3, with_amax_reduction=True
        ),
    ):
        assert a != other
    group = object()  # a stand-in process group: compared by identity
    c = Float8CurrentScalingQuantizer(E4M3, with_amax_reduction=True, amax_reduction_group=group)
    d = Float8CurrentScalingQuantizer(E4M3, with_amax_reduction=True, amax_reduction_group=group)
    e = Float8CurrentScalingQuantizer(E4M3, with_amax_reduction=True, amax_reduction_group=object())
    assert c == d and hash(c) == hash(d) and c != e
    b.set_usage(columnwise=False)  # settings change: so does equality
    assert a != b
    # Delayed-scaling quantizers hold their own state: compared by identity, as upstream's.
    scale, amax = torch.ones(1), torch.zeros(1)
    assert Float8Quantizer(scale, amax, E4M3) != Float8Quantizer(scale, amax, E4M3)
    assert a != Float8Quantizer(scale, amax, E4M3)


def test_compatible_recipes():
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    assert DelayedState().quantizer()._get_compatible_recipe() is DelayedScaling
    assert Float8CurrentScalingQuantizer(E4M3)._get_compatible_recipe() is Float8CurrentScaling
    assert Float8CurrentScalingQuantizer(E4M3).is_requantization_safe()
    assert DelayedState().quantizer().supports_only_rowwise_all_gather()


def test_quantizer_is_abstract_and_validates_input():
    with pytest.raises(TypeError):
        Quantizer(rowwise=True, columnwise=True)
    q = Float8CurrentScalingQuantizer(E4M3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        q.quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype"):
        with torch.no_grad():
            q(torch.ones(4, dtype=torch.float64))
    assert q.is_quantizable(torch.ones(2)) and not q.is_quantizable(
        torch.ones(2, dtype=torch.int32)
    )
    c = q.copy()
    c.set_usage(columnwise=False)
    assert q.columnwise_usage and not c.columnwise_usage


# ------------------------------------------------------------------------------------------
# quantize_with_dbias_impl: the linear core's grad-output cast that also yields the bias gradient


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("dtype", HP)
def test_quantize_with_dbias_is_quantize_plus_the_column_sum(kind, columnwise, dtype):
    x = sample((3, 40, 32), dtype=dtype, seed=4)

    def make():
        if kind == "delayed":
            return DelayedState().quantizer(fp8=E5M2)
        return Float8CurrentScalingQuantizer(E5M2)

    fused_q, plain_q = make(), make()
    for q in (fused_q, plain_q):
        q.set_usage(rowwise=True, columnwise=columnwise)
    fused, dbias = fused_q.quantize_with_dbias_impl(x)
    plain = plain_q.quantize_impl(x)
    assert torch.equal(uint8_view(fused._data), uint8_view(plain._data))
    if columnwise:
        assert torch.equal(uint8_view(fused._transpose), uint8_view(plain._transpose))
    assert torch.equal(fused._scale_inv, plain._scale_inv)
    assert dbias.dtype == dtype and dbias.shape == (32,)
    # Accumulated in float32, rounded once to dtype: within the float32 summation bound
    # ((rows - 1) * 2**-24 * sum |x|) plus one rounding of dtype of the float64 sum.
    exact = oracle.column_sum(x.double())
    rows = x.numel() // x.shape[-1]
    bound = (rows - 1) * 2.0**-24 * oracle.column_sum(x.double().abs())
    bound += torch.finfo(dtype).eps * exact.abs()
    assert ((dbias.double() - exact).abs() <= bound).all()


def test_quantize_with_dbias_of_an_empty_tensor_gives_zeros():
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(rowwise=True, columnwise=True)
    _, dbias = q.quantize_with_dbias_impl(torch.empty(0, 16))
    assert torch.equal(dbias, torch.zeros(16))


def test_internal_storages_hold_their_quantizer_but_never_a_reducing_one():
    delayed = DelayedState().quantizer()
    delayed.internal = True
    assert delayed.quantize_impl(sample())._quantizer is delayed  # no copy per cast
    reducing = Float8CurrentScalingQuantizer(E4M3, with_amax_reduction=False)
    reducing.with_amax_reduction = True  # as set up for a process group
    reducing.internal = True
    reducing._scale_and_amax = lambda src: (torch.ones(1), None)  # no process group here
    held = reducing.quantize_impl(sample())._quantizer
    assert held is not reducing and held.with_amax_reduction is False
