"""Round trips and writes that once went wrong silently or crashed: pickling a storage that
holds typed FP8 views, and ``t[key] = value`` where ``t[key]`` is not a view of ``t``'s bytes."""

import pickle

import pytest
import torch

import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

E4M3 = tex.DType.kFloat8E4M3


def _quantizers():
    return {
        "delayed": lambda: Float8Quantizer(torch.full((1,), 2.0), torch.zeros(1), E4M3),
        "current": lambda: Float8CurrentScalingQuantizer(E4M3, torch.device("cpu")),
        "block1d": lambda: Float8BlockQuantizer(
            E4M3, rowwise=True, columnwise=True, block_scaling_dim=1
        ),
        "block2d": lambda: Float8BlockQuantizer(
            E4M3, rowwise=True, columnwise=True, block_scaling_dim=2
        ),
        "mxfp8": lambda: MXFP8Quantizer(E4M3),
        "nvfp4": lambda: NVFP4Quantizer(),
    }


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_pickled_float8_storage_loads_back(kind, columnwise):
    # A cast hands the storage the FP8-typed tensors it wrote (kept next to the uint8 bytes
    # for GEMMs). Pickling both views of one buffer made pickle.loads fail inside torch
    # ("'UntypedStorage' has no attribute 'dtype'").
    quantizer = _quantizers()[kind]()
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    quantizer.internal = True
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    storage = quantizer(x)
    storage.float8_gemm_input(columnwise=False)
    loaded = pickle.loads(pickle.dumps(storage))
    assert type(loaded) is type(storage)
    torch.testing.assert_close(loaded.dequantize(), storage.dequantize(), rtol=0, atol=0)
    assert loaded.dequantize().dtype == torch.bfloat16
    # The typed views are made again on demand, over the loaded bytes.
    values, scale_inv = loaded.float8_gemm_input(columnwise=False)
    assert values.dtype == torch.float8_e4m3fn
    assert values.untyped_storage().data_ptr() == loaded._data.untyped_storage().data_ptr()
    assert torch.equal(scale_inv, storage._scale_inv)
