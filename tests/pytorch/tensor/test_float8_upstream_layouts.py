"""When a Float8Tensor holds its transposed copy, and where its ``_scale_inv`` lives: upstream's rules.

Upstream (facts: te_api_facts.md 7.4/7.5) materializes ``_transpose`` whenever column-wise usage
is requested on a device without non-TN FP8 GEMMs (Hopper, Ada, and the CPU path here), for every
shape: a 0-d tensor's transpose is a 0-d copy of its one byte. A tensor built by the constructor
without ``data_transpose`` has none (``_transpose_invalid`` is True). Upstream's constructor also
accepts an ``fp8_scale_inv`` on another device than the bytes (its tests pass a CPU
``torch.full([1], s)`` with CUDA bytes); here that value is copied to the bytes' device.

Expected bytes come from tests/pytorch/fp8_oracle.py (a per-element encoder independent of the
package); the column-wise layout is spelled out with plain torch ops.
"""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch
from utils import needs_cuda

from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.device import is_non_tn_fp8_gemm_supported
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
)

E4M3 = torch.float8_e4m3fn
# Upstream's test_quantized_tensor shapes (``[]`` is a 0-d tensor).
UPSTREAM_SHAPES = [(), (1,), (311,), (7, 11), (7, 5, 3), (2, 3, 5, 3)]


def sample(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3.0


def columnwise_layout(rowwise: torch.Tensor) -> torch.Tensor:
    """``(d0, ..., dn) -> (dn, d0, ..., dn-1)`` as bytes; a 0-d tensor is its own transpose."""
    if rowwise.dim() == 0:
        return rowwise.clone()
    last = rowwise.shape[-1]
    return rowwise.reshape(-1, last).t().contiguous().reshape(last, *rowwise.shape[:-1])


def delayed(device="cpu", scale=0.5, **usages):
    return Float8Quantizer(
        torch.full([1], scale, device=device), torch.zeros(1, device=device), E4M3, **usages
    )


def current(device="cpu", **usages):
    return Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device=device, **usages)


def expected_scale(kind, x):
    if kind == "delayed":
        return torch.tensor([0.5])
    return oracle.scale_from_amax(oracle.amax(x), E4M3)


def make_quantizer(kind, device="cpu", **usages):
    return delayed(device, **usages) if kind == "delayed" else current(device, **usages)


# ---------------------------------------------------------------------- _transpose (CPU path)


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("shape", UPSTREAM_SHAPES, ids=str)
def test_columnwise_usage_materializes_the_transpose_for_every_shape(kind, shape):
    x = sample(shape)
    with torch.no_grad():
        y = make_quantizer(kind)(x)
    ref = oracle.cast_bytes(x, expected_scale(kind, x), E4M3)
    assert torch.equal(y._data, ref)
    assert y._transpose is not None and y._transpose_invalid is False
    assert y._transpose.dtype == torch.uint8
    assert torch.equal(y._transpose, columnwise_layout(ref))
    if len(shape) == 0:
        # Its own buffer, not an alias of the row-wise byte (a later write to one keeps the other).
        assert y._transpose.data_ptr() != y._data.data_ptr()
    assert y.get_usages() == {"rowwise": True, "columnwise": True}


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("shape", UPSTREAM_SHAPES, ids=str)
def test_rowwise_only_has_no_transpose(kind, shape):
    with torch.no_grad():
        y = make_quantizer(kind, columnwise=False)(sample(shape))
    assert y._transpose is None and y._transpose_invalid is True


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_columnwise_only_0d_tensor_keeps_the_byte_as_its_transpose(kind):
    x = torch.tensor(-3.3)
    with torch.no_grad():
        y = make_quantizer(kind, rowwise=False, columnwise=True)(x)
    scale = expected_scale(kind, x)
    ref = oracle.cast_bytes(x, scale, E4M3)
    assert y._data is None and y._transpose_invalid is False
    assert y.shape == torch.Size(()) and torch.equal(y._transpose, ref)
    assert torch.equal(
        y.dequantize(), oracle.dequantize(ref, oracle.reciprocal(scale), torch.float32, E4M3)
    )


def test_0d_quantize_in_place_rewrites_both_layouts():
    q = delayed(scale=2.0)
    with torch.no_grad():
        y = q(torch.tensor(1.0))
        data, transpose = y._data, y._transpose
        y.quantize_(torch.tensor(-7.25))
    ref = oracle.cast_bytes(torch.tensor(-7.25), 2.0, E4M3)
    assert y._data is data and y._transpose is transpose  # written in place
    assert torch.equal(y._data, ref) and torch.equal(y._transpose, ref)
    q.set_usage(rowwise=False, columnwise=True)
    with torch.no_grad():
        z = q(torch.tensor(1.0))
        kept = z._transpose
        z.quantize_(torch.tensor(0.75))
    assert z._data is None and z._transpose is kept
    assert torch.equal(kept, oracle.cast_bytes(torch.tensor(0.75), 2.0, E4M3))


