"""Which ``Float8Tensor`` keeps a shared scale when it is re-quantized in place.

A part of a larger FP8 tensor that the dispatch made (a dim-0 slice, ``split``, a partial
``as_strided``, ``t()`` of a row-wise-only tensor, and views of those) shares that tensor's
``_scale_inv``: in-place updates and ``copy_`` into it keep the shared scale so the rest of the
larger tensor stays valid. A tensor whose bytes were merely moved into a bigger buffer
(``replace_raw_data``, as Megatron's distributed optimizer packs FP8 parameters into a
bucket) is a whole tensor with its own scale: its updates take the quantizer's current scale
(delayed scaling) or a fresh one from the new values (current scaling), write the bucket in
place and leave the rest of the bucket alone.

Oracles: ``fp8_oracle``'s byte cast, float32 reciprocal, dequantization and current-scaling
scale; a sentinel byte in the rest of the bucket; the bytes saved before a load.
"""

from __future__ import annotations

import copy

import fp8_oracle as oracle
import pytest
import torch

from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from transformer_engine.pytorch.tensor.utils import replace_raw_data

E4M3 = torch.float8_e4m3fn
SENTINEL = 0xAB


def _sample(shape=(8, 16), seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bucketed(p):
    """``p``'s bytes moved into the first half of a bucket whose second half holds a sentinel."""
    bucket = torch.full((2 * p.numel(),), SENTINEL, dtype=torch.uint8)
    replace_raw_data(p, bucket[: p.numel()].view(p.shape))
    assert p._data.data_ptr() == bucket.data_ptr()
    return bucket


def _values(t, scale_inv=None):
    scale_inv = t._scale_inv if scale_inv is None else scale_inv
    return oracle.dequantize(t._data, scale_inv, torch.float32, E4M3)


def _delayed(x, scale=1.0):
    state_scale, amax = torch.full((1,), scale), torch.zeros(1)
    with torch.no_grad():
        t = Float8Quantizer(state_scale, amax, DType.kFloat8E4M3)(x)
    return torch.nn.Parameter(t), state_scale


# ---------------------------------------------------------------------- whole tensors in a bucket


def test_bucketed_delayed_param_in_place_op_takes_the_new_scale():
    p, scale = _delayed(_sample())
    bucket = _bucketed(p)
    values = _values(p) + 0.0  # what add_(0.0) computes (-0.0 + 0.0 is +0.0)
    scale.fill_(64.0)  # a recipe update raised the scale
    with torch.no_grad():
        p.add_(0.0)
    assert torch.equal(p._scale_inv, oracle.reciprocal(64.0))
    assert torch.equal(bucket[:128].view(8, 16), oracle.cast_bytes(values, 64.0, E4M3))
    assert torch.equal(bucket[128:], torch.full((128,), SENTINEL, dtype=torch.uint8))


def test_bucketed_current_scaling_param_sgd_step_rescales():
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, torch.device("cpu"))
    with torch.no_grad():
        p = torch.nn.Parameter(q(_sample(scale=0.01)))
    bucket = _bucketed(p)
    grad = _sample(seed=1)
    updated = _values(p) - grad  # SGD, lr=1, in float32
    p.grad = grad.clone()
    torch.optim.SGD([p], lr=1.0).step()
    scale = oracle.scale_from_amax(oracle.amax(updated), E4M3)
    assert torch.equal(p._scale_inv, oracle.reciprocal(scale))
    assert torch.equal(p._data, oracle.cast_bytes(updated, scale, E4M3))
    assert p._data.data_ptr() == bucket.data_ptr()
    assert torch.equal(bucket[128:], torch.full((128,), SENTINEL, dtype=torch.uint8))


def test_copy_of_large_values_into_a_bucketed_current_scaling_param():
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, torch.device("cpu"))
    with torch.no_grad():
        p = torch.nn.Parameter(q(_sample(scale=0.01)))
    _bucketed(p)
    big = _sample(seed=2, scale=10.0)
    with torch.no_grad():
        p.copy_(big)
    scale = oracle.scale_from_amax(oracle.amax(big), E4M3)
    assert torch.equal(p._scale_inv, oracle.reciprocal(scale))
    assert torch.equal(p._data, oracle.cast_bytes(big, scale, E4M3))


