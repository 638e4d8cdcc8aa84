"""``tex.split_quantize(tensor, split_sections, quantizer_list)``: the rows of each section cast
with that section's quantizer, against the per-element FP8 oracle of ``fp8_oracle.py``
(delayed scaling: the quantizer's scale; current scaling: 448 / the section's own amax);
empty sections, and bad sections or quantizer lists refused by name."""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch

import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Quantizer

E4M3 = torch.float8_e4m3fn


def _delayed(scale: float) -> Float8Quantizer:
    return Float8Quantizer(torch.tensor([scale]), torch.zeros(1), E4M3)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(seed)) * 3


def test_each_section_is_cast_with_its_quantizer():
    x = _rows(10)
    outs = tex.split_quantize(x, [3, 0, 7], [_delayed(2.0), _delayed(1.0), _delayed(0.5)])
    assert [tuple(o.shape) for o in outs] == [(3, 16), (0, 16), (7, 16)]
    assert torch.equal(outs[0]._data.view(torch.uint8), oracle.cast_bytes(x[:3], 2.0, oracle.E4M3))
    assert torch.equal(outs[2]._data.view(torch.uint8), oracle.cast_bytes(x[3:], 0.5, oracle.E4M3))


def test_current_scaling_takes_each_sections_own_amax():
    x = _rows(8, seed=1)
    x[4:] *= 100  # the second section's amax is far larger: one scale for both would differ
    quantizers = [Float8CurrentScalingQuantizer(E4M3) for _ in range(2)]
    outs = tex.split_quantize(x, torch.tensor([4, 4]), quantizers)
    for part, out in zip((x[:4], x[4:]), outs):
        scale = (torch.tensor(448.0) / part.abs().max()).item()  # in float32, as the recipe
        assert torch.equal(out._data.view(torch.uint8), oracle.cast_bytes(part, scale, oracle.E4M3))
        torch.testing.assert_close(out._scale_inv, torch.tensor([1 / scale]))


def test_bad_sections_and_quantizer_lists_are_refused():
    x = _rows(6)
    with pytest.raises(ValueError, match="2 split sections but 1 quantizers"):
        tex.split_quantize(x, [3, 3], [_delayed(1.0)])
    with pytest.raises(ValueError, match="sum to the tensor's 6 rows"):
        tex.split_quantize(x, [3, 2], [_delayed(1.0), _delayed(1.0)])
    with pytest.raises(ValueError, match="non-negative"):
        tex.split_quantize(x, [7, -1], [_delayed(1.0), _delayed(1.0)])
    with pytest.raises(TypeError):
        tex.split_quantize(x, [6], ["not a quantizer"])