def test_0d_make_empty_update_usage_and_new_empty():
    e = delayed().make_empty(())
    assert e._transpose is not None and e._transpose.shape == torch.Size(())
    with torch.no_grad():
        y = delayed(columnwise=False)(torch.tensor(2.5))
    assert y._transpose is None
    y.update_usage(columnwise_usage=True)
    assert y._transpose_invalid is False and torch.equal(y._transpose, y._data)
    assert y._transpose.data_ptr() != y._data.data_ptr()
    n = y.new_empty(())
    assert n._transpose is not None and n._transpose.shape == torch.Size(())


def test_0d_transpose_only_constructor():
    byte = oracle.cast_bytes(torch.tensor(1.5), 1.0, E4M3)
    t = Float8Tensor((), torch.float32, data=None, data_transpose=byte,
                     fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E4M3)  # fmt: skip
    assert t.shape == torch.Size(()) and t.dequantize().item() == 1.5


def test_constructor_without_data_transpose_holds_none():
    t = Float8Tensor((4, 8), torch.float32, data=torch.zeros(4, 8, dtype=torch.uint8),
                     fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E4M3)  # fmt: skip
    assert t._transpose is None and t._transpose_invalid is True


# ---------------------------------------------------------------------- scale_inv placement


def test_scale_inv_on_another_device_is_copied_to_the_bytes_device():
    data = torch.zeros(4, 8, dtype=torch.uint8, device="meta")
    t = Float8Tensor((4, 8), torch.float32, data=data, fp8_scale_inv=torch.full([1], 0.375),
                     fp8_dtype=DType.kFloat8E4M3)  # fmt: skip
    assert t.device.type == "meta" and t._scale_inv.device.type == "meta"
    s = Float8TensorStorage(data=data, fp8_scale_inv=torch.full([1], 0.375),
                            fp8_dtype=DType.kFloat8E4M3)  # fmt: skip
    assert s._scale_inv.device.type == "meta"


def test_same_device_scale_inv_is_kept_as_is():
    scale_inv = torch.full([1], 0.375)
    t = Float8Tensor((2,), torch.float32, data=torch.zeros(2, dtype=torch.uint8),
                     fp8_scale_inv=scale_inv, fp8_dtype=DType.kFloat8E4M3)  # fmt: skip
    assert t._scale_inv is scale_inv


def test_meta_scale_inv_with_real_bytes_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="meta tensor"):
        Float8Tensor((2,), torch.float32, data=torch.zeros(2, dtype=torch.uint8),
                     fp8_scale_inv=torch.ones(1, device="meta"), fp8_dtype=DType.kFloat8E4M3)  # fmt: skip


def test_data_and_transpose_on_different_devices_are_refused():
    with pytest.raises(ValueError, match="data_transpose is on"):
        Float8Tensor((4, 8), torch.float32, data=torch.zeros(4, 8, dtype=torch.uint8),
                     data_transpose=torch.zeros(8, 4, dtype=torch.uint8, device="meta"),
                     fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E4M3)  # fmt: skip


# ---------------------------------------------------------------------- GPU (H200)


@needs_cuda
@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("shape", UPSTREAM_SHAPES, ids=str)
def test_gpu_columnwise_usage_layouts_follow_the_device(kind, shape):
    device = torch.device("cuda", torch.cuda.current_device())
    x = sample(shape)
    with torch.no_grad():
        y = make_quantizer(kind, device)(x.to(device))
    ref = oracle.cast_bytes(x, expected_scale(kind, x), E4M3)
    assert torch.equal(y._data.cpu(), ref)
    if is_non_tn_fp8_gemm_supported(device):
        assert y._transpose is None  # Blackwell: the row-wise bytes serve both usages
    else:  # Hopper / Ada: the transposed copy, as upstream
        assert y._transpose_invalid is False
        assert torch.equal(y._transpose.cpu(), columnwise_layout(ref))


@needs_cuda
def test_gpu_constructor_takes_a_cpu_scale_inv_like_upstream_tests():
    device = torch.device("cuda", torch.cuda.current_device())
    byte = oracle.cast_bytes(torch.tensor([1.5, -2.0]), 1.0, E4M3)
    t = Float8Tensor(shape=(2,), dtype=torch.float32, data=byte.to(device),
                     fp8_dtype=DType.kFloat8E4M3, fp8_scale_inv=torch.full([1], 0.375))  # fmt: skip
    assert t.is_cuda and t._scale_inv.device == device
    assert t._scale_inv.item() == 0.375
    assert torch.equal(t.dequantize().cpu(), torch.tensor([1.5 * 0.375, -2.0 * 0.375]))