def test_load_state_dict_into_a_bucketed_param_loads_the_saved_bytes():
    p, _ = _delayed(_sample(scale=0.01), scale=448.0)
    bucket = _bucketed(p)
    module = torch.nn.Module()
    module.w = p
    saved, _ = _delayed(_sample(seed=3), scale=64.0)
    saved_bytes, saved_scale_inv = saved._data.clone(), saved._scale_inv.clone()
    module.load_state_dict({"w": saved.detach()})
    assert module.w is p
    assert torch.equal(p._data, saved_bytes) and torch.equal(p._scale_inv, saved_scale_inv)
    assert p._data.data_ptr() == bucket.data_ptr()  # loaded into the bucket, in place


# ---------------------------------------------------------------------- parts of a larger tensor


def _part_write(t, part, new_scale, state_scale):
    """Raise the quantizer's scale, add 1 to ``part`` in place; return (scale_inv, bytes,
    values) of ``t`` from before."""
    before = (t._scale_inv.clone(), t._data.clone(), _values(t))
    state_scale.fill_(new_scale)
    with torch.no_grad():
        part.add_(1.0)
    return before


PARTS = {
    "slice": lambda t: t[2:5],
    "narrow": lambda t: t.narrow(0, 2, 3),
    "split": lambda t: t.split([2, 3, 3])[1],
    "slice_of_slice_view": lambda t: t[1:6][1:4].view(-1),
    "as_strided_rows": lambda t: torch.as_strided(t, (3, 16), (16, 1), 32),
    "detached_slice": lambda t: t[2:5].detach(),
}


@pytest.mark.parametrize("make_part", list(PARTS.values()), ids=list(PARTS))
def test_parts_keep_the_shared_scale(make_part):
    p, state_scale = _delayed(_sample(), scale=2.0)
    t = p.detach()
    part = make_part(t)
    scale_inv, raw, values = _part_write(t, part, 64.0, state_scale)
    assert torch.equal(t._scale_inv, scale_inv)
    expected = raw.clone()
    expected[2:5] = oracle.cast_bytes(values[2:5] + 1.0, 2.0, E4M3)
    assert torch.equal(t._data, expected)


def test_parts_of_a_bucketed_param_keep_its_scale():
    p, state_scale = _delayed(_sample(), scale=2.0)
    _bucketed(p)
    t = p.detach()
    scale_inv, raw, values = _part_write(t, t[2:5], 64.0, state_scale)
    assert torch.equal(t._scale_inv, scale_inv)
    assert torch.equal(t._data[2:5], oracle.cast_bytes(values[2:5] + 1.0, 2.0, E4M3))
    assert torch.equal(t._data[5:], raw[5:])


def test_transpose_copy_of_a_rowwise_tensor_leaves_the_source_intact():
    state_scale = torch.full((1,), 2.0)
    q = Float8Quantizer(state_scale, torch.zeros(1), DType.kFloat8E4M3, columnwise=False)
    with torch.no_grad():
        t = q(_sample())
    tt = t.t()
    scale_inv, raw, _ = _part_write(t, tt, 64.0, state_scale)
    assert torch.equal(t._scale_inv, scale_inv) and torch.equal(t._data, raw)


def test_whole_results_take_a_scale_of_their_own():
    # a clone, a deep copy and a full-length slice own (or cover) their bytes: they rescale
    for make in (lambda t: t[2:5].clone(), lambda t: copy.deepcopy(t[2:5]), lambda t: t[0:8]):
        p, state_scale = _delayed(_sample(), scale=2.0)
        t = p.detach()
        part = make(t)
        values = _values(part) + 0.0
        state_scale.fill_(64.0)
        with torch.no_grad():
            part.add_(0.0)
        assert torch.equal(part._scale_inv, oracle.reciprocal(64.0))
        assert torch.equal(part._data, oracle.cast_bytes(values, 64.0, E4M3))


def test_data_setter_takes_the_part_and_the_whole():
    p, state_scale = _delayed(_sample(), scale=2.0)
    other, other_scale = _delayed(_sample(seed=4), scale=2.0)
    q, _ = _delayed(_sample((3, 16), seed=5), scale=2.0)
    q.data = other.detach()[2:5]  # q now holds part of `other` (and its quantizer)
    other_scale.fill_(64.0)
    before = other._scale_inv.clone()
    with torch.no_grad():
        q.add_(0.0)
    assert torch.equal(other._scale_inv, before)
    q.data = p.detach()[2:5].clone()  # a whole tensor again (with p's quantizer)
    state_scale.fill_(64.0)
    with torch.no_grad():
        q.add_(0.0)
    assert torch.equal(q._scale_inv, oracle.reciprocal(64.0))
